"""quantize(): every documented type gives weight matrices of that type, f32 norms, a model that loads,
and logits near the f32 model's; bad input leaves nothing behind."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from pyllama_dspark import Batch, Context, Model
from pyllama_dspark.errors import LlamaError
from pyllama_dspark.model import quantize

PROMPT = [1, 17, 42, 99, 3, 250, 7, 11, 12, 13]
# max relative logit error against the f32 model: 2-3x what this tiny model measured (f16 1.2e-3, bf16 8.9e-3,
# q8_0 2.3e-2, q5_0 0.12, q4_0 0.22, q4_1 0.29); weights that lost their meaning (scrambled blocks, wrong scales)
# give ~1 or more
TOLERANCE = {"f32": 0.0, "f16": 4e-3, "bf16": 2.5e-2, "q8_0": 6e-2, "q5_0": 0.3, "q4_0": 0.6, "q4_1": 0.6}


def last_logits(path) -> np.ndarray:
    with Model(path) as model:
        ctx = Context(model, n_ctx=64)
        batch = Batch(len(PROMPT))
        batch.add_tokens(PROMPT, 0, logits="last")
        ctx.decode(batch)
        return ctx.logits(-1).copy()


@pytest.mark.parametrize("qtype", list(TOLERANCE))
def test_weights_take_the_type_and_logits_stay_near_f32(make_model, tmp_path, qtype):
    src = make_model(arch="qwen3", n_layer=2, n_embd=64)
    out = quantize(src, tmp_path / f"m-{qtype}.gguf", qtype)
    types = {t.name: (t.tensor_type.name, len(t.shape)) for t in gguf.GGUFReader(out).tensors}
    matrices = {name: ttype for name, (ttype, ndim) in types.items() if ndim == 2}
    # like llama-quantize, 4- and 5-bit types keep the output head at 8 bits (its K-quant choice needs
    # rows of 256; these are 64 wide)
    head = matrices.pop("output.weight")
    assert head == ("Q8_0" if qtype.startswith(("q4", "q5")) else qtype.upper())
    assert set(matrices.values()) == {qtype.upper()}, matrices
    assert {ttype for name, (ttype, ndim) in types.items() if ndim == 1} == {"F32"}, "norms stay f32"
    reference, logits = last_logits(src), last_logits(out)
    err = float(np.abs(logits - reference).max() / np.abs(reference).max())
    assert err <= TOLERANCE[qtype], f"{qtype}: max relative logit error {err:.2e}"
    if qtype != "f32":
        assert err > 0, "the weights did change type, so the logits must move a little"


def test_bad_input_raises_and_leaves_nothing(make_model, tmp_path):
    src = make_model(arch="qwen3", n_layer=2)
    with pytest.raises(ValueError, match="qtype must be one of"):
        quantize(src, tmp_path / "x.gguf", "q5_k")
    with pytest.raises(FileNotFoundError):
        quantize(tmp_path / "missing.gguf", tmp_path / "y.gguf", "f16")
    not_gguf = tmp_path / "not.gguf"
    not_gguf.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(LlamaError):
        quantize(not_gguf, tmp_path / "z.gguf", "f16")
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "y.gguf").exists()
    assert not (tmp_path / "z.gguf").exists()


def test_q4_k_m_mixes_q4_k_and_q6_k_and_stays_near_f32(make_model, tmp_path):
    """The K-quant llama-quantize users pick most (rows of 256: the tiny model is made that wide)."""
    src = make_model(arch="qwen3", n_layer=2, n_embd=256, n_ff=512)
    out = quantize(src, tmp_path / "m-q4_k_m.gguf", "q4_k_m")
    matrices = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors if len(t.shape) == 2}
    assert set(matrices.values()) <= {"Q4_K", "Q6_K"}, matrices
    assert "Q4_K" in matrices.values() and matrices["output.weight"] == "Q6_K", matrices
    reference, logits = last_logits(src), last_logits(out)
    err = float(np.abs(logits - reference).max() / np.abs(reference).max())
    assert 0 < err <= 0.6, f"q4_k_m: max relative logit error {err:.2e}"


def test_requantizing_needs_allow_requantize_and_then_keeps_the_values(quantized, tmp_path):
    """An already-quantized src (the shipped SmolLM2 is q4_1) is refused unless asked; with allow_requantize
    an f32 copy of a q4_1 model holds its dequantized weights (gguf-py's dequantization as the reference)."""
    src = quantized("qwen3", "q4_1")
    with pytest.raises(LlamaError, match="q8_0 failed"):
        quantize(src, tmp_path / "r.gguf", "q8_0")
    assert not (tmp_path / "r.gguf").exists()
    out = quantize(src, tmp_path / "r-f32.gguf", "f32", allow_requantize=True)
    copies = {t.name: t for t in gguf.GGUFReader(out).tensors}
    assert {t.tensor_type.name for t in copies.values()} == {"F32"}
    for tensor in gguf.GGUFReader(src).tensors:
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(-1)
        np.testing.assert_allclose(np.asarray(copies[tensor.name].data).reshape(-1), expected, rtol=1e-6,
                                   atol=1e-7, err_msg=tensor.name)
