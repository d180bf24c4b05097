"""The DSpark converter (pyllama_dspark.convert): round trips, refusals, peer and loader checks.

Checkpoints come from ``testing.write_tiny_dspark_checkpoint``; targets from
the tiny-model kit. The peer test runs the vendored ``convert_hf_to_gguf.py``
in a subprocess (it needs torch, transformers and sentencepiece; set
PYLLAMA_DSPARK_PEER_PYTHON to an interpreter that has them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import gguf
import numpy as np
import pytest

from pyllama_dspark import testing as kit
from pyllama_dspark.cli import main as cli_main
from pyllama_dspark.convert import errors
from pyllama_dspark.convert.converter import convert
from pyllama_dspark.convert.safetensors import bf16_to_f32, f32_to_bf16, read_safetensors, write_safetensors

TinySpec = kit.TinySpec
VT = gguf.GGUFValueType
REPO = Path(__file__).resolve().parent.parent
VENDOR = REPO / "vendor" / "llama.cpp"
# a 3-layer target: HF taps 0 and 1 are valid, 2 is its last layer
TARGET = dict(arch="qwen3", n_layer=3)


# --------------------------------------------------------------------------
# helpers


def read_gguf(path):
    """(key -> (type names, value), tensor name -> (numpy shape, ggml type, float32 or int data))"""
    reader = gguf.GGUFReader(path)
    kvs = {k: ([t.name for t in f.types], f.contents()) for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = {}
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        data = np.array(t.data) if t.tensor_type.name.startswith("I") else gguf.quants.dequantize(t.data, t.tensor_type)
        tensors[t.name] = (shape, t.tensor_type.name, np.asarray(data).reshape(shape))
    return kvs, tensors


def checkpoint_values(folder) -> dict[str, np.ndarray]:
    """Every checkpoint tensor as float32 (ints kept), across shards."""
    out = {}
    for part in sorted(Path(folder).glob("*.safetensors")):
        out.update({n: r.load().astype(np.float32) if r.dtype in ("BF16", "F16", "F32") else r.load()
                    for n, r in read_safetensors(part).items()})
    return out


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.suffix in (".gguf", ".tmp"))


@pytest.fixture
def target(make_model):
    return make_model(**TARGET)


@pytest.fixture
def ckpt(tmp_path, model_dir):
    """ckpt(**kw) -> a tiny checkpoint folder for the 3-layer qwen3 target (or kw['target'])."""

    def build(name="ck", **kw):
        spec = kw.pop("target", TinySpec(**TARGET))
        return kit.write_tiny_dspark_checkpoint(tmp_path / name, target=spec, target_cache_dir=model_dir, **kw)

    return build


def rewrite_tensors(folder: Path, edit) -> None:
    """Apply edit(dict name -> float32/int array) to a single-file checkpoint (stored as f32)."""
    values = checkpoint_values(folder)
    edit(values)
    write_safetensors(folder / "model.safetensors", values)


def edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


# --------------------------------------------------------------------------
# safetensors reader/writer


def test_bf16_round_trip_is_exact_and_rounds_to_nearest_even():
    values = np.array([1.0, -2.5, 3.1415927, 1e-30, 65536.0, np.inf], dtype=np.float32)
    assert np.array_equal(bf16_to_f32(f32_to_bf16(values))[[0, 1, 4, 5]], values[[0, 1, 4, 5]])
    # 1 + 2^-8 is halfway between two bf16 values: ties go to the even mantissa (1.0)
    assert bf16_to_f32(f32_to_bf16(np.array([1 + 2**-8], np.float32)))[0] == 1.0
    assert bf16_to_f32(f32_to_bf16(np.array([1 + 3 * 2**-8], np.float32)))[0] == 1 + 2**-6


def test_safetensors_round_trip(tmp_path):
    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array([1, -2], np.int64),
              "c": np.ones((2, 2), np.float16), "m": np.array([True, False])}
    write_safetensors(tmp_path / "x.safetensors", arrays)
    refs = read_safetensors(tmp_path / "x.safetensors")
    assert list(refs) == list(arrays)
    for name, a in arrays.items():
        assert refs[name].load().dtype == a.dtype and np.array_equal(refs[name].load(), a)
    write_safetensors(tmp_path / "y.safetensors", arrays, bf16=True)
    refs = read_safetensors(tmp_path / "y.safetensors")
    assert refs["a"].dtype == "BF16" and refs["b"].dtype == "I64" and refs["c"].dtype == "BF16"
    assert np.array_equal(refs["a"].load(), arrays["a"]) and np.array_equal(refs["a"].rows(1, 2), arrays["a"][1:])


# --------------------------------------------------------------------------
# round trip


EXPECTED_KEYS = {
    "general.architecture": (["STRING"], "dflash"),
    "general.type": (["STRING"], "model"),
    "general.file_type": (["UINT32"], 32),
    "general.quantization_version": (["UINT32"], 2),
    "dflash.block_count": (["UINT32"], 1),
    "dflash.context_length": (["UINT32"], 4096),
    "dflash.embedding_length": (["UINT32"], 64),
    "dflash.feed_forward_length": (["UINT32"], 128),
    "dflash.attention.head_count": (["UINT32"], 4),
    "dflash.attention.head_count_kv": (["UINT32"], 2),
    "dflash.attention.key_length": (["UINT32"], 16),
    "dflash.attention.value_length": (["UINT32"], 16),
    "dflash.rope.freq_base": (["FLOAT32"], 1.0e6),
    "dflash.block_size": (["UINT32"], 4),
    "dflash.target_layers": (["ARRAY", "INT32"], [1, 2]),
    "dflash.sample_from_anchor": (["BOOL"], True),
    "dflash.has_confidence_head": (["BOOL"], True),
    "tokenizer.ggml.model": (["STRING"], "no_vocab"),
    "dflash.vocab_size": (["UINT32"], 256),
    "tokenizer.ggml.mask_token_id": (["UINT32"], 255),
}


def _expected_tensors(n_layer=1, h=64, rank=8, vocab=256):
    shapes = {"fc.weight": ((h, 2 * h), "BF16"), "enc.output_norm.weight": ((h,), "F32"),
              "output_norm.weight": ((h,), "F32"), "markov_w1.weight": ((vocab, rank), "BF16"),
              "markov_w2.weight": ((vocab, rank), "BF16"), "conf_proj.weight": ((1, h + rank), "BF16"),
              "conf_proj.bias": ((1,), "F32")}
    for il in range(n_layer):
        p = f"blk.{il}."
        shapes.update({p + "attn_norm.weight": ((h,), "F32"), p + "ffn_norm.weight": ((h,), "F32"),
                       p + "attn_q_norm.weight": ((16,), "F32"), p + "attn_k_norm.weight": ((16,), "F32"),
                       p + "attn_q.weight": ((64, h), "BF16"), p + "attn_k.weight": ((32, h), "BF16"),
                       p + "attn_v.weight": ((32, h), "BF16"), p + "attn_output.weight": ((h, 64), "BF16"),
                       p + "ffn_gate.weight": ((128, h), "BF16"), p + "ffn_up.weight": ((128, h), "BF16"),
                       p + "ffn_down.weight": ((h, 128), "BF16")})
    return shapes


def test_round_trip_keys_tensors_and_values(ckpt, target, tmp_path):
    folder = ckpt()
    result = convert(folder, tmp_path / "d.gguf", target_gguf=target)
    kvs, tensors = read_gguf(result.path)
    assert kvs.pop("general.name") == (["STRING"], "ck")
    eps_type, eps = kvs.pop("dflash.attention.layer_norm_rms_epsilon")
    assert eps_type == ["FLOAT32"] and eps == pytest.approx(1e-6)
    assert kvs == EXPECTED_KEYS
    assert {n: t[:2] for n, t in tensors.items()} == _expected_tensors()
    source = checkpoint_values(folder)
    for gguf_name, hf_name in [("fc.weight", "model.fc.weight"), ("enc.output_norm.weight", "model.hidden_norm.weight"),
                               ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
                               ("blk.0.ffn_norm.weight", "model.layers.0.post_attention_layernorm.weight"),
                               ("markov_w2.weight", "model.markov_head.markov_w2.weight"),
                               ("conf_proj.bias", "model.confidence_head.proj.bias")]:
        np.testing.assert_array_equal(tensors[gguf_name][2], source[hf_name], err_msg=gguf_name)
    assert [t[0] for t in result.tensors] == list(tensors)
    assert result.omitted == {"token_embd.weight", "output.weight"}


# Written here from the DSpark/DFlash module layout and llama.cpp's dflash tensor names, not read
# from pyllama_dspark.convert, so a swapped entry in the converter's own table fails this test.
HF_TO_GGUF_GLOBAL = {
    "model.fc.weight": "fc.weight",
    "model.hidden_norm.weight": "enc.output_norm.weight",
    "model.norm.weight": "output_norm.weight",
    "model.markov_head.markov_w1.weight": "markov_w1.weight",
    "model.markov_head.markov_w2.weight": "markov_w2.weight",
    "model.confidence_head.proj.weight": "conf_proj.weight",
    "model.confidence_head.proj.bias": "conf_proj.bias",
    "model.embed_tokens.weight": "token_embd.weight",
    "lm_head.weight": "output.weight",
}
HF_TO_GGUF_LAYER = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}


def _independent_gguf_name(hf_name: str) -> str:
    if hf_name in HF_TO_GGUF_GLOBAL:
        return HF_TO_GGUF_GLOBAL[hf_name]
    _, _, il, rest = hf_name.split(".", 3)  # model.layers.<il>.<rest>
    return f"blk.{il}.{HF_TO_GGUF_LAYER[rest]}"


@pytest.mark.parametrize("outtype", ["f32", "bf16"])
def test_every_tensor_matches_its_hf_source_by_an_independent_name_table(ckpt, target, tmp_path, outtype):
    folder = ckpt(n_layer=2)
    source = checkpoint_values(folder)
    assert len(source) == len(HF_TO_GGUF_GLOBAL) + 2 * len(HF_TO_GGUF_LAYER)
    result = convert(folder, tmp_path / "d.gguf", outtype=outtype, target_gguf=target, keep_shared_tensors=True)
    _, tensors = read_gguf(result.path)
    expected = {_independent_gguf_name(hf): values for hf, values in source.items()}
    assert sorted(tensors) == sorted(expected)
    for name, values in expected.items():
        shape, _, data = tensors[name]
        assert shape == values.shape, name
        # the checkpoint is bf16, so f32 and bf16 outputs both hold its values exactly
        np.testing.assert_array_equal(data, values, err_msg=f"{name} does not hold the values of its HF tensor")
    # no two tensors of the same shape may share values: a swap of equals would go unseen
    by_shape: dict = {}
    for name, values in expected.items():
        by_shape.setdefault(values.shape, []).append((name, values))
    for group in by_shape.values():
        for i, (a, va) in enumerate(group):
            for b, vb in group[i + 1:]:
                assert not np.array_equal(va, vb), f"the fixture gives {a} and {b} equal values"


@pytest.mark.parametrize("style", kit.DSPARK_CONFIG_STYLES)
def test_config_styles_give_the_same_taps(ckpt, target, tmp_path, style):
    kvs, tensors = read_gguf(convert(ckpt(config_style=style), tmp_path / "d.gguf", target_gguf=target).path)
    assert kvs["dflash.target_layers"] == (["ARRAY", "INT32"], [1, 2])  # HF ids 0, 1 + 1
    assert kvs["tokenizer.ggml.mask_token_id"][1] == 255 and kvs["dflash.block_size"][1] == 4
    # EAGLE-3-style (aux) exports use a bonus anchor slot, the others sample from the anchor
    assert kvs["dflash.sample_from_anchor"][1] is (style != "aux")
    assert "markov_w1.weight" in tensors


def test_explicit_taps_and_block_size(ckpt, make_model, tmp_path):
    spec = TinySpec(arch="qwen3", n_layer=6)
    folder = ckpt(target=spec, target_layer_ids=(0, 2, 4), block_size=7)
    kvs, tensors = read_gguf(convert(folder, tmp_path / "d.gguf", target_gguf=make_model(arch="qwen3", n_layer=6)).path)
    assert kvs["dflash.target_layers"][1] == [1, 3, 5] and kvs["dflash.block_size"][1] == 7
    assert tensors["fc.weight"][0] == (64, 3 * 64)


@pytest.mark.parametrize("dtype, outtype, matrix_type", [
    ("f32", "f32", "F32"), ("bf16", "f32", "F32"), ("f16", "f16", "F16"), ("bf16", "auto", "BF16"),
    ("f32", "auto", "F16"), ("bf16", "bf16", "BF16"), ("bf16", "q8_0", "Q8_0"),
])
def test_input_and_output_types(ckpt, target, tmp_path, dtype, outtype, matrix_type):
    folder = ckpt(dtype=dtype)
    kvs, tensors = read_gguf(convert(folder, tmp_path / "d.gguf", outtype=outtype, target_gguf=target).path)
    assert tensors["fc.weight"][1] == matrix_type and tensors["blk.0.attn_norm.weight"][1] == "F32"
    # rank-8 rows do not split into Q8_0 blocks of 32: upstream falls back to F16
    assert tensors["markov_w1.weight"][1] == ("F16" if matrix_type == "Q8_0" else matrix_type)
    assert kvs["general.file_type"][1] == {"F32": 0, "F16": 1, "Q8_0": 7, "BF16": 32}[matrix_type]
    source = checkpoint_values(folder)["model.layers.0.mlp.down_proj.weight"]
    got = tensors["blk.0.ffn_down.weight"][2]
    if matrix_type in ("F32", "BF16") or dtype == "f16":
        np.testing.assert_array_equal(got, source)  # lossless for these pairs
    else:
        np.testing.assert_allclose(got, source, atol=0.02 * np.abs(source).max())


def test_sharded_checkpoint_converts_like_a_single_file(ckpt, target, tmp_path):
    one = read_gguf(convert(ckpt("one"), tmp_path / "one.gguf", target_gguf=target).path)
    two_folder = ckpt("two", shards=2)
    assert (two_folder / "model.safetensors.index.json").is_file()
    assert len(list(two_folder.glob("model-*-of-00002.safetensors"))) == 2
    two = read_gguf(convert(two_folder, tmp_path / "two.gguf", target_gguf=target).path)
    assert {k: v for k, v in one[0].items() if k != "general.name"} == \
        {k: v for k, v in two[0].items() if k != "general.name"}
    assert one[1].keys() == two[1].keys()
    for name in one[1]:
        np.testing.assert_array_equal(one[1][name][2], two[1][name][2], err_msg=name)


@pytest.mark.parametrize("prefix", ["", "drafter."])
def test_tensor_name_prefixes(ckpt, target, tmp_path, prefix):
    ref = read_gguf(convert(ckpt("ref"), tmp_path / "ref.gguf", target_gguf=target).path)[1]
    got = read_gguf(convert(ckpt("p", prefix=prefix), tmp_path / "p.gguf", target_gguf=target).path)[1]
    assert got.keys() == ref.keys()
    for name in ref:
        np.testing.assert_array_equal(got[name][2], ref[name][2], err_msg=name)


def test_markov_rank_zero_without_confidence_head(ckpt, target, tmp_path):
    folder = ckpt(markov_rank=0, confidence_head=False)
    kvs, tensors = read_gguf(convert(folder, tmp_path / "d.gguf", target_gguf=target).path)
    assert not any(n.startswith(("markov_", "conf_proj")) for n in tensors)
    assert kvs["dflash.has_confidence_head"][1] is False


def test_reduced_draft_vocabulary_writes_d2t_and_its_own_head(ckpt, target, tmp_path):
    folder = ckpt(draft_vocab_size=100)
    result = convert(folder, tmp_path / "d.gguf", target_gguf=target)
    kvs, tensors = read_gguf(result.path)
    offsets = checkpoint_values(folder)["d2t"]
    assert tensors["d2t"][1] == "I64"
    np.testing.assert_array_equal(tensors["d2t"][2], offsets + np.arange(100))  # absolute target ids
    assert tensors["output.weight"][0] == (100, 64) and tensors["markov_w2.weight"][0] == (100, 8)
    assert tensors["markov_w1.weight"][0] == (256, 8)
    assert "token_embd.weight" not in tensors and "t2d" not in tensors
    assert result.omitted == {"token_embd.weight"}


# --------------------------------------------------------------------------
# shared tensors: token_embd / output


def test_keep_shared_tensors_keeps_copies_of_the_target(ckpt, target, tmp_path):
    result = convert(ckpt(dtype="f32"), tmp_path / "d.gguf", outtype="f32", target_gguf=target,
                     keep_shared_tensors=True)
    tensors = read_gguf(result.path)[1]
    weights = kit.load_tiny_weights(target)
    np.testing.assert_array_equal(tensors["token_embd.weight"][2], weights["token_embd.weight"])
    np.testing.assert_array_equal(tensors["output.weight"][2], weights["output.weight"])
    assert not result.omitted and any("--keep-shared-tensors" in n for n in result.notes)


def test_without_a_target_shared_tensors_are_kept_and_vocab_is_none(ckpt, tmp_path):
    result = convert(ckpt(), tmp_path / "d.gguf")
    kvs, tensors = read_gguf(result.path)
    assert {"token_embd.weight", "output.weight"} <= tensors.keys()
    assert kvs["tokenizer.ggml.model"][1] == "no_vocab" and kvs["dflash.vocab_size"][1] == 256
    assert any("no target" in n for n in result.notes)


def test_checkpoint_without_shared_tensors(ckpt, target, tmp_path):
    result = convert(ckpt(with_shared_embeddings=False), tmp_path / "d.gguf", target_gguf=target)
    tensors = read_gguf(result.path)[1]
    assert "token_embd.weight" not in tensors and "output.weight" not in tensors
    assert any("borrows the target's" in n for n in result.notes)


def test_tied_target_head_is_recognised(ckpt, make_model, tmp_path):
    spec = TinySpec(**TARGET, tie_embeddings=True)
    result = convert(ckpt(target=spec), tmp_path / "d.gguf", target_gguf=make_model(**TARGET, tie_embeddings=True))
    assert result.omitted == {"token_embd.weight", "output.weight"}


def test_quantized_target_still_counts_as_equal(ckpt, target, tmp_path):
    # a Q8_0 copy of the target: its shared tensors only approximate the checkpoint's
    reader = gguf.GGUFReader(target)
    writer = gguf.GGUFWriter(tmp_path / "t8.gguf", "qwen3")
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            sub_type = field.types[-1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    for t in reader.tensors:
        data = np.asarray(t.data)
        if t.name in ("token_embd.weight", "output.weight"):
            writer.add_tensor(t.name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert convert(ckpt(), tmp_path / "d.gguf", target_gguf=tmp_path / "t8.gguf").omitted == \
        {"token_embd.weight", "output.weight"}


def test_a_different_head_is_kept(ckpt, target, tmp_path):
    folder = ckpt(dtype="f32")
    rewrite_tensors(folder, lambda v: v.__setitem__("lm_head.weight", v["lm_head.weight"][::-1].copy()))
    result = convert(folder, tmp_path / "d.gguf", target_gguf=target)
    assert result.omitted == {"token_embd.weight"}
    assert "output.weight" in read_gguf(result.path)[1]


def test_own_embedding_without_head_is_refused_for_an_untied_target(ckpt, target, tmp_path):
    folder = ckpt(dtype="f32")

    def edit(v):
        v["model.embed_tokens.weight"] = v["model.embed_tokens.weight"][::-1].copy()
        del v["lm_head.weight"]

    rewrite_tensors(folder, edit)
    with pytest.raises(errors.UnsupportedModelError, match="LM head"):
        convert(folder, tmp_path / "d.gguf", target_gguf=target)
    assert leftovers(tmp_path) == []


def test_target_model_dir(ckpt, target, tmp_path):
    weights = kit.load_tiny_weights(target)
    hf = tmp_path / "hf-target"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64,
                                                "num_hidden_layers": 3, "vocab_size": 256}))
    write_safetensors(hf / "model.safetensors", {"model.embed_tokens.weight": weights["token_embd.weight"],
                                                 "lm_head.weight": weights["output.weight"]}, bf16=True)
    result = convert(ckpt(), tmp_path / "d.gguf", target_model_dir=hf)
    assert result.omitted == {"token_embd.weight", "output.weight"}
    (hf / "model.safetensors").unlink()  # a config-only folder: sizes are checked, nothing can be compared
    assert convert(ckpt(), tmp_path / "f.gguf", target_model_dir=hf).omitted == frozenset()
    edit_config(hf, num_hidden_layers=2)  # HF tap 1 is now the last layer
    with pytest.raises(errors.TargetMismatchError, match="last layer"):
        convert(ckpt(), tmp_path / "e.gguf", target_model_dir=hf)


# --------------------------------------------------------------------------
# refusals: each raises before writing and leaves nothing behind


def _drop(name):
    return lambda v: v.pop(name)


def _reshape_fc(v):
    v["model.fc.weight"] = v["model.fc.weight"][:, :64].copy()


def _integer_norm(v):
    v["model.norm.weight"] = np.ones(64, np.int32)


def _add_unknown(v):
    v["model.layers.0.self_attn.rotary_scale"] = np.ones(4, np.float32)


def _t2d_flip(v):
    """t2d marks one id d2t does not map, and drops one it does."""
    t2d = v["t2d"].copy()
    kept = np.flatnonzero(t2d)
    t2d[kept[0]] = False
    t2d[np.flatnonzero(~t2d)[-1]] = True
    v["t2d"] = t2d


def _d2t_repeat(v):
    """draft rows 0 and 1 both map to the first row's target id (offsets are target id - draft row)."""
    d2t = v["d2t"].copy()
    d2t[1] = d2t[0] - 1
    v["d2t"] = d2t


