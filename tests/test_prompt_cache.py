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
from pyllama_dspark.drafter import Draft
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


def scheduler_for(model, drafter_path, *, slots: int, drafting: bool, cache: bool = True, cache_ram_bytes: int = 0):
    ctx = Context(model, n_ctx=256 * slots, n_seq_max=slots, n_batch=32, n_rs_seq=4 if model.is_hybrid else 0)
    drafter = DSparkDrafter(drafter_path, ctx, n_seq_max=slots) if drafting else None
    return BatchScheduler(ctx, drafter, n_draft=3 if drafting else None, cache_prompts=cache,
                          cache_ram_bytes=cache_ram_bytes), ctx, drafter


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


@pytest.mark.parametrize("drafting", [False, True], ids=["plain", "dspark"])
def test_a_memory_taken_over_comes_back_from_host_memory(pair, drafting):
    """The same three conversations with host memory for what slots lose: the evicted one is copied back into a
    slot (target KV, recurrent state, drafter) and continues from there, with the cold output."""
    arch, target, drafter_path = pair
    with Model(target) as model:
        scheduler, ctx, drafter = scheduler_for(model, drafter_path, slots=2, drafting=drafting,
                                                cache_ram_bytes=64 << 20)
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
            assert scheduler.saved_bytes == 0  # nothing was cut yet
            turn("c", c)  # takes a's slot: a's memory goes to host memory
            assert 0 < scheduler.saved_bytes <= 64 << 20
            turn("a3", a)  # back from host memory, into the least recently used slot (b's, saved in turn)
            # what a2's memory held: its prompt and output (but the last token, unless a round was cut after it)
            assert reused["a3"] in (len(a) - 3, len(a) - 2) and scheduler.cache_hits_saved == 1
            turn("b3", b)
            assert reused["b3"] in (len(b) - 3, len(b) - 2) and scheduler.cache_hits_saved == 2
        finally:
            close(scheduler, ctx, drafter)


def test_host_memory_stays_within_its_budget(make_pair):
    made = make_pair(spec("llama"))
    with Model(made.target) as model:
        scheduler, ctx, drafter = scheduler_for(model, made.drafter, slots=1, drafting=True,
                                                cache_ram_bytes=1 << 30)
        try:
            prompts = [[100 + i] * 30 for i in range(4)]
            for prompt in prompts:
                run(scheduler, prompt)
            one = scheduler.saved_bytes // 3  # three conversations were cut (the fourth holds the slot)
            assert len(scheduler._saved) == 3 and one > 0
            scheduler.cache_ram_bytes = int(2.5 * one)
            run(scheduler, prompts[0])  # the first is back; the slot's (the fourth) goes to host memory
            assert scheduler.cache_hits_saved == 1
            run(scheduler, [7] * 30)  # cuts the first again: the oldest copies are dropped to fit the budget
            assert scheduler.saved_bytes <= scheduler.cache_ram_bytes and len(scheduler._saved) == 2
            assert run(scheduler, prompts[1]).stats.n_reused == 0  # the oldest copy was dropped
            scheduler.cache_prompts = False
            assert scheduler.saved_bytes == 0 and not scheduler._saved
        finally:
            close(scheduler, ctx, drafter)


class OracleBatchDrafter:
    """Drafts the target's greedy continuation (``expected`` per sequence: prompt + cold output), every draft right;
    it holds nothing native (``saved``/``restore`` copy its own bookkeeping)."""

    capture_layers: list[int] = []
    block_size = 4

    def __init__(self, n_seq_max: int):
        self.n_seq_max = n_seq_max
        self.expected: dict[int, list[int]] = {}

    def propose_many(self, asks):
        return [Draft(np.asarray(self.expected[seq][pos + 1:pos + 1 + k], dtype=np.int32))
                for seq, anchor, pos, k, sampler in asks]

    def observe(self, tokens, rows, pos0, seq_id=0):
        pass

    def reset(self, seq_id=None):
        pass

    def saved(self, seq_id):
        return b"", ([], 0)

    def restore(self, seq_id, saved):
        pass


def test_a_generation_cut_inside_a_round_keeps_only_what_it_handed_out(pair):
    """A stop token inside a round of accepted drafts: the memory held drafts past it; they are dropped at the end,
    so the kept ids are the prompt and the output, and a recurrent state (reusable only whole) serves the next turn."""
    arch, target, _ = pair
    with Model(target) as model:
        ctx = Context(model, n_ctx=256, n_seq_max=1, n_batch=32, n_rs_seq=4 if model.is_hybrid else 0)
        drafter = OracleBatchDrafter(1)
        scheduler = BatchScheduler(ctx, drafter, n_draft=4, cache_prompts=True)
        try:
            prompt = [5, 17, 42, 99, 3, 250, 7, 11]
            expected = cold(model, prompt)
            drafter.expected[0] = prompt + expected
            stop_at = next(i for i in range(2, 4) if expected[i] not in expected[:i])  # inside the first round
            request = BatchRequest(np.asarray(prompt), N, stop_at_eog=False, stop_tokens=frozenset([expected[stop_at]]))
            result = scheduler.run([request])[0]
            assert result.tokens == expected[:stop_at + 1] and result.stats.accepted == 4
            assert scheduler.held[0] == prompt + result.tokens and ctx.seq_pos_max(0) == len(prompt) + stop_at
            follow = prompt + result.tokens + [8, 9]
            drafter.expected[0] = follow + cold(model, follow)
            again = scheduler.run([BatchRequest(np.asarray(follow), N, stop_at_eog=False)])[0]
            assert again.stats.n_reused == len(prompt) + len(result.tokens) and again.tokens == cold(model, follow)
        finally:
            scheduler.close()
            ctx.close()


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
