"""Patch 0024: under consistent numerics, flash attention of a small batch (a lone token included) runs each KV
head's chunk once for every (row, query head) pair that reads it, in SIMD lanes of their own. Each row must stay
bit-identical to a single-token decode: at every verify width, at contexts on both sides of the 256-cell chunk
boundary and far past it, with f16 and quantized KV caches, on every architecture and GQA ratio. Its numbers are
checked against upstream's attention on an f32 cache, where only the order of the sums differs."""

from __future__ import annotations

import numpy as np
import pytest

import reference
from conftest import ARCHS
from pyllama_dspark import Batch, Context, Model
from pyllama_dspark._lib import lib

# (n_head, n_head_kv): GQA ratios 1, 3, 4 and 8; heads of 32 so that q8_0/q4_0 blocks divide them
HEADS = {1: (4, 4), 3: (6, 2), 4: (8, 2), 8: (8, 1)}
CONTEXTS = [1, 250, 255, 256, 257, 3000]  # cells before the batch; 250 + 16 rows cross the first boundary
WIDTHS = range(2, 17)


def tokens(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in (np.arange(n) * 37 + seed * 11) % 250 + 1]


@pytest.fixture(scope="module")
def gqa_model(make_model):
    def build(arch: str, ratio: int):
        n_head, n_head_kv = HEADS[ratio]
        return make_model(arch=arch, n_layer=2, n_embd=32 * n_head, n_head=n_head, n_head_kv=n_head_kv, n_ff=128)

    return build


def prefill(ctx: Context, batch: Batch, prefix: list[int]) -> None:
    ctx.clear()
    for start in range(0, len(prefix), batch.capacity):
        part = prefix[start:start + batch.capacity]
        batch.clear()
        batch.add_tokens(part, start, logits="none")
        ctx.decode(batch)


def single_token_rows(ctx: Context, prefix: list[int], following: list[int]) -> np.ndarray:
    batch, rows = Batch(512), []
    prefill(ctx, batch, prefix)
    for i, token in enumerate(following):
        batch.clear()
        batch.add(token, len(prefix) + i, logits=True)
        ctx.decode(batch)
        rows.append(ctx.logits(-1).copy())
    return np.array(rows)


