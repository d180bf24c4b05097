"""The draft-length and draft-source choosers' decisions (draft_length.DraftLengthChooser, SourceChooser) against
literal costs (StaticCostTable) and literal acceptances: caps, the every-probe_every extra slot, the probe schedule
at plain steps (its doubling, its cap of 64, its halving and its reset), the confidence cut, what reaches the cost
table, and which source drafts. test_draft_length.py and test_hybrid.py run the same choosers inside the loop."""

from __future__ import annotations

import numpy as np
import pytest

from pyllama_dspark.draft_length import (CostTable, DraftLengthChooser, SourceChooser, StaticCostTable,
                                         expected_tokens_by_k)

# drafting is free and verifying up to 2 rows costs as much as 1: at acceptance 0.8 the best is k = 1
# (rates 1, 1.8, 2.44 / 2, 2.952 / 3, 3.36 / 4)
BEST_ONE = dict(verify={1: 1.0, 2: 1.0, 3: 2.0, 4: 3.0, 5: 4.0}, draft={1: 0.0, 2: 0.0, 3: 0.0, 4: 0.0})
# verify rows are free past the first: the best is always the longest draft
BEST_ALL = dict(verify={1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: 1.0}, draft={1: 0.0, 2: 0.0, 3: 0.0, 4: 0.0})
# one draft pays when slot 0's acceptance is above 0.2 (break-even (0 + 1.2) / 1 - 1); two never do
ONE_IF_ABOVE_0_2 = dict(verify={1: 1.0, 2: 1.2, 3: 100.0}, draft={1: 0.0, 2: 0.0})


def chooser(costs: dict, k_max: int = 4, **kwargs) -> DraftLengthChooser:
    """A chooser on literal costs; without a margin unless given (the margin has tests of its own)."""
    kwargs.setdefault("margin", 0.0)
    out = DraftLengthChooser(k_max, **kwargs)
    out.costs = StaticCostTable(**costs)
    return out


def plain_steps_before_a_probe(c: DraftLengthChooser, cap: int | None = None, limit: int = 200) -> int:
    """How many plain steps (plan() == 0) come before the next probe (plan() == 1)."""
    for steps in range(limit):
        k = c.plan(cap)
        if k:
            assert k == 1
            return steps
    raise AssertionError(f"no probe in {limit} plans")


def test_plan_honours_the_cap_and_drafts_one_slot_more_every_probe_every_rounds():
    c = chooser(BEST_ONE, probe_every=3)
    assert c.best() == 1 and c.best(0) == 0
    assert [c.plan() for _ in range(6)] == [1, 1, 2, 1, 1, 2]  # the third, sixth, ... round measures slot 2
    c = chooser(BEST_ALL, probe_every=100)
    assert c.best() == 4 and c.best(2) == 2 and c.best(9) == 4
    assert [c.plan(2), c.plan(1), c.plan(None), c.plan(7)] == [2, 1, 4, 4]
    c = chooser(BEST_ALL, probe_every=1)  # the extra slot never passes the cap
    assert [c.plan(2), c.plan(4), c.plan()] == [2, 4, 4]
    c = chooser(BEST_ONE, probe_every=1)
    assert [c.plan(1), c.plan(3)] == [1, 2]


def test_plan_drafts_nothing_and_never_probes_when_nothing_may_be_drafted():
    for cap in (0, -1):
        c = chooser(BEST_ALL, probe_every=2)
        assert [c.plan(cap) for _ in range(10)] == [0] * 10
    assert chooser(BEST_ALL, k_max=0).plan() == 0


def test_best_rate_is_the_expected_tokens_per_unit_of_cost():
    c = chooser(BEST_ONE)
    assert c.best_rate() == (1, pytest.approx(1.8))
    assert c.best_rate(0) == (0, pytest.approx(1.0)) and c.best_rate(-3) == (0, pytest.approx(1.0))
    c = chooser(BEST_ALL)
    assert c.best_rate(3) == (3, pytest.approx(2.952)) and c.best_rate(0) == (0, 1.0)


