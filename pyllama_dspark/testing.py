"""Tiny deterministic random-weight GGUF models for tests.

The kit writes small *target* models for the three architectures the package
drives (``llama``, ``qwen3`` and the hybrid ``qwen35``), and ``qwen2`` (llama's
layers with Q/K/V biases and half-split RoPE), whose graph has no capture taps of
ours and is captured through upstream's ``l_out`` names, with nothing but numpy
and the ``gguf`` package, so tests never need a download or torch.

Design points:

* Every tensor is drawn from its own generator seeded with
  ``zlib.crc32(tensor_name) ^ spec.seed``. A tensor therefore depends only on
  its name, its shape, the seed and (for ``token_embd``, ``output`` and
  ``output_norm``) ``tie_embeddings``: adding layers, changing the architecture
  or the storage dtype of other tensors leaves it unchanged.
* Tensor names, shapes and metadata keys follow the vendored llama.cpp loader
  (``src/models/{llama,qwen3,qwen35,qwen2}.cpp``, ``src/llama-arch.cpp``). Keys are
  written as explicit strings with explicit GGUF value types, because the C++
  loader checks value types strictly and older ``gguf`` releases lack some of
  the qwen35 helpers.
* Projection matrices use a fan-in scaled init (std ``1/sqrt(fan_in)``, three
  times that for ``ffn_down``) rather than the tiny std 0.02 of real
  pre-training: with 0.02 the residual stream would be the token embedding
  alone, the model would ignore its context and a KV-cache or recurrent-state
  bug would not change a single generated token. The token embedding (std 1)
  and the LM head (logit std about 2, minus ``0.1 * token_embd`` so the current
  token is not its own best successor) make greedy decoding wander over many
  tokens instead of repeating one; ``_init_values`` explains each choice,
  including the tied-embedding case. Norm weights are ``1 + N(0, 0.1)``.

Qwen3.5 (``qwen35``) layout
---------------------------
``qwen35`` interleaves Gated DeltaNet (recurrent) layers with full-attention
layers. The file stores ``qwen35.full_attention_interval = min(4, n_layer)``
and the loader marks layer ``i`` recurrent unless ``(i + 1) % interval == 0``:

* ``n_layer=2`` (the default): layer 0 recurrent, layer 1 full attention;
* ``n_layer=3``: layers 0, 1 recurrent, layer 2 full attention;
* ``n_layer=4``: layers 0, 1, 2 recurrent, layer 3 full attention (the real
  Qwen3.5 pattern, repeated every 4 layers for deeper models).

Layer 0 is thus recurrent for every ``n_layer >= 2``. The linear-attention
sizes derive from the attention sizes: ``ssm.state_size`` (head dim of keys and
values) = ``n_embd // n_head``, ``ssm.group_count`` (key heads) = ``n_head_kv``,
``ssm.time_step_rank`` (value heads) = ``n_head``, ``ssm.inner_size`` =
``state_size * n_head``, ``ssm.conv_kernel`` = 4. Full-attention layers rotate
half of each head (``rope.dimension_count = head_dim // 2``, as Qwen3.5 uses
partial rotary) with interleaved M-RoPE sections split like the real model's
``[11, 11, 10, 0]``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import pathlib
import tempfile
import zlib
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
from gguf import GGUFValueType as VT

from . import resources
from .convert.writer import write_atomically

__all__ = [
    "TinySpec",
    "write_tiny_model",
    "tiny_model",
    "load_tiny_weights",
    "vocab_gguf_path",
    "write_tiny_dspark_checkpoint",
    "default_dspark_target_layer_ids",
]

ARCHS = ("llama", "qwen3", "qwen35", "qwen2")
VOCABS = ("none", "llama-spm")
DTYPES = ("f32", "f16")

# Bump when the generator changes in a way that alters the bytes written, so
# files cached by tiny_model() under an older scheme are not reused.
_KIT_VERSION = 1

_VOCAB_DIR_ENV = "PYLLAMA_DSPARK_VOCAB_DIR"
_RMS_EPS = 1e-6
_SSM_CONV_KERNEL = 4
_FILE_TYPE_ALL_F32 = 0
_FILE_TYPE_MOSTLY_F16 = 1
# token_embd std when it doubles as the LM head (see _init_values)
_TIED_EMBD_STD = 0.5
# fraction of token_embd subtracted from an untied LM head (see _init_values)
_OUTPUT_ANTI_REPEAT = 0.1


@dataclass(frozen=True)
class TinySpec:
    """Shape and content of a tiny random-weight model.

    ``n_vocab`` is ignored when ``vocab="llama-spm"``: the model then has the
    tokenizer's 32000 tokens. ``dtype`` is the storage type of 2-D weight
    matrices; norms, biases and the qwen35 conv kernel are always f32, and
    with ``vocab="llama-spm"`` the (large) token embedding and LM head are
    always f16 so files stay a few MB. See the module docstring for the
    ``qwen35`` layer layout. ``chat_template`` (with a vocabulary only) is
    stored as ``tokenizer.chat_template``: a llama.cpp template name such as
    "chatml", or a Jinja text llama.cpp recognises. ``logit_std`` sets the
    spread of the output logits: the default 2 gives flat next-token
    distributions (top-1 probability of a few percent over 32000 tokens);
    larger values give the peaked ones of a trained model.
    """

    arch: str
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    n_vocab: int = 256
    n_ctx_train: int = 4096
    vocab: str = "none"
    dtype: str = "f32"
    seed: int = 0
    tie_embeddings: bool = False
    chat_template: str | None = None
    logit_std: float = 2.0

    def __post_init__(self) -> None:
        _validate_spec(self)


def _validate_spec(spec: TinySpec) -> None:
    """Reject specs the loader would refuse, with a message naming the field."""
    if spec.arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {spec.arch!r}")
    if spec.vocab not in VOCABS:
        raise ValueError(f"vocab must be one of {VOCABS}, got {spec.vocab!r}")
    if not spec.logit_std > 0:
        raise ValueError(f"logit_std must be > 0, got {spec.logit_std!r}")
    if spec.chat_template is not None and spec.vocab == "none":
        raise ValueError("chat_template needs a vocabulary (vocab='llama-spm')")
    if spec.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {spec.dtype!r}")
    for field in ("n_layer", "n_embd", "n_head", "n_head_kv", "n_ff", "n_vocab", "n_ctx_train"):
        if getattr(spec, field) < 1:
            raise ValueError(f"{field} must be >= 1, got {getattr(spec, field)}")
    if spec.seed < 0:
        raise ValueError(f"seed must be >= 0, got {spec.seed}")
    if spec.n_embd % spec.n_head != 0:
        raise ValueError(f"n_embd ({spec.n_embd}) must be a multiple of n_head ({spec.n_head})")
    if spec.n_head % spec.n_head_kv != 0:
        raise ValueError(f"n_head ({spec.n_head}) must be a multiple of n_head_kv ({spec.n_head_kv})")
    head_dim = spec.n_embd // spec.n_head
    if head_dim % 2 != 0:
        raise ValueError(f"head dim n_embd/n_head = {head_dim} must be even for RoPE")
    if spec.arch == "qwen35":
        if spec.n_layer < 2:
            raise ValueError("qwen35 needs n_layer >= 2 (one recurrent and one attention layer)")
        if head_dim % 4 != 0:
            raise ValueError(f"qwen35 rotates half a head, so n_embd/n_head = {head_dim} must be a multiple of 4")


# --------------------------------------------------------------------------
# derived sizes


@dataclass(frozen=True)
class _Dims:
    """Sizes derived from a spec, in the loader's vocabulary."""

    n_vocab: int
    head_dim: int
    n_rot: int
    # qwen35 only (zero otherwise)
    full_attn_interval: int = 0
    ssm_d_conv: int = 0
    ssm_d_state: int = 0
    ssm_n_group: int = 0
    ssm_dt_rank: int = 0
    ssm_d_inner: int = 0

    @property
    def ssm_conv_dim(self) -> int:
        """Channels of the qwen35 short conv: q and k (per key head) plus v."""
        return 2 * self.ssm_d_state * self.ssm_n_group + self.ssm_d_inner


