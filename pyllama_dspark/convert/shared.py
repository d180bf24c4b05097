"""Whether to write the drafter's token embedding and LM head or borrow the target's.

A DSpark drafter's ``embed_tokens`` and ``lm_head`` are frozen copies of the
target's (DSPARK.md). When both are left out of the GGUF, the loader borrows
the target's through the draft context's ``ctx_other`` (src/models/dflash.cpp),
which saves two vocabulary-sized matrices. They are left out only when they
provably equal the target's, because the loader has one sharp edge: with
``token_embd`` present and ``output`` absent it uses ``token_embd`` as the LM
head, which is wrong for a target with an untied head. The vendored converter
drops ``lm_head`` of every full-vocabulary drafter unconditionally and can
produce exactly that file; this module never does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import keys
from .errors import UnsupportedModelError
from .safetensors import TensorRef
from .target import RowSource, TargetInfo
from .tensors import TensorPlan

__all__ = ["SharedDecision", "decide_shared", "same_values"]

_CHUNK_ROWS = 1024  # 1024 x 8192 float64 values: 64 MiB per operand
# relative RMS difference accepted as "the same tensor": float storage
# differs from a bf16 checkpoint by rounding only (~0.3 %), while a quantized
# target (Q2_K..Q8_0) stays well under 50 %; an unrelated matrix is ~140 %
_TOL_EXACT = 1e-2
_TOL_QUANTIZED = 0.5


@dataclass(frozen=True)
class SharedDecision:
    """GGUF tensors left out, and one line per decision for the user."""

    omitted: frozenset[str]
    notes: tuple[str, ...]


def same_values(ref: TensorRef, other: RowSource) -> bool:
    """True when checkpoint tensor ``ref`` equals ``other`` up to ``other``'s storage precision.

    Compared in chunks of rows, so a vocabulary-sized matrix is never
    dequantized whole.
    """
    if tuple(ref.shape) != tuple(other.shape):
        return False
    diff = norm = 0.0
    for start in range(0, ref.shape[0], _CHUNK_ROWS):
        stop = min(start + _CHUNK_ROWS, ref.shape[0])
        a, b = ref.rows(start, stop).astype(np.float64), other.read(start, stop).astype(np.float64)
        diff += float(np.sum((a - b) ** 2))
        norm += float(np.sum(b ** 2))
    tol = _TOL_EXACT if other.exact else _TOL_QUANTIZED
    return diff <= (tol ** 2) * norm


def _target_head(target: TargetInfo) -> RowSource | None:
    return target.output if target.output is not None else target.token_embd


def _is_same(plan: TensorPlan, name: str, other: RowSource | None, notes: list[str]) -> bool:
    if name not in plan.tensors or other is None:
        return False
    try:
        return same_values(plan.tensors[name].ref, other)
    except NotImplementedError as exc:  # gguf-py cannot dequantize every ggml type in numpy
        notes.append(f"kept {name}: cannot compare it with the target's ({exc})")
        return False


def _omissions(plan: TensorPlan, target: TargetInfo) -> tuple[set[str], list[str]]:
    omitted: set[str] = set()
    notes: list[str] = []
    if _is_same(plan, keys.TOKEN_EMBD, target.token_embd, notes):
        omitted.add(keys.TOKEN_EMBD)
    embd_written = keys.TOKEN_EMBD in plan.tensors and keys.TOKEN_EMBD not in omitted
    if _is_same(plan, keys.OUTPUT, _target_head(target), notes):
        if embd_written:
            notes.append("output kept although it equals the target's head: the drafter has its own token_embd, "
                         "and the loader would use that as the head if output were left out")
        else:
            omitted.add(keys.OUTPUT)
    if omitted:
        names = " and ".join(n for n in (keys.TOKEN_EMBD, keys.OUTPUT) if n in omitted)
        notes.append(f"omitted {names}: equal to the target's ({target.description}); the drafter borrows "
                     "them at run time through the draft context's ctx_other (--keep-shared-tensors keeps them)")
    return omitted, notes


def _check_head(plan: TensorPlan, omitted: set[str], target: TargetInfo | None) -> list[str]:
    """The loader ties a missing output to token_embd; refuse that when the target's head is untied."""
    embd_written = keys.TOKEN_EMBD in plan.tensors and keys.TOKEN_EMBD not in omitted
    if not embd_written or keys.OUTPUT in plan.tensors:
        return []
    if target is not None and target.output is not None:
        raise UnsupportedModelError(
            "the checkpoint has embed_tokens but no lm_head: written as token_embd without output, the loader "
            f"would use it as the LM head, but the target's head is untied ({target.description}). token_embd "
            "is left out only when it equals the target's and --keep-shared-tensors is not given.")
    return ["token_embd written without output: the loader will use token_embd as the LM head (tied)"]


def decide_shared(plan: TensorPlan, target: TargetInfo | None, *, keep: bool) -> SharedDecision:
    """Decide which of token_embd/output to leave out.

    Args:
        plan: the checked tensor plan.
        target: the target, or None when none was given (nothing can be
            proven equal then, so everything present is kept).
        keep: ``--keep-shared-tensors``: keep whatever the checkpoint has.

    Raises:
        UnsupportedModelError: the file would tie the head to a token
            embedding that differs from the target's untied head.
    """
    present = [n for n in (keys.TOKEN_EMBD, keys.OUTPUT) if n in plan.tensors]
    omitted: set[str] = set()
    notes: list[str] = []
    if not present:
        notes.append("the checkpoint has no embed_tokens/lm_head: the drafter borrows the target's at run time")
    elif keep or target is None:
        why = "--keep-shared-tensors" if keep else "no target given to prove them equal to its own"
        notes.append(f"kept {' and '.join(present)} ({why})")
    else:
        omitted, notes = _omissions(plan, target)
    notes += _check_head(plan, omitted, target)
    return SharedDecision(frozenset(omitted), tuple(notes))
