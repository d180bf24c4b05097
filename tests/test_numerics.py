"""Patch 0005: a small-batch decode is bit-identical to token-by-token decoding (the ground of exact
greedy speculative decoding), for f32 and quantized weights on every target."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import ARCHS
from pyllama_dspark import Batch, Context, Model

TOKENS = [1, 17, 42, 99, 3, 250, 7] + list(range(30, 60))


def single_rows(model, **kw):
    ctx = Context(model, n_ctx=256, n_batch=16, **kw)
    batch, rows = Batch(1), []
    for pos, token in enumerate(TOKENS):
        batch.clear()
        batch.add(token, pos, logits=True)
        ctx.decode(batch)
        rows.append(ctx.logits(-1).copy())
    return np.array(rows)


def batched_rows(model, n, **kw):
    ctx = Context(model, n_ctx=256, n_batch=64, **kw)
    batch, rows = Batch(64), []
    for start in range(0, len(TOKENS), n):
        batch.clear()
        batch.add_tokens(TOKENS[start:start + n], start, logits="all")
        ctx.decode(batch)
        rows.append(ctx.all_logits().copy())
    return np.concatenate(rows)


@pytest.mark.parametrize("qtype", ["f32", "q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("arch", ARCHS)
def test_batched_rows_are_bit_identical_to_single_tokens(quantized, arch, qtype):
    with Model(quantized(arch, qtype)) as model:
        single = single_rows(model)
        for n in (2, 5, 8, 37):
            np.testing.assert_array_equal(batched_rows(model, n), single, err_msg=f"{arch} {qtype} batch {n}")


def test_without_the_mode_batched_rows_differ(quantized):
    """Why the mode exists: upstream's kernels give other last bits for a batch than for one token."""
    with Model(quantized("llama", "f32")) as model:
        single = single_rows(model, consistent_numerics=False)
        batched = batched_rows(model, 8, consistent_numerics=False)
    assert np.abs(batched - single).max() > 0


@pytest.mark.parametrize("qtype", ["q8_0", "q4_1"])
def test_batches_use_the_two_column_kernels_and_single_tokens_do_not(quantized, qtype):
    """Patch 0008: a small batch of q4_1/q8_0 weights goes through the two-column dot kernels (the rows are
    still bit-identical to single tokens, see above); a one-token decode keeps the one-column kernel."""
    from pyllama_dspark._lib import lib

    if lib.ggml_cpu_dspark_x2_chunks() == 0 and not _x2_built():
        pytest.skip("the two-column kernels are built for AVX2 on x86-64 only")
    with Model(quantized("llama", qtype)) as model:
        ctx = Context(model, n_ctx=256, n_batch=16)
        batch = Batch(16)
        batch.add_tokens(TOKENS[:4], 0, logits="last")
        ctx.decode(batch)
        before = lib.ggml_cpu_dspark_x2_chunks()
        batch.clear()
        batch.add(TOKENS[4], 4, logits=True)
        ctx.decode(batch)
        assert lib.ggml_cpu_dspark_x2_chunks() == before, "a single-token decode used the two-column kernels"
        batch.clear()
        batch.add_tokens(TOKENS[5:8], 5, logits="all")
        ctx.decode(batch)
        assert lib.ggml_cpu_dspark_x2_chunks() > before, "a 3-token decode did not use the two-column kernels"


def _x2_built() -> bool:
    import platform

    with open("/proc/cpuinfo") as fh:
        return platform.machine() in ("x86_64", "AMD64") and " avx2" in fh.read()


LONG = (np.arange(70) * 37 % 251 + 1).tolist()


@pytest.mark.parametrize("qtype", ["f32", "q8_0"])
def test_the_mode_covers_batches_up_to_64_and_prompt_sized_batches_keep_the_fast_kernels(quantized, qtype):
    """The README's boundary: rows of a 64-token batch are bit-identical to token-by-token decoding; a
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
