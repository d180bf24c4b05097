"""The GGUF key/value metadata of a converted drafter.

Mirrors, key by key and condition by condition, what the vendored
``convert_hf_to_gguf.py`` writes for a DSpark checkpoint:
``TextModel.set_gguf_parameters`` (conversion/base.py), then
``DFlashModel.set_gguf_parameters`` / ``set_vocab`` and
``DSparkModel.set_gguf_parameters`` (conversion/qwen.py). Where upstream
takes the vocabulary from ``--target-model-dir`` through transformers, this
module copies the ``tokenizer.*`` keys of the target GGUF, which the same
converter wrote from the same tokenizer. Without one it writes a
``no_vocab`` tokenizer plus ``dflash.vocab_size``, which the loader accepts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from gguf import GGUFValueType as VT

from . import keys
from .config import CONTEXT_LENGTH_FIELDS, DraftConfig, find_hparam
from .errors import InvalidConfigError
from .target import TargetInfo
from .tensors import TensorPlan

__all__ = ["build_metadata"]

_ROPE_SCALING_TYPES = {"linear": "linear", "yarn": "yarn", "su": "longrope", "longrope": "longrope"}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _u32(template: str, value: Any) -> keys.KV:
    key = keys.arch_key(template)
    if not _is_int(value) or not 0 <= value < 1 << 32:
        raise InvalidConfigError(f"{key} must be an integer in [0, 2^32), got {value!r}")
    return key, value, VT.UINT32, None


def _f32(template: str, value: Any) -> keys.KV:
    key = keys.arch_key(template)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise InvalidConfigError(f"{key} must be a finite number, got {value!r}")
    return key, float(value), VT.FLOAT32, None


def _bool(template: str, value: Any) -> keys.KV:
    key = keys.arch_key(template)
    if not isinstance(value, bool):
        raise InvalidConfigError(f"{key} must be true or false, got {value!r}")
    return key, value, VT.BOOL, None


def _i32s(template: str, values: list[int]) -> keys.KV:
    key = keys.arch_key(template)
    if not isinstance(values, (list, tuple)) or not all(_is_int(v) and -(1 << 31) <= v < 1 << 31 for v in values):
        raise InvalidConfigError(f"{key} must be a list of 32-bit integers, got {values!r}")
    return key, list(values), VT.ARRAY, VT.INT32


def _optional(kvs: list[keys.KV], make: Any, template: str, value: Any) -> None:
    if value is not None:
        kvs.append(make(template, value))


def _sizes(hp: Mapping[str, Any], n_layer: int) -> list[keys.KV]:
    """TextModel.set_gguf_parameters: sizes, heads, norms (each only when the config has it)."""
    kvs = [_u32(keys.BLOCK_COUNT, n_layer)]
    _optional(kvs, _u32, keys.CONTEXT_LENGTH, find_hparam(hp, CONTEXT_LENGTH_FIELDS))
    _optional(kvs, _u32, keys.EMBEDDING_LENGTH, find_hparam(hp, ("hidden_size", "n_embd", "dim")))
    _optional(kvs, _u32, keys.FEED_FORWARD_LENGTH, find_hparam(hp, (
        "prefix_dense_intermediate_size", "dense_intermediate_size", "intermediate_size", "n_inner", "hidden_dim")))
    _optional(kvs, _u32, keys.HEAD_COUNT, find_hparam(hp, ("num_attention_heads", "n_head", "n_heads")))
    _optional(kvs, _u32, keys.HEAD_COUNT_KV, find_hparam(hp, ("num_key_value_heads", "n_kv_heads")))
    _optional(kvs, _f32, keys.LAYERNORM_RMS_EPS, find_hparam(hp, ("rms_norm_eps", "norm_eps")))
    _optional(kvs, _f32, keys.LAYERNORM_EPS, find_hparam(hp, ("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon")))
    if hp.get("head_dim") is not None:
        kvs += [_u32(keys.KEY_LENGTH, hp["head_dim"]), _u32(keys.VALUE_LENGTH, hp["head_dim"])]
    return kvs


def _rope_parameters(hp: Mapping[str, Any]) -> dict[str, Any]:
    """TextModel.__init__: rope_parameters with the top-level rope fields mirrored in."""
    rp = dict(hp.get("rope_parameters", hp.get("rope_scaling")) or {})
    if "full_attention" in rp or "sliding_attention" in rp:
        return rp
    mirrored = {
        "sliding_attention": (lambda v: {"rope_theta": v}, ("local_rope_theta", "rope_local_theta",
                              "rope_theta_local", "swa_rope_theta", "rope_local_base_freq")),
        "rope_theta": (None, ("global_rope_theta", "rope_global_theta", "rope_theta_global", "rope_theta",
                              "rotary_emb_base")),
        "partial_rotary_factor": (None, ("partial_rotary_factor", "rope_pct", "rope_percent")),
        "original_max_position_embeddings": (None, ("original_max_position_embeddings",)),
    }
    for field, (wrap, names) in mirrored.items():
        value = find_hparam(hp, names)
        if value is not None and field not in rp:
            rp[field] = wrap(value) if wrap else value
    if "rope_type" not in rp and rp.get("type") is not None:
        rp["rope_type"] = rp["type"]
    return rp


def _rope_scaling(params: Mapping[str, Any]) -> list[keys.KV]:
    kind = _ROPE_SCALING_TYPES.get(str(params.get("rope_type")))
    factor = params.get("factor")
    if kind is None or (kind != "longrope" and factor is None):
        return []  # default/dynamic/llama3 rope: nothing to write, as upstream
    kvs: list[keys.KV] = [(keys.arch_key(keys.ROPE_SCALING_TYPE), kind, VT.STRING, None)]
    if kind == "longrope":
        return kvs
    kvs.append(_f32(keys.ROPE_SCALING_FACTOR, factor))
    if kind == "yarn":
        if params.get("original_max_position_embeddings") is None:
            raise InvalidConfigError("yarn rope scaling needs original_max_position_embeddings")
        kvs.append(_u32(keys.ROPE_SCALING_ORIG_CTX_LEN, params["original_max_position_embeddings"]))
        _optional(kvs, _f32, keys.ROPE_SCALING_YARN_EXT_FACTOR, params.get("extrapolation_factor"))
        _optional(kvs, _f32, keys.ROPE_SCALING_YARN_ATTN_FACTOR,
                  params.get("attention_factor", params.get("attn_factor")))
        _optional(kvs, _f32, keys.ROPE_SCALING_YARN_BETA_FAST, params.get("beta_fast"))
        _optional(kvs, _f32, keys.ROPE_SCALING_YARN_BETA_SLOW, params.get("beta_slow"))
    return kvs


def _rope(cfg: DraftConfig, target: TargetInfo | None) -> list[keys.KV]:
    rp = _rope_parameters(cfg.hparams)
    params = rp.get("full_attention", rp)
    kvs = _rope_scaling(params)
    if "mrope_section" in rp:
        sections = list(rp["mrope_section"])[:4]
        kvs.append(_i32s(keys.ROPE_DIMENSION_SECTIONS, sections + [0] * (4 - len(sections))))
    _optional(kvs, _f32, keys.ROPE_FREQ_BASE, params.get("rope_theta"))
    _optional(kvs, _f32, keys.ROPE_FREQ_BASE_SWA, rp.get("sliding_attention", {}).get("rope_theta"))
    head_dim = cfg.head_dim
    factor = rp.get("partial_rotary_factor")
    if factor is not None:
        _f32(keys.ROPE_DIMENSION_COUNT, factor)  # a number, or InvalidConfigError naming the key
        kvs.append(_u32(keys.ROPE_DIMENSION_COUNT, int(head_dim * factor)))
    if target is not None and target.uses_mrope:
        # the draft ropes on the temporal dimension only (DFlashModel.set_gguf_parameters)
        kvs.append(_i32s(keys.ROPE_DIMENSION_SECTIONS, [head_dim // 2, 0, 0, 0]))
    return kvs


def _attention_options(cfg: DraftConfig) -> list[keys.KV]:
    """Causality, sliding window and the optional scales of DFlashModel.set_gguf_parameters."""
    hp, kvs = cfg.hparams, []
    causal = hp.get("is_causal")
    _optional(kvs, _bool, keys.CAUSAL, cfg.dflash("causal") if causal is None else causal)
    nested = hp.get("dflash_config") or {}
    window = nested.get("swa_window_size") or hp.get("sliding_window")
    if (hp.get("use_sliding_window", False) or nested.get("use_swa", False)) and window:
        pattern = ([True] * cfg.n_layer if nested.get("use_swa", False)
                   else [t == "sliding_attention" for t in hp.get("layer_types") or []])
        kvs.append(_u32(keys.SLIDING_WINDOW, window))
        if pattern:
            kvs.append((keys.arch_key(keys.SLIDING_WINDOW_PATTERN), pattern, VT.ARRAY, VT.BOOL))
    _optional(kvs, _f32, keys.VALUE_SCALE, nested.get("attention_value_scale"))
    _optional(kvs, _f32, keys.LOGIT_SCALE, cfg.dflash("output_multiplier"))
    softcap = cfg.dflash("final_logit_softcapping")
    if softcap is not None and _f32(keys.FINAL_LOGIT_SOFTCAPPING, softcap)[1] > 0:
        kvs.append(_f32(keys.FINAL_LOGIT_SOFTCAPPING, softcap))
    _optional(kvs, _f32, keys.EMBEDDING_SCALE, cfg.dflash("input_embedding_scale"))
    return kvs


def _dspark(cfg: DraftConfig, plan: TensorPlan) -> list[keys.KV]:
    return [
        _u32(keys.BLOCK_SIZE, cfg.block_size),
        # GGUF stores layer *inputs*: the output of HF layer i is the input of layer i + 1
        _i32s(keys.TARGET_LAYERS, [i + 1 for i in cfg.target_layer_ids]),
        _bool(keys.SAMPLE_FROM_ANCHOR, cfg.sample_from_anchor),
        _bool(keys.HAS_CONFIDENCE_HEAD, plan.has_confidence_head),
    ]


def _vocab(cfg: DraftConfig, target: TargetInfo | None) -> list[keys.KV]:
    kvs = list(target.tokenizer_kvs) if target is not None else []
    model = next((v for k, v, _, _ in kvs if k == keys.TOKENIZER_MODEL), None)
    if model is None:
        kvs.append((keys.TOKENIZER_MODEL, keys.NO_VOCAB, VT.STRING, None))
    if model is None or model in (b"no_vocab", b"none", "no_vocab", "none"):
        # a vocabulary-less model takes its size from {arch}.vocab_size
        kvs.append(_u32(keys.VOCAB_SIZE, cfg.n_vocab))
    if cfg.mask_token_id is not None:
        kvs.append((keys.MASK_TOKEN_ID, cfg.mask_token_id, VT.UINT32, None))
    return kvs


def build_metadata(cfg: DraftConfig, plan: TensorPlan, target: TargetInfo | None, *,
                   file_type: int, name: str) -> list[keys.KV]:
    """Every metadata entry of the drafter GGUF except ``general.architecture``.

    Args:
        cfg: the parsed drafter config.
        plan: the checked tensors (decides ``has_confidence_head``).
        target: the target, or None (no tokenizer then, see the module docstring).
        file_type: the ``general.file_type`` code (keys.FILE_TYPES).
        name: ``general.name``.

    Returns:
        ``(key, value, type, element type)`` entries, one per key (a later
        entry for the same key replaces an earlier one, as in GGUFWriter).
    """
    kvs: list[keys.KV] = [
        (keys.GENERAL_TYPE, "model", VT.STRING, None),
        (keys.GENERAL_NAME, name, VT.STRING, None),
        (keys.GENERAL_FILE_TYPE, file_type, VT.UINT32, None),
        (keys.GENERAL_QUANTIZATION_VERSION, keys.QUANTIZATION_VERSION, VT.UINT32, None),
    ]
    kvs += _sizes(cfg.hparams, cfg.n_layer) + _rope(cfg, target) + _attention_options(cfg)
    kvs += _dspark(cfg, plan) + _vocab(cfg, target)
    return list({kv[0]: kv for kv in kvs}.values())