def verify_rows(ctx: Context, prefix: list[int], following: list[int], *, filled: bool = False) -> np.ndarray:
    """The rows of one batch after the prefix (already in the cache when filled), removed again after."""
    batch = Batch(512)
    if not filled:
        prefill(ctx, batch, prefix)
    batch.clear()
    batch.add_tokens(following, len(prefix), logits="all")
    ctx.decode(batch)
    rows = ctx.all_logits().copy()
    if filled:
        ctx.seq_rm(0, len(prefix), -1)
    return rows


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
# ratios 3 and 4: up to 6 s each here and 35-60 s under AddressSanitizer (qwen35), so slow
@pytest.mark.parametrize("ratio", [1, pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("arch", ARCHS)
def test_verify_rows_are_bit_identical_to_single_tokens(gqa_model, arch, ratio, kv_type):
    with Model(gqa_model(arch, ratio)) as model, Context(model, n_ctx=3072, n_batch=512, kv_type=kv_type) as ctx:
        # the batch's rows are removed again after each width; a hybrid target's recurrent state cannot drop
        # them without snapshots, so it fills the cache anew each time
        refill = model.is_hybrid
        for n_prefix in CONTEXTS:
            prefix, following = tokens(n_prefix), tokens(max(WIDTHS), seed=1)
            single = single_token_rows(ctx, prefix, following)
            prefill(ctx, Batch(512), prefix)
            before = lib.ggml_cpu_dspark_shared_attention_ops()
            for width in WIDTHS:
                rows = verify_rows(ctx, prefix, following[:width], filled=not refill)
                np.testing.assert_array_equal(rows, single[:width],
                                              err_msg=f"{arch} GQA {ratio} {kv_type}: {width} rows after {n_prefix}")
            assert lib.ggml_cpu_dspark_shared_attention_ops() > before, "the batches did not take the shared path"


@pytest.mark.parametrize("kv_type", ["f16", "f32"])
def test_a_gqa_ratio_of_8_stays_bit_identical(gqa_model, kv_type):
    """Eight query heads on one KV head: a 16-row batch fills 128 lanes, four items of one chunk."""
    with Model(gqa_model("llama", 8)) as model, Context(model, n_ctx=1024, n_batch=512, kv_type=kv_type) as ctx:
        prefix, following = tokens(700), tokens(16, seed=2)
        single = single_token_rows(ctx, prefix, following)
        for width in (2, 5, 16):
            np.testing.assert_array_equal(verify_rows(ctx, prefix, following[:width]), single[:width],
                                          err_msg=f"{kv_type}: {width} rows")


def test_rows_match_across_thread_counts(gqa_model):
    """Threads decide who computes an item, never its value."""
    with Model(gqa_model("qwen3", 3)) as model:
        prefix, following = tokens(600), tokens(8, seed=3)
        results = []
        for n_threads in (1, 2, 3):
            with Context(model, n_ctx=1024, n_batch=512, n_threads=n_threads) as ctx:
                results.append(verify_rows(ctx, prefix, following))
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_array_equal(results[0], results[2])


@pytest.mark.parametrize("arch", ARCHS)
def test_numbers_are_as_close_to_a_float64_forward_pass_as_upstreams(gqa_model, arch):
    """Against tests/reference.py (the tiny models' forward pass in float64), on an f32 cache: the shared path's
    rows are no further from it than upstream's kernel's (one_chunk multiplies in f32 there as the shared path
    does; on f16 it rounds the query to f16 first). The tiny random models amplify rounding (two kernels that
    differ only in the order of their sums give logits 4e-4 apart), hence a bound relative to upstream."""
    path = gqa_model(arch, 3)
    prefix, following = tokens(900), tokens(8, seed=4)
    expected = reference.forward(path, arch, prefix + following).logits[len(prefix):]
    with Model(path) as model:
        with Context(model, n_ctx=1024, n_batch=512, kv_type="f32") as ctx:
            shared = verify_rows(ctx, prefix, following)
            single = single_token_rows(ctx, prefix, following)
        with Context(model, n_ctx=1024, n_batch=512, kv_type="f32", consistent_numerics=False) as ctx:
            upstream = single_token_rows(ctx, prefix, following)
    np.testing.assert_array_equal(shared, single)
    ours, theirs = np.abs(shared - expected).max(), np.abs(upstream - expected).max()
    assert ours <= 1.5 * theirs, f"shared path {ours:.3g} from float64, upstream {theirs:.3g}"
    assert ours < 1e-3 * np.abs(expected).max()
    assert np.abs(shared - upstream).max() > 0  # a different kernel really ran


def test_the_switch_selects_the_per_row_path_and_both_are_exact(gqa_model):
    """ggml_cpu_dspark_set_shared_attention(False) (GGML_DSPARK_FA_PER_ROW=1 at start) keeps patch 0013's path
    for measurements: exact too, and a different computation of the same attention."""
    with Model(gqa_model("llama", 3)) as model, Context(model, n_ctx=1024, n_batch=512) as ctx:
        prefix, following = tokens(520), tokens(6, seed=5)
        shared = verify_rows(ctx, prefix, following)
        previous = lib.ggml_cpu_dspark_set_shared_attention(False)
        try:
            before = lib.ggml_cpu_dspark_shared_attention_ops()
            per_row = verify_rows(ctx, prefix, following)
            per_row_single = single_token_rows(ctx, prefix, following)
            assert lib.ggml_cpu_dspark_shared_attention_ops() == before
        finally:
            assert lib.ggml_cpu_dspark_set_shared_attention(previous) is False
    np.testing.assert_array_equal(per_row, per_row_single)
    np.testing.assert_allclose(shared, per_row, rtol=0, atol=1e-2 * np.abs(per_row).max())
    assert np.abs(shared - per_row).max() > 0


def test_rows_of_several_sequences_in_one_batch_equal_their_single_tokens(gqa_model):
    """Per-sequence KV streams (n_seq_max > 1, as the batch scheduler runs): a batch holding rows of two
    sequences reaches the kernel as two streams (q->ne[3] = 2), a single token as one; each row is the same.
    (Patch 0013 took one stream only: two streams went to upstream's unchunked path, and past 256 cells such rows
    differed from their single tokens in the last bits.)"""
    with Model(gqa_model("qwen3", 3)) as model, Context(model, n_ctx=2048, n_batch=512, n_seq_max=2) as ctx:
        prefixes = {0: tokens(300, seed=6), 1: tokens(700, seed=7)}
        following = {0: tokens(3, seed=8), 1: tokens(5, seed=9)}
        batch = Batch(512, n_seq_max=2)
        for seq, prefix in prefixes.items():
            for start in range(0, len(prefix), 512):
                batch.clear()
                batch.add_tokens(prefix[start:start + 512], start, seq_id=seq, logits="none")
                ctx.decode(batch)
        single = {}
        for seq in (0, 1):
            rows = []
            for i, token in enumerate(following[seq]):
                batch.clear()
                batch.add(token, len(prefixes[seq]) + i, seq_id=seq, logits=True)
                ctx.decode(batch)
                rows.append(ctx.logits(-1).copy())
            single[seq] = np.array(rows)
            ctx.seq_rm(seq, len(prefixes[seq]), -1)
        batch.clear()
        for seq in (0, 1):
            batch.add_tokens(following[seq], len(prefixes[seq]), seq_id=seq, logits="all")
        before = lib.ggml_cpu_dspark_shared_attention_ops()
        ctx.decode(batch)
        used = lib.ggml_cpu_dspark_shared_attention_ops() > before
        rows = ctx.all_logits().copy()
    np.testing.assert_array_equal(rows[:3], single[0])
    np.testing.assert_array_equal(rows[3:], single[1])
    assert used