def _derive_dims(spec: TinySpec) -> _Dims:
    """Head, rotary and (qwen35) linear-attention sizes; see the module docstring."""
    head_dim = spec.n_embd // spec.n_head
    n_vocab = len(_spm_vocab_fields()["tokenizer.ggml.tokens"][0]) if spec.vocab == "llama-spm" else spec.n_vocab
    if spec.arch != "qwen35":
        return _Dims(n_vocab=n_vocab, head_dim=head_dim, n_rot=head_dim)
    return _Dims(
        n_vocab=n_vocab,
        head_dim=head_dim,
        n_rot=head_dim // 2,
        full_attn_interval=min(4, spec.n_layer),
        ssm_d_conv=_SSM_CONV_KERNEL,
        ssm_d_state=head_dim,
        ssm_n_group=spec.n_head_kv,
        ssm_dt_rank=spec.n_head,
        ssm_d_inner=head_dim * spec.n_head,
    )


def _is_recurrent(dims: _Dims, il: int) -> bool:
    """Mirror of llama_model_qwen35::load_arch_hparams's layer marking."""
    return dims.full_attn_interval > 0 and (il + 1) % dims.full_attn_interval != 0


def _rope_sections(n_rot: int) -> list[int]:
    """Split n_rot/2 rotary pairs into (t, h, w, e) sections like Qwen3.5's [11, 11, 10, 0]."""
    pairs = n_rot // 2
    t = -(-pairs // 3)
    h = -(-(pairs - t) // 2)
    return [t, h, pairs - t - h, 0]


# --------------------------------------------------------------------------
# metadata


# (key, value, GGUF type, array element type or None)
_KV = tuple[str, Any, VT, VT | None]


def _u32(key: str, value: int) -> _KV:
    return (key, int(value), VT.UINT32, None)


def _f32(key: str, value: float) -> _KV:
    return (key, float(value), VT.FLOAT32, None)


def _common_kvs(spec: TinySpec, dims: _Dims) -> list[_KV]:
    a = spec.arch
    kvs = [
        ("general.name", f"pyllama-dspark-tiny-{a}", VT.STRING, None),
        _u32(f"{a}.vocab_size", dims.n_vocab),
        _u32(f"{a}.context_length", spec.n_ctx_train),
        _u32(f"{a}.embedding_length", spec.n_embd),
        _u32(f"{a}.block_count", spec.n_layer),
        _u32(f"{a}.feed_forward_length", spec.n_ff),
        _u32(f"{a}.attention.head_count", spec.n_head),
        _u32(f"{a}.attention.head_count_kv", spec.n_head_kv),
        _f32(f"{a}.attention.layer_norm_rms_epsilon", _RMS_EPS),
        _f32(f"{a}.rope.freq_base", 10000.0 if a == "llama" else 1.0e6),
        _u32(f"{a}.rope.dimension_count", dims.n_rot),
    ]
    if a in ("qwen3", "qwen35"):
        # Qwen checkpoints do not always have head_dim == n_embd/n_head, so
        # their converter writes the head sizes explicitly; do the same.
        kvs += [
            _u32(f"{a}.attention.key_length", dims.head_dim),
            _u32(f"{a}.attention.value_length", dims.head_dim),
        ]
    return kvs


def _qwen35_kvs(dims: _Dims) -> list[_KV]:
    a = "qwen35"
    return [
        (f"{a}.rope.dimension_sections", _rope_sections(dims.n_rot), VT.ARRAY, VT.INT32),
        _u32(f"{a}.full_attention_interval", dims.full_attn_interval),
        _u32(f"{a}.ssm.conv_kernel", dims.ssm_d_conv),
        _u32(f"{a}.ssm.state_size", dims.ssm_d_state),
        _u32(f"{a}.ssm.group_count", dims.ssm_n_group),
        _u32(f"{a}.ssm.time_step_rank", dims.ssm_dt_rank),
        _u32(f"{a}.ssm.inner_size", dims.ssm_d_inner),
    ]


@functools.lru_cache(maxsize=None)
def _spm_vocab_fields() -> dict[str, tuple[Any, VT, VT | None]]:
    """All ``tokenizer.*`` fields of the vendored llama-spm vocab file, with their GGUF types."""
    reader = gguf.GGUFReader(vocab_gguf_path("llama-spm"))
    fields: dict[str, tuple[Any, VT, VT | None]] = {}
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        main = field.types[0]
        sub = field.types[-1] if main == VT.ARRAY else None
        value = field.contents()
        # tuples: the cached arrays are shared by every model written
        fields[key] = (tuple(value) if main == VT.ARRAY else value, main, sub)
    return fields


def _vocab_kvs(spec: TinySpec) -> list[_KV]:
    if spec.vocab == "none":
        return [("tokenizer.ggml.model", "no_vocab", VT.STRING, None)]
    kvs = [(k, v, t, s) for k, (v, t, s) in _spm_vocab_fields().items() if k != "tokenizer.chat_template"]
    if spec.chat_template is not None:
        kvs.append(("tokenizer.chat_template", spec.chat_template, VT.STRING, None))
    return kvs


def _all_kvs(spec: TinySpec, dims: _Dims, file_type: int) -> list[_KV]:
    kvs = _common_kvs(spec, dims)
    if spec.arch == "qwen35":
        kvs += _qwen35_kvs(dims)
    kvs.append(_u32("general.file_type", file_type))
    return kvs + _vocab_kvs(spec)


# --------------------------------------------------------------------------
# tensors


@dataclass(frozen=True)
class _TensorDef:
    """One tensor to write. ``shape`` is numpy order (the reverse of ggml's ne)."""

    name: str
    shape: tuple[int, ...]
    kind: str  # selects the init in _init_values
    gain: float = 1.0  # extra factor on the std of a "matrix"


def _mat(name: str, ne0: int, ne1: int, gain: float = 1.0) -> _TensorDef:
    """A weight matrix given in the loader's ``{ne0, ne1}`` order (ne0 = input features)."""
    return _TensorDef(name, (ne1, ne0), "matrix", gain)


def _norm(name: str, n: int) -> _TensorDef:
    return _TensorDef(name, (n,), "norm")


def _attention_defs(spec: TinySpec, dims: _Dims, il: int, q_mult: int) -> list[_TensorDef]:
    """Q/K/V/O projections; qwen35 doubles Q (query + output gate, interleaved per head)."""
    p = f"blk.{il}"
    q_dim = dims.head_dim * spec.n_head
    kv_dim = dims.head_dim * spec.n_head_kv
    return [
        _mat(f"{p}.attn_q.weight", spec.n_embd, q_dim * q_mult),
        _mat(f"{p}.attn_k.weight", spec.n_embd, kv_dim),
        _mat(f"{p}.attn_v.weight", spec.n_embd, kv_dim),
        _mat(f"{p}.attn_output.weight", q_dim, spec.n_embd),
    ]


def _qk_norm_defs(dims: _Dims, il: int) -> list[_TensorDef]:
    return [
        _norm(f"blk.{il}.attn_q_norm.weight", dims.head_dim),
        _norm(f"blk.{il}.attn_k_norm.weight", dims.head_dim),
    ]


def _ffn_defs(spec: TinySpec, il: int) -> list[_TensorDef]:
    p = f"blk.{il}"
    return [
        _mat(f"{p}.ffn_gate.weight", spec.n_embd, spec.n_ff),
        _mat(f"{p}.ffn_up.weight", spec.n_embd, spec.n_ff),
        # The FFN sees only the current position while attention averages
        # over the context and changes slowly; a larger FFN output keeps the
        # next token strongly position-dependent, which stops greedy decoding
        # from locking onto one token (most visibly with tied embeddings).
        _mat(f"{p}.ffn_down.weight", spec.n_ff, spec.n_embd, gain=3.0),
    ]


def _gated_delta_net_defs(spec: TinySpec, dims: _Dims, il: int) -> list[_TensorDef]:
    """Linear-attention tensors of a qwen35 recurrent layer (shapes from load_block_trunk)."""
    p = f"blk.{il}"
    return [
        _mat(f"{p}.attn_qkv.weight", spec.n_embd, dims.ssm_conv_dim),
        _mat(f"{p}.attn_gate.weight", spec.n_embd, dims.ssm_d_inner),
        _TensorDef(f"{p}.ssm_conv1d.weight", (dims.ssm_conv_dim, dims.ssm_d_conv), "conv"),
        _TensorDef(f"{p}.ssm_dt.bias", (dims.ssm_dt_rank,), "ssm_dt"),
        _TensorDef(f"{p}.ssm_a", (dims.ssm_dt_rank,), "ssm_a"),
        _mat(f"{p}.ssm_beta.weight", spec.n_embd, dims.ssm_dt_rank),
        _mat(f"{p}.ssm_alpha.weight", spec.n_embd, dims.ssm_dt_rank),
        _norm(f"{p}.ssm_norm.weight", dims.ssm_d_state),
        _mat(f"{p}.ssm_out.weight", dims.ssm_d_inner, spec.n_embd),
    ]


def _block_defs(spec: TinySpec, dims: _Dims, il: int) -> list[_TensorDef]:
    attn_norm = _norm(f"blk.{il}.attn_norm.weight", spec.n_embd)
    if spec.arch == "llama":
        return [
            attn_norm,
            *_attention_defs(spec, dims, il, 1),
            _norm(f"blk.{il}.ffn_norm.weight", spec.n_embd),
            *_ffn_defs(spec, il),
        ]
    if spec.arch == "qwen2":
        q_dim, kv_dim = dims.head_dim * spec.n_head, dims.head_dim * spec.n_head_kv
        return [
            attn_norm,
            *_attention_defs(spec, dims, il, 1),
            _TensorDef(f"blk.{il}.attn_q.bias", (q_dim,), "bias"),
            _TensorDef(f"blk.{il}.attn_k.bias", (kv_dim,), "bias"),
            _TensorDef(f"blk.{il}.attn_v.bias", (kv_dim,), "bias"),
            _norm(f"blk.{il}.ffn_norm.weight", spec.n_embd),
            *_ffn_defs(spec, il),
        ]
    if spec.arch == "qwen3":
        return [
            attn_norm,
            *_attention_defs(spec, dims, il, 1),
            *_qk_norm_defs(dims, il),
            _norm(f"blk.{il}.ffn_norm.weight", spec.n_embd),
            *_ffn_defs(spec, il),
        ]
    # qwen35: the FFN input norm is called post_attention_norm
    mixer = (
        _gated_delta_net_defs(spec, dims, il)
        if _is_recurrent(dims, il)
        else [*_attention_defs(spec, dims, il, 2), *_qk_norm_defs(dims, il)]
    )
    return [attn_norm, _norm(f"blk.{il}.post_attention_norm.weight", spec.n_embd), *mixer, *_ffn_defs(spec, il)]


def _tensor_defs(spec: TinySpec, dims: _Dims) -> list[_TensorDef]:
    defs = [_TensorDef("token_embd.weight", (dims.n_vocab, spec.n_embd), "embd")]
    for il in range(spec.n_layer):
        defs += _block_defs(spec, dims, il)
    defs.append(_TensorDef("output_norm.weight", (spec.n_embd,), "tied_head_norm" if spec.tie_embeddings else "norm"))
    if not spec.tie_embeddings:
        defs.append(_TensorDef("output.weight", (dims.n_vocab, spec.n_embd), "output"))
    return defs


def _tensor_rng(name: str, seed: int) -> np.random.Generator:
    """Generator private to one tensor, so each tensor is reproducible on its own."""
    return np.random.default_rng(zlib.crc32(name.encode("utf-8")) ^ seed)


def _init_values(d: _TensorDef, spec: TinySpec) -> np.ndarray:
    """Random float32 values for one tensor; scales chosen to keep activations O(1)."""
    z = _tensor_rng(d.name, spec.seed).standard_normal(d.shape, dtype=np.float32)
    if d.kind == "matrix":
        # fan-in scaled: unit-variance inputs give unit-variance outputs, so
        # every layer visibly changes the residual stream
        return z * np.float32(d.gain / math.sqrt(d.shape[-1]))
    if d.kind == "norm":
        # not exactly one, so a norm weight applied wrongly shows up in a
        # reference comparison, yet close enough to keep scales sane
        return np.float32(1.0) + np.float32(0.1) * z
    if d.kind == "embd":
        return z * np.float32(_TIED_EMBD_STD if spec.tie_embeddings else 1.0)
    if d.kind == "output":
        # Logits with std about 2 over RMS-normalised hidden states, minus a
        # little of the token embedding: the residual stream is dominated by
        # the current token's embedding, so this lowers that token's own
        # logit and keeps greedy decoding from settling on one token.
        head = z * np.float32(spec.logit_std / math.sqrt(d.shape[-1]))
        embd = _init_values(_TensorDef("token_embd.weight", d.shape, "embd"), spec)
        return head - np.float32(_OUTPUT_ANTI_REPEAT) * embd
    if d.kind == "tied_head_norm":
        # With a tied head, logit_j = e_j . (h_hat * g) and h is dominated by
        # e_t, so a positive g makes every token predict itself. Weights of
        # random sign remove that bias; the scale gives logits of std about 2.
        return z * np.float32(spec.logit_std / (_TIED_EMBD_STD * math.sqrt(d.shape[-1])))
    if d.kind == "bias":
        # large enough that a bias dropped or added twice shows in a reference comparison
        return np.float32(0.5) * z
    if d.kind == "conv":
        return z * np.float32(1.0 / math.sqrt(d.shape[-1]))
    if d.kind == "ssm_a":
        # -exp(A_log) as the converter stores it: negative, so the decay
        # exp(softplus(.) * a) stays in (0, 1)
        return -np.exp(np.float32(0.5) * z)
    if d.kind == "ssm_dt":
        # softplus(-1) ~ 0.3: a per-step decay around 0.7, a memory of a few tokens
        return np.float32(-1.0) + np.float32(0.5) * z
    raise AssertionError(f"unknown tensor kind {d.kind!r}")


def _storage_dtype(d: _TensorDef, spec: TinySpec) -> np.dtype:
    """f16 or f32 for one tensor, following the HF converter's rules."""
    if d.kind in ("embd", "output") and spec.vocab == "llama-spm":
        return np.dtype(np.float16)  # 32000-row matrices: keep the file small
    # norms, biases, ssm_a and the conv kernel stay f32 like convert_hf_to_gguf
    if d.kind in ("matrix", "embd", "output") and spec.dtype == "f16":
        return np.dtype(np.float16)
    return np.dtype(np.float32)


def _file_type(spec: TinySpec, defs: list[_TensorDef]) -> int:
    if any(_storage_dtype(d, spec) == np.float16 for d in defs):
        return _FILE_TYPE_MOSTLY_F16
    return _FILE_TYPE_ALL_F32


# --------------------------------------------------------------------------
# public API


def write_tiny_model(path: str | os.PathLike[str], spec: TinySpec) -> pathlib.Path:
    """Write the model described by ``spec`` to ``path`` and return the path.

    The output is byte-for-byte deterministic for a given spec. The file is
    written next to ``path`` under a temporary name and renamed into place, so
    readers never see a partial file.
    """
    path = pathlib.Path(path)
    dims = _derive_dims(spec)
    defs = _tensor_defs(spec, dims)

    writer = gguf.GGUFWriter(None, spec.arch)
    for key, value, vtype, sub_type in _all_kvs(spec, dims, _file_type(spec, defs)):
        writer.add_key_value(key, value, vtype, sub_type)
    for d in defs:
        writer.add_tensor(d.name, _init_values(d, spec).astype(_storage_dtype(d, spec)))

    path.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp: pathlib.Path) -> None:
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    return write_atomically(path, writer, write)


def _spec_digest(spec: TinySpec) -> str:
    payload = json.dumps({"kit": _KIT_VERSION, **dataclasses.asdict(spec)}, sort_keys=True)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]


