"""GGUF names for a DSpark drafter, written out because PyPI's gguf lacks them.

The released ``gguf`` package (0.19) predates the DFlash/DSpark architecture,
so every key and tensor name the vendored loader reads is spelled here. Each
group names the vendored file it was checked against (paths relative to
``vendor/llama.cpp``). Keys containing ``{arch}`` are formatted with ``ARCH``.
"""

from __future__ import annotations

from typing import Any

from gguf import GGUFValueType

# src/llama-arch.cpp: { LLM_ARCH_DFLASH, "dflash" }. DSpark has no arch of its
# own: the loader detects it by the tensor MARKOV_W1 (src/models/dflash.cpp).
ARCH = "dflash"

# gguf-py/gguf/constants.py, Keys.General
GENERAL_ARCHITECTURE = "general.architecture"
GENERAL_TYPE = "general.type"
GENERAL_NAME = "general.name"
GENERAL_FILE_TYPE = "general.file_type"
GENERAL_QUANTIZATION_VERSION = "general.quantization_version"

# gguf-py/gguf/constants.py, Keys.LLM / Keys.Attention / Keys.Rope; read by
# llama_model_dflash::load_arch_hparams and the shared hparams loader
# (src/llama-model.cpp). Types follow gguf_writer.py's add_* helpers.
BLOCK_COUNT = "{arch}.block_count"                          # u32
CONTEXT_LENGTH = "{arch}.context_length"                    # u32
EMBEDDING_LENGTH = "{arch}.embedding_length"                # u32
FEED_FORWARD_LENGTH = "{arch}.feed_forward_length"          # u32
VOCAB_SIZE = "{arch}.vocab_size"                            # u32, only without a tokenizer
HEAD_COUNT = "{arch}.attention.head_count"                  # u32
HEAD_COUNT_KV = "{arch}.attention.head_count_kv"            # u32
KEY_LENGTH = "{arch}.attention.key_length"                  # u32
VALUE_LENGTH = "{arch}.attention.value_length"              # u32
LAYERNORM_RMS_EPS = "{arch}.attention.layer_norm_rms_epsilon"  # f32
LAYERNORM_EPS = "{arch}.attention.layer_norm_epsilon"       # f32
CAUSAL = "{arch}.attention.causal"                          # bool
VALUE_SCALE = "{arch}.attention.value_scale"                # f32
SLIDING_WINDOW = "{arch}.attention.sliding_window"          # u32
SLIDING_WINDOW_PATTERN = "{arch}.attention.sliding_window_pattern"  # bool[]
ROPE_FREQ_BASE = "{arch}.rope.freq_base"                    # f32
ROPE_FREQ_BASE_SWA = "{arch}.rope.freq_base_swa"            # f32
ROPE_DIMENSION_COUNT = "{arch}.rope.dimension_count"        # u32
ROPE_DIMENSION_SECTIONS = "{arch}.rope.dimension_sections"  # i32[4]
ROPE_SCALING_TYPE = "{arch}.rope.scaling.type"              # str
ROPE_SCALING_FACTOR = "{arch}.rope.scaling.factor"          # f32
ROPE_SCALING_ORIG_CTX_LEN = "{arch}.rope.scaling.original_context_length"  # u32
ROPE_SCALING_YARN_EXT_FACTOR = "{arch}.rope.scaling.yarn_ext_factor"        # f32
ROPE_SCALING_YARN_ATTN_FACTOR = "{arch}.rope.scaling.yarn_attn_factor"      # f32
ROPE_SCALING_YARN_BETA_FAST = "{arch}.rope.scaling.yarn_beta_fast"          # f32
ROPE_SCALING_YARN_BETA_SLOW = "{arch}.rope.scaling.yarn_beta_slow"          # f32
LOGIT_SCALE = "{arch}.logit_scale"                          # f32
FINAL_LOGIT_SOFTCAPPING = "{arch}.final_logit_softcapping"  # f32
EMBEDDING_SCALE = "{arch}.embedding_scale"                  # f32

# DFlash/DSpark specific (constants.py Keys.LLM; src/llama-arch.cpp
# LLM_KV_DFLASH_BLOCK_SIZE, LLM_KV_TARGET_LAYERS). src/models/dflash.cpp reads
# "dflash.block_size" and "dflash.sample_from_anchor" back from the raw KV map.
BLOCK_SIZE = "{arch}.block_size"                            # u32
TARGET_LAYERS = "{arch}.target_layers"                      # i32[], layer inputs = HF id + 1
SAMPLE_FROM_ANCHOR = "{arch}.sample_from_anchor"            # bool
HAS_CONFIDENCE_HEAD = "{arch}.has_confidence_head"          # bool

# constants.py Keys.Tokenizer (only the ones the converter writes itself)
TOKENIZER_MODEL = "tokenizer.ggml.model"                    # str
MASK_TOKEN_ID = "tokenizer.ggml.mask_token_id"              # u32
TOKENIZER_PREFIX = "tokenizer."
NO_VOCAB = "no_vocab"  # src/llama-vocab.cpp: "no_vocab" (or "none") + {arch}.vocab_size

# constants.py TENSOR_NAMES for MODEL_ARCH.DFLASH; created in
# llama_model_dflash::load_arch_tensors (src/models/dflash.cpp).
TOKEN_EMBD = "token_embd.weight"      # optional: borrowed from the target through ctx_other
OUTPUT = "output.weight"              # optional: borrowed likewise (full-vocab drafts)
OUTPUT_NORM = "output_norm.weight"
FC = "fc.weight"                      # {n_taps * n_embd, n_embd}
ENC_OUTPUT_NORM = "enc.output_norm.weight"  # the HF hidden_norm, applied after fc
MARKOV_W1 = "markov_w1.weight"        # {rank, n_vocab}; its presence switches DSpark on
MARKOV_W2 = "markov_w2.weight"        # {rank, n_vocab_draft}
CONF_PROJ = "conf_proj.weight"        # {n_embd + rank, 1}
CONF_PROJ_BIAS = "conf_proj.bias"     # {1}
D2T = "d2t"                           # i64 {n_vocab_draft}: absolute target ids (no suffix)

# Per-layer names, "blk.{bid}." + suffix.
BLOCK_PREFIX = "blk.{bid}."
ATTN_NORM = "attn_norm.weight"
ATTN_Q = "attn_q.weight"
ATTN_K = "attn_k.weight"
ATTN_V = "attn_v.weight"
ATTN_OUT = "attn_output.weight"
ATTN_Q_NORM = "attn_q_norm.weight"
ATTN_K_NORM = "attn_k_norm.weight"
FFN_NORM = "ffn_norm.weight"
FFN_GATE = "ffn_gate.weight"
FFN_UP = "ffn_up.weight"
FFN_DOWN = "ffn_down.weight"

# gguf-py/gguf/constants.py LlamaFileType; GGML_QUANT_VERSION
FILE_TYPES = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}
QUANTIZATION_VERSION = 2


def arch_key(template: str) -> str:
    """``template`` with ``{arch}`` replaced by the DFlash architecture name."""
    return template.format(arch=ARCH)


def block_tensor(bid: int, suffix: str) -> str:
    """Name of a per-layer tensor, e.g. ``block_tensor(0, ATTN_Q) == "blk.0.attn_q.weight"``."""
    return BLOCK_PREFIX.format(bid=bid) + suffix


# One metadata entry as GGUFWriter.add_key_value takes it:
# (key, value, value type, element type for arrays else None)
KV = tuple[str, Any, GGUFValueType, "GGUFValueType | None"]