def test_at_plain_steps_a_probe_comes_every_probe_every_steps():
    c = chooser(ONE_IF_ABOVE_0_2, k_max=2, accept_prior=0.1, probe_every=3)
    assert c.best() == 0
    assert [c.plan() for _ in range(9)] == [0, 0, 1, 0, 0, 1, 0, 0, 1]
    # plain rounds observed as such (k = 0) are no rejected probes: the schedule stays
    for _ in range(20):
        c.observe_round(0, 0, 0.0, 1.0)
    assert plain_steps_before_a_probe(c) == 2


def test_rejected_probes_double_the_gap_up_to_64():
    c = chooser(ONE_IF_ABOVE_0_2, k_max=2, accept_prior=0.1, probe_every=3)
    gaps = []
    for _ in range(8):
        gaps.append(plain_steps_before_a_probe(c) + 1)
        c.observe_acceptance(1, 0)
    assert gaps == [3, 6, 12, 24, 48, 64, 64, 64]


def test_an_accepted_probe_halves_the_gap_where_drafting_usually_does_not_pay():
    # both averages held at 0.1 (alpha and slow_alpha 0), below the break-even 0.2: a right probe is luck more
    # often than a change of text, so the gap halves (24 -> 12) instead of going back to probe_every at once
    c = chooser(ONE_IF_ABOVE_0_2, k_max=2, accept_prior=0.1, alpha=0.0, slow_alpha=0.0, probe_every=3)
    for _ in range(3):
        plain_steps_before_a_probe(c)
        c.observe_acceptance(1, 0)  # gap 3 -> 6 -> 12 -> 24
    assert plain_steps_before_a_probe(c) == 23
    c.observe_acceptance(1, 1)
    assert c.best() == 0 and plain_steps_before_a_probe(c) == 11
    c.observe_acceptance(1, 1)
    assert plain_steps_before_a_probe(c) == 5
    for _ in range(3):
        c.observe_acceptance(1, 1)  # 6 -> 3, then never below probe_every
        assert plain_steps_before_a_probe(c) == 2


def test_an_accepted_probe_resets_the_gap_where_the_slow_average_says_drafting_pays():
    # the slow average held at 0.3 (over the break-even 0.2) while ten rejections took the running one to 0.105
    # and the gap to 64: a right probe (running 0.19, still no drafting) is a dip ending, so probe_every again
    c = chooser(ONE_IF_ABOVE_0_2, k_max=2, accept_prior=0.3, alpha=0.1, slow_alpha=0.0, probe_every=3)
    for _ in range(10):
        c.observe_acceptance(1, 0)
    assert plain_steps_before_a_probe(c) == 63
    c.observe_acceptance(1, 1)
    assert c.accept[0] < c.break_even() and c.best() == 0
    assert plain_steps_before_a_probe(c) == 2


def test_acceptances_at_the_break_even_do_not_slow_the_probes():
    # alpha 0 and slow_alpha 0 hold both averages at the prior, which is the break-even exactly: (0 + 1.5) / 1 - 1
    half = dict(verify={1: 1.0, 2: 1.5, 3: 100.0}, draft={1: 0.0, 2: 0.0})
    c = chooser(half, k_max=2, accept_prior=0.5, alpha=0.0, probe_every=2, slow_alpha=0.0)
    assert c.break_even() == 0.5 and c.best() == 0  # one draft at 0.5 pays exactly as much as a plain step
    for _ in range(3):
        assert plain_steps_before_a_probe(c) == 1
        c.observe_acceptance(1, 0)
    below = chooser(half, k_max=2, accept_prior=0.49, alpha=0.0, probe_every=2, slow_alpha=0.0)
    below.observe_acceptance(1, 0)
    assert plain_steps_before_a_probe(below) == 3


