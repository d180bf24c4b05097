"""The cost-aware draft length: the pure chooser with made-up costs, then the loop with real and fake drafters."""

from __future__ import annotations

import numpy as np
import pytest

from pyllama_dspark import Context, DSparkDrafter, Model, Speculator, generate
from pyllama_dspark.draft_length import (CostTable, DraftLengthChooser, StaticCostTable, expected_tokens,
                                        expected_tokens_by_k)
from pyllama_dspark.testing import TinySpec, tiny_model

from drafters import oracle

SPEC = TinySpec(arch="llama", n_layer=2)


def feed(chooser: DraftLengthChooser, rounds: int, *, accepted, verify=lambda n: 0.008 + 0.004 * (n - 1),
         draft=lambda k: 0.001 * k) -> list[int]:
    """Run rounds with the chooser's plan; accepted(k) says how many drafts the target accepts."""
    plans = []
    for _ in range(rounds):
        k = chooser.plan()
        plans.append(k)
        chooser.observe_round(k, accepted(k), draft(k), verify(k + 1))
    return plans


def test_expected_tokens_is_one_plus_the_sum_of_prefix_products():
    accept = np.array([0.5, 0.5, 1.0])
    assert expected_tokens_by_k(accept).tolist() == [1.0, 1.5, 1.75, 2.0]
    assert expected_tokens(accept, 0) == 1.0 and expected_tokens(accept, 2) == 1.75


def test_cost_table_fills_unmeasured_rows_from_the_measured_ones():
    table = CostTable(6)
    assert table.verify(1) == 1.0 and table.verify(3) == 2.0 and table.draft(0) == 0.0  # priors, relative
    table.observe(2, 0.003, 0.015)  # one measurement: the prior's shape scaled to it
    assert table.verify(3) == pytest.approx(0.015) and table.verify(1) == pytest.approx(0.0075)
    table.observe(0, 0.0, 0.010)
    table.observe(4, 0.005, 0.020)  # verify measured at 1, 3, 5 rows: a line (0.0025 s per row)
    assert table.verify(1) == pytest.approx(0.010) and table.verify(7) == pytest.approx(0.025)
    assert table.draft(3) == pytest.approx(0.004)
    table.observe(0, 0.0, 0.020)  # moving average, not the last value
    assert 0.010 < table.verify(1) < 0.020


def test_a_drafter_that_is_always_right_drafts_the_most_when_verify_is_cheap():
    chooser = DraftLengthChooser(4)
    plans = feed(chooser, 20, accepted=lambda k: k, verify=lambda n: 0.008 + 0.001 * (n - 1))
    assert plans[5:] == [4] * 15


def test_a_drafter_that_is_never_right_settles_at_plain_decoding_and_probes_rarely():
    chooser = DraftLengthChooser(4)
    plans = feed(chooser, 200, accepted=lambda k: 0)
    assert plans[0] > 0  # tried first (optimistic prior)
    assert plans[2:5] == [0, 0, 0]  # settled within a few rounds
    probes = [i for i, k in enumerate(plans) if k > 0 and i >= 2]
    assert probes and all(plans[i] == 1 for i in probes)  # probes draft one token
    assert len(probes) <= 0.06 * len(plans)
    assert np.diff(probes).tolist() == sorted(np.diff(probes).tolist())  # ever rarer


def test_a_probe_that_succeeds_brings_drafting_back():
    chooser = DraftLengthChooser(4)
    feed(chooser, 30, accepted=lambda k: 0)
    plans = feed(chooser, 120, accepted=lambda k: k)  # the text became predictable
    assert np.mean(plans[-20:]) >= 3, plans


def test_the_cost_of_verify_decides_the_length():
    """Same acceptance (70 % per slot): cheap extra rows -> long drafts, expensive extra rows -> short ones."""
    rng = np.random.default_rng(0)

    def accepted(k):
        return int(np.argmin(np.append(rng.random(k) < 0.7, False)))

    cheap = feed(DraftLengthChooser(6), 200, accepted=accepted, verify=lambda n: 0.010 + 0.0005 * n)
    dear = feed(DraftLengthChooser(6), 200, accepted=accepted, verify=lambda n: 0.010 + 0.006 * n)
    assert np.mean(cheap[50:]) > np.mean(dear[50:]) + 1
    assert np.mean(dear[50:]) >= 0.5  # 70 % still pays for a short draft at 0.6x a token per extra row