def default_cache_dir() -> pathlib.Path:
    """Directory tiny_model() uses when no cache_dir is given."""
    return pathlib.Path(tempfile.gettempdir()) / "pyllama-dspark-tiny"


def tiny_model(spec: TinySpec, cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Return the path of the model for ``spec``, writing it on first use.

    Files live in ``cache_dir`` (default ``<tmp>/pyllama-dspark-tiny``) under
    a name derived from a hash of the spec and the kit version, so concurrent
    test processes share one copy; the atomic write in write_tiny_model makes
    racing writers harmless.
    """
    directory = pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = directory / f"{spec.arch}-{spec.vocab}-{spec.dtype}-{_spec_digest(spec)}.gguf"
    if not path.is_file():
        write_tiny_model(path, spec)
    return path


def load_tiny_weights(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Read every tensor of a GGUF file as a float32 numpy array.

    Shapes are numpy order as GGUFReader gives them (the reverse of ggml's
    ``ne``), e.g. ``token_embd.weight`` is ``(n_vocab, n_embd)``. f16 (and any
    quantized) tensors are dequantized. The arrays are copies, independent of
    the file.
    """
    reader = gguf.GGUFReader(path)
    weights: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        weights[t.name] = np.array(values, dtype=np.float32, copy=True)
    return weights


def vocab_gguf_path(name: str = "llama-spm") -> pathlib.Path:
    """Locate the vocab-only file ``ggml-vocab-<name>.gguf``.

    Looks in ``$PYLLAMA_DSPARK_VOCAB_DIR`` first, then in the package's
    ``data/`` (the build installs ggml-vocab-llama-spm.gguf there), then in
    the source tree's ``vendor/llama.cpp/models``. Raises FileNotFoundError
    naming every place searched when none has it.
    """
    filename = f"ggml-vocab-{name}.gguf"
    candidates = []
    env_dir = os.environ.get(_VOCAB_DIR_ENV)
    if env_dir:
        candidates.append(pathlib.Path(env_dir) / filename)
    installed = resources.data_path(filename)  # shipped in the package by the build
    if installed is not None:
        candidates.append(installed)
    candidates.append(pathlib.Path(__file__).resolve().parent.parent / "vendor" / "llama.cpp" / "models" / filename)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    searched = ", ".join(str(c) for c in candidates)
    raise FileNotFoundError(
        f"vocab file {filename} not found (searched: {searched}); "
        f"set {_VOCAB_DIR_ENV} to a directory holding llama.cpp's models/{filename}"
    )


# --------------------------------------------------------------------------
# tiny Hugging Face DSpark drafter checkpoints (input of pyllama_dspark.convert)

# one of the names the vendored DSparkModel converter registers (conversion/qwen.py)
DSPARK_ARCHITECTURE = "DSparkDraftModel"
DSPARK_CONFIG_STYLES = ("top", "nested", "aux")
DSPARK_DTYPES = ("bf16", "f16", "f32")


@dataclass(frozen=True)
class _DraftSpec:
    """The drafter's sizes, derived from the target so taps and vocabulary fit."""

    target: TinySpec
    n_layer: int
    n_vocab: int
    head_dim: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    markov_rank: int
    confidence_head: bool
    confidence_with_markov: bool
    draft_vocab_size: int | None
    prefix: str
    seed: int


def default_dspark_target_layer_ids(n_layer: int) -> tuple[int, ...]:
    """Valid HF taps (outputs of layer i) for a target with ``n_layer`` layers: the first
    layer and the second to last, never the last one (upstream aborts on that)."""
    if n_layer < 2:
        raise ValueError(f"a DSpark target needs at least 2 layers (the last cannot be tapped), got {n_layer}")
    return tuple(sorted({0, n_layer - 2}))


def _draft_matrix(name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    z = _tensor_rng(name, seed).standard_normal(shape, dtype=np.float32)
    return z * np.float32(1.0 / math.sqrt(shape[-1]))


def _draft_norm(name: str, n: int, seed: int) -> np.ndarray:
    return np.float32(1.0) + np.float32(0.1) * _tensor_rng(name, seed).standard_normal((n,), dtype=np.float32)


def _draft_layer(d: _DraftSpec, il: int) -> dict[str, np.ndarray]:
    t, p, seed_name = d.target, f"{d.prefix}layers.{il}.", f"layers.{il}."
    h, q, kv = t.n_embd, t.n_head * d.head_dim, t.n_head_kv * d.head_dim
    mats = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, q), "mlp.gate_proj": (t.n_ff, h), "mlp.up_proj": (t.n_ff, h),
            "mlp.down_proj": (h, t.n_ff)}
    norms = {"input_layernorm": h, "post_attention_layernorm": h,
             "self_attn.q_norm": d.head_dim, "self_attn.k_norm": d.head_dim}
    # seeded by the unprefixed name, so every prefix variant holds the same values
    out = {f"{p}{k}.weight": _draft_matrix(seed_name + k, s, d.seed) for k, s in mats.items()}
    out.update({f"{p}{k}.weight": _draft_norm(seed_name + k, n, d.seed) for k, n in norms.items()})
    return out


