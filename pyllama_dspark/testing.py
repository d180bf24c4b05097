"""Tiny deterministic random-weight GGUF models for tests.

The kit writes small *target* models for the three architectures the package
drives (``llama``, ``qwen3`` and the hybrid ``qwen35``) with nothing but numpy
and the ``gguf`` package, so tests never need a download or torch.

Design points:

* Every tensor is drawn from its own generator seeded with
  ``zlib.crc32(tensor_name) ^ spec.seed``. A tensor therefore depends only on
  its name, its shape, the seed and (for ``token_embd``, ``output`` and
  ``output_norm``) ``tie_embeddings``: adding layers, changing the architecture
  or the storage dtype of other tensors leaves it unchanged.
* Tensor names, shapes and metadata keys follow the vendored llama.cpp loader
  (``src/models/{llama,qwen3,qwen35}.cpp``, ``src/llama-arch.cpp``). Keys are
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

__all__ = [
    "TinySpec",
    "write_tiny_model",
    "tiny_model",
    "load_tiny_weights",
    "vocab_gguf_path",
]

ARCHS = ("llama", "qwen3", "qwen35")
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
    ``qwen35`` layer layout.
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

    def __post_init__(self) -> None:
        _validate_spec(self)


def _validate_spec(spec: TinySpec) -> None:
    """Reject specs the loader would refuse, with a message naming the field."""
    if spec.arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {spec.arch!r}")
    if spec.vocab not in VOCABS:
        raise ValueError(f"vocab must be one of {VOCABS}, got {spec.vocab!r}")
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
    return [(k, v, t, s) for k, (v, t, s) in _spm_vocab_fields().items()]


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
        head = z * np.float32(2.0 / math.sqrt(d.shape[-1]))
        embd = _init_values(_TensorDef("token_embd.weight", d.shape, "embd"), spec)
        return head - np.float32(_OUTPUT_ANTI_REPEAT) * embd
    if d.kind == "tied_head_norm":
        # With a tied head, logit_j = e_j . (h_hat * g) and h is dominated by
        # e_t, so a positive g makes every token predict itself. Weights of
        # random sign remove that bias; the scale gives logits of std about 2.
        return z * np.float32(2.0 / (_TIED_EMBD_STD * math.sqrt(d.shape[-1])))
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
    fd, tmp_name = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = pathlib.Path(tmp_name)
    try:
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return path


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