def _d2t_to_mask(v):
    """the last draft row maps to target id 255, the checkpoint's mask token."""
    d2t = v["d2t"].copy()
    d2t[-1] = 255 - (len(d2t) - 1)
    v["d2t"] = d2t
    t2d = np.zeros(256, np.bool_)
    t2d[d2t + np.arange(len(d2t))] = True
    v["t2d"] = t2d


CHECKPOINT_ERRORS = [
    ("unknown architecture", {}, lambda f: edit_config(f, architectures=["LlamaForCausalLM"]),
     errors.UnsupportedModelError, "architecture 'LlamaForCausalLM'"),
    ("markov head type", {}, lambda f: edit_config(f, markov_head_type="gated"),
     errors.UnsupportedModelError, "markov_head_type 'gated'"),
    ("missing layer tensor", {}, lambda f: rewrite_tensors(f, _drop("model.layers.0.mlp.up_proj.weight")),
     errors.MissingTensorError, r"layers\.0\.mlp\.up_proj\.weight \(blk\.0\.ffn_up\.weight, shape \[128, 64\]\)"),
    ("missing markov head", {}, lambda f: rewrite_tensors(f, _drop("model.markov_head.markov_w2.weight")),
     errors.MissingTensorError, "markov_w2"),
    ("mis-shaped fc", {}, lambda f: rewrite_tensors(f, _reshape_fc),
     errors.TensorShapeError, r"expected shape \[64, 128\], got \[64, 64\]"),
    ("unmapped tensor", {}, lambda f: rewrite_tensors(f, _add_unknown),
     errors.UnexpectedTensorError, "rotary_scale"),
    ("confidence head on h alone", {"confidence_with_markov": False}, None,
     errors.UnsupportedModelError, "confidence_head_with_markov"),
    ("confidence head without markov", {"markov_rank": 0}, None,
     errors.UnsupportedModelError, "markov_rank=0"),
    ("reduced vocab without d2t", {"draft_vocab_size": 100}, lambda f: rewrite_tensors(f, _drop("d2t")),
     errors.MissingTensorError, r"d2t \(d2t, shape \[100\]\)"),
    ("t2d disagrees with d2t", {"draft_vocab_size": 100}, lambda f: rewrite_tensors(f, _t2d_flip),
     errors.CheckpointError, r"t2d and d2t disagree on the draft vocabulary: t2d marks 100 target ids, d2t maps 100"),
    ("t2d without d2t", {}, lambda f: rewrite_tensors(f, lambda v: v.update(t2d=np.ones(256, np.bool_))),
     errors.CheckpointError, "has 't2d' \\(t2d\\) but no d2t table"),
    ("t2d of the wrong length", {"draft_vocab_size": 100},
     lambda f: rewrite_tensors(f, lambda v: v.update(t2d=v["t2d"][:200].copy())),
     errors.TensorShapeError, r"\(t2d\): expected shape \[256\]"),
    ("d2t repeats a target id", {"draft_vocab_size": 100}, lambda f: rewrite_tensors(f, _d2t_repeat),
     errors.CheckpointError, "d2t maps two draft tokens to the same target id"),
    ("d2t maps to the mask token", {"draft_vocab_size": 100}, lambda f: rewrite_tensors(f, _d2t_to_mask),
     errors.CheckpointError, "d2t maps a draft token to the mask token 255"),
    ("d2t beyond the vocab", {"draft_vocab_size": 100},
     lambda f: rewrite_tensors(f, lambda v: v.update(d2t=v["d2t"] + 300)),
     errors.CheckpointError, r"d2t maps to target ids outside \[0, 256\)"),
    ("draft_vocab_size disagrees with d2t", {"draft_vocab_size": 100}, lambda f: edit_config(f, draft_vocab_size=90),
     errors.TensorShapeError, r"expected shape \[90[^\]]*\], got \[100"),
    ("mask id outside the vocab", {}, lambda f: edit_config(f, mask_token_id=256),
     errors.InvalidConfigError, r"mask_token_id 256 is outside the vocabulary \[0, 256\)"),
    ("no taps", {}, lambda f: edit_config(f, target_layer_ids=[]),
     errors.InvalidConfigError, "target_layer_ids must be a non-empty list"),
    ("integer weight", {}, lambda f: rewrite_tensors(f, _integer_norm),
     errors.CheckpointError, "'model.norm.weight' holds I32 values, expected floating point"),
    ("no config", {}, lambda f: (f / "config.json").unlink(),
     errors.CheckpointError, "no config.json"),
    ("truncated safetensors", {}, lambda f: (f / "model.safetensors").write_bytes(b"\x10\x00"),
     errors.CheckpointError, "too short"),
]