def _draft_heads(d: _DraftSpec) -> dict[str, np.ndarray]:
    """Markov and confidence heads (omitted when their rank/flag says so)."""
    p, h, r = d.prefix, d.target.n_embd, d.markov_rank
    out: dict[str, np.ndarray] = {}
    if r > 0:
        # w1 rows are embeddings (std 1), w2 a projection from rank r
        w1 = _draft_matrix("markov_w1", (d.n_vocab, r), d.seed) * np.float32(math.sqrt(r))
        out[f"{p}markov_head.markov_w1.weight"] = w1
        w2_rows = d.draft_vocab_size or d.n_vocab
        out[f"{p}markov_head.markov_w2.weight"] = _draft_matrix("markov_w2", (w2_rows, r), d.seed)
    if d.confidence_head:
        width = h + r if d.confidence_with_markov else h
        out[f"{p}confidence_head.proj.weight"] = _draft_matrix("conf_proj", (1, width), d.seed)
        out[f"{p}confidence_head.proj.bias"] = np.full((1,), 0.5, dtype=np.float32)
    return out


def _draft_vocab_ids(d: _DraftSpec) -> np.ndarray:
    """Sorted target ids of a reduced draft vocabulary; never the mask token."""
    candidates = np.setdiff1d(np.arange(d.n_vocab), [d.mask_token_id])
    chosen = _tensor_rng("d2t", d.seed).choice(candidates, size=d.draft_vocab_size, replace=False)
    return np.sort(chosen).astype(np.int64)


