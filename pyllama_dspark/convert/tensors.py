"""Which checkpoint tensor becomes which GGUF tensor, and the shapes the loader expects.

HF names may carry optional ``model.`` and ``drafter.`` prefixes
(DSPARK.md); they are stripped before mapping. The GGUF names and the shapes
follow ``llama_model_dflash::load_arch_tensors`` (src/models/dflash.cpp);
shapes here are numpy order, the reverse of ggml's ``ne``:

=======================================  ================================  =====================
HF (prefix stripped)                     GGUF                              numpy shape
=======================================  ================================  =====================
fc.weight                                fc.weight                         (H, n_taps*H)
hidden_norm.weight                       enc.output_norm.weight            (H,)
norm.weight                              output_norm.weight                (H,)
layers.i.input_layernorm.weight          blk.i.attn_norm.weight            (H,)
layers.i.self_attn.{q,k,v,o}_proj        blk.i.attn_{q,k,v,output}         (nh*hd, H) ...
layers.i.self_attn.{q,k}_norm.weight     blk.i.attn_{q,k}_norm.weight      (hd,)
layers.i.post_attention_layernorm        blk.i.ffn_norm.weight             (H,)
layers.i.mlp.{gate,up,down}_proj         blk.i.ffn_{gate,up,down}          (F, H) / (H, F)
embed_tokens.weight                      token_embd.weight (optional)      (V, H)
lm_head.weight                           output.weight (optional)          (Vd, H)
markov_head.markov_w1.weight             markov_w1.weight                  (V, R)
markov_head.markov_w2.weight             markov_w2.weight                  (Vd, R)
confidence_head.proj.weight / .bias      conf_proj.weight / conf_proj.bias (1, H+R) / (1,)
d2t                                      d2t (absolute target ids, i64)    (Vd,)
=======================================  ================================  =====================

The loader creates only the tensors it knows and then refuses a file whose
tensor count differs, so an unmapped tensor is an error here, not a warning.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from . import keys
from .config import DraftConfig
from .errors import CheckpointError, MissingTensorError, TensorShapeError, UnexpectedTensorError, UnsupportedModelError
from .safetensors import TensorRef

__all__ = ["SourceTensor", "TensorPlan", "plan_tensors", "strip_prefix"]

_PREFIXES = ("drafter.", "model.")
# conversion/base.py prepare_tensors skips these; t2d is unused at run time (qwen.py DSparkModel)
_SKIPPED_SUFFIXES = (".attention.masked_bias", ".attention.bias", ".rotary_emb.inv_freq")
_SKIPPED = ("t2d",)
_GLOBAL = {
    "fc.weight": keys.FC,
    "hidden_norm.weight": keys.ENC_OUTPUT_NORM,
    "norm.weight": keys.OUTPUT_NORM,
    "embed_tokens.weight": keys.TOKEN_EMBD,
    "lm_head.weight": keys.OUTPUT,
    "markov_head.markov_w1.weight": keys.MARKOV_W1,
    "markov_head.markov_w2.weight": keys.MARKOV_W2,
    "confidence_head.proj.weight": keys.CONF_PROJ,
    "confidence_head.proj.bias": keys.CONF_PROJ_BIAS,
    "d2t": keys.D2T,
}
_LAYER = {
    "input_layernorm.weight": keys.ATTN_NORM,
    "self_attn.q_proj.weight": keys.ATTN_Q,
    "self_attn.k_proj.weight": keys.ATTN_K,
    "self_attn.v_proj.weight": keys.ATTN_V,
    "self_attn.o_proj.weight": keys.ATTN_OUT,
    "self_attn.q_norm.weight": keys.ATTN_Q_NORM,
    "self_attn.k_norm.weight": keys.ATTN_K_NORM,
    "post_attention_layernorm.weight": keys.FFN_NORM,
    "mlp.gate_proj.weight": keys.FFN_GATE,
    "mlp.up_proj.weight": keys.FFN_UP,
    "mlp.down_proj.weight": keys.FFN_DOWN,
}
_FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")
_LAYER_NAME = re.compile(r"^layers\.(\d+)\.(.+)$")
_GGUF_TO_HF = {g: h for h, g in _GLOBAL.items()}


@dataclass(frozen=True)
class SourceTensor:
    """A checkpoint tensor with its original HF name."""

    hf_name: str
    ref: TensorRef


@dataclass(frozen=True)
class TensorPlan:
    """The checked mapping from checkpoint to GGUF.

    ``tensors`` maps GGUF name -> source (d2t excluded: ``d2t`` holds its
    absolute target ids). ``markov_rank`` is 0 without a Markov head.
    """

    tensors: dict[str, SourceTensor]
    markov_rank: int
    has_confidence_head: bool
    d2t: np.ndarray | None


def strip_prefix(name: str) -> str:
    """``name`` without any leading ``model.`` / ``drafter.`` prefixes."""
    while name.startswith(_PREFIXES):
        name = name.split(".", 1)[1]
    return name


def _gguf_name(short: str, n_layer: int) -> str | None:
    if short in _GLOBAL:
        return _GLOBAL[short]
    m = _LAYER_NAME.match(short)
    if m and m.group(2) in _LAYER and int(m.group(1)) < n_layer:
        return keys.block_tensor(int(m.group(1)), _LAYER[m.group(2)])
    return None


def _map_names(cfg: DraftConfig, refs: dict[str, TensorRef]) -> dict[str, SourceTensor]:
    mapped: dict[str, SourceTensor] = {}
    for hf_name, ref in refs.items():
        short = strip_prefix(hf_name)
        if short in _SKIPPED or hf_name.endswith(_SKIPPED_SUFFIXES):
            continue
        gguf_name = _gguf_name(short, cfg.n_layer)
        if gguf_name is None:
            raise UnexpectedTensorError(
                f"cannot map checkpoint tensor {hf_name!r} to a DSpark GGUF tensor "
                f"(a drafter with num_hidden_layers={cfg.n_layer} has no such tensor)")
        if gguf_name in mapped:
            raise UnexpectedTensorError(f"{hf_name!r} and {mapped[gguf_name].hf_name!r} both map to {gguf_name}")
        mapped[gguf_name] = SourceTensor(hf_name, ref)
    return mapped


def _markov_rank(cfg: DraftConfig, mapped: dict[str, SourceTensor]) -> int:
    present = [n for n in (keys.MARKOV_W1, keys.MARKOV_W2) if n in mapped]
    rank = mapped[present[0]].ref.shape[-1] if present else 0
    if cfg.markov_rank is not None and cfg.markov_rank != rank:
        if not present:
            raise MissingTensorError(
                f"config.json says markov_rank={cfg.markov_rank} but the checkpoint has no Markov head "
                f"(expected {_GGUF_TO_HF[keys.MARKOV_W1]} and {_GGUF_TO_HF[keys.MARKOV_W2]})")
        raise TensorShapeError(
            f"config.json says markov_rank={cfg.markov_rank}, the Markov head tensors have rank {rank}")
    return rank


def _check_confidence(cfg: DraftConfig, mapped: dict[str, SourceTensor], rank: int) -> bool:
    has_conf = keys.CONF_PROJ in mapped
    if cfg.confidence_head and not has_conf:
        raise MissingTensorError(
            "config.json enables the confidence head but the checkpoint has no confidence_head.proj.weight")
    if keys.CONF_PROJ_BIAS in mapped and not has_conf:
        raise UnexpectedTensorError("confidence_head.proj.bias without confidence_head.proj.weight")
    if has_conf and (rank == 0 or cfg.confidence_with_markov is False):
        # load_arch_tensors creates conf_proj only next to markov_w1, with
        # ne = {n_embd + rank, 1}: the head must read [h_k ; w1[prev_k]]
        raise UnsupportedModelError(
            f"the confidence head must read [h_k ; markov_w1[prev]] (confidence_head_with_markov=true, "
            f"markov_rank > 0) for the vendored loader; this checkpoint has markov_rank={rank}, "
            f"confidence_head_with_markov={cfg.confidence_with_markov}")
    return has_conf


def _layer_shapes(cfg: DraftConfig, il: int) -> dict[str, tuple[int, ...]]:
    h, hd, f = cfg.n_embd, cfg.head_dim, cfg.n_ff
    q, kv = cfg.n_head * hd, cfg.n_head_kv * hd
    shapes = {
        keys.ATTN_NORM: (h,), keys.ATTN_Q: (q, h), keys.ATTN_K: (kv, h), keys.ATTN_V: (kv, h),
        keys.ATTN_OUT: (h, q), keys.ATTN_Q_NORM: (hd,), keys.ATTN_K_NORM: (hd,), keys.FFN_NORM: (h,),
        keys.FFN_GATE: (f, h), keys.FFN_UP: (f, h), keys.FFN_DOWN: (h, f),
    }
    return {keys.block_tensor(il, s): shape for s, shape in shapes.items()}


def expected_shapes(cfg: DraftConfig, rank: int) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """(numpy shape of every tensor the drafter may have, names the loader requires)."""
    h, v, vd = cfg.n_embd, cfg.n_vocab, cfg.n_vocab_draft
    shapes = {
        keys.FC: (h, cfg.n_taps * h), keys.ENC_OUTPUT_NORM: (h,), keys.OUTPUT_NORM: (h,),
        keys.TOKEN_EMBD: (v, h), keys.OUTPUT: (vd, h), keys.D2T: (vd,),
        keys.MARKOV_W1: (v, rank), keys.MARKOV_W2: (vd, rank),
        keys.CONF_PROJ: (1, h + rank), keys.CONF_PROJ_BIAS: (1,),
    }
    for il in range(cfg.n_layer):
        shapes.update(_layer_shapes(cfg, il))
    required = {n for n in shapes if n.startswith("blk.")} | {keys.FC, keys.ENC_OUTPUT_NORM, keys.OUTPUT_NORM}
    if rank > 0:
        required |= {keys.MARKOV_W1, keys.MARKOV_W2}
    if vd < v:
        # a reduced draft vocabulary needs its own head and the draft->target table
        required |= {keys.OUTPUT, keys.D2T}
    return shapes, required


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GGUF_TO_HF:
        return _GGUF_TO_HF[gguf_name]
    _, il, suffix = gguf_name.split(".", 2)
    return f"layers.{il}." + next(h for h, g in _LAYER.items() if g == suffix)


def _check_shapes(cfg: DraftConfig, mapped: dict[str, SourceTensor], rank: int) -> None:
    shapes, required = expected_shapes(cfg, rank)
    missing = sorted(required - set(mapped))
    if missing:
        listed = ", ".join(f"{_hf_name(n)} ({n}, shape {list(shapes[n])})" for n in missing)
        raise MissingTensorError(f"checkpoint lacks tensors the loader requires: {listed}")
    for name, src in mapped.items():
        if name != keys.D2T and src.ref.dtype not in _FLOAT_DTYPES:
            raise CheckpointError(f"tensor {src.hf_name!r} holds {src.ref.dtype} values, expected floating point")
        got = tuple(src.ref.shape)
        # the checkpoint may store the 1-element bias as a scalar-like (1,) or ()
        if got != shapes[name] and not (name == keys.CONF_PROJ_BIAS and got == ()):
            raise TensorShapeError(
                f"tensor {src.hf_name!r} (-> {name}): expected shape {list(shapes[name])}, got {list(got)}")


def _absolute_d2t(cfg: DraftConfig, src: SourceTensor) -> np.ndarray:
    """d2t as absolute target ids, checked like the vendored DSparkModel.prepare_tensors."""
    if src.ref.dtype not in ("I64", "I32", "I16", "I8", "U8"):
        raise CheckpointError(f"d2t must hold integers, got dtype {src.ref.dtype}")
    offsets = src.ref.load().astype(np.int64).reshape(-1)
    ids = offsets + np.arange(offsets.size, dtype=np.int64)
    if np.any((ids < 0) | (ids >= cfg.n_vocab)):
        raise CheckpointError(f"d2t maps to target ids outside [0, {cfg.n_vocab})")
    if np.unique(ids).size != ids.size:
        raise CheckpointError("d2t maps two draft tokens to the same target id")
    if cfg.mask_token_id is not None and cfg.mask_token_id in set(ids.tolist()):
        raise CheckpointError(f"d2t maps a draft token to the mask token {cfg.mask_token_id}, which must never be "
                              f"drafted")
    return ids


def plan_tensors(cfg: DraftConfig, refs: dict[str, TensorRef]) -> TensorPlan:
    """Map and check every checkpoint tensor against ``cfg``.

    Raises:
        UnexpectedTensorError: a tensor the loader would not consume.
        MissingTensorError: a required tensor is absent (names HF and GGUF names and the shape).
        TensorShapeError: a tensor's shape differs from the one ``cfg`` implies.
        UnsupportedModelError: a confidence head the loader cannot read.
        CheckpointError: a malformed d2t table or a weight that is not floating point.
    """
    mapped = _map_names(cfg, refs)
    rank = _markov_rank(cfg, mapped)
    has_conf = _check_confidence(cfg, mapped, rank)
    _check_shapes(cfg, mapped, rank)
    d2t_src = mapped.pop(keys.D2T, None)
    d2t = _absolute_d2t(cfg, d2t_src) if d2t_src is not None else None
    t2d = next((SourceTensor(name, ref) for name, ref in refs.items() if strip_prefix(name) == "t2d"), None)
    if t2d is not None:
        _check_t2d(cfg, t2d, d2t)
    return TensorPlan(tensors=mapped, markov_rank=rank, has_confidence_head=has_conf, d2t=d2t)


def _check_t2d(cfg: DraftConfig, src: SourceTensor, d2t: np.ndarray | None) -> None:
    """t2d (a target-side mask, True where the target id is in the draft vocabulary) must describe the same
    vocabulary as d2t. It is not written (llama.cpp reads d2t alone), but a checkpoint whose two tables disagree
    was exported wrong, and which one is right cannot be told."""
    if d2t is None:
        raise CheckpointError(f"the checkpoint has {src.hf_name!r} (t2d) but no d2t table to map draft rows to "
                              f"target ids")
    if tuple(src.ref.shape) != (cfg.n_vocab,):
        raise TensorShapeError(f"tensor {src.hf_name!r} (t2d): expected shape [{cfg.n_vocab}] (one flag per target "
                               f"token), got {list(src.ref.shape)}")
    if src.ref.dtype not in ("BOOL", "I64", "I32", "I16", "I8", "U8"):
        raise CheckpointError(f"t2d must hold booleans or integers, got dtype {src.ref.dtype}")
    flags = src.ref.load().reshape(-1) != 0
    in_d2t = np.zeros(cfg.n_vocab, dtype=bool)
    in_d2t[d2t] = True
    if not np.array_equal(flags, in_d2t):
        only_t2d = np.flatnonzero(flags & ~in_d2t)[:5].tolist()
        only_d2t = np.flatnonzero(in_d2t & ~flags)[:5].tolist()
        raise CheckpointError(f"t2d and d2t disagree on the draft vocabulary: t2d marks {int(flags.sum())} target "
                              f"ids, d2t maps {d2t.size}; in t2d only: {only_t2d}, in d2t only: {only_d2t}")
