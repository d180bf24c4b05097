"""Stream metadata and tensors into a GGUF file, atomically.

gguf-py's GGUFWriter keeps every added tensor in memory until it writes; for
a multi-GB checkpoint that is the whole model. Here the tensor *infos* are
declared first (shape, type and byte size are known without the data), then
each tensor is produced, converted and written one at a time.

The file is written under a temporary name in the destination folder and
renamed into place at the end, so a reader (or a failed run) never sees a
partial GGUF; any exception removes the temporary file.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from . import keys

__all__ = ["OutputTensor", "write_gguf"]

_PLAIN_DTYPES = {QT.F32: np.float32, QT.F16: np.float16, QT.I64: np.int64}


@dataclass(frozen=True)
class OutputTensor:
    """One tensor to write: numpy-order ``shape``, storage type, and a producer of the stored data.

    ``produce`` returns the data ready for the file: float32/float16/int64
    arrays for the plain types, gguf.quants.quantize output (uint8) for BF16
    and Q8_0.
    """

    name: str
    shape: tuple[int, ...]
    qtype: QT
    produce: Callable[[], np.ndarray]

    def info(self) -> tuple[tuple[int, ...], np.dtype, int]:
        """(shape as GGUFWriter.add_tensor_info takes it, its dtype, byte size)."""
        if self.qtype in _PLAIN_DTYPES:
            dtype = np.dtype(_PLAIN_DTYPES[self.qtype])
            return self.shape, dtype, int(np.prod(self.shape, dtype=np.int64)) * dtype.itemsize
        byte_shape = gguf.quants.quant_shape_to_byte_shape(self.shape, self.qtype)
        return tuple(byte_shape), np.dtype(np.uint8), int(np.prod(byte_shape, dtype=np.int64))


def _declare(writer: gguf.GGUFWriter, kvs: Sequence[keys.KV], tensors: Sequence[OutputTensor]) -> None:
    for key, value, vtype, sub_type in kvs:
        writer.add_key_value(key, value, vtype, sub_type)
    for t in tensors:
        shape, dtype, nbytes = t.info()
        writer.add_tensor_info(t.name, shape, dtype, nbytes, raw_dtype=None if t.qtype in _PLAIN_DTYPES else t.qtype)


def _write(writer: gguf.GGUFWriter, path: Path, tensors: Sequence[OutputTensor]) -> None:
    writer.write_header_to_file(path=path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in tensors:
        data = t.produce()
        expected = t.info()[2]
        if data.nbytes != expected:
            raise RuntimeError(f"{t.name}: produced {data.nbytes} bytes, declared {expected}")
        writer.write_tensor_data(data)
    writer.close()


def write_gguf(path: str | os.PathLike[str], kvs: Sequence[keys.KV], tensors: Sequence[OutputTensor]) -> Path:
    """Write a ``dflash`` GGUF with ``kvs`` and ``tensors`` to ``path``, atomically.

    Args:
        path: destination; its folder must exist. An existing file is replaced
            only once the new one is complete.
        kvs: metadata entries (``general.architecture`` is added by the writer).
        tensors: written in this order, each produced only when its turn comes.

    Returns:
        ``path`` as a Path.
    """
    writer = gguf.GGUFWriter(None, keys.ARCH)

    def write(tmp: Path) -> None:
        _declare(writer, kvs, tensors)
        _write(writer, tmp, tensors)

    return write_atomically(path, writer, write)


def write_atomically(path: str | os.PathLike[str], writer: gguf.GGUFWriter, write: Callable[[Path], None]) -> Path:
    """Run ``write(tmp)`` on a temporary file beside ``path``, then rename it into place.

    On any error the writer is closed and the temporary file removed: no partial file is left.
    """
    path = Path(path)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return path
