"""reuse_prefix: a chat's next turn keeps the memory of the conversation so far (target and drafter) and
decodes only what is new, with the same tokens as a fresh run; anything else touching the context in
between, another owner, or a recurrent memory that cannot be trimmed falls back to a full prefill."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import ARCHS
from pyllama_dspark import Batch, Context, Model, Speculator, generate
from pyllama_dspark.drafter import DSparkDrafter
from pyllama_dspark.testing import TinySpec

TURN_1 = [5, 17, 42, 99, 3, 250, 7, 11]
N = 12


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, make_pair):
    return request.param, *make_pair(TinySpec(arch=request.param, n_layer=3))[:2]


def fresh_plain(model, prompt):
    ctx = Context(model, n_ctx=256)
    try:
        return generate(ctx, prompt, max_tokens=N, stop_at_eog=False).tokens
    finally:
        ctx.close()


def second_turn(first_prompt, first_tokens):
    """The conversation so far, then a new 'user turn'."""
    return list(first_prompt) + list(first_tokens) + [8, 9, 10]


def test_plain_generation_keeps_the_conversation(pair):
    arch, target, _ = pair
    with Model(target) as model:
        ctx = Context(model, n_ctx=256, n_rs_seq=4)
        first = generate(ctx, TURN_1, max_tokens=N, stop_at_eog=False, reuse_prefix=True)
        assert first.stats.n_reused == 0
        turn_2 = second_turn(TURN_1, first.tokens)
        second = generate(ctx, turn_2, max_tokens=N, stop_at_eog=False, reuse_prefix=True)
        # plain decoding decodes each token after yielding it: the memory held the prompt and all N tokens
        assert second.stats.n_reused == len(TURN_1) + N
        assert second.tokens == fresh_plain(model, turn_2), f"{arch}: a reused prefix changed the output"
        # the same prompt again: everything but its last token is kept (its logits are needed)
        again = generate(ctx, turn_2, max_tokens=N, stop_at_eog=False, reuse_prefix=True)
        if model.is_hybrid or model.is_recurrent:
            assert again.stats.n_reused == 0  # a recurrent state cannot be rewound past its snapshots
        else:
            assert again.stats.n_reused == len(turn_2) - 1
        assert again.tokens == second.tokens


def test_speculative_generation_keeps_the_target_and_the_drafter(pair):
    arch, target, drafter_path = pair
    with Model(target) as model:
        ctx = Context(model, n_ctx=256, n_rs_seq=Speculator.target_rs_seq(4))
        spec = Speculator(ctx, DSparkDrafter(drafter_path, ctx), n_draft=4)
        first = spec.generate(TURN_1, max_tokens=N, stop_at_eog=False, reuse_prefix=True)
        assert first.tokens == fresh_plain(model, TURN_1)
        turn_2 = second_turn(TURN_1, first.tokens)
        second = spec.generate(turn_2, max_tokens=N, stop_at_eog=False, reuse_prefix=True)
        assert second.stats.n_reused == len(TURN_1) + N - 1
        assert second.tokens == fresh_plain(model, turn_2), f"{arch}: speculative output after reuse"
        # the drafter kept its features too: its drafts equal a fresh speculator's on the same prompt
        fresh_ctx = Context(model, n_ctx=256, n_rs_seq=Speculator.target_rs_seq(4))
        fresh = Speculator(fresh_ctx, DSparkDrafter(drafter_path, fresh_ctx), n_draft=4)
        fresh_steps = list(fresh.run(np.asarray(turn_2), max_tokens=N, stop_at_eog=False))
        reused_steps = list(spec.run(np.asarray(turn_2), max_tokens=N, stop_at_eog=False, reuse_prefix=True))
        assert [s.n_accept for s in reused_steps] == [s.n_accept for s in fresh_steps]


def test_anything_else_on_the_context_in_between_means_a_full_prefill(make_model):
    with Model(make_model(arch="llama", n_layer=3)) as model:
        ctx = Context(model, n_ctx=256)
        first = generate(ctx, TURN_1, max_tokens=N, stop_at_eog=False, reuse_prefix=True)
        turn_2 = second_turn(TURN_1, first.tokens)
        batch = Batch(1)
        batch.add(1, len(TURN_1) + N, logits=True)
        ctx.decode(batch)  # someone else decodes on the context
        assert generate(ctx, turn_2, max_tokens=N, stop_at_eog=False, reuse_prefix=True).stats.n_reused == 0
        generate(ctx, TURN_1, max_tokens=N, stop_at_eog=False, reuse_prefix=True)
        # a speculator does not take over a plain generation's memory (its drafter did not see it)
        from pyllama_dspark import PromptLookupDrafter

        spec = Speculator(ctx, PromptLookupDrafter(block_size=2), n_draft=2)
        assert spec.generate(turn_2, max_tokens=4, stop_at_eog=False, reuse_prefix=True).stats.n_reused == 0
        # and without reuse_prefix nothing is kept
        generate(ctx, TURN_1, max_tokens=N, stop_at_eog=False)
        assert generate(ctx, turn_2, max_tokens=N, stop_at_eog=False).stats.n_reused == 0


def test_a_stream_stopped_early_leaves_a_reusable_memory(make_model):
    with Model(make_model(arch="llama", n_layer=3)) as model:
        ctx = Context(model, n_ctx=256)
        events = generate(ctx, TURN_1, max_tokens=N, stop_at_eog=False, reuse_prefix=True, stream=True)
        taken = [next(events).token for _ in range(5)]
        events.close()
        turn_2 = second_turn(TURN_1, taken)
        result = generate(ctx, turn_2, max_tokens=N, stop_at_eog=False, reuse_prefix=True)
        assert result.stats.n_reused == len(TURN_1) + 4
        assert result.tokens == fresh_plain(model, turn_2)
