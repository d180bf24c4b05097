"""Export: the trained module as a DeepSpec-layout checkpoint folder, then our converter makes the GGUF.

The folder holds ``config.json`` (architecture ``DSparkDraftModel``, Qwen3 fields plus the DSpark
fields) and ``model.safetensors`` with the HF names the converter reads (prefix ``model.``). The
token embeddings and output head are the target's and are not written: the GGUF borrows them from
the target at run time. A reduced draft vocabulary is written as the speculators/SpecForge trainers write
it: ``draft_vocab_size`` in the config, ``lm_head`` with the drafter's own rows, ``d2t`` as offsets (target
id = i + d2t[i]) and ``t2d`` as a target-side mask. Going through the converter means every trained
drafter also exercises it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..convert.converter import convert
from ..convert.safetensors import write_safetensors
from .model import DraftConfig, DSparkDraft

ARCHITECTURE = "DSparkDraftModel"


def checkpoint_config(c: DraftConfig, taps: tuple[int, ...], n_vocab_draft: int | None = None) -> dict:
    reduced = {} if n_vocab_draft is None else {"draft_vocab_size": int(n_vocab_draft)}
    return reduced | {
        "architectures": [ARCHITECTURE], "model_type": "qwen3",
        "hidden_size": c.n_embd, "intermediate_size": c.n_ff, "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head, "num_key_value_heads": c.n_head_kv, "head_dim": c.head_dim,
        "rms_norm_eps": c.eps, "rope_theta": c.rope_theta, "max_position_embeddings": c.n_ctx_train,
        "vocab_size": c.n_vocab, "hidden_act": "silu",
        "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "float32",
        "block_size": c.block_size, "target_layer_ids": list(taps), "mask_token_id": c.mask_token,
        "markov_rank": c.markov_rank, "markov_head_type": "vanilla", "enable_confidence_head": _exports_confidence(c),
        "confidence_head_with_markov": _exports_confidence(c),
    }


def _exports_confidence(c: DraftConfig) -> bool:
    """The runtime graph reads a confidence head only as [h_k ; markov_w1[prev]]: without a Markov head
    (``--markov-rank 0``) the drafter is written without one (the cost-aware loop then cuts by acceptance alone)."""
    return c.confidence and c.markov_rank > 0


def checkpoint_tensors(module: DSparkDraft) -> dict[str, np.ndarray]:
    """HF name -> float32 array of every trained tensor."""
    def a(t):
        return t.detach().cpu().float().numpy().copy()

    p = "model."
    out = {f"{p}fc.weight": a(module.fc.weight), f"{p}hidden_norm.weight": a(module.hidden_norm)}
    for i, layer in enumerate(module.layers):
        q = f"{p}layers.{i}."
        out.update({
            q + "input_layernorm.weight": a(layer.input_layernorm),
            q + "post_attention_layernorm.weight": a(layer.post_attention_layernorm),
            q + "self_attn.q_proj.weight": a(layer.q_proj.weight),
            q + "self_attn.k_proj.weight": a(layer.k_proj.weight),
            q + "self_attn.v_proj.weight": a(layer.v_proj.weight),
            q + "self_attn.o_proj.weight": a(layer.o_proj.weight),
            q + "self_attn.q_norm.weight": a(layer.q_norm), q + "self_attn.k_norm.weight": a(layer.k_norm),
            q + "mlp.gate_proj.weight": a(layer.gate_proj.weight), q + "mlp.up_proj.weight": a(layer.up_proj.weight),
            q + "mlp.down_proj.weight": a(layer.down_proj.weight),
        })
    out[f"{p}norm.weight"] = a(module.norm)
    if module.markov_w1 is not None:
        out[f"{p}markov_head.markov_w1.weight"] = a(module.markov_w1)
        out[f"{p}markov_head.markov_w2.weight"] = a(module.markov_w2)
    if module.conf_proj is not None and _exports_confidence(module.c):
        out[f"{p}confidence_head.proj.weight"] = a(module.conf_proj.weight)
        out[f"{p}confidence_head.proj.bias"] = a(module.conf_proj.bias)
    if module.draft_ids is not None:
        ids = module.draft_ids.cpu().numpy().astype(np.int64)
        out["lm_head.weight"] = a(module.output)
        out["d2t"] = ids - np.arange(len(ids), dtype=np.int64)
        t2d = np.zeros(module.c.n_vocab, dtype=np.bool_)
        t2d[ids] = True
        out["t2d"] = t2d
    return out


def write_checkpoint(module: DSparkDraft, taps: tuple[int, ...], folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    n_vocab_draft = None if module.draft_ids is None else len(module.draft_ids)
    (folder / "config.json").write_text(json.dumps(checkpoint_config(module.c, taps, n_vocab_draft), indent=2))
    write_safetensors(folder / "model.safetensors", checkpoint_tensors(module))
    return folder


def export_gguf(module: DSparkDraft, taps: tuple[int, ...], folder: Path, outfile: Path, target: Path, *,
                outtype: str = "f16"):
    """Write the checkpoint folder, then convert it against the target (atomic: nothing half-written at
    ``outfile``). Returns the converter's ConversionResult."""
    write_checkpoint(module, taps, folder)
    return convert(folder, outfile, outtype=outtype, target_gguf=target)