@pytest.mark.parametrize("case, kw, mutate, exc, match", CHECKPOINT_ERRORS, ids=[c[0] for c in CHECKPOINT_ERRORS])
def test_bad_checkpoint_is_refused(ckpt, target, tmp_path, case, kw, mutate, exc, match):
    folder = ckpt(dtype="f32", **kw)
    if mutate:
        mutate(folder)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(exc, match=match):
        convert(folder, out / "d.gguf", target_gguf=target)
    assert leftovers(out) == []


TARGET_ERRORS = [
    ("hidden width", dict(arch="qwen3", n_layer=3, n_embd=32, n_head=2, n_head_kv=2), {},
     "hidden width 32, but the drafter's fc expects 2 taps x hidden_size 64"),
    ("vocabulary", dict(arch="qwen3", n_layer=3, n_vocab=128), {},
     "vocabulary of 128 tokens, drafter vocab_size is 256"),
    ("tap beyond the layers", dict(arch="qwen3", n_layer=3), {"target_layer_ids": (0, 5)}, "layer 5 does not exist"),
    ("tap on the last layer", dict(arch="qwen3", n_layer=3), {"target_layer_ids": (0, 2)}, "last layer"),
]


@pytest.mark.parametrize("case, target_fields, kw, match", TARGET_ERRORS, ids=[c[0] for c in TARGET_ERRORS])
def test_target_that_does_not_fit_is_refused(ckpt, make_model, tmp_path, case, target_fields, kw, match):
    folder = ckpt(**kw)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(errors.TargetMismatchError, match=match):
        convert(folder, out / "d.gguf", target_gguf=make_model(**target_fields))
    assert leftovers(out) == []


