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
