"""The speculative loop with drafters of known behaviour: exact output, exact statistics."""

from __future__ import annotations

import numpy as np
import pytest

import drafters
from conftest import ARCHS
from pyllama_dspark import Context, Model, generate
from pyllama_dspark.speculative import Speculator
from pyllama_dspark.stats import SpecStats

PROMPTS = [
    [1, 17, 42, 99, 3, 250, 7],
    [5, 5, 5, 5],
    (np.arange(40) * 37 % 251 + 1).tolist(),   # longer than n_batch below: chunked prefill
    [200, 13],
    [9, 8, 7, 6, 5, 4, 3, 2, 1, 100, 101],
]
N_TOKENS = 128


def target_context(model, n_draft=4):
    # n_batch 16 < the 40-token prompt (chunked prefill); n_ubatch 8 < a 5-row verify + crosses ubatches
    return Context(model, n_ctx=512, n_batch=16, n_ubatch=8, n_rs_seq=Speculator.target_rs_seq(n_draft))


_PLAIN: dict = {}


def plain_greedy(model, prompt, n=N_TOKENS):
    """Plain greedy decoding (generate.py, token by token): the reference every run must reproduce."""
    key = (str(model.path), tuple(prompt), n)
    if key not in _PLAIN:
        ctx = Context(model, n_ctx=512, n_batch=16, n_ubatch=8)
        _PLAIN[key] = generate(ctx, prompt, max_tokens=n, stop_at_eog=False).tokens
        ctx.close()
    return list(_PLAIN[key])


@pytest.fixture(scope="module", params=ARCHS)
def arch_model(request, make_model):
    with Model(make_model(arch=request.param, n_layer=3)) as model:
        yield request.param, model


def run_spec(model, prompt, drafter, n_draft):
    ctx = target_context(model, n_draft)
    spec = Speculator(ctx, drafter, n_draft=n_draft)
    stats = SpecStats()
    steps = list(spec.run(np.asarray(prompt, dtype=np.int32), max_tokens=N_TOKENS, stop_at_eog=False,
                          stats=stats))
    ctx.close()
    return [t for s in steps for t in s.tokens], steps, stats


@pytest.mark.parametrize("kind", ["oracle", "never", "prefix1", "prefix2"])
@pytest.mark.parametrize("n_draft", [1, 4])
def test_output_equals_plain_greedy(arch_model, kind, n_draft):
    arch, model = arch_model
    for prompt in PROMPTS:
        expected = plain_greedy(model, prompt)
        full = list(prompt) + expected
        make = {"oracle": drafters.oracle, "never": drafters.never,
                "prefix1": lambda e, v, b: drafters.prefix(e, v, 1, b),
                "prefix2": lambda e, v, b: drafters.prefix(e, v, 2, b)}[kind]
        drafter = make(full, model.n_vocab, 4)
        tokens, steps, stats = run_spec(model, prompt, drafter, n_draft)
        assert tokens == expected, f"{arch} {kind} n_draft={n_draft} prompt={prompt[:4]}..."
        assert stats.n_generated == N_TOKENS


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "q4_1"])
@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_targets_stay_exact(quantized, arch, qtype):
    with Model(quantized(arch, qtype)) as model:
        for prompt in PROMPTS[:3]:
            expected = plain_greedy(model, prompt)
            for right in (1, 3):
                drafter = drafters.prefix(list(prompt) + expected, model.n_vocab, right)
                tokens, _, _ = run_spec(model, prompt, drafter, 4)
                assert tokens == expected, f"{arch} {qtype} right={right}"


def test_statistics_are_exactly_as_constructed(arch_model):
    arch, model = arch_model
    prompt = PROMPTS[0]
    full = list(prompt) + plain_greedy(model, prompt)
    for right in range(0, 5):
        drafter = drafters.prefix(full, model.n_vocab, right, block_size=4)
        tokens, steps, stats = run_spec(model, prompt, drafter, 4)
        rounds = steps[1:]  # steps[0] is the token sampled from the prompt
        assert stats.rounds == sum(s.n_draft > 0 for s in rounds)
        assert stats.plain_steps == sum(s.n_draft == 0 for s in rounds)
        for step in rounds:
            assert step.n_accept == min(right, step.n_draft)
            assert step.from_draft == [True] * step.n_accept + [False][: len(step.tokens) - step.n_accept]
        full_rounds = [s for s in rounds if s.n_draft == 4]
        assert stats.drafted == sum(s.n_draft for s in rounds)
        assert stats.accepted == sum(s.n_accept for s in rounds)
        assert stats.tau == pytest.approx(stats.accepted / stats.rounds + 1)
        if right == 4:
            assert stats.accept_rate == 1.0
        if right == 0:
            assert stats.accepted == 0 and stats.tau == 1.0
        # per position (1-based i): reached iff i <= a + 1, accepted iff i <= a
        n_full = len(full_rounds)
        assert stats.reached_per_pos[: min(right + 1, 4)][0] >= n_full
        for i in range(1, 5):
            expect_acc = sum(1 for s in rounds if s.n_draft >= i and i <= s.n_accept)
            expect_reach = sum(1 for s in rounds if s.n_draft >= i and i <= s.n_accept + 1)
            assert stats.accepted_per_pos[i - 1] == expect_acc
            assert stats.reached_per_pos[i - 1] == expect_reach
        if n_full:
            assert stats.accepted_per_pos[0] >= (n_full if right >= 1 else 0)