def test_shard_index_disagreeing_with_the_shards_is_refused(ckpt, tmp_path):
    folder = ckpt(shards=2)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.extra.weight"] = "model-00001-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(errors.CheckpointError, match=r"missing tensors \['model.extra.weight'\]"):
        convert(folder, tmp_path / "d.gguf")


def test_bad_outtype_and_output_folder(ckpt, tmp_path):
    with pytest.raises(errors.ConversionError, match="outtype must be one of"):
        convert(ckpt(), tmp_path / "d.gguf", outtype="q4_0")
    with pytest.raises(errors.ConversionError, match="does not exist"):
        convert(ckpt(), tmp_path / "nowhere" / "d.gguf")


def test_failure_while_writing_leaves_no_partial_file(ckpt, target, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "d.gguf").write_bytes(b"previous")
    calls = []
    real = gguf.quants.quantize

    def failing(data, qtype):
        calls.append(qtype)
        if len(calls) == 3:
            raise OSError("disk full")
        return real(data, qtype)

    monkeypatch.setattr(gguf.quants, "quantize", failing)
    with pytest.raises(OSError, match="disk full"):
        convert(ckpt(), out / "d.gguf", target_gguf=target)
    assert leftovers(out) == ["d.gguf"] and (out / "d.gguf").read_bytes() == b"previous"


