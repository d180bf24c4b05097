"""A token scan's logit rows, decoded one token at a time or in batches of a width: what the exactness tests
(CPU, Vulkan, RPC) compare bit for bit. The context is the caller's (its memory must be empty)."""

from __future__ import annotations

import numpy as np

from pyllama_dspark import Batch, Context


def single_rows(ctx: Context, tokens) -> np.ndarray:
    batch, rows = Batch(1), []
    for pos, token in enumerate(tokens):
        batch.clear()
        batch.add(token, pos, logits=True)
        ctx.decode(batch)
        rows.append(ctx.logits(-1).copy())
    return np.array(rows)


def batched_rows(ctx: Context, tokens, width: int) -> np.ndarray:
    """The scan again in batches of width tokens, each after the same prefix as its single-token decodes."""
    batch, rows = Batch(width), []
    for start in range(0, len(tokens), width):
        batch.clear()
        batch.add_tokens(tokens[start:start + width], start, logits="all")
        ctx.decode(batch)
        rows.append(ctx.all_logits().copy())
    return np.concatenate(rows)