def test_a_rejected_probe_slows_the_probes_when_either_average_is_below_the_break_even():
    # the slow average lifted over the break-even by accepted probes keeps the gap only while the running
    # acceptance is there too: an optimistic slow average alone (it starts at the prior) no longer does
    c = chooser(ONE_IF_ABOVE_0_2, k_max=2, accept_prior=0.1, alpha=0.5, probe_every=2, slow_alpha=0.5, margin=0.0)
    c.observe_acceptance(1, 1)  # slow: 0.1 -> 0.55; slot 0: 0.1 -> 0.55, drafting pays
    assert c.best() == 1
    c.observe_acceptance(1, 0)  # slow 0.275, slot 0 0.275: both >= 0.2, a rejected draft does not slow probing
    assert c.best() == 1
    c.observe_acceptance(1, 0)  # slot 0 0.1375 < 0.2: no drafting; slow 0.1375: probes slowed
    assert c.best() == 0 and plain_steps_before_a_probe(c) == 3
    optimistic = chooser(ONE_IF_ABOVE_0_2, k_max=2, accept_prior=0.9, alpha=0.9, probe_every=2, slow_alpha=0.0)
    optimistic.observe_acceptance(1, 0)  # slot 0: 0.09, the slow average still 0.9: slowed by the running one
    assert optimistic.best() == 0 and plain_steps_before_a_probe(optimistic) == 3


def test_drafting_that_pays_resets_the_gap():
    # a gap doubled by rejections goes back to probe_every once one draft pays, even if it pays by one slot only
    c = chooser(ONE_IF_ABOVE_0_2, k_max=2, accept_prior=0.1, alpha=0.5, probe_every=2)
    c.observe_acceptance(1, 0)  # slot 0: 0.05, gap 4
    assert plain_steps_before_a_probe(c) == 3
    c.observe_acceptance(1, 1)  # slot 0: 0.525, best() == 1: gap back to 2
    assert c.best() == 1
    c.observe_acceptance(1, 0)  # slot 0: 0.2625, best() still 1: gap 2
    c.observe_acceptance(1, 0)  # slot 0: 0.13125, best() 0: a rejected probe doubles 2 -> 4
    assert c.best() == 0 and plain_steps_before_a_probe(c) == 3


def test_acceptance_averages_move_by_alpha_on_the_slots_reached():
    c = chooser(BEST_ALL, k_max=3, accept_prior=0.8, alpha=0.5)
    c.observe_acceptance(3, 1)  # slot 0 accepted, slot 1 rejected, slot 2 never reached
    np.testing.assert_allclose(c.accept, [0.9, 0.4, 0.8])
    c.observe_acceptance(0, 0)  # nothing checked: nothing moves
    np.testing.assert_allclose(c.accept, [0.9, 0.4, 0.8])
    # a proposal longer than k_max (a free source's) moves the k_max slots there are
    c.observe_acceptance(6, 6)
    np.testing.assert_allclose(c.accept, [0.95, 0.7, 0.9])


def test_the_cut_keeps_the_prefix_with_the_best_rate_and_clips_confidences():
    c = chooser(dict(verify={1: 1.0, 2: 1.0, 3: 2.0, 4: 3.5}, draft={1: 0.0, 2: 0.0, 3: 0.0}), k_max=3)
    assert c.cut(None, 3, 0.1) == 3 and c.cut(np.array([0.0, 0.0, 0.0]), 1, 0.0) == 1
    assert c.cut(np.array([0.0, 0.0]), 0, 0.0) == 0
    assert c.cut(np.array([0.9, 0.0]), 2, 0.0) == 1  # rates 1.9 / 1, 1.9 / 2
    assert c.cut(np.array([0.9, 0.99]), 2, 0.0) == 1  # 1.9, 2.791 / 2
    assert c.cut(np.array([1.0, 1.0, 1.0]), 3, 0.0) == 1  # 2 / 1, 3 / 2, 4 / 3.5
    assert c.cut(np.array([1.0, 1.0, 1.0]), 3, 10.0) == 3  # the spent draft time makes long blocks pay
    # confidences outside [0, 1] count as their bound
    assert c.cut(np.array([1.0, 3.0, 3.0]), 3, 0.0) == 1
    flat = chooser(dict(verify={1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}, draft={1: 0.0, 2: 0.0, 3: 0.0}), k_max=3)
    assert flat.cut(np.array([-1.0, -1.0, 1.0]), 3, 0.0) == 1
    assert flat.cut(np.array([1.0, 1.0, 1.0, 1.0]), 2, 0.0) == 2  # only the drafted slots count


