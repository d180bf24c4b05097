"""Storage type and data of every output tensor.

The rules are those of ``ModelBase.prepare_tensors`` (conversion/base.py):
1-D tensors, ``*_norm.weight`` and anything not named ``*.weight`` stay
float32; the other matrices take ``--outtype``; a matrix whose rows do not
split into Q8_0 blocks of 32 falls back to float16; ``d2t`` is int64.
bfloat16 checkpoint data is widened to float32 first and float16 data is kept
as float16, as upstream does, so both converters round identically.
"""

from __future__ import annotations

from collections.abc import Iterable

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from . import keys
from .config import DraftConfig
from .errors import ConversionError
from .safetensors import TensorRef
from .tensors import SourceTensor, TensorPlan
from .writer import OutputTensor

__all__ = ["OUTTYPES", "resolve_outtype", "output_tensors"]

OUTTYPES = ("auto", "f32", "f16", "bf16", "q8_0")
_QTYPES = {"f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16, "q8_0": QT.Q8_0}
_Q8_0_BLOCK = 32
_ROPE_PERMUTED = (keys.ATTN_Q, keys.ATTN_K, keys.ATTN_Q_NORM, keys.ATTN_K_NORM)


def resolve_outtype(outtype: str, refs: Iterable[TensorRef]) -> str:
    """``outtype``, with ``auto`` resolved like upstream: the first bf16/f16 matrix decides, else f16.

    Raises:
        ConversionError: an unknown outtype.
    """
    if outtype not in OUTTYPES:
        raise ConversionError(f"outtype must be one of {', '.join(OUTTYPES)}, got {outtype!r}")
    if outtype != "auto":
        return outtype
    first = next((r.dtype for r in refs if len(r.shape) >= 2 and r.dtype in ("BF16", "F16")), None)
    return "bf16" if first == "BF16" else "f16"


def _qtype(name: str, shape: tuple[int, ...], outtype: str) -> QT:
    if len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return QT.F32
    qtype = _QTYPES[outtype]
    if qtype == QT.Q8_0 and shape[-1] % _Q8_0_BLOCK != 0:
        return QT.F16  # upstream's QuantError fallback
    return qtype


def _deinterleave_rope(data: np.ndarray, head_dim: int) -> np.ndarray:
    """Interleaved-RoPE rows -> NeoX order: per head, even dims first, then odd (DFlashModel.modify_tensors)."""
    shape = data.shape
    return data.reshape(-1, head_dim // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _producer(src: SourceTensor, qtype: QT, permute_head_dim: int | None):
    def produce() -> np.ndarray:
        data = src.ref.load()
        if permute_head_dim is not None:
            data = _deinterleave_rope(data, permute_head_dim)
        return gguf.quants.quantize(data.reshape(src.ref.shape or (1,)), qtype)
    return produce


def _permute_head_dim(cfg: DraftConfig, name: str) -> int | None:
    if cfg.hparams.get("rope_is_neox_style", True) or not name.endswith(_ROPE_PERMUTED):
        return None
    return cfg.head_dim


def output_tensors(cfg: DraftConfig, plan: TensorPlan, omitted: frozenset[str], outtype: str) -> list[OutputTensor]:
    """The tensors to write, in checkpoint order, then ``d2t``.

    Args:
        cfg: the drafter config (head_dim and RoPE layout).
        plan: the checked mapping.
        omitted: GGUF names left out (shared with the target).
        outtype: a resolved outtype (not ``auto``).
    """
    out = []
    for name, src in plan.tensors.items():
        if name in omitted:
            continue
        shape = tuple(src.ref.shape) or (1,)
        qtype = _qtype(name, shape, outtype)
        out.append(OutputTensor(name, shape, qtype, _producer(src, qtype, _permute_head_dim(cfg, name))))
    if plan.d2t is not None:
        ids = plan.d2t
        out.append(OutputTensor(keys.D2T, ids.shape, QT.I64, lambda: ids))
    return out