def _draft_vocab_tensors(d: _DraftSpec, target_weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """embed_tokens, lm_head (or its reduced rows) and d2t/t2d, as the checkpoint stores them."""
    head = target_weights.get("output.weight", target_weights["token_embd.weight"])
    out = {f"{d.prefix}embed_tokens.weight": target_weights["token_embd.weight"]}
    if d.draft_vocab_size is None:
        out["lm_head.weight"] = head
        return out
    ids = _draft_vocab_ids(d)
    out["lm_head.weight"] = head[ids]
    # EAGLE-3 convention: d2t holds offsets (target id - draft id), t2d a target-side mask
    out["d2t"] = ids - np.arange(ids.size, dtype=np.int64)
    t2d = np.zeros(d.n_vocab, dtype=np.bool_)
    t2d[ids] = True
    out["t2d"] = t2d
    return out


def _dspark_fields(d: _DraftSpec) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "block_size": d.block_size, "target_layer_ids": list(d.target_layer_ids),
        "mask_token_id": d.mask_token_id, "markov_rank": d.markov_rank, "markov_head_type": "vanilla",
        "enable_confidence_head": d.confidence_head, "confidence_head_with_markov": d.confidence_with_markov,
    }
    if d.draft_vocab_size is not None:
        fields["draft_vocab_size"] = d.draft_vocab_size
    return fields


