"""A small numpy reader and writer for the safetensors format.

The format: 8 bytes little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``
(offsets relative to the end of the header), then the raw little-endian data.
The reader maps tensors lazily (``np.memmap``), so a multi-GB checkpoint is
never loaded whole; bfloat16 is widened to float32 by a 16-bit shift, which is
exact.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import CheckpointError

__all__ = ["TensorRef", "read_safetensors", "write_safetensors", "bf16_to_f32", "f32_to_bf16"]

# safetensors dtype name -> numpy dtype of the stored bytes (BF16 as raw uint16)
_NUMPY_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U8": np.uint8, "BOOL": np.bool_,
}
_DTYPE_NAMES = {np.dtype(v): k for k, v in _NUMPY_DTYPES.items() if k != "BF16"}
_MAX_HEADER = 100 * 1024 * 1024  # the reference implementation's limit


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """float32 values of raw bfloat16 bits (uint16); exact."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """Raw bfloat16 bits (uint16) of float32 values, rounded to nearest even like torch."""
    u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = np.isnan(values)
    return np.where(nan, 0x7FC0, rounded).astype(np.uint16)


@dataclass(frozen=True)
class TensorRef:
    """One tensor of a safetensors file, read on demand.

    ``dtype`` is the safetensors name (``"BF16"``, ``"F32"``, ...), ``shape``
    the numpy shape, ``offset`` the absolute byte offset of the data.
    """

    path: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    def raw(self) -> np.ndarray:
        """The stored values as a read-only memory map (bfloat16 as uint16 bits)."""
        count = int(np.prod(self.shape, dtype=np.int64))
        if count == 0:
            return np.zeros(self.shape, dtype=_NUMPY_DTYPES[self.dtype])
        return np.memmap(self.path, dtype=_NUMPY_DTYPES[self.dtype], mode="r",
                         offset=self.offset, shape=self.shape)

    def load(self) -> np.ndarray:
        """The values in memory: bfloat16 and float64 become float32, f16/f32/ints keep their type."""
        data = self.raw()
        if self.dtype == "BF16":
            return bf16_to_f32(data)
        if self.dtype == "F64":
            return data.astype(np.float32)
        return np.array(data)

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of the first axis as float32 (for chunked comparisons)."""
        data = self.raw()[start:stop]
        return bf16_to_f32(data) if self.dtype == "BF16" else np.asarray(data, dtype=np.float32)


def _read_header(path: Path) -> tuple[dict, int]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path}: too short for a safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", prefix)
        if n > min(_MAX_HEADER, size - 8):
            raise CheckpointError(f"{path}: header length {n} does not fit the file ({size} bytes)")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path}: header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    return header, 8 + n


def _tensor_ref(path: Path, name: str, meta: dict, data_start: int, data_size: int) -> TensorRef:
    def whole(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    try:
        dtype, shape, (begin, end) = meta["dtype"], meta["shape"], meta["data_offsets"]
        if not (isinstance(shape, list) and all(map(whole, shape)) and whole(begin) and whole(end)):
            raise TypeError
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry {meta!r}") from None
    shape = tuple(shape)
    if not isinstance(dtype, str) or dtype not in _NUMPY_DTYPES:
        raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r}")
    expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(_NUMPY_DTYPES[dtype]).itemsize
    if not 0 <= begin <= end <= data_size or end - begin != expected:
        raise CheckpointError(
            f"{path}: tensor {name!r} ({dtype} {list(shape)}) needs {expected} bytes, "
            f"header gives [{begin}, {end}) of {data_size}")
    return TensorRef(path, name, dtype, shape, data_start + begin)


def read_safetensors(path: str | os.PathLike[str]) -> dict[str, TensorRef]:
    """Index a safetensors file: tensor name -> TensorRef, in header order.

    Raises:
        CheckpointError: the file is truncated or its header is malformed.
    """
    path = Path(path)
    header, data_start = _read_header(path)
    data_size = path.stat().st_size - data_start
    return {name: _tensor_ref(path, name, meta, data_start, data_size)
            for name, meta in header.items() if name != "__metadata__"}


def _stored(array: np.ndarray, bf16: bool) -> tuple[str, np.ndarray]:
    if bf16 and np.issubdtype(array.dtype, np.floating):
        return "BF16", f32_to_bf16(array.astype(np.float32))
    dtype = np.dtype(array.dtype)
    if dtype not in _DTYPE_NAMES:
        raise TypeError(f"cannot store dtype {dtype} in safetensors")
    return _DTYPE_NAMES[dtype], np.ascontiguousarray(array, dtype=dtype.newbyteorder("<"))


def write_safetensors(path: str | os.PathLike[str], tensors: Mapping[str, np.ndarray], *,
                      bf16: bool = False, metadata: Mapping[str, str] | None = None) -> Path:
    """Write ``tensors`` to ``path`` in safetensors format and return the path.

    Args:
        path: output file.
        tensors: name -> array, written in this order.
        bf16: store floating-point arrays as bfloat16 (round to nearest even);
            integer and bool arrays keep their type.
        metadata: string pairs for the ``__metadata__`` entry (default ``{"format": "pt"}``).
    """
    stored = {name: _stored(np.asarray(a), bf16) for name, a in tensors.items()}
    header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name, (dtype, data) in stored.items():
        header[name] = {"dtype": dtype, "shape": list(data.shape), "data_offsets": [offset, offset + data.nbytes]}
        offset += data.nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the data section starts 8-byte aligned
    path = Path(path)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, data in stored.values():
            f.write(data.tobytes())
    return path