def test_expected_tokens_multiply_in_float64_whatever_the_input_dtype():
    accept = np.array([0.1, 0.3, 0.7], dtype=np.float32)
    wide = accept.astype(np.float64)
    want = [1.0, 1 + wide[0], 1 + wide[0] + wide[0] * wide[1], 1 + wide[0] + wide[0] * wide[1]
            + wide[0] * wide[1] * wide[2]]
    got = expected_tokens_by_k(accept)
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, want)


def test_observe_round_hands_the_drafted_count_to_the_cost_table():
    c = DraftLengthChooser(4, margin=0.0)
    c.observe_round(2, 1, 0.3, 1.0, k_drafted=4)  # 4 drafted, 2 kept by the cut, 3 rows verified
    assert c.costs.measured("draft") == [4] and c.costs.measured("verify") == [3]
    c.observe_round(1, 1, 0.1, 1.0)  # k_drafted defaults to k
    assert c.costs.measured("draft") == [1, 4] and c.costs.measured("verify") == [2, 3]
    sources = SourceChooser({"a": 4, "b": 4}, margin=0.0)
    sources.observe_round("b", 1, 0, 0.2, 1.0, k_drafted=3)
    assert sources.choosers["b"].costs.measured("draft") == [3] and sources.choosers["a"].costs.measured("draft") == []
    assert sources.choosers["a"].costs.measured("verify") == [2]  # verify costs are shared


def test_a_new_draft_row_count_refits_even_when_the_verify_row_is_known():
    table = CostTable(4)
    table.observe(1, 0.1, 1.0)  # draft 1, verify 2: both new
    table.observe(1, 0.3, 1.0, k_drafted=2)  # draft 2 new, verify 2 known: the draft line is refitted now
    assert table.draft(3) == pytest.approx(0.5)  # the line through (1, 0.1) and (2, 0.3)


def test_measurements_that_are_ignored_do_not_refit():
    table = CostTable(4)
    table.observe(1, 0.1, 1.0)
    before = table.verify(3)
    table.observe(1, 0.1, 3.0)  # verify 2 averaged: no new row count, no refit before refit_every rounds
    table.observe(1, float("nan"), 3.0)  # an ignored draft time is not a new row count either
    table.observe(9, 0.1, 3.0, k_drafted=0)  # nor a row count past the table
    # the mean of 1, 2 (3 counted as twice the average of 1) and 3, weighed 3:1 with the fill-in (1.0)
    assert table.verify(3) == before and table.verify(2) == pytest.approx((6.0 + 1.0) / 4)


def test_the_default_refit_comes_every_32_rounds():
    table = CostTable(4)
    table.observe(1, 0.1, 1.0)
    before = table.verify(3)
    for _ in range(31):
        table.observe(1, 0.1, 2.0)
    assert table.verify(3) == before  # 31 rounds since the last fit
    table.observe(1, 0.1, 2.0)
    assert table.verify(3) == pytest.approx(table.verify(2) * 2.0 / 1.5)  # refitted: the prior's shape, rescaled


def test_a_source_chooser_needs_a_source():
    with pytest.raises(ValueError, match="^a SourceChooser needs at least one source$"):
        SourceChooser({})


def source_chooser(costs: dict, **accept: float) -> SourceChooser:
    out = SourceChooser({name: 4 for name in accept}, margin=0.0)
    for name, value in accept.items():
        out.choosers[name].costs = StaticCostTable(**costs)
        out.choosers[name].accept[:] = value
        out.choosers[name].probe_every = 100
    return out