def _dspark_config(d: _DraftSpec, style: str, dtype: str) -> dict[str, Any]:
    t = d.target
    config: dict[str, Any] = {
        "architectures": [DSPARK_ARCHITECTURE], "model_type": "qwen3",
        "hidden_size": t.n_embd, "intermediate_size": t.n_ff, "num_hidden_layers": d.n_layer,
        "num_attention_heads": t.n_head, "num_key_value_heads": t.n_head_kv, "head_dim": d.head_dim,
        "max_position_embeddings": t.n_ctx_train, "rms_norm_eps": _RMS_EPS,
        "rope_theta": 10000.0 if t.arch == "llama" else 1.0e6, "vocab_size": d.n_vocab,
        "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
        "torch_dtype": {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}[dtype],
    }
    fields = _dspark_fields(d)
    if style == "nested":
        config["dflash_config"] = fields
    elif style == "aux":
        # EAGLE-3/SpecForge schema: layer *inputs* (HF id + 1), other fields at the top
        del fields["target_layer_ids"]
        config.update(fields, aux_hidden_state_layer_ids=[i + 1 for i in d.target_layer_ids])
    else:
        config.update(fields)
    return config


def _write_shards(folder: pathlib.Path, tensors: dict[str, np.ndarray], shards: int, bf16: bool) -> None:
    from .convert.safetensors import write_safetensors

    if shards == 1:
        write_safetensors(folder / "model.safetensors", tensors, bf16=bf16)
        return
    names = list(tensors)
    weight_map: dict[str, str] = {}
    for k in range(shards):
        part = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        chunk = {n: tensors[n] for n in names[k::shards]}  # interleaved, so every shard has several kinds
        write_safetensors(folder / part, chunk, bf16=bf16)
        weight_map.update(dict.fromkeys(chunk, part))
    total = sum(int(np.asarray(a).nbytes) for a in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2), encoding="utf-8")


