"""A GGUF file's header, read once and fast: metadata and the tensor table, tensors on demand.

``gguf.GGUFReader`` builds numpy views of every field, tokenizer arrays included: for a drafter
that carries a 50-150k-token vocabulary that is seconds per open, and loading a drafter opened
the file three times. This reader walks the header with ``struct`` over a memory map, keeps
numeric arrays as numpy views, skips string arrays (their length is kept; ``GGUFHeader.value``
decodes one on request) and reads a tensor's bytes only when asked.

Layout (GGUF v2/v3, little-endian): magic ``GGUF``, u32 version, u64 tensor count, u64 key
count; each key is a string (u64 length + UTF-8), a u32 value type and the value; each tensor
is a name, u32 n_dims, u64 dims (ggml order), u32 ggml type and u64 offset into the data
section, which starts at the next multiple of ``general.alignment`` (32 by default).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# value type id -> (struct format, numpy dtype) for fixed-size scalars
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
            4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
            10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands, or its header is cut short."""


@dataclass(frozen=True)
class StringArray:
    """A string array left undecoded: where it is and how many strings it holds."""

    offset: int
    count: int


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order (ne0 first), like GGUFReader's ReaderTensor.shape
    ggml_type: int
    offset: int  # absolute, in the file


class GGUFHeader:
    """Metadata and tensor table of a GGUF file (the file stays memory-mapped while this object lives)."""

    def __init__(self, path: str | os.PathLike[str], *, file=None):
        """``file``: the path already open for reading in binary (not opened again; left open)."""
        self.path = Path(path)
        with contextlib.nullcontext(file) if file is not None else open(self.path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size < 24:
                raise GGUFFormatError(f"{self.path.name}: {size} bytes is too short for a GGUF header")
            self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self._parse()
        except struct.error as exc:
            raise GGUFFormatError(f"{self.path.name}: the header ends early ({exc})") from None

    # --- public ------------------------------------------------------------------------
    def value(self, key: str, default: Any = None) -> Any:
        """A key's value: ints/floats/bools/strings as Python values, numeric arrays as lists, string
        arrays decoded on this call (slow for tokenizer vocabularies: ask only when needed)."""
        if key not in self.fields:
            return default
        v = self.fields[key]
        if isinstance(v, StringArray):
            return [raw.decode("utf-8", errors="replace") for raw in self.raw_strings(key)]
        return v.tolist() if isinstance(v, np.ndarray) else v

    def raw_strings(self, key: str) -> list[bytes]:
        """A string array's items as the bytes stored (no decoding); [] if the key is absent or not one."""
        v = self.fields.get(key)
        if not isinstance(v, StringArray):
            return []
        out, pos = [], v.offset
        for _ in range(v.count):
            (n,) = struct.unpack_from("<Q", self._map, pos)
            out.append(self._map[pos + 8:pos + 8 + n])
            pos += 8 + n
        return out

    def tensor_data(self, name: str) -> np.ndarray:
        """The tensor's stored data, shaped like ``gguf.GGUFReader``'s ``ReaderTensor.data``: float and int
        types as [..., ne0] arrays of that type, block-quantized types as uint8 [rows, bytes per row]."""
        import gguf

        info = self.tensors[name]
        qtype = gguf.GGMLQuantizationType(info.ggml_type)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        raw = np.frombuffer(self._map, dtype=np.uint8, count=self._nbytes(info), offset=info.offset)
        rows = tuple(reversed(info.shape))
        if qtype.name in _NUMPY_OF_PLAIN_TYPE:
            return raw.view(_NUMPY_OF_PLAIN_TYPE[qtype.name]).reshape(rows)
        return raw.reshape(*rows[:-1], rows[-1] // block * type_size)

    def dequantized(self, name: str) -> np.ndarray:
        """The tensor as float64, numpy order ([ne1, ne0] for a matrix)."""
        import gguf

        qtype = gguf.GGMLQuantizationType(self.tensors[name].ggml_type)
        data = self.tensor_data(name)
        if qtype.name in _NUMPY_OF_PLAIN_TYPE:  # gguf-py dequantizes only F32/F16 of these
            return data.astype(np.float64)
        return np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float64)

    # --- parsing -----------------------------------------------------------------------
    def _parse(self) -> None:
        if self._map[:4] != _MAGIC:
            raise GGUFFormatError(f"{self.path.name}: not a GGUF file (magic {bytes(self._map[:4])!r})")
        self._pos = 4
        self.version = self._scalar("<I")
        if self.version not in (2, 3):
            raise GGUFFormatError(f"{self.path.name}: GGUF version {self.version} is not supported (2 or 3)")
        n_tensors, n_kv = self._scalar("<Q"), self._scalar("<Q")
        if n_tensors > len(self._map) or n_kv > len(self._map):
            raise GGUFFormatError(f"{self.path.name}: implausible counts ({n_tensors} tensors, {n_kv} keys)")
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(self._scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._scalar("<I")
            if n_dims > 8:
                raise GGUFFormatError(f"{self.path.name}: tensor {name} has {n_dims} dimensions")
            shape = struct.unpack_from(f"<{n_dims}Q", self._map, self._pos)
            self._pos += 8 * n_dims
            infos.append((name, tuple(int(d) for d in shape), self._scalar("<I"), self._scalar("<Q")))
        alignment = int(self.fields.get("general.alignment", _DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise GGUFFormatError(f"{self.path.name}: general.alignment {alignment} is not a power of two")
        self.data_offset = -(-self._pos // alignment) * alignment
        self.tensors = {name: TensorInfo(name, shape, ggml_type, self.data_offset + offset)
                        for name, shape, ggml_type, offset in infos}
        for info in self.tensors.values():
            if info.offset + self._nbytes(info) > len(self._map):
                raise GGUFFormatError(f"{self.path.name}: tensor {info.name} runs past the end of the file "
                                      "(truncated?)")

    def _nbytes(self, info: TensorInfo) -> int:
        import gguf

        try:
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(info.ggml_type)]
        except (ValueError, KeyError):
            raise GGUFFormatError(f"{self.path.name}: tensor {info.name} has unknown type {info.ggml_type}") from None
        n = int(np.prod(info.shape, dtype=np.float64))
        if n % block:
            raise GGUFFormatError(f"{self.path.name}: tensor {info.name} of {n} values is not whole blocks of {block}")
        return n // block * type_size

    def _scalar(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return v

    def _string(self) -> str:
        n = self._scalar("<Q")
        if self._pos + n > len(self._map):
            raise GGUFFormatError(f"{self.path.name}: a string of {n} bytes runs past the end of the file")
        s = bytes(self._map[self._pos:self._pos + n]).decode("utf-8", errors="replace")
        self._pos += n
        return s

    def _value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self._scalar(_SCALARS[vtype][0])  # struct's "?" gives a bool
        if vtype == _STRING:
            return self._string()
        if vtype != _ARRAY:
            raise GGUFFormatError(f"{self.path.name}: unknown value type {vtype} at byte {self._pos - 4}")
        etype, count = self._scalar("<I"), self._scalar("<Q")
        if etype in _SCALARS:
            dtype = np.dtype(_SCALARS[etype][1]).newbyteorder("<")
            if self._pos + count * dtype.itemsize > len(self._map):
                raise GGUFFormatError(f"{self.path.name}: an array of {count} values runs past the end of the file")
            arr = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._pos)
            self._pos += count * dtype.itemsize
            return arr
        if etype == _STRING:
            start = self._pos
            for _ in range(count):  # skip: only the lengths are read
                n = self._scalar("<Q")
                self._pos += n
                if self._pos > len(self._map):
                    raise GGUFFormatError(f"{self.path.name}: a string array runs past the end of the file")
            return StringArray(start, count)
        raise GGUFFormatError(f"{self.path.name}: arrays of value type {etype} are not supported")


_NUMPY_OF_PLAIN_TYPE = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                        "I32": np.int32, "I64": np.int64}  # others (BF16, block types) stay bytes
