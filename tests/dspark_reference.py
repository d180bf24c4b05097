"""Independent float64 numpy forward pass of a DSpark drafter stored as a ``dflash`` GGUF.

The math follows the vendored llama.cpp (``src/models/dflash.cpp``: ``load_arch_hparams``,
``load_arch_tensors``, the ``graph<false>`` decoder and ``build_dspark_markov_head``; rope
type from ``llama_model_rope_type`` in ``src/llama-model.cpp``; the draft driver in
``common/speculative.cpp``). Only what that code does is modelled; where DeepSpec and the
vendored tree could differ, the vendored tree decides (this is a reference for llama.cpp).

Context (an embedding batch in llama.cpp, positions ``0..P-1``): each feature row
``f`` (``n_taps * n_embd`` wide, taps concatenated in ``dflash.target_layers`` order) gives
``g = rms_norm(fc @ f) * enc.output_norm``; every layer ``l`` stores
``K = rope(rms_norm_head(W_k g) * attn_k_norm, pos)`` and ``V = W_v g``. Context rows get no
``attn_norm`` and issue no queries. A layer without ``attn_v`` shares K: ``V = rms_norm_head(W_k g)``
(no weight, no RoPE).

Block (a token batch): ids ``[anchor, mask * (B-1)]`` at positions ``P..P+B-1``;
``x = token_embd[ids]`` (times ``dflash.embedding_scale`` if set). Per layer:
``n = rms_norm(x) * attn_norm``; Q/K/V from ``n``; q_norm/k_norm per head; RoPE; attention
of the B queries over ``[context K/V ; block K/V]`` that is NON-causal (unless
``dflash.attention.causal`` is true, which ``common/speculative.cpp`` passes to
``llama_set_causal_attn``), GQA, ``kq_scale = dflash.attention.scale`` or ``1/sqrt(head_dim)``,
optional per-head sinks; ``wo``; optional ``dflash.attention.value_scale``; optional
``post_attention_norm``; residual; ``rms_norm * ffn_norm``; ``down(act(gate) * up)`` with act
SiLU (or tanh-GELU for ``dflash.hidden_activation`` = gelu*); optional ``post_ffw_norm``;
residual; optional ``layer_output_scale``. Then ``h = rms_norm(x) * output_norm`` (this is
``res->t_embd``) and ``base = lm_head @ h``. DSpark does NOT apply ``dflash.logit_scale`` or the
final soft-cap to its logits (only DFlash2's selector does).

RoPE: NEOX (rotates pairs ``(i, i + n_rot/2)``), ``theta_i = pos * freq_scale *
freq_base**(-2i/n_rot) / rope_freqs[i]``, cos/sin scaled by ``rope.scaling.attn_factor``;
dims past ``n_rot`` untouched. A draft for an M-RoPE target (``rope.dimension_sections``)
is MROPE in llama.cpp; with text positions (and ``sections[3] == 0``) that is exactly NEOX
at the token position, without rope_freqs.

Markov head (present iff ``markov_w1.weight``): ``logits_k = base_k + W2 @ w1[prev_k]`` for
the draft slots ``k >= i0`` where ``i0 = 0`` if ``dflash.sample_from_anchor`` (default true)
else 1; ``prev_{i0} = anchor`` and ``prev_k = argmax(logits_{k-1})`` after it (the in-graph
chain is greedy; ``prev_tokens`` overrides it). With ``sample_from_anchor = false`` slot 0
is passed through unbiased. If ``B > dflash.block_size`` llama.cpp skips the Markov head
(and the confidence) entirely, and so does this reference. Confidence (iff
``conf_proj.weight``): ``sigmoid(conf_proj @ [h_k ; w1[prev_k]] + bias)`` with ``h_k`` the
final-norm hidden; slot 0 of a bonus-anchor drafter holds ``sigmoid(base_0[0])`` (an unread pad).

Borrowing: without ``token_embd.weight`` the target's token embeddings are used; without
``output.weight`` the lm_head is the drafter's own ``token_embd`` (tied) if it has one,
otherwise the target's output matrix. Reduced vocabularies (``d2t``, absolute target ids)
scatter the draft logits into the full vocabulary with ``-inf`` elsewhere, and the Markov
bias likewise (0 elsewhere).

Not modelled (raises NotImplementedError): DeepSeek-V4 drafters (``hyper_connection.count``),
DFlash2 (selector/conv tensors), YaRN/LongRoPE scaling, ``input_scale`` tensors.

Agreement with llama.cpp is limited by its f16 KV cache (see tests/reference.py);
``round_kv_to_f16=True`` rounds the stored K (after RoPE) and V to f16 like the cache does.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import gguf
import numpy as np

ARCH = "dflash"


@dataclass
class DraftReference:
    logits: np.ndarray  # [B, n_vocab] post-Markov slot logits (what llama.cpp returns as the drafter's logits)
    base_logits: np.ndarray  # [B, n_vocab] lm_head logits before the Markov bias
    tokens: list[int]  # greedy chain: tokens[k] = argmax(logits[k])
    confidence: np.ndarray | None  # [B] sigmoid(conf_proj . [h_k ; w1[prev_k]] + b), None without a confidence head
    hidden: np.ndarray  # [B, n_embd_drafter] final-norm hidden (input of lm_head)
    prev: list[int] | None = None  # [B] the Markov conditioning token of each draft slot (-1: none), None w/o Markov


@dataclass(frozen=True)
class DrafterHParams:
    n_layer: int
    n_embd: int
    n_head: tuple[int, ...]  # per layer
    n_head_kv: tuple[int, ...]  # per layer
    head_dim: int
    n_rot: int
    eps: float
    freq_base: float
    freq_scale: float
    attn_factor: float
    rope_sections: tuple[int, int, int, int]
    kq_scale: float
    embedding_scale: float  # 0 = off
    value_scale: float  # 0 = off
    ffn_act: str  # "silu" | "gelu"
    causal: bool
    n_swa: int  # 0 = no sliding window
    is_swa: tuple[bool, ...]  # per layer
    block_size: int | None  # dflash.block_size (None if absent)
    sample_from_anchor: bool
    target_layers: tuple[int, ...]


@dataclass
class Drafter:
    """A drafter GGUF read once: metadata, hyper-parameters and float64 weights."""

    meta: dict[str, Any]
    hp: DrafterHParams
    weights: dict[str, np.ndarray] = field(repr=False)
    d2t: np.ndarray | None = field(default=None, repr=False)


# --------------------------------------------------------------------------- loading


def _f32(value: Any) -> float:
    """llama.cpp holds float hyper-parameters as float32."""
    return float(np.float32(value))


def _as_bool(value: Any) -> bool:
    # llama.cpp reads dflash.sample_from_anchor back from its string map: "true" / "false"
    if isinstance(value, str):
        return value == "true"
    return bool(value)


def _per_layer(value: Any, n_layer: int) -> tuple[int, ...]:
    if isinstance(value, (list, tuple, np.ndarray)):
        if len(value) != n_layer:
            raise ValueError(f"per-layer array of length {len(value)}, expected {n_layer}")
        return tuple(int(v) for v in value)
    return (int(value),) * n_layer


def _metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    return {key: f.contents() for key, f in reader.fields.items()
            if not key.startswith("tokenizer.ggml.") or key == "tokenizer.ggml.mask_token_id"}


def _hparams(meta: Mapping[str, Any]) -> DrafterHParams:
    a = ARCH
    arch = meta.get("general.architecture")
    if arch != ARCH:
        raise ValueError(f"general.architecture is {arch!r}, not {ARCH!r}")
    if int(meta.get(f"{a}.hyper_connection.count", 0) or 0) > 0:
        raise NotImplementedError("DeepSeek-V4 DSpark drafters (hyper_connection.count > 0) are not modelled")
    if f"{a}.target_layers" not in meta:
        raise ValueError("DFlash model requires 'dflash.target_layers' in GGUF metadata")

    n_layer = int(meta[f"{a}.block_count"]) - int(meta.get(f"{a}.nextn_predict_layers", 0) or 0)
    n_embd = int(meta[f"{a}.embedding_length"])
    n_head = _per_layer(meta[f"{a}.attention.head_count"], n_layer)
    n_head_kv = _per_layer(meta.get(f"{a}.attention.head_count_kv", meta[f"{a}.attention.head_count"]), n_layer)
    head_dim_k = int(meta.get(f"{a}.attention.key_length", n_embd // n_head[0]))
    head_dim_v = int(meta.get(f"{a}.attention.value_length", n_embd // n_head[0]))
    if head_dim_k != head_dim_v:
        raise ValueError(f"DFlash asserts key_length == value_length, got {head_dim_k} != {head_dim_v}")
    n_rot = int(meta.get(f"{a}.rope.dimension_count", head_dim_k))

    scaling = str(meta.get(f"{a}.rope.scaling.type", "linear"))
    factor = float(meta.get(f"{a}.rope.scaling.factor", meta.get(f"{a}.rope.scale_linear", 0.0)) or 0.0)
    if scaling in ("yarn", "longrope") or float(meta.get(f"{a}.rope.scaling.yarn_ext_factor", -1.0)) > 0:
        raise NotImplementedError(f"rope scaling {scaling!r} is not modelled")
    freq_scale = 1.0 if scaling == "none" or factor == 0.0 else _f32(1.0 / _f32(factor))

    sections = meta.get(f"{a}.rope.dimension_sections")
    sections = tuple(int(s) for s in sections[:4]) if sections is not None else (0, 0, 0, 0)
    sections = (sections + (0, 0, 0, 0))[:4]
    if sections[3] != 0:
        raise NotImplementedError(f"M-RoPE sections {sections} with a non-zero 4th section are not modelled")

    act = str(meta.get(f"{a}.hidden_activation", "silu"))
    if act in ("gelu", "gelu_pytorch_tanh"):
        act = "gelu"
    elif act != "silu":
        raise ValueError(f"unsupported DFlash hidden activation: {act}")

    attn_scale = _f32(meta.get(f"{a}.attention.scale", 0.0) or 0.0)
    kq_scale = attn_scale if attn_scale != 0.0 else _f32(1.0 / math.sqrt(float(np.float32(head_dim_k))))

    n_swa = int(meta.get(f"{a}.attention.sliding_window", 0) or 0)
    if n_swa > 0:
        pattern = meta.get(f"{a}.attention.sliding_window_pattern")
        if pattern is None:
            raise ValueError("dflash.attention.sliding_window needs dflash.attention.sliding_window_pattern")
        is_swa = tuple(bool(pattern[il]) if il < len(pattern) else False for il in range(n_layer))
    else:
        is_swa = (False,) * n_layer

    block_size = meta.get(f"{a}.block_size")
    return DrafterHParams(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim_k,
        n_rot=n_rot,
        eps=_f32(meta[f"{a}.attention.layer_norm_rms_epsilon"]),
        freq_base=_f32(meta.get(f"{a}.rope.freq_base", 10000.0)),
        freq_scale=freq_scale,
        attn_factor=_f32(meta.get(f"{a}.rope.scaling.attn_factor", 1.0)),
        rope_sections=sections,
        kq_scale=kq_scale,
        embedding_scale=_f32(meta.get(f"{a}.embedding_scale", 0.0) or 0.0),
        value_scale=_f32(meta.get(f"{a}.attention.value_scale", 0.0) or 0.0),
        ffn_act=act,
        causal=_as_bool(meta.get(f"{a}.attention.causal", False)),
        n_swa=n_swa,
        is_swa=is_swa,
        block_size=None if block_size is None else int(block_size),
        sample_from_anchor=_as_bool(meta.get(f"{a}.sample_from_anchor", True)),
        target_layers=tuple(int(t) for t in meta[f"{a}.target_layers"]),
    )


def dequantize_tensor(t: Any) -> np.ndarray:
    """A GGUFReader tensor as float64 in numpy order (the reverse of ggml's ``ne``)."""
    shape = tuple(reversed([int(d) for d in t.shape]))
    qt = t.tensor_type
    if qt in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F64):
        values = np.asarray(t.data)
    else:  # bf16 and block-quantized types come as bytes
        values = gguf.quants.dequantize(np.asarray(t.data), qt)
    return np.array(values, dtype=np.float64).reshape(shape)


