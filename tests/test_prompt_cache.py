"""The batch scheduler's prompt cache (issue 35): a finished sequence leaves its memory (target KV, a hybrid target's
recurrent state, the drafter's memory) in its slot; a request goes to the free slot sharing the longest prefix
with it and decodes only the rest. Every output equals the cold output (plain greedy decoding of the whole prompt
alone), after reuse, after a mismatch that keeps only a few tokens, after one that keeps all but the last, and
after the slot was taken by another conversation; on llama, qwen3 and qwen35 (recurrent state)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import ARCHS
from pyllama_dspark import Context, DSparkDrafter, Model, generate
from pyllama_dspark.batching import BatchRequest, BatchScheduler
from pyllama_dspark.testing import TinySpec

pytestmark = pytest.mark.timeout(600)

N = 12


def spec(arch: str) -> TinySpec:
    return TinySpec(arch=arch, n_layer=3, vocab="llama-spm")


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, make_pair):
    made = make_pair(spec(request.param))
    return request.param, made.target, made.drafter


def cold(model, prompt) -> list[int]:
    """Plain greedy decoding of the whole prompt on a fresh context."""
    ctx = Context(model, n_ctx=256, n_rs_seq=4 if model.is_hybrid else 0)
    try:
        return generate(ctx, np.asarray(prompt), max_tokens=N, stop_at_eog=False).tokens
    finally:
        ctx.close()


def scheduler_for(model, drafter_path, *, slots: int, drafting: bool, cache: bool = True):
    ctx = Context(model, n_ctx=256 * slots, n_seq_max=slots, n_batch=32, n_rs_seq=4 if model.is_hybrid else 0)
    drafter = DSparkDrafter(drafter_path, ctx, n_seq_max=slots) if drafting else None
    return BatchScheduler(ctx, drafter, n_draft=3 if drafting else None, cache_prompts=cache), ctx, drafter


def close(scheduler, ctx, drafter) -> None:
    scheduler.close()
    if drafter is not None:
        drafter.close()
    ctx.close()


def run(scheduler, prompt):
    return scheduler.run([BatchRequest(np.asarray(prompt, dtype=np.int64), N, stop_at_eog=False)])[0]


def expected_reuse(held: list[int], prompt: list[int], recurrent: bool) -> int:
    """The contract: the common prefix, short of the prompt's last token; a recurrent state all of it or nothing."""
    n = min(len(held), len(prompt) - 1)
    keep = next((i for i in range(n) if held[i] != prompt[i]), n)
    return (keep if keep == len(held) else 0) if recurrent else keep


@pytest.mark.parametrize("drafting", [False, True], ids=["plain", "dspark"])
def test_a_conversation_reuses_its_prefix_and_every_output_equals_the_cold_one(pair, drafting):
    arch, target, drafter_path = pair
    recurrent = arch == "qwen35"
    with Model(target) as model:
        scheduler, ctx, drafter = scheduler_for(model, drafter_path, slots=2, drafting=drafting)
        try:
            prompt = [5, 17, 42, 99, 3, 250, 7, 11]
            for turn in range(3):
                result = run(scheduler, prompt)
                assert result.tokens == cold(model, prompt), f"{arch} turn {turn}: the cache changed the output"
                held = max(scheduler.held, key=len)
                if turn == 0:
                    assert result.stats.n_reused == 0
                else:  # the last turn's memory: its prompt and what was decoded of its output
                    assert result.stats.n_reused == len(previous_held)
                # the memory holds the prompt and the output but (at most) its last token, which was never decoded
                assert held[:len(prompt)] == prompt and len(prompt) + N - 1 <= len(held) <= len(prompt) + N
                assert held[len(prompt):] == result.tokens[:len(held) - len(prompt)]
                previous_held = held
                prompt = prompt + result.tokens + [8, 9, 10 + turn]  # the next "user turn"

            # all but the last token of the held ids again: a transformer keeps them, a recurrent state cannot rewind
            again = held[:-1] + [3]
            result = run(scheduler, again)
            assert result.stats.n_reused == (0 if recurrent else len(again) - 1)
            assert result.tokens == cold(model, again)

            # a prompt sharing only a few tokens with any slot: a cold start, in a slot other than the conversation's
            before = scheduler.held
            stranger = again[:3] + [77] * 40
            result = run(scheduler, stranger)
            assert result.stats.n_reused == 0 and result.tokens == cold(model, stranger)
            assert any(h == b for h, b in zip(scheduler.held, before) if b), "the conversation's slot was not spared"

            # and the conversation again: it finds its slot
            held = max(before, key=len)
            follow = again + [4, 4]
            result = run(scheduler, follow)
            assert result.tokens == cold(model, follow)
            assert result.stats.n_reused == expected_reuse(held, follow, recurrent)
        finally:
            close(scheduler, ctx, drafter)