def test_rollback_at_every_depth_on_the_hybrid_target(make_model):
    """qwen35: rejected tails of every length 0..4 are rolled back through the recurrent snapshots."""
    with Model(make_model(arch="qwen35", n_layer=3)) as model:
        for prompt in PROMPTS[:3]:
            full = list(prompt) + plain_greedy(model, prompt)
            for right in range(5):
                tokens, steps, _ = run_spec(model, prompt, drafters.prefix(full, model.n_vocab, right), 4)
                assert tokens == full[len(prompt):]
                assert {s.n_draft - s.n_accept for s in steps[1:] if s.n_draft == 4} == {4 - right} or right == 4


def test_hybrid_target_without_snapshots_is_refused(make_model):
    with Model(make_model(arch="qwen35", n_layer=3)) as model:
        ctx = Context(model, n_ctx=128)
        with pytest.raises(ValueError, match="n_rs_seq"):
            Speculator(ctx, drafters.oracle([], model.n_vocab), n_draft=4)


def test_n_draft_beyond_the_block_is_clamped_with_a_warning(make_model):
    with Model(make_model(arch="llama")) as model:
        ctx = Context(model, n_ctx=128)
        with pytest.warns(UserWarning, match="clamped"):
            spec = Speculator(ctx, drafters.oracle([], model.n_vocab, block_size=4), n_draft=9)
        assert spec.n_draft == 4
        with pytest.raises(ValueError):
            Speculator(ctx, drafters.oracle([], model.n_vocab), n_draft=-1)


def test_prompt_errors(make_model):
    with Model(make_model(arch="llama")) as model:
        ctx = Context(model, n_ctx=64)
        spec = Speculator(ctx, drafters.never([], model.n_vocab))
        with pytest.raises(ValueError, match="empty prompt"):
            spec.generate([], max_tokens=4)
        with pytest.raises(ValueError, match="does not fit"):
            spec.generate([1] * ctx.n_ctx, max_tokens=4)


def test_stop_strings_across_block_boundaries_and_streaming(make_model):
    with Model(make_model(arch="llama", vocab="llama-spm")) as model:
        prompt = "The quick brown fox"
        ctx = Context(model, n_ctx=256, n_batch=32)
        plain = generate(ctx, prompt, max_tokens=40, stop_at_eog=False)
        ids = model.tokenize(prompt, parse_special=True).tolist()
        pieces = [model.token_to_piece(t).decode("utf-8", "replace") for t in plain.tokens]
        spec = Speculator(ctx, drafters.oracle(ids + plain.tokens, model.n_vocab, block_size=4), n_draft=4)
        full = spec.generate(prompt, max_tokens=40, stop_at_eog=False)
        assert full.tokens == plain.tokens and full.text == plain.text
        # a stop string made of the end of token 5 and the start of token 6: tokens 1..4 are one round
        # (oracle, 4 drafts + bonus), so it spans the boundary between the 2nd and 3rd rounds' text
        boundary = len("".join(pieces[:6]))
        stop = plain.text[boundary - 2: boundary + 2]
        assert len(stop.strip()) >= 2
        cut = plain.text.find(stop)
        result = spec.generate(prompt, max_tokens=40, stop_at_eog=False, stop=[stop])
        assert result.stop_reason == "stop"
        assert result.text == plain.text[:cut]
        streamed = "".join(e.text for e in spec.generate(prompt, max_tokens=40, stop_at_eog=False, stop=[stop],
                                                         stream=True))
        assert streamed == plain.text[:cut]


def test_statistics_have_the_literal_values_of_a_known_sequence_of_rounds():
    from pyllama_dspark.stats import SpecStats

    stats = SpecStats()
    for drafted, accepted in [(4, 4), (4, 0), (4, 2), (2, 1), (0, 0)]:
        stats.observe_round(drafted, accepted)
    assert (stats.rounds, stats.plain_steps, stats.drafted, stats.accepted) == (4, 1, 14, 7)
    assert stats.accept_rate == 0.5 and stats.tau == 2.75  # 7 / 4 + 1
    # position i reached iff i <= a + 1 (and i <= drafted): reached [4, 3, 2, 1], accepted [3, 2, 1, 1]
    assert stats.reached_per_pos == [4, 3, 2, 1] and stats.accepted_per_pos == [3, 2, 1, 1]
    assert stats.per_position_rate == [0.75, 2 / 3, 0.5, 1.0]
    with pytest.raises(ValueError):
        stats.observe_round(2, 3)