def _validate_draft_args(n_layer: int, dtype: str, config_style: str, shards: int) -> None:
    if n_layer < 1:
        raise ValueError(f"n_layer must be >= 1, got {n_layer}")
    if dtype not in DSPARK_DTYPES:
        raise ValueError(f"dtype must be one of {DSPARK_DTYPES}, got {dtype!r}")
    if config_style not in DSPARK_CONFIG_STYLES:
        raise ValueError(f"config_style must be one of {DSPARK_CONFIG_STYLES}, got {config_style!r}")
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")


def _draft_tensors(d: _DraftSpec, target_path: pathlib.Path, with_shared_embeddings: bool) -> dict[str, np.ndarray]:
    h, p = d.target.n_embd, d.prefix
    tensors = {f"{p}fc.weight": _draft_matrix("fc", (h, len(d.target_layer_ids) * h), d.seed),
               f"{p}hidden_norm.weight": _draft_norm("hidden_norm", h, d.seed)}
    for il in range(d.n_layer):
        tensors.update(_draft_layer(d, il))
    tensors[f"{p}norm.weight"] = _draft_norm("norm", h, d.seed)
    tensors.update(_draft_heads(d))
    vocab = _draft_vocab_tensors(d, load_tiny_weights(target_path))
    if not with_shared_embeddings:
        # a reduced-vocabulary drafter always ships its own (smaller) head
        vocab = {k: v for k, v in vocab.items() if k != "lm_head.weight" or d.draft_vocab_size is not None}
        vocab.pop(f"{p}embed_tokens.weight")
    tensors.update(vocab)
    return tensors


