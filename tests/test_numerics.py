"""Patches 0005/0012: a small-batch decode is bit-identical to token-by-token decoding (the ground of exact
greedy speculative decoding), for f32 and quantized weights on every target; outside small batches the mode
computes exactly what the fast paths compute (it costs nothing there)."""

from __future__ import annotations

import numpy as np
import pytest

import token_scan
from conftest import ARCHS
from pyllama_dspark import Batch, Context, ContextInitError, Model, UnsupportedModeError
from pyllama_dspark.model import quantize

TOKENS = [1, 17, 42, 99, 3, 250, 7] + list(range(30, 87))  # 64


def single_rows(model, tokens=TOKENS, **kw):
    with Context(model, n_ctx=256, n_batch=16, **kw) as ctx:
        return token_scan.single_rows(ctx, tokens)


def batched_rows(model, n, **kw):
    with Context(model, n_ctx=256, n_batch=64, **kw) as ctx:
        return token_scan.batched_rows(ctx, TOKENS, n)


@pytest.mark.parametrize("qtype", ["f32", "f16", "q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("arch", ARCHS)
def test_batched_rows_are_bit_identical_to_single_tokens(quantized, arch, qtype):
    with Model(quantized(arch, qtype)) as model:
        single = single_rows(model)
        for n in (2, 5, 8, 16, 37, 64):
            np.testing.assert_array_equal(batched_rows(model, n), single, err_msg=f"{arch} {qtype} batch {n}")


@pytest.mark.parametrize("arch", ARCHS)
def test_rows_are_bit_identical_with_a_q8_0_kv_cache(make_model, arch):
    """A quantized KV cache adds the attention-rotation (Hadamard) matmul, whose batch has n_tokens x n_head
    columns; the mode keeps one path for it at every width. (Heads of 32: q8_0 blocks must divide them.)"""
    with Model(make_model(arch=arch, n_layer=2, n_embd=128)) as model:
        single = single_rows(model, kv_type="q8_0")
        for n in (3, 8, 16):
            np.testing.assert_array_equal(batched_rows(model, n, kv_type="q8_0"), single, err_msg=f"{arch} {n}")


def test_a_q8_0_kv_cache_without_flash_attention_is_refused_with_llama_cpps_reason(make_model):
    with Model(make_model(arch="llama", n_layer=2, n_embd=128)) as model:
        with pytest.raises(ContextInitError, match="quantized V cache requires flash_attn"):
            Context(model, n_ctx=64, kv_type="q8_0", flash_attn=False)


@pytest.mark.parametrize("flash_attn", [True, False])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_verify_rows_after_removed_tails_match_across_the_256_cell_boundary(quantized, arch, flash_attn):
    """The speculative pattern: a batch of k+1 rows, then seq_rm of the rejected tail, again and again, while
    the cache grows past 256 cells (the attended window then differs between a batch and a single token).
    Every verified row equals the token-by-token decode of the same committed sequence."""
    tokens = (np.arange(330) * 37 % 241 + 5).tolist()
    n_prompt = 230
    with Model(quantized(arch, "q4_1")) as model:
        plain = Context(model, n_ctx=512, n_batch=256, flash_attn=flash_attn)
        spec = Context(model, n_ctx=512, n_batch=256, flash_attn=flash_attn)
        batch = Batch(256)
        for ctx in (plain, spec):  # the same prompt batch in both, so both caches start equal
            batch.clear()
            batch.add_tokens(tokens[:n_prompt], 0, logits="last")
            ctx.decode(batch)
        expected = {}
        for pos in range(n_prompt, len(tokens)):
            batch.clear()
            batch.add(tokens[pos], pos, logits=True)
            plain.decode(batch)
            expected[pos] = plain.logits(-1).copy()
        rng = np.random.default_rng(0)
        pos, checked = n_prompt, 0
        while pos < len(tokens) - 8:
            width = int(rng.integers(2, 9))
            batch.clear()
            batch.add_tokens(tokens[pos:pos + width], pos, logits="all")
            spec.decode(batch)
            rows = spec.all_logits()
            for i in range(width):
                np.testing.assert_array_equal(rows[i], expected[pos + i], err_msg=f"{arch} fa={flash_attn} "
                                              f"position {pos + i} (batch of {width} at {pos})")
            keep = int(rng.integers(1, width + 1))  # accepted drafts + the anchor
            spec.seq_rm(0, pos + keep, -1)
            pos, checked = pos + keep, checked + width
    assert pos > 256 + 8 and checked > 100


def test_without_the_mode_batched_rows_differ(quantized):
    """Why the mode exists: upstream's kernels give other last bits for a batch than for one token."""
    with Model(quantized("llama", "f32")) as model:
        single = single_rows(model, consistent_numerics=False)
        batched = batched_rows(model, 8, consistent_numerics=False)
    assert np.abs(batched - single).max() > 0


@pytest.mark.parametrize("width", [3, 8])
@pytest.mark.parametrize("qtype", ["q4_1", "f16"])
def test_q4_1_and_f16_batches_use_the_multi_column_kernels_and_single_tokens_do_not(quantized, qtype, width):
    """Patches 0008/0015/0016: a small batch of q4_1 or f16 weights goes through the multi-column dot kernels
    (the rows are still bit-identical to single tokens, see above); a one-token decode keeps the one-column
    kernel. The f16 kernel is built on every SIMD architecture, the q4_1 one on x86-64 AVX2."""
    from pyllama_dspark._lib import lib

    if qtype == "q4_1" and not _x2_built():
        pytest.skip("the quantized multi-column kernels are built for AVX2 on x86-64 only")
    with Model(quantized("llama", qtype)) as model:
        ctx = Context(model, n_ctx=256, n_batch=16)
        single, batch = _decode_deltas(ctx, lib.ggml_cpu_dspark_x2_chunks, width)
    assert single == 0, "a single-token decode used the multi-column kernels"
    assert batch > 0, f"a {width}-token decode did not use the multi-column kernels"


@pytest.mark.parametrize("qtype,width,kernel", [("q8_0", 3, "multi-column"), ("q8_0", 20, "tinyBLAS"),
                                                ("q4_0", 3, "multi-column"), ("q4_0", 20, "tinyBLAS")])
def test_small_q8_0_and_q4_0_batches_take_the_faster_of_two_equal_kernels(quantized, qtype, width, kernel):
    """Patches 0014/0015: on x86 AVX2, tinyBLAS computes q8_0/q4_0 elements exactly as vec_dot, so the mode lets
    it take batches of 17-64 columns (bit-identity: test_batched_rows_are_bit_identical_to_single_tokens); 2-16
    columns go to the multi-column vec_dot kernels, which are faster there. One token keeps vec_dot; without
    the mode tinyBLAS is not counted."""
    from pyllama_dspark._lib import lib

    if not _x2_built():
        pytest.skip("claimed for x86-64 AVX2 only")
    counter = {"multi-column": lib.ggml_cpu_dspark_x2_chunks,
               "tinyBLAS": lib.ggml_cpu_dspark_consistent_sgemm_matrices}[kernel]
    other = lib.ggml_cpu_dspark_consistent_sgemm_matrices if kernel == "multi-column" else None
    with Model(quantized("llama", qtype)) as model:
        before_other = other() if other else 0
        single, batch = _decode_deltas(Context(model, n_ctx=256, n_batch=32), counter, width)
        assert single == 0 and batch > 0, (kernel, single, batch)
        if other:
            assert other() == before_other, f"tinyBLAS took a {qtype} batch of {width}"
        if kernel == "tinyBLAS":
            _, batch_off = _decode_deltas(Context(model, n_ctx=256, n_batch=32, consistent_numerics=False), counter,
                                          width)
            assert batch_off == 0


def _decode_deltas(ctx, counter, width=3):
    """How far counter moves over a one-token decode, then over a decode of width tokens, after a 4-token prompt."""
    batch = Batch(32)
    batch.add_tokens(TOKENS[:4], 0, logits="last")
    ctx.decode(batch)
    before = counter()
    batch.clear()
    batch.add(TOKENS[4], 4, logits=True)
    ctx.decode(batch)
    single = counter() - before
    batch.clear()
    batch.add_tokens(TOKENS[5:5 + width], 5, logits="all")
    ctx.decode(batch)
    return single, counter() - before - single


def _x2_built() -> bool:
    import platform

    with open("/proc/cpuinfo") as fh:
        return platform.machine() in ("x86_64", "AMD64") and " avx2" in fh.read()


LONG = (np.arange(70) * 37 % 251 + 1).tolist()
PROMPT_100 = (np.arange(100) * 53 % 251 + 1).tolist()


@pytest.mark.parametrize("qtype", ["f32", "q8_0"])
def test_the_mode_covers_batches_up_to_64_and_prompt_sized_batches_keep_the_fast_kernels(quantized, qtype):
    """The boundary docs/python-api.md states: rows of a 64-token batch are bit-identical to token-by-token decoding; a
    65-token batch is prompt-sized and goes through the fast (batch-shaped) kernels."""
    with Model(quantized("llama", qtype)) as model:
        ctx = Context(model, n_ctx=256, n_batch=128, n_ubatch=128)
        batch = Batch(128)
        single = []
        for pos, token in enumerate(LONG[:65]):
            batch.clear()
            batch.add(token, pos, logits=True)
            ctx.decode(batch)
            single.append(ctx.logits(-1).copy())
        rows = {}
        for n in (64, 65):
            ctx.clear()
            batch.clear()
            batch.add_tokens(LONG[:n], 0, logits="all")
            ctx.decode(batch)
            rows[n] = ctx.all_logits().copy()
    np.testing.assert_array_equal(rows[64], np.array(single[:64]), err_msg=f"{qtype}: a 64-token batch")
    if qtype == "f32":  # tinyBLAS takes f32 batches and sums in another order (q8_0 may have no faster kernel)
        assert np.abs(rows[65] - np.array(single)).max() > 0, "a 65-token f32 batch did not use the fast kernels"


def _prompt_and_next_rows(model, prompt, following, consistent):
    """Logits of a prompt batch (all rows, one ubatch), then of single tokens after it."""
    ctx = Context(model, n_ctx=256, n_batch=128, n_ubatch=128, consistent_numerics=consistent)
    batch = Batch(128)
    batch.add_tokens(prompt, 0, logits="all")
    ctx.decode(batch)
    rows = [ctx.all_logits().copy()]
    for i, token in enumerate(following):
        batch.clear()
        batch.add(token, len(prompt) + i, logits=True)
        ctx.decode(batch)
        rows.append(ctx.logits(-1)[None].copy())
    return np.concatenate(rows)


@pytest.mark.parametrize("qtype", ["f32", "q4_k_m"])
def test_the_mode_computes_prompts_and_single_tokens_exactly_as_the_fast_paths(make_model, tmp_path, qtype):
    """Patch 0012: outside batches of 2..64 the mode takes the same kernels as no mode (tinyBLAS and the tiled
    K-quant matmul for a 100-token prompt, op fusion everywhere), so the results are equal bit for bit. Under
    patch 0005's use_ref the q4_k_m prompt went through vec_dot and the fused norms were split, and differed.
    A single token's matmuls are the fast path's too; its attention is the mode's own since patch 0024 (the
    shared-KV kernel; tests/test_attention.py), so with patch 0013's per-row path selected it is equal as well."""
    from pyllama_dspark._lib import lib

    src = make_model(arch="llama", n_layer=2, n_embd=256, n_ff=512)
    path = src if qtype == "f32" else quantize(src, tmp_path / f"m-{qtype}.gguf", qtype)
    with Model(path) as model:
        on = _prompt_and_next_rows(model, PROMPT_100, LONG[:6], consistent=True)
        previous = lib.ggml_cpu_dspark_set_shared_attention(False)
        try:
            on_per_row = _prompt_and_next_rows(model, PROMPT_100, LONG[:6], consistent=True)
        finally:
            lib.ggml_cpu_dspark_set_shared_attention(previous)
        off = _prompt_and_next_rows(model, PROMPT_100, LONG[:6], consistent=False)
        one_by_one = single_rows(model, tokens=PROMPT_100)
    np.testing.assert_array_equal(on[:100], off[:100])
    np.testing.assert_array_equal(on_per_row, off)
    assert np.abs(on[100:] - off[100:]).max() > 0  # the single tokens' attention is the shared kernel's
    # and the prompt did take a batch kernel (a 100-token batch sums in another order than one token)
    assert np.abs(on[:100] - one_by_one).max() > 0


def test_the_mode_is_refused_on_repacked_weights(quantized):
    """Repacked (extra buffer type) weights go through kernels that tile by batch width: a context that is
    asked for consistent numerics on such a model raises, naming the way out; without the mode it works."""
    with Model(quantized("llama", "q4_0"), use_extra_bufts=True) as model:
        with pytest.raises(UnsupportedModeError, match="use_extra_bufts=False"):
            Context(model, n_ctx=64)
        ctx = Context(model, n_ctx=64, consistent_numerics=False)
        with pytest.raises(UnsupportedModeError):
            ctx.set_consistent_numerics(True)
        assert isinstance(UnsupportedModeError("x", op="y"), ValueError)