def load_drafter(path: str | os.PathLike[str]) -> Drafter:
    """Read a ``dflash`` GGUF: metadata, hyper-parameters and every tensor as float64."""
    reader = gguf.GGUFReader(path)
    meta = _metadata(reader)
    hp = _hparams(meta)
    weights: dict[str, np.ndarray] = {}
    d2t = None
    for t in reader.tensors:
        if t.name.endswith(".input_scale"):
            raise NotImplementedError(f"input scales ({t.name}) are not modelled")
        if t.name.startswith("selector_") or "_conv_" in t.name:
            raise NotImplementedError(f"DFlash2 tensors ({t.name}) are not modelled")
        if t.name == "d2t":
            d2t = np.array(t.data, dtype=np.int64).reshape(-1)
            continue
        weights[t.name] = dequantize_tensor(t)
    return Drafter(meta=meta, hp=hp, weights=weights, d2t=d2t)


# --------------------------------------------------------------------------- math


def _rms(x: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return _rms(x, eps) * weight


def _mm(w: Mapping[str, np.ndarray], name: str, x: np.ndarray) -> np.ndarray:
    """``build_lora_mm``: x @ W.T (W numpy [n_out, n_in]), times the optional ``<base>.scale``."""
    y = x @ w[name + ".weight"].T
    s = w.get(name + ".scale")
    return y if s is None else y * s.reshape(-1)[0]


def _rope(x: np.ndarray, pos: np.ndarray, hp: DrafterHParams, freq_factors: np.ndarray | None) -> np.ndarray:
    """NEOX RoPE of x [n_tokens, n_heads, head_dim] at positions pos [n_tokens] (ggml_rope_ext, ext_factor 0)."""
    n_rot = hp.n_rot
    inv = hp.freq_base ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
    if freq_factors is not None:
        inv = inv / freq_factors[: n_rot // 2]
    theta = hp.freq_scale * pos.astype(np.float64)[:, None] * inv[None, :]
    cos = (np.cos(theta) * hp.attn_factor)[:, None, :]
    sin = (np.sin(theta) * hp.attn_factor)[:, None, :]
    out = x.copy()
    a, b = x[..., : n_rot // 2], x[..., n_rot // 2 : n_rot]
    out[..., : n_rot // 2] = a * cos - b * sin
    out[..., n_rot // 2 : n_rot] = a * sin + b * cos
    return out


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float64)


def _kv(w: Mapping[str, np.ndarray], p: str, x: np.ndarray, pos: np.ndarray, hp: DrafterHParams, il: int,
        freq_factors: np.ndarray | None, round_f16: bool) -> tuple[np.ndarray, np.ndarray]:
    """K (normed, roped) and V [n, n_head_kv, head_dim] of the input rows x, as the cache stores them."""
    n, kvh, hd = x.shape[0], hp.n_head_kv[il], hp.head_dim
    k_raw = _mm(w, p + "attn_k", x).reshape(n, kvh, hd)
    if p + "attn_v.weight" in w:
        v = _mm(w, p + "attn_v", x).reshape(n, kvh, hd)
    else:  # shared K/V: V = rms_norm(raw K), no weight, no rope
        v = _rms(k_raw, hp.eps)
    k = _rope(_norm(k_raw, w[p + "attn_k_norm.weight"], hp.eps), pos, hp, freq_factors)
    if round_f16:
        k, v = _f16(k), _f16(v)
    return k, v


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray,
            hp: DrafterHParams, il: int, sinks: np.ndarray | None) -> np.ndarray:
    """q [T, H, D] over k/v [S, Hkv, D]; returns [T, H*D]."""
    group = hp.n_head[il] // hp.n_head_kv[il]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = np.einsum("thd,shd->hts", q, k) * hp.kq_scale
    keep = np.ones((q.shape[0], k.shape[0]), dtype=bool)
    if hp.causal:
        keep &= k_pos[None, :] <= q_pos[:, None]
    if hp.is_swa[il]:
        keep &= (q_pos[:, None] - k_pos[None, :]) < hp.n_swa
    scores = np.where(keep[None], scores, -np.inf)
    m = scores.max(axis=-1, keepdims=True)
    if sinks is not None:
        m = np.maximum(m, sinks.reshape(-1, 1, 1))
    e = np.exp(scores - m)
    denom = e.sum(axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + np.exp(sinks.reshape(-1, 1, 1) - m)
    probs = e / denom
    return np.einsum("hts,shd->thd", probs, v).reshape(q.shape[0], -1)


def _ffn(w: Mapping[str, np.ndarray], p: str, x: np.ndarray, act: str) -> np.ndarray:
    gate = _mm(w, p + "ffn_gate", x)
    if act == "silu":
        a = gate / (1.0 + np.exp(-gate))
    else:  # ggml_gelu: tanh approximation
        a = 0.5 * gate * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * gate * (1.0 + 0.044715 * gate * gate)))
    return _mm(w, p + "ffn_down", a * _mm(w, p + "ffn_up", x))


def context_hidden(drafter: Drafter, features: np.ndarray) -> np.ndarray:
    """``g = rms_norm(fc @ f) * enc.output_norm`` for feature rows [P, n_taps * n_embd_target]."""
    w, hp = drafter.weights, drafter.hp
    f = np.asarray(features, dtype=np.float64)
    if f.ndim != 2 or f.shape[1] != w["fc.weight"].shape[1]:
        raise ValueError(f"features must be [P, {w['fc.weight'].shape[1]}], got {f.shape}")
    return _norm(_mm(w, "fc", f), w["enc.output_norm.weight"], hp.eps)


# --------------------------------------------------------------------------- forward


def draft_forward(drafter_gguf: str | os.PathLike[str] | Drafter, *, features: np.ndarray, anchor: int,
                  mask_token: int, block_size: int, target_token_embd: np.ndarray | None = None,
                  target_output: np.ndarray | None = None, prev_tokens: Sequence[int] | None = None,
                  round_kv_to_f16: bool = False) -> DraftReference:
    """One DSpark proposal: context ``features`` at positions 0..P-1, block of ``block_size`` rows at P..P+B-1.

    ``drafter_gguf`` is a path or a ``Drafter`` from ``load_drafter`` (to read the file once).
    ``target_token_embd`` / ``target_output`` ([n_vocab, n_embd]) stand in for the tensors the
    drafter borrows from the target (ignored when the drafter has its own). ``prev_tokens``
    overrides the token chosen at slot j (``prev_tokens[j]`` conditions slot j+1), modelling
    a sampled instead of greedy chain; it needs at least B-1 entries.
    """
    d = drafter_gguf if isinstance(drafter_gguf, Drafter) else load_drafter(drafter_gguf)
    w, hp = d.weights, d.hp
    B = int(block_size)
    if B < 1:
        raise ValueError(f"block_size must be >= 1, got {B}")
    g = context_hidden(d, features)
    P = g.shape[0]

    # token embeddings: own, else the target's (ctx_other)
    tok_embd = w.get("token_embd.weight")
    if tok_embd is None:
        if target_token_embd is None:
            raise ValueError("the drafter has no token_embd.weight: pass target_token_embd")
        tok_embd = np.asarray(target_token_embd, dtype=np.float64)
    # lm_head: own output, else own token_embd (tied), else the target's output
    head = w.get("output.weight")
    head_scale = w.get("output.scale")
    if head is None and "token_embd.weight" in w:
        head = w["token_embd.weight"]
    if head is None:
        if target_output is None:
            raise ValueError("the drafter has no output.weight nor token_embd.weight: pass target_output")
        head, head_scale = np.asarray(target_output, dtype=np.float64), None
    n_vocab = tok_embd.shape[0]
    for t in [anchor, mask_token]:
        if not 0 <= int(t) < n_vocab:
            raise ValueError(f"token {t} outside the vocabulary [0, {n_vocab})")

    freq_factors = w.get("rope_freqs.weight")
    if any(hp.rope_sections):
        freq_factors = None  # ggml_rope_multi is called without freq factors

    ctx_pos = np.arange(P)
    blk_pos = np.arange(P, P + B)
    all_pos = np.concatenate([ctx_pos, blk_pos])

    ids = np.array([int(anchor)] + [int(mask_token)] * (B - 1), dtype=np.int64)
    x = tok_embd[ids]
    if hp.embedding_scale != 0.0:
        x = x * hp.embedding_scale

    for il in range(hp.n_layer):
        p = f"blk.{il}."
        k_ctx, v_ctx = _kv(w, p, g, ctx_pos, hp, il, freq_factors, round_kv_to_f16)

        n = _norm(x, w[p + "attn_norm.weight"], hp.eps)
        q = _mm(w, p + "attn_q", n).reshape(B, hp.n_head[il], hp.head_dim)
        q = _rope(_norm(q, w[p + "attn_q_norm.weight"], hp.eps), blk_pos, hp, freq_factors)
        k_blk, v_blk = _kv(w, p, n, blk_pos, hp, il, freq_factors, round_kv_to_f16)
        attn = _attend(q, np.concatenate([k_ctx, k_blk]), np.concatenate([v_ctx, v_blk]),
                       blk_pos, all_pos, hp, il, w.get(p + "attn_sinks.weight"))
        cur = _mm(w, p + "attn_output", attn)
        if hp.value_scale != 0.0:
            cur = cur * hp.value_scale
        if p + "post_attention_norm.weight" in w:
            cur = _norm(cur, w[p + "post_attention_norm.weight"], hp.eps)
        ffn_inp = cur + x

        cur = _ffn(w, p, _norm(ffn_inp, w[p + "ffn_norm.weight"], hp.eps), hp.ffn_act)
        if p + "post_ffw_norm.weight" in w:
            cur = _norm(cur, w[p + "post_ffw_norm.weight"], hp.eps)
        cur = cur + ffn_inp
        if p + "layer_output_scale.weight" in w:
            cur = cur * w[p + "layer_output_scale.weight"].reshape(-1)[0]
        x = cur

    hidden = _norm(x, w["output_norm.weight"], hp.eps)
    base = hidden @ head.T
    if head_scale is not None:
        base = base * head_scale.reshape(-1)[0]
    if d.d2t is not None:
        if base.shape[1] != d.d2t.shape[0]:
            raise ValueError(f"d2t has {d.d2t.shape[0]} rows, the lm_head {base.shape[1]}")
        full = np.full((B, n_vocab), -np.inf)
        full[:, d.d2t] = base
        base = full

    logits, confidence, prev_list = _markov(d, base, hidden, int(anchor), B, prev_tokens)
    return DraftReference(
        logits=logits,
        base_logits=base,
        tokens=[int(np.argmax(row)) for row in logits],
        confidence=confidence,
        hidden=hidden,
        prev=prev_list,
    )


def _markov(d: Drafter, base: np.ndarray, hidden: np.ndarray, anchor: int, B: int,
            prev_tokens: Sequence[int] | None) -> tuple[np.ndarray, np.ndarray | None, list[int] | None]:
    """``build_dspark_markov_head`` for one block."""
    w, hp = d.weights, d.hp
    w1 = w.get("markov_w1.weight")
    if w1 is None:  # plain DFlash (rank 0 ablation): no bias, no confidence
        return base.copy(), None, None
    w2 = w["markov_w2.weight"]
    w2_scale = w.get("markov_w2.scale")
    if hp.block_size is None:
        raise ValueError("DSpark draft requires 'dflash.block_size' in GGUF metadata")
    if B > hp.block_size:  # llama.cpp returns without building the head
        return base.copy(), None, None
    if prev_tokens is not None and len(prev_tokens) < B - 1:
        raise ValueError(f"prev_tokens needs at least {B - 1} entries, got {len(prev_tokens)}")

    conf_w = w.get("conf_proj.weight")
    conf_b = w.get("conf_proj.bias")
    if conf_w is not None and conf_w.reshape(-1).shape[0] != hidden.shape[1] + w1.shape[1]:
        raise ValueError(f"conf_proj has {conf_w.size} inputs; the loader requires n_embd + rank = "
                         f"{hidden.shape[1] + w1.shape[1]}")

    n_vocab = base.shape[1]
    logits = np.empty_like(base)
    confidence = np.zeros(B) if conf_w is not None else None
    prev_list = [-1] * B
    i0 = 0 if hp.sample_from_anchor else 1
    if i0 == 1:
        logits[0] = base[0]
        if confidence is not None:
            confidence[0] = 1.0 / (1.0 + np.exp(-base[0, 0]))  # unread pad column
    prev = anchor
    for i in range(i0, B):
        w1_prev = w1[prev]
        bias = w2 @ w1_prev
        if w2_scale is not None:
            bias = bias * w2_scale.reshape(-1)[0]
        if d.d2t is not None:
            full = np.zeros(n_vocab)
            full[d.d2t] = bias
            bias = full
        logits[i] = base[i] + bias
        prev_list[i] = prev
        if confidence is not None:
            z = float(conf_w.reshape(-1) @ np.concatenate([hidden[i], w1_prev]))
            if conf_b is not None:
                z += float(conf_b.reshape(-1)[0])
            confidence[i] = 1.0 / (1.0 + np.exp(-z))
        if i + 1 < B:
            prev = int(prev_tokens[i]) if prev_tokens is not None else int(np.argmax(logits[i]))
    return logits, confidence, prev_list