def test_the_source_with_the_best_rate_drafts_within_its_cap():
    sources = source_chooser(BEST_ALL, a=0.5, b=0.9)
    assert sources.choose({"a": 4, "b": 4}) == ("b", 4)
    assert sources.choose({"a": 4, "b": 2}) == ("b", 2)  # b's cap: 2 at 0.9 still beats 4 at 0.5
    assert sources.choose({"a": 4}) == ("a", 4)
    assert sources.choose({"a": 4, "b": 0}) == ("a", 4)
    assert sources.choose({"b": 0}) == ("b", 0)  # a cap of 0 drafts nothing, and probes nothing
    assert sources.choose({"b": -2}) == ("b", 0)
    assert sources.choose({}) == ("b", 0)


def test_a_free_source_that_drafts_one_slot_is_chosen():
    sources = source_chooser(BEST_ONE, a=0.8)
    assert sources.choosers["a"].best() == 1
    assert sources.choose({"a": 4}, free={"a"}) == ("a", 1)


def test_when_no_source_drafts_the_last_one_asked_is_returned():
    never = dict(verify={1: 1.0, 2: 5.0, 3: 9.0, 4: 13.0, 5: 17.0}, draft={1: 0.0, 2: 0.0, 3: 0.0, 4: 0.0})
    sources = source_chooser(never, a=0.3, b=0.3)
    assert sources.choose({"a": 4, "b": 4}) == ("b", 0)
    assert sources.choose({"a": 4, "b": 4}, free={"a", "b"}) == ("b", 0)
    assert sources.choose({"a": 4, "b": 4}, free={"b"}) == ("a", 0)


def test_the_margin_keeps_plain_steps_where_a_draft_pays_by_less():
    # one draft at acceptance a pays (1 + a) / 1.2 times a plain step: 1.042x at 0.25, 1.058x at 0.27
    assert chooser(ONE_IF_ABOVE_0_2, k_max=2, accept_prior=0.25, margin=0.05).best() == 0
    assert chooser(ONE_IF_ABOVE_0_2, k_max=2, accept_prior=0.27, margin=0.05).best() == 1
    assert chooser(ONE_IF_ABOVE_0_2, k_max=2, accept_prior=0.25, margin=0.0).best() == 1
    c = chooser(ONE_IF_ABOVE_0_2, k_max=2, accept_prior=0.27, margin=0.05)
    assert c.break_even() == pytest.approx(1.05 * 1.2 - 1)
    assert c.best_rate() == (1, pytest.approx(1.27 / 1.2 / 1.05))  # the rate a source is compared by, deflated
    assert DraftLengthChooser(4).margin == 0.05 and SourceChooser({"a": 2}).choosers["a"].margin == 0.05


def test_every_probe_every_th_drafting_round_drafts_one_slot_more_and_no_other():
    c = chooser(BEST_ONE, probe_every=4)
    assert [c.plan() for _ in range(8)] == [1, 1, 1, 2, 1, 1, 1, 2]


def test_the_probe_gap_counts_plain_rounds_from_the_last_drafting_round():
    c = chooser(ONE_IF_ABOVE_0_2, k_max=2, probe_every=4)
    c.plan()
    c.plan()  # two plain rounds that would count towards a probe...
    c.accept[:] = 0.9
    assert c.plan() == 1  # ...but a drafting round comes between
    c.accept[:] = 0.0
    assert plain_steps_before_a_probe(c) == 3  # three plain rounds, then the probe on the fourth


def test_the_slow_average_of_slot_0_moves_by_slow_alpha_on_rounds_that_drafted():
    c = chooser(ONE_IF_ABOVE_0_2, k_max=2, accept_prior=0.8, slow_alpha=0.05)
    c.observe_acceptance(1, 0)
    assert c._accept0_slow == pytest.approx(0.8 - 0.05 * 0.8)
    c.observe_acceptance(2, 1)
    assert c._accept0_slow == pytest.approx(0.76 + 0.05 * (1 - 0.76))
    c.observe_acceptance(0, 0)  # nothing drafted: no change
    assert c._accept0_slow == pytest.approx(0.772)


def test_a_source_chooser_gives_its_margin_to_every_source():
    sources = SourceChooser({"lookup": 8, "dspark": 4}, margin=0.25)
    assert [c.margin for c in sources.choosers.values()] == [0.25, 0.25]