# --------------------------------------------------------------------------
# hub ids and the command line


def _fake_hub(monkeypatch, result=None, error=None):
    calls = []

    def snapshot_download(repo_id, **kw):
        calls.append((repo_id, kw))
        if error is not None:
            raise error
        return str(result)

    monkeypatch.setitem(sys.modules, "huggingface_hub", types.SimpleNamespace(snapshot_download=snapshot_download))
    return calls


def test_hub_repo_id_goes_through_snapshot_download(ckpt, tmp_path, monkeypatch):
    calls = _fake_hub(monkeypatch, result=ckpt())
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    convert("someone/tiny-dspark", tmp_path / "d.gguf")
    assert calls == [("someone/tiny-dspark", {"allow_patterns": ["*.json", "*.safetensors"], "local_files_only": True})]
    assert read_gguf(tmp_path / "d.gguf")[0]["general.name"][1] == "someone/tiny-dspark"


def test_hub_failures_are_conversion_errors(tmp_path, monkeypatch):
    _fake_hub(monkeypatch, error=FileNotFoundError("not in cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(errors.CheckpointError, match="HF_HUB_OFFLINE is set"):
        convert("someone/missing", tmp_path / "d.gguf")
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # not installed
    with pytest.raises(errors.CheckpointError, match="needs huggingface_hub"):
        convert("someone/missing", tmp_path / "d.gguf")
    with pytest.raises(errors.CheckpointError, match="no such folder"):
        convert(str(tmp_path / "nope" / "deeper"), tmp_path / "d.gguf")
    assert leftovers(tmp_path) == []


def test_cli_convert(ckpt, target, tmp_path, capsys):
    out = tmp_path / "cli.gguf"
    assert cli_main(["convert", str(ckpt()), "--outfile", str(out), "--target-gguf", str(target),
                     "--outtype", "f16"]) == 0
    captured = capsys.readouterr()
    assert f"wrote {out}" in captured.out and "omitted token_embd.weight and output.weight" in captured.err
    assert read_gguf(out)[1]["fc.weight"][1] == "F16"
    assert cli_main(["convert", str(ckpt()), "-o", str(tmp_path / "k.gguf"), "--keep-shared-tensors"]) == 0
    assert "output.weight" in read_gguf(tmp_path / "k.gguf")[1]
    bad = ckpt("bad")
    edit_config(bad, markov_head_type="gated")
    assert cli_main(["convert", str(bad), "--outfile", str(tmp_path / "bad.gguf")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("pyllama-dspark: error: unsupported markov_head_type 'gated'")
    assert not (tmp_path / "bad.gguf").exists()


# --------------------------------------------------------------------------
# peer: the vendored convert_hf_to_gguf.py on the same checkpoint


def _peer_python() -> str:
    python = os.environ.get("PYLLAMA_DSPARK_PEER_PYTHON", sys.executable)
    probe = subprocess.run([python, "-c", "import torch, transformers, sentencepiece"], capture_output=True, text=True)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        pytest.skip(f"the vendored converter needs torch, transformers and sentencepiece in {python} ({last}); "
                    "set PYLLAMA_DSPARK_PEER_PYTHON to an interpreter that has them")
    return python


def _upstream_target_dir(tmp_path) -> Path:
    # upstream's DFlash set_vocab takes the vocabulary from --target-model-dir through that
    # architecture's own set_vocab. OpenELM's falls back to the vendored
    # models/ggml-vocab-llama-spm.gguf when the folder has no tokenizer.model, which is
    # exactly the vocabulary of the kit's llama-spm target: no tokenizer files needed.
    folder = tmp_path / "upstream-target"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["OpenELMForCausalLM"], "model_type": "openelm"}))
    return folder


def _run_upstream(python, folder, out, outtype, target_dir):
    script = VENDOR / "convert_hf_to_gguf.py"
    env = {**os.environ, "PYTHONPATH": str(VENDOR / "gguf-py")}
    proc = subprocess.run([python, str(script), str(folder), "--outfile", str(out), "--outtype", outtype,
                           "--target-model-dir", str(target_dir)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


# general.name/size_label/basename come from upstream's model-card heuristics
_HEURISTIC_KEYS = ("general.name", "general.size_label", "general.basename", "general.finetune", "general.version")

PEER_CASES = {
    "top-f32": (dict(), "f32"),
    "nested-sharded-bf16": (dict(config_style="nested", shards=2), "bf16"),
    "aux-f32in-q8_0": (dict(config_style="aux", dtype="f32"), "q8_0"),
    "reduced-vocab-no-conf": (dict(draft_vocab_size=1000, confidence_head=False), "f16"),
}


@pytest.mark.slow
@pytest.mark.peer
@pytest.mark.parametrize("case", PEER_CASES)
def test_same_content_as_the_vendored_converter(ckpt, make_model, tmp_path, case):
    if not (VENDOR / "convert_hf_to_gguf.py").is_file():
        pytest.skip("vendor/llama.cpp/convert_hf_to_gguf.py not in this tree")
    python = _peer_python()
    kw, outtype = PEER_CASES[case]
    spec = TinySpec(arch="llama", vocab="llama-spm", n_layer=3)
    folder = ckpt(target=spec, **kw)
    theirs = tmp_path / "upstream.gguf"
    _run_upstream(python, folder, theirs, outtype, _upstream_target_dir(tmp_path))
    ours = convert(folder, tmp_path / "ours.gguf", outtype=outtype, keep_shared_tensors=True,
                   target_gguf=make_model(arch="llama", vocab="llama-spm", n_layer=3)).path
    (our_kvs, our_tensors), (their_kvs, their_tensors) = read_gguf(ours), read_gguf(theirs)
    for kvs in (our_kvs, their_kvs):
        for key in _HEURISTIC_KEYS:
            kvs.pop(key, None)
    assert our_kvs.keys() == their_kvs.keys()
    for key in our_kvs:
        assert our_kvs[key] == their_kvs[key], key  # types and values, tokenizer arrays included
    # upstream drops lm_head of every full-vocabulary drafter; we keep it (see convert/shared.py)
    dropped = set() if "draft_vocab_size" in kw else {"output.weight"}
    assert our_tensors.keys() - their_tensors.keys() == dropped and their_tensors.keys() <= our_tensors.keys()
    for name, (shape, qtype, data) in their_tensors.items():
        assert our_tensors[name][:2] == (shape, qtype), name
        np.testing.assert_array_equal(our_tensors[name][2], data, err_msg=name)


# --------------------------------------------------------------------------
# the native loader


def test_converted_drafter_loads_in_the_vendored_llama_cpp(ckpt, target, tmp_path):
    try:
        from pyllama_dspark import Context, ContextInitError, Model
    except ImportError as exc:  # the native library may be mid-rebuild
        pytest.skip(f"pyllama_dspark's native library does not import: {exc}")
    borrowed = convert(ckpt(), tmp_path / "borrowed.gguf", target_gguf=target).path
    standalone = convert(ckpt(), tmp_path / "standalone.gguf", target_gguf=target, keep_shared_tensors=True).path
    with Model(target) as target_model, Model(borrowed) as drafter, Model(standalone) as own:
        assert drafter.arch == "dflash" and drafter.n_embd == 64 and drafter.n_vocab == 256
        target_ctx = Context(target_model, n_ctx=64)
        Context(drafter, n_ctx=64, ctx_other=target_ctx)
        # without token_embd/output the drafter must borrow the target's
        with pytest.raises(ContextInitError):
            Context(drafter, n_ctx=64)
        Context(own, n_ctx=64)
