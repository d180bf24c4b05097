"""config.json of a DSpark drafter, normalised and checked.

Exports disagree on where the DSpark fields live (DSPARK.md, "HF checkpoint"):

* top level: ``block_size``, ``target_layer_ids``, ``mask_token_id``, ...;
* nested in ``dflash_config`` (DFlash-lineage exports);
* ``aux_hidden_state_layer_ids`` (EAGLE-3/SpecForge exports), which are
  already layer *inputs* (HF id + 1), optionally with a
  ``transformer_layer_config`` holding the decoder sizes.

``parse_config`` folds them into one DraftConfig exactly as the vendored
``DSparkModel.__init__`` (conversion/qwen.py) does, so both converters agree
on every value. ``target_layer_ids`` are kept in the HF convention (output of
layer i); the GGUF writer adds one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import InvalidConfigError, UnsupportedModelError

__all__ = ["SUPPORTED_ARCHITECTURES", "DraftConfig", "parse_config", "find_hparam"]

# conversion/qwen.py: @ModelBase.register(...) on DSparkModel. All five share
# one Qwen3-style tensor layout; Gemma-4 and DeepSeek-V4 drafters do not.
SUPPORTED_ARCHITECTURES = (
    "Qwen3DSparkModel", "DSparkDraftModel", "DSparkSpeculator", "Lfm2DSparkDraftModel", "LingDSparkModel",
)
# upstream's default when neither dflash_config nor the top level has one
DEFAULT_BLOCK_SIZE = 16
# convert_hf_to_gguf's candidates for {arch}.context_length, in its order
CONTEXT_LENGTH_FIELDS = ("max_position_embeddings", "n_ctx", "n_positions", "max_length",
                         "max_sequence_length", "model_max_length")
_MOE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")


@dataclass(frozen=True)
class DraftConfig:
    """The drafter's sizes and DSpark settings.

    ``hparams`` is the merged config (``transformer_layer_config`` and
    ``text_config`` lifted to the top, ``dflash_config`` filled in) from
    which the metadata writer reads the optional hyper-parameters.
    ``markov_rank``, ``confidence_head`` and ``confidence_with_markov`` are
    None when config.json does not say; the tensors decide then.
    """

    architecture: str
    hparams: Mapping[str, Any]
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    n_vocab_draft: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int | None
    sample_from_anchor: bool
    markov_rank: int | None
    confidence_head: bool | None
    confidence_with_markov: bool | None

    @property
    def n_taps(self) -> int:
        """Number of target layers the drafter reads."""
        return len(self.target_layer_ids)

    def dflash(self, name: str, default: Any = None) -> Any:
        """A DSpark field from ``dflash_config``, else from the top level, else ``default``."""
        nested = self.hparams.get("dflash_config") or {}
        return nested[name] if name in nested else self.hparams.get(name, default)


def find_hparam(hparams: Mapping[str, Any], names: tuple[str, ...]) -> Any:
    """The value of the first of ``names`` present (convert_hf_to_gguf's find_hparam), else None."""
    return next((hparams[n] for n in names if n in hparams), None)


def _merged(config: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """Lift nested sections and fill ``dflash_config``; also returns sample_from_anchor."""
    hp = dict(config)
    # EAGLE-3-style exports (bonus-anchor block) do not sample from the anchor
    eagle3_style = "transformer_layer_config" in hp or "aux_hidden_state_layer_ids" in hp
    anchor = hp.get("sample_from_anchor", not eagle3_style)
    for section in ("transformer_layer_config", "text_config"):
        if isinstance(hp.get(section), dict):
            hp = {**hp, **hp[section]}
    if "aux_hidden_state_layer_ids" in hp:
        aux = hp["aux_hidden_state_layer_ids"]
        if not isinstance(aux, list) or not all(isinstance(i, int) for i in aux):
            raise InvalidConfigError(f"aux_hidden_state_layer_ids must be a list of ints, got {aux!r}")
        hp.setdefault("dflash_config", {"mask_token_id": hp.get("mask_token_id"),
                                        "target_layer_ids": [i - 1 for i in aux]})
    else:
        hp.setdefault("dflash_config", {k: hp[k] for k in ("target_layer_ids", "mask_token_id") if k in hp})
    if not isinstance(hp["dflash_config"], dict):
        raise InvalidConfigError(f"dflash_config must be an object, got {hp['dflash_config']!r}")
    return hp, bool(anchor)


def _architecture(hp: Mapping[str, Any]) -> str:
    archs = hp.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {arch!r} is not a DSpark drafter this converter supports; "
            f"expected one of {', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def _positive(hp: Mapping[str, Any], names: tuple[str, ...], default: int | None = None) -> int:
    value = find_hparam(hp, names)
    if value is None:
        value = default
    if value is None:
        raise InvalidConfigError(f"config.json has none of {list(names)}")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidConfigError(f"{names[0]} must be a positive integer, got {value!r}")
    return value


def _check_supported(hp: Mapping[str, Any], dflash: Mapping[str, Any]) -> None:
    head_type = dflash.get("markov_head_type", hp.get("markov_head_type", "vanilla"))
    if head_type != "vanilla":
        raise UnsupportedModelError(f"unsupported markov_head_type {head_type!r} (only 'vanilla' is supported)")
    act = hp.get("hidden_act", "silu")
    if act != "silu":
        # the DFlash graph runs SwiGLU unless {arch}.hidden_activation says otherwise,
        # and the vendored converter does not write that key
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported (the drafter FFN is SwiGLU: 'silu')")
    if any(hp.get(f) for f in _MOE_FIELDS):
        raise UnsupportedModelError("mixture-of-experts drafters are not supported (dense Qwen3-style layers only)")
    if "conv_kernel_size" in dflash:
        raise UnsupportedModelError("DFlash2 drafters (conv/selector heads) are not DSpark drafters")


def _layer_ids(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise InvalidConfigError(
            f"target_layer_ids must be a non-empty list (the loader requires dflash.target_layers), got {value!r}")
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
        raise InvalidConfigError(f"target_layer_ids must be layer indices >= 0, got {value!r}")
    return tuple(value)


def _optional(dflash: Mapping[str, Any], hp: Mapping[str, Any], name: str, kind: type) -> Any:
    value = dflash.get(name, hp.get(name))
    if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
        raise InvalidConfigError(f"{name} must be {kind.__name__}, got {value!r}")
    return value


def _sizes(hp: Mapping[str, Any]) -> dict[str, int]:
    n_embd = _positive(hp, ("hidden_size", "n_embd", "dim"))
    n_head = _positive(hp, ("num_attention_heads", "n_head", "n_heads"))
    return {
        "n_layer": _positive(hp, ("num_hidden_layers", "n_layers", "n_layer", "num_layers")),
        "n_embd": n_embd,
        "n_head": n_head,
        "n_head_kv": _positive(hp, ("num_key_value_heads", "n_kv_heads"), n_head),
        "head_dim": _positive(hp, ("head_dim",), n_embd // n_head or None),
        "n_ff": _positive(hp, ("intermediate_size", "n_inner", "hidden_dim")),
        "n_vocab": _positive(hp, ("vocab_size",)),
    }


def parse_config(config: Mapping[str, Any]) -> DraftConfig:
    """Normalise and check a drafter's config.json.

    Raises:
        UnsupportedModelError: unknown architecture, a Markov head other than
            ``vanilla``, a non-SwiGLU or MoE drafter.
        InvalidConfigError: a missing or out-of-range field.
    """
    hp, anchor = _merged(config)
    arch = _architecture(hp)
    dflash = hp["dflash_config"]
    _check_supported(hp, dflash)
    if find_hparam(hp, ("rms_norm_eps", "norm_eps")) is None:
        raise InvalidConfigError("config.json has no rms_norm_eps (the loader requires the RMSNorm epsilon)")
    _positive(hp, CONTEXT_LENGTH_FIELDS)  # the loader requires {arch}.context_length
    sizes = _sizes(hp)
    n_vocab_draft = _optional(dflash, hp, "draft_vocab_size", int) or sizes["n_vocab"]
    if not 1 <= n_vocab_draft <= sizes["n_vocab"]:
        raise InvalidConfigError(f"draft_vocab_size {n_vocab_draft} must be in [1, vocab_size={sizes['n_vocab']}]")
    mask = _optional(dflash, hp, "mask_token_id", int)
    if mask is not None and not 0 <= mask < sizes["n_vocab"]:
        raise InvalidConfigError(f"mask_token_id {mask} is outside the vocabulary [0, {sizes['n_vocab']})")
    block_size = _optional(dflash, hp, "block_size", int)
    block_size = DEFAULT_BLOCK_SIZE if block_size is None else block_size
    if block_size < 1:
        raise InvalidConfigError(f"block_size must be >= 1, got {block_size}")
    rank = _optional(dflash, hp, "markov_rank", int)
    if rank is not None and rank < 0:
        raise InvalidConfigError(f"markov_rank must be >= 0, got {rank}")
    return DraftConfig(
        architecture=arch, hparams=hp, **sizes, n_vocab_draft=n_vocab_draft, block_size=block_size,
        target_layer_ids=_layer_ids(dflash.get("target_layer_ids", hp.get("target_layer_ids"))),
        mask_token_id=mask, sample_from_anchor=anchor, markov_rank=rank,
        confidence_head=_optional(dflash, hp, "enable_confidence_head", bool),
        confidence_with_markov=_optional(dflash, hp, "confidence_head_with_markov", bool),
    )