def test_cut_keeps_the_confident_prefix():
    chooser = DraftLengthChooser(4)
    feed(chooser, 5, accepted=lambda k: k)
    assert chooser.cut(np.array([0.95, 0.9, 0.05, 0.05]), 4, t_draft=0.001) == 2
    assert chooser.cut(np.array([0.99, 0.99, 0.99, 0.99]), 4, t_draft=0.001) == 4
    assert chooser.cut(np.array([0.01, 0.01, 0.01, 0.01]), 4, t_draft=0.001) == 1  # one is always kept
    assert chooser.cut(None, 3, t_draft=0.001) == 3


def test_bad_k_max_is_refused():
    with pytest.raises(ValueError):
        DraftLengthChooser(-1)


def test_static_costs_are_used_as_given_and_never_change():
    table = StaticCostTable(verify={1: 8.0, 2: 9.2, 3: 10.9, 5: 14.0}, draft={1: 2.7, 4: 3.0})
    assert table.verify(2) == 9.2 and table.draft(1) == 2.7 and table.draft(0) == 0.0
    assert 10.9 < table.verify(4) < 14.0  # filled in between the given ones
    table.observe(1, 100.0, 100.0)
    assert table.verify(2) == 9.2 and table.draft(1) == 2.7


# --- in the loop -----------------------------------------------------------------------------

# SmolLM2 Q4_1 on 2 threads (ms): a verify of n rows and a DSpark draft of k slots
SMOLLM2_LIKE_COSTS = StaticCostTable(verify={1: 8.0, 2: 9.2, 3: 10.9, 4: 12.5, 5: 14.2},
                                     draft={1: 2.7, 2: 2.8, 3: 2.9, 4: 3.0})


@pytest.fixture(scope="module")
def target(model_dir):
    return tiny_model(SPEC, cache_dir=model_dir)


@pytest.fixture(scope="module")
def random_drafter(make_pair):
    return make_pair(SPEC).drafter


def test_cost_aware_loop_with_a_random_drafter_settles_at_plain_steps_and_matches_greedy(target, random_drafter):
    prompt = list(range(1, 9))
    with Model(target) as model:
        ctx = Context(model, n_ctx=256)
        expected = generate(ctx, prompt, max_tokens=96, stop_at_eog=False).tokens
        spec = Speculator(ctx, DSparkDrafter(random_drafter, ctx))
        assert spec.draft_length is not None  # cost-aware by default
        spec.draft_length.costs = SMOLLM2_LIKE_COSTS  # timings of a tiny model on a busy machine are noise
        steps = list(spec.run(np.array(prompt, dtype=np.int32), max_tokens=96, stop_at_eog=False))
    assert [t for s in steps for t in s.tokens] == expected
    drafted = [s.n_draft for s in steps[1:]]
    assert sum(k > 0 for k in drafted[6:]) <= 0.15 * len(drafted[6:]), drafted  # plain steps, a few probes


def test_cost_aware_loop_with_an_oracle_drafter_drafts_long_blocks(target):
    prompt = list(range(1, 9))
    with Model(target) as model:
        ctx = Context(model, n_ctx=256)
        expected = prompt + generate(ctx, prompt, max_tokens=96, stop_at_eog=False).tokens
        spec = Speculator(ctx, oracle(expected, model.n_vocab, block_size=4))
        spec.draft_length.costs = SMOLLM2_LIKE_COSTS
        steps = list(spec.run(np.array(prompt, dtype=np.int32), max_tokens=96, stop_at_eog=False))
    assert [t for s in steps for t in s.tokens] == expected[len(prompt):]
    drafted = [s.n_draft for s in steps[1:-1]]
    assert np.mean(drafted[3:]) >= 3, drafted


def test_fixed_n_draft_turns_the_chooser_off(target, random_drafter):
    with Model(target) as model:
        ctx = Context(model, n_ctx=256)
        spec = Speculator(ctx, DSparkDrafter(random_drafter, ctx), n_draft=3)
        assert spec.draft_length is None
        steps = list(spec.run(np.arange(1, 9, dtype=np.int32), max_tokens=40, stop_at_eog=False))
    assert {s.n_draft for s in steps[1:-4]} == {3}  # the last rounds are capped by max_tokens


def test_a_drafter_that_is_rarely_right_keeps_probing_rarely():
    """Right 3 % of the time (the DSpark drafter on a language it was not trained for): a rare accepted probe does
    not bring probing back to every probe_every rounds; probes stay about as rare as for a useless drafter."""
    rng = np.random.default_rng(1)
    plans = feed(DraftLengthChooser(4), 400, accepted=lambda k: int(k > 0 and rng.random() < 0.03))
    probes = [i for i, k in enumerate(plans) if k > 0 and i >= 2]
    assert len(probes) <= 0.04 * len(plans), probes