def write_tiny_dspark_checkpoint(
    folder: str | os.PathLike[str], *, target: TinySpec, n_layer: int = 1, block_size: int = 4,
    target_layer_ids: tuple[int, ...] | None = None, markov_rank: int = 8, confidence_head: bool = True,
    confidence_with_markov: bool = True, dtype: str = "bf16", config_style: str = "top", shards: int = 1,
    with_shared_embeddings: bool = True, draft_vocab_size: int | None = None, prefix: str = "model.",
    seed: int = 0, target_cache_dir: str | os.PathLike[str] | None = None,
) -> pathlib.Path:
    """Write a tiny random Hugging Face DSpark drafter checkpoint for ``target`` into ``folder``.

    The folder gets ``config.json`` (architecture ``DSparkDraftModel``, model
    type ``qwen3``) and safetensors, in the layout pyllama_dspark.convert and
    the vendored ``convert_hf_to_gguf.py`` read. The drafter is as wide as the
    target (``fc`` is ``[n_embd, n_taps * n_embd]``), uses its vocabulary and
    ``mask_token_id = n_vocab - 1``. Weights are seeded per tensor name like
    the target kit's.

    Args:
        folder: created if missing; existing files of the same names are replaced.
        target: the target model's spec; its GGUF is built (or reused) with
            ``tiny_model(target, target_cache_dir)``.
        n_layer: drafter layers.
        block_size: DSpark block size B.
        target_layer_ids: HF taps (outputs of layer i); default
            ``default_dspark_target_layer_ids(target.n_layer)``.
        markov_rank: rank R of the Markov head; 0 writes none.
        confidence_head: write ``confidence_head.proj`` (weight + bias).
        confidence_with_markov: the head reads ``[h ; w1[prev]]`` (width
            n_embd + R) rather than ``h`` alone (width n_embd).
        dtype: ``bf16`` (as released checkpoints), ``f16`` or ``f32``.
        config_style: ``top`` (DSpark fields at the top level), ``nested``
            (in ``dflash_config``) or ``aux`` (``aux_hidden_state_layer_ids``,
            +1 based).
        shards: 1 writes ``model.safetensors``; more write
            ``model-0000k-of-0000n.safetensors`` plus the index.
        with_shared_embeddings: include ``embed_tokens``/``lm_head``, copies
            of the target's ``token_embd``/``output`` (its ``token_embd`` when tied).
        draft_vocab_size: a reduced draft vocabulary: ``lm_head`` holds those
            rows of the target's head, with ``d2t`` offsets and a ``t2d`` mask.
        prefix: ``"model."`` (default), ``""`` or ``"drafter."`` before every
            tensor name except ``lm_head``, ``d2t`` and ``t2d``.
        seed: weight seed.
        target_cache_dir: where ``tiny_model`` keeps the target GGUF.

    Returns:
        ``folder`` as a Path.
    """
    _validate_draft_args(n_layer, dtype, config_style, shards)
    target_path = tiny_model(target, target_cache_dir)
    n_vocab = _derive_dims(target).n_vocab
    d = _DraftSpec(
        target=target, n_layer=n_layer, n_vocab=n_vocab, head_dim=target.n_embd // target.n_head,
        block_size=block_size,
        target_layer_ids=tuple(target_layer_ids) if target_layer_ids is not None
        else default_dspark_target_layer_ids(target.n_layer),
        mask_token_id=n_vocab - 1, markov_rank=markov_rank, confidence_head=confidence_head,
        confidence_with_markov=confidence_with_markov, draft_vocab_size=draft_vocab_size, prefix=prefix, seed=seed,
    )
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = _dspark_config(d, config_style, dtype)
    (folder / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    tensors = _draft_tensors(d, target_path, with_shared_embeddings)
    if dtype == "f16":
        tensors = {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in tensors.items()}
    _write_shards(folder, tensors, shards, bf16=dtype == "bf16")
    return folder


class AlwaysRightDrafter:
    """A drafter that proposes a known continuation: ``sequence`` holds prompt + the target's greedy output,
    indexed by position, so every draft is accepted. Speculative decoding with it measures the ceiling the
    loop allows on a machine (benchmarks), and its output must equal plain greedy decoding."""

    capture_layers: list[int] = []

    def __init__(self, sequence, block_size: int):
        self.sequence, self.block_size = [int(t) for t in sequence], int(block_size)

    def reset(self) -> None:
        pass

    def observe(self, tokens, rows, pos0: int) -> None:
        pass

    def propose(self, anchor: int, pos: int, n_max: int, sampler=None):
        from .drafter import Draft

        return Draft(tokens=np.asarray(self.sequence[pos + 1: pos + 1 + n_max], dtype=np.int32))
