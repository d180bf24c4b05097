"""The tiny-model kit (pyllama_dspark.testing): pure Python, no native library."""

from __future__ import annotations


import gguf
import numpy as np
import pytest

from pyllama_dspark import testing as kit

TinySpec = kit.TinySpec
ARCHS = ["llama", "qwen3", "qwen35"]
VT = gguf.GGUFValueType


def _fields(path) -> dict[str, tuple[object, list]]:
    reader = gguf.GGUFReader(path)
    return {k: (f.contents(), list(f.types)) for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _tensor_types(path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (numpy shape, ggml type name)"""
    reader = gguf.GGUFReader(path)
    return {t.name: (tuple(int(n) for n in reversed(t.shape)), t.tensor_type.name) for t in reader.tensors}


# --------------------------------------------------------------------------
# determinism and seeding


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_same_spec_gives_identical_bytes(tmp_path, arch, dtype):
    spec = TinySpec(arch=arch, dtype=dtype)
    a = kit.write_tiny_model(tmp_path / "a.gguf", spec)
    b = kit.write_tiny_model(tmp_path / "b.gguf", spec)
    assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize("arch", ARCHS)
def test_layer_count_does_not_change_shared_tensors(tmp_path, arch):
    small = kit.load_tiny_weights(kit.write_tiny_model(tmp_path / "l2.gguf", TinySpec(arch=arch, n_layer=2)))
    large = kit.load_tiny_weights(kit.write_tiny_model(tmp_path / "l5.gguf", TinySpec(arch=arch, n_layer=5)))
    shared = [n for n in small if n.startswith("blk.0.") or not n.startswith("blk.")]
    assert any(n.startswith("blk.0.") for n in shared)
    for name in shared:
        np.testing.assert_array_equal(small[name], large[name], err_msg=name)


def test_seed_changes_every_tensor(tmp_path):
    w0 = kit.load_tiny_weights(kit.write_tiny_model(tmp_path / "s0.gguf", TinySpec(arch="qwen3", seed=0)))
    w1 = kit.load_tiny_weights(kit.write_tiny_model(tmp_path / "s1.gguf", TinySpec(arch="qwen3", seed=1)))
    assert w0.keys() == w1.keys()
    for name in w0:
        assert not np.array_equal(w0[name], w1[name]), name


def test_tensors_are_seeded_by_name_not_by_arch(tmp_path):
    # token_embd and the FFN of block 0 have the same name and shape in
    # llama and qwen3, so they must hold the same values
    wl = kit.load_tiny_weights(kit.write_tiny_model(tmp_path / "l.gguf", TinySpec(arch="llama")))
    wq = kit.load_tiny_weights(kit.write_tiny_model(tmp_path / "q.gguf", TinySpec(arch="qwen3")))
    for name in ("token_embd.weight", "blk.0.ffn_up.weight", "blk.0.attn_q.weight"):
        np.testing.assert_array_equal(wl[name], wq[name])


# --------------------------------------------------------------------------
# metadata


def _expected_keys(arch: str, n_vocab: int = 256) -> dict[str, object]:
    keys = {
        "general.architecture": arch,
        "general.name": f"pyllama-dspark-tiny-{arch}",
        "general.file_type": 0,
        f"{arch}.vocab_size": n_vocab,
        f"{arch}.context_length": 4096,
        f"{arch}.embedding_length": 64,
        f"{arch}.block_count": 2,
        f"{arch}.feed_forward_length": 128,
        f"{arch}.attention.head_count": 4,
        f"{arch}.attention.head_count_kv": 2,
        f"{arch}.attention.layer_norm_rms_epsilon": pytest.approx(1e-6),
        f"{arch}.rope.freq_base": 10000.0 if arch == "llama" else 1.0e6,
        f"{arch}.rope.dimension_count": 8 if arch == "qwen35" else 16,
    }
    if arch != "llama":
        keys |= {f"{arch}.attention.key_length": 16, f"{arch}.attention.value_length": 16}
    if arch == "qwen35":
        keys |= {
            "qwen35.rope.dimension_sections": [2, 1, 1, 0],
            "qwen35.full_attention_interval": 2,
            "qwen35.ssm.conv_kernel": 4,
            "qwen35.ssm.state_size": 16,
            "qwen35.ssm.group_count": 2,
            "qwen35.ssm.time_step_rank": 4,
            "qwen35.ssm.inner_size": 64,
        }
    return keys


@pytest.mark.parametrize("arch", ARCHS)
def test_metadata_round_trip(tmp_path, arch):
    fields = _fields(kit.write_tiny_model(tmp_path / "m.gguf", TinySpec(arch=arch)))
    expected = _expected_keys(arch) | {"tokenizer.ggml.model": "no_vocab"}
    assert {k: v for k, (v, _) in fields.items()} == expected


@pytest.mark.parametrize("arch", ARCHS)
def test_metadata_value_types(tmp_path, arch):
    # the C++ loader rejects e.g. an INT32 where it reads a uint32_t
    fields = _fields(kit.write_tiny_model(tmp_path / "m.gguf", TinySpec(arch=arch)))
    for key, (value, types) in fields.items():
        if isinstance(value, bool) or isinstance(value, str):
            continue
        if isinstance(value, float):
            assert types == [VT.FLOAT32], key
        elif isinstance(value, int):
            assert types == [VT.UINT32], key
        else:
            assert types == [VT.ARRAY, VT.INT32], key


def _tokenizer_fields(reader: gguf.GGUFReader) -> dict[str, tuple[list, int, list]]:
    """tokenizer.* fields as (types, length, a sample of values); decoding all 32000 strings is slow."""
    out = {}
    for key, f in reader.fields.items():
        if key.startswith("tokenizer."):
            if f.types[0] == VT.ARRAY:
                sample = [f.contents(i) for i in (0, 1, 2, 259, 15043, len(f.data) - 1)]
            else:
                sample = [f.contents()]
            out[key] = (list(f.types), len(f.data), sample)
    return out


@pytest.mark.slow  # GGUFReader takes seconds to parse a 32000-token vocab
def test_llama_spm_vocab_is_copied(tmp_path):
    path = kit.write_tiny_model(tmp_path / "v.gguf", TinySpec(arch="qwen35", vocab="llama-spm", n_vocab=99))
    reader = gguf.GGUFReader(path)
    assert _tokenizer_fields(reader) == _tokenizer_fields(gguf.GGUFReader(kit.vocab_gguf_path("llama-spm")))
    assert reader.fields["tokenizer.ggml.add_bos_token"].contents() is True
    assert reader.fields["qwen35.vocab_size"].contents() == 32000
    assert reader.fields["general.file_type"].contents() == 1
    types = {t.name: (tuple(int(n) for n in reversed(t.shape)), t.tensor_type.name) for t in reader.tensors}
    # n_vocab is ignored; the big matrices are f16 even though dtype is f32
    assert types["token_embd.weight"] == ((32000, 64), "F16")
    assert types["output.weight"] == ((32000, 64), "F16")
    assert types["blk.0.ffn_up.weight"] == ((128, 64), "F32")


# --------------------------------------------------------------------------
# tensors


def test_qwen35_layer_layout(tmp_path):
    for n_layer, attention_layers in [(2, {1}), (3, {2}), (4, {3}), (8, {3, 7})]:
        path = kit.write_tiny_model(tmp_path / f"q{n_layer}.gguf", TinySpec(arch="qwen35", n_layer=n_layer))
        types = _tensor_types(path)
        for il in range(n_layer):
            is_attn = il in attention_layers
            assert (f"blk.{il}.attn_q.weight" in types) == is_attn, (n_layer, il)
            assert (f"blk.{il}.ssm_a" in types) == (not is_attn), (n_layer, il)


def test_qwen35_tensor_shapes(tmp_path):
    types = _tensor_types(kit.write_tiny_model(tmp_path / "q.gguf", TinySpec(arch="qwen35", n_layer=2)))
    # numpy order: the reverse of the loader's {ne0, ne1}
    expected = {
        "blk.0.attn_qkv.weight": (128, 64),  # conv_dim = 2 * 16 * 2 + 64
        "blk.0.attn_gate.weight": (64, 64),
        "blk.0.ssm_conv1d.weight": (128, 4),
        "blk.0.ssm_dt.bias": (4,),
        "blk.0.ssm_a": (4,),
        "blk.0.ssm_beta.weight": (4, 64),
        "blk.0.ssm_alpha.weight": (4, 64),
        "blk.0.ssm_norm.weight": (16,),
        "blk.0.ssm_out.weight": (64, 64),
        "blk.0.post_attention_norm.weight": (64,),
        "blk.1.attn_q.weight": (128, 64),  # query and gate
        "blk.1.attn_k.weight": (32, 64),
        "blk.1.attn_v.weight": (32, 64),
        "blk.1.attn_output.weight": (64, 64),
        "blk.1.attn_q_norm.weight": (16,),
        "blk.1.ffn_down.weight": (64, 128),
    }
    for name, shape in expected.items():
        assert types[name][0] == shape, name
    assert "blk.0.ffn_norm.weight" not in types


def test_storage_types(tmp_path):
    f16 = _tensor_types(kit.write_tiny_model(tmp_path / "h.gguf", TinySpec(arch="qwen35", dtype="f16")))
    for name, (shape, ggml_type) in f16.items():
        keep_f32 = len(shape) == 1 or name.endswith("ssm_conv1d.weight")
        assert ggml_type == ("F32" if keep_f32 else "F16"), name
    f32 = _tensor_types(kit.write_tiny_model(tmp_path / "f.gguf", TinySpec(arch="qwen35")))
    assert {t for _, t in f32.values()} == {"F32"}


def test_tied_embeddings_omit_output(tmp_path):
    types = _tensor_types(kit.write_tiny_model(tmp_path / "t.gguf", TinySpec(arch="llama", tie_embeddings=True)))
    assert "output.weight" not in types
    assert "token_embd.weight" in types


def test_load_tiny_weights_dequantizes_f16(tmp_path):
    w32 = kit.load_tiny_weights(kit.write_tiny_model(tmp_path / "f.gguf", TinySpec(arch="llama")))
    w16 = kit.load_tiny_weights(kit.write_tiny_model(tmp_path / "h.gguf", TinySpec(arch="llama", dtype="f16")))
    assert w32.keys() == w16.keys()
    for name, a in w32.items():
        assert a.dtype == np.float32 and w16[name].dtype == np.float32
        # matrices are stored rounded to f16, norms stay f32
        expected = a.astype(np.float16).astype(np.float32) if a.ndim == 2 else a
        np.testing.assert_array_equal(w16[name], expected, err_msg=name)
    assert w32["token_embd.weight"].shape == (256, 64)
    assert w32["blk.0.attn_k.weight"].shape == (32, 64)


def test_weight_scales_are_sane(tmp_path):
    w = kit.load_tiny_weights(kit.write_tiny_model(tmp_path / "q.gguf", TinySpec(arch="qwen35")))
    for name, a in w.items():
        assert np.all(np.isfinite(a)), name
        assert 0.0 < float(np.abs(a).max()) < 10.0, name
    assert np.all(w["blk.0.ssm_a"] < 0)  # decay exp(softplus(.) * a) must stay below 1


# --------------------------------------------------------------------------
# generation quality, with a small numpy forward of llama / qwen3


def _rms(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, neox, base):
    t, _, d = x.shape
    angles = np.arange(t)[:, None] * base ** (-np.arange(0, d, 2) / d)[None, :]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    if neox:
        a, b = x[..., : d // 2], x[..., d // 2 :]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], -1)
    out = np.empty_like(x)
    a, b = x[..., 0::2], x[..., 1::2]
    out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
    return out


def _last_logits(w, spec, tokens):
    """Logits of the last position (no KV cache: recompute the whole prefix)."""
    hd = spec.n_embd // spec.n_head
    t = len(tokens)
    neox, base = spec.arch != "llama", 1e4 if spec.arch == "llama" else 1e6
    x = w["token_embd.weight"][tokens]
    for il in range(spec.n_layer):
        p = f"blk.{il}."
        h = _rms(x, w[p + "attn_norm.weight"])
        q = (h @ w[p + "attn_q.weight"].T).reshape(t, spec.n_head, hd)
        k = (h @ w[p + "attn_k.weight"].T).reshape(t, spec.n_head_kv, hd)
        v = (h @ w[p + "attn_v.weight"].T).reshape(t, spec.n_head_kv, hd)
        if spec.arch == "qwen3":
            q, k = _rms(q, w[p + "attn_q_norm.weight"]), _rms(k, w[p + "attn_k_norm.weight"])
        q, k = _rope(q, neox, base), _rope(k, neox, base)
        group = spec.n_head // spec.n_head_kv
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + np.triu(np.full((t, t), -np.inf), 1)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", s, v).reshape(t, -1) @ w[p + "attn_output.weight"].T
        h = _rms(x, w[p + "ffn_norm.weight"])
        g = h @ w[p + "ffn_gate.weight"].T
        x = x + (g / (1 + np.exp(-g)) * (h @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T
    head = w.get("output.weight", w["token_embd.weight"])
    return _rms(x[-1], w["output_norm.weight"]) @ head.T


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("tie", [False, True])
def test_greedy_decoding_does_not_collapse(tmp_path, arch, tie):
    spec = TinySpec(arch=arch, tie_embeddings=tie)
    weights = kit.load_tiny_weights(kit.write_tiny_model(tmp_path / "g.gguf", spec))
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    tokens = [1, 2, 3, 4]
    for _ in range(64):
        tokens.append(int(np.argmax(_last_logits(w, spec, np.array(tokens)))))
    generated = tokens[4:]
    assert len(set(generated)) >= 16, generated
    assert _longest_run(generated) <= 4, generated


def _longest_run(seq) -> int:
    longest = run = 1
    for prev, cur in zip(seq, seq[1:]):
        run = run + 1 if cur == prev else 1
        longest = max(longest, run)
    return longest


# --------------------------------------------------------------------------
# cache, sizes, lookup, validation


def test_tiny_model_caches_by_spec(tmp_path):
    spec = TinySpec(arch="llama")
    path = kit.tiny_model(spec, cache_dir=tmp_path)
    mtime = path.stat().st_mtime_ns
    assert kit.tiny_model(spec, cache_dir=tmp_path) == path
    assert path.stat().st_mtime_ns == mtime
    other = kit.tiny_model(TinySpec(arch="llama", seed=1), cache_dir=tmp_path)
    assert other != path
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, other.name])  # no temp files left


@pytest.mark.parametrize("arch", ARCHS)
def test_file_sizes(tmp_path, arch):
    for dtype in ("f32", "f16"):
        size = kit.write_tiny_model(tmp_path / f"{dtype}.gguf", TinySpec(arch=arch, dtype=dtype)).stat().st_size
        assert 50_000 < size < 1_000_000, (dtype, size)
    size = kit.write_tiny_model(tmp_path / "spm.gguf", TinySpec(arch=arch, vocab="llama-spm")).stat().st_size
    assert 4_000_000 < size < 10_000_000, size
    tied = TinySpec(arch=arch, vocab="llama-spm", tie_embeddings=True)
    size = kit.write_tiny_model(tmp_path / "spm-tied.gguf", tied).stat().st_size
    assert size < 6_000_000, size


def test_vocab_gguf_path_prefers_env_dir(tmp_path, monkeypatch):
    fake = tmp_path / "ggml-vocab-llama-spm.gguf"
    fake.write_bytes(b"")
    monkeypatch.setenv("PYLLAMA_DSPARK_VOCAB_DIR", str(tmp_path))
    assert kit.vocab_gguf_path() == fake


def test_vocab_gguf_path_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("PYLLAMA_DSPARK_VOCAB_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="ggml-vocab-nonexistent.gguf"):
        kit.vocab_gguf_path("nonexistent")


@pytest.mark.parametrize(
    "fields",
    [
        {"arch": "gpt2"},
        {"arch": "llama", "vocab": "bpe"},
        {"arch": "llama", "dtype": "q8_0"},
        {"arch": "llama", "n_embd": 60},
        {"arch": "llama", "n_head_kv": 3},
        {"arch": "llama", "seed": -1},
        {"arch": "qwen35", "n_layer": 1},
    ],
)
def test_invalid_specs_are_rejected(fields):
    with pytest.raises(ValueError):
        TinySpec(**fields)