def test_conversations_keep_their_own_slots_and_an_evicted_one_starts_cold(pair):
    """Three conversations on two slots, each turn a new request: with room, each finds its own memory; the third
    takes the least recently used slot, and that conversation starts cold afterwards, with the right output."""
    arch, target, drafter_path = pair
    with Model(target) as model:
        scheduler, ctx, drafter = scheduler_for(model, drafter_path, slots=2, drafting=True)
        try:
            a, b, c = [5, 17, 42, 99, 3, 250], [60, 61, 62, 63, 64, 65, 66], [120, 121, 122, 123]
            reused = {}

            def turn(name, prompt):
                result = run(scheduler, prompt)
                assert result.tokens == cold(model, prompt), f"{arch} {name}"
                reused[name] = result.stats.n_reused
                return prompt + result.tokens + [8, 9]

            a, b = turn("a", a), turn("b", b)
            a, b = turn("a2", a), turn("b2", b)
            turn("c", c)
            turn("a3", a)
            assert reused["a"] == reused["b"] == reused["c"] == 0
            assert reused["a2"] >= 6 + N - 1 and reused["b2"] >= 7 + N - 1  # each found its own memory
            # c took the least recently used slot, a's (b2 ran after a2): a starts cold
            assert reused["a3"] == 0
        finally:
            close(scheduler, ctx, drafter)


def test_without_the_cache_a_finished_sequence_frees_its_memory(make_pair):
    made = make_pair(spec("llama"))
    with Model(made.target) as model:
        scheduler, ctx, drafter = scheduler_for(model, made.drafter, slots=2, drafting=True, cache=False)
        try:
            prompt = [5, 17, 42, 99, 3, 250, 7, 11]
            first = run(scheduler, prompt)
            again = run(scheduler, prompt + first.tokens)
            assert again.stats.n_reused == 0 and again.tokens == cold(model, prompt + first.tokens)
            assert scheduler.held == [[], []] and [ctx.seq_pos_max(s) for s in (0, 1)] == [-1, -1]
            # turned on, then off again: what was kept is freed
            scheduler.cache_prompts = True
            run(scheduler, prompt)
            assert max(ctx.seq_pos_max(s) for s in (0, 1)) > 0
            scheduler.cache_prompts = False
            assert scheduler.held == [[], []] and [ctx.seq_pos_max(s) for s in (0, 1)] == [-1, -1]
        finally:
            close(scheduler, ctx, drafter)


def test_a_memory_touched_from_outside_is_not_trusted(make_pair):
    made = make_pair(spec("llama"))
    with Model(made.target) as model:
        scheduler, ctx, drafter = scheduler_for(model, made.drafter, slots=1, drafting=True)
        try:
            prompt = [5, 17, 42, 99, 3, 250, 7, 11]
            first = run(scheduler, prompt)
            ctx.seq_rm(0, 4, -1)  # someone trimmed the slot behind the scheduler's back
            follow = prompt + first.tokens + [8]
            result = run(scheduler, follow)
            assert result.stats.n_reused == 0 and result.tokens == cold(model, follow)
        finally:
            close(scheduler, ctx, drafter)


def test_min_prefix_share_is_checked(make_pair):
    made = make_pair(spec("llama"))
    with Model(made.target) as model:
        ctx = Context(model, n_ctx=256, n_seq_max=1)
        try:
            with pytest.raises(ValueError, match=r"min_prefix_share must be in \[0, 1\], got 1.5"):
                BatchScheduler(ctx, cache_prompts=True, min_prefix_share=1.5)
            with pytest.raises(TypeError, match="min_prefix_share must be a number"):
                BatchScheduler(ctx, cache_prompts=True, min_prefix_share="high")
        finally:
            ctx.close()
