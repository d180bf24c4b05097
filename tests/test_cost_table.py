"""The draft-length chooser's cost table (draft_length.CostTable, StaticCostTable) against literal values: the
priors, one measurement scaling them, a least-squares line through two or more (never falling, floored, weighted by
counts), the averages and their weighing with the line, the refit schedule, what a measurement must be to count,
and verify costs shared between tables."""

from __future__ import annotations

import numpy as np
import pytest

from pyllama_dspark.draft_length import CostTable, DraftLengthChooser, StaticCostTable


def verifies(table, n_max):
    return [round(table.verify(n), 6) for n in range(n_max + 2)]


def drafts(table, k_max):
    return [round(table.draft(k), 6) for k in range(k_max + 1)]


def test_a_fresh_table_is_the_priors_in_units_of_one_verify_row():
    table = CostTable(3)  # verify prior (1.0, 0.5): 1 + 0.5 (n - 1); draft prior (0.2, 0.05): 0.2 + 0.05 (k - 1)
    assert verifies(table, 3) == [0.5, 1.0, 1.5, 2.0, 2.5]
    assert drafts(table, 3) == [0.0, 0.2, 0.25, 0.3]
    np.testing.assert_allclose(table.round_seconds(2), [1.0, 1.7, 2.25])
    assert table.measured("verify") == [] and table.measured("draft") == []


def test_custom_priors_and_a_measured_one_row_verify_scale_the_draft_prior():
    table = CostTable(2, verify_prior=(2.0, 1.0), draft_prior=(0.5, 0.25))
    assert verifies(table, 2) == [1.0, 2.0, 3.0, 4.0]
    assert drafts(table, 2) == [0.0, 0.5, 0.75]
    table.observe(0, 0.0, 4.0)  # a verify of one row, no draft: the draft prior is in units of that
    assert table.measured("verify") == [1] and table.measured("draft") == []
    assert drafts(table, 2) == [0.0, 2.0, 3.0]


def test_one_measurement_scales_the_prior_shape():
    table = CostTable(3)
    table.observe(1, 0.1, 0.6)  # a draft of 1 slot, a verify of 2 rows
    assert table.measured("draft") == [1] and table.measured("verify") == [2]
    assert verifies(table, 3) == [0.2, 0.4, 0.6, 0.8, 1.0]  # shape 0.5 1 1.5 2 2.5, scaled by 0.6 / 1.5
    assert drafts(table, 3) == [0.0, 0.1, 0.125, 0.15]  # shape 0.2 0.25 0.3, scaled by 0.1 / 0.2


def test_two_measurements_draw_a_line_not_falling_and_floored():
    table = CostTable(3)
    table.observe(0, 0.0, 1.0)
    table.observe(2, 0.0, 2.0, k_drafted=0)  # no draft measured: k_drafted 0
    assert verifies(table, 3) == [0.5, 1.0, 1.5, 2.0, 2.5]  # through (1, 1.0) and (3, 2.0)
    assert table.measured("draft") == []
    falling = CostTable(3)
    falling.observe(0, 0.0, 2.0)
    falling.observe(2, 0.0, 1.0, k_drafted=0)
    # flat at the mean; a measured row count's one measurement weighed 1:1 with that (2.0 and 1.5, 1.0 and 1.5)
    assert verifies(falling, 3) == [1.5, 1.75, 1.5, 1.25, 1.5]
    steep = CostTable(3)
    steep.observe(0, 0.0, 1.0)
    steep.observe(1, 0.0, 3.0, k_drafted=0)
    assert verifies(steep, 3) == [0.25, 1.0, 3.0, 5.0, 7.0]  # -1 at 0 rows, floored at a quarter of the least


def test_repeated_measurements_are_a_plain_mean_then_a_moving_average_and_a_stall_counts_as_twice():
    table = CostTable(2)  # alpha 0.2: the first 5 measurements plainly averaged
    table.observe(1, 0.1, 0.4)  # the fill-in: the prior's shape through verify(2) = 0.4, draft(1) = 0.1, kept
    for seconds in [0.8, 0.6, 0.6, 0.6]:
        table.observe(1, 0.15, seconds)
    # the mean 0.6 of 5 measurements weighed 5:1 with the fill-in 0.4; draft: 0.14 and 0.1
    assert table.verify(2) == pytest.approx((5 * 0.6 + 0.4) / 6)
    assert table.draft(1) == pytest.approx((5 * 0.14 + 0.1) / 6)
    table.observe(1, 0.3, 0.8)  # the 6th: weight alpha
    assert table.verify(2) == pytest.approx((6 * 0.64 + 0.4) / 7)
    table.observe(1, 0.3, 5.0)  # a stall: counts as twice the average, 1.28
    assert table.verify(2) == pytest.approx((7 * (0.64 + 0.2 * 0.64) + 0.4) / 8)
    half = CostTable(2, alpha=0.5)
    for seconds in [0.4, 0.8, 0.8]:  # the mean of two, then weight 0.5
        half.observe(1, 0.1, seconds)
    assert half.verify(2) == pytest.approx((3 * 0.7 + 0.4) / 4)


def test_one_slow_round_of_a_rarely_run_row_count_is_not_its_cost_nor_the_lines():
    table = CostTable(9)
    for _ in range(40):  # what the loop runs often: one row at 10 ms, two at 11 ms
        table.observe(0, 0.0, 0.010)
        table.observe(1, 0.001, 0.011)
    table.observe(2, 0.001, 0.030)  # three rows, once, in a stall
    # the fill-in weighs each row count by its measurements (least squares); three rows' estimate is its one
    # measurement and the line's weighed 1:1
    slope, icept = np.polyfit([1, 2, 3], [0.010, 0.011, 0.030], 1, w=np.sqrt([40, 40, 1]))
    assert table.verify(3) == pytest.approx((0.030 + icept + 3 * slope) / 2)
    assert table.verify(9) == pytest.approx(icept + 9 * slope) == pytest.approx(0.0272, abs=1e-4)
    unweighted = np.polyval(np.polyfit([1, 2, 3], [0.010, 0.011, 0.030], 1), 9)
    assert unweighted == pytest.approx(0.087)  # what a line through the three averages said
    assert table.verify(1) == pytest.approx((40 * 0.010 + icept + slope) / 41)


def test_the_fill_in_is_refitted_on_a_new_row_count_and_every_refit_every_rounds():
    table = CostTable(3, refit_every=2)
    table.observe(0, 0.0, 1.0)
    table.observe(2, 0.0, 2.0, k_drafted=0)
    assert table.verify(2) == pytest.approx(1.5)
    table.observe(2, 0.0, 3.0, k_drafted=0)  # row 3's mean now 2.5; a known row count, one round since the fit
    assert table.verify(3) == pytest.approx((2 * 2.5 + 2.0) / 3) and table.verify(2) == pytest.approx(1.5)
    table.observe(0, 0.0, 1.0)  # the second round since the fit: refitted through (1, 1.0) and (3, 2.5)
    assert table.verify(2) == pytest.approx(1.75) and table.verify(3) == pytest.approx(2.5)


def test_a_table_that_joins_later_counts_its_rounds_to_a_refit_from_its_creation():
    measured = CostTable(3)
    measured.observe(1, 0.0, 1.0, k_drafted=0)  # verify 2 rows: new, fitted
    late = CostTable(3)
    late.share_verify(measured)
    before = measured.verify(3)
    for _ in range(31):  # verify 2 known: moving averages only, no refit before 32 rounds of this table
        late.observe(1, 0.0, 3.0, k_drafted=0)
    assert measured.verify(3) == before
    late.observe(1, 0.0, 3.0, k_drafted=0)  # the 32nd: every sharing table is refitted to the averaged row
    assert measured.verify(3) == pytest.approx(measured.verify(2) * 2.0 / 1.5) != before


@pytest.mark.parametrize("seconds", [float("nan"), float("inf"), -0.1])
def test_a_measurement_that_is_not_a_finite_non_negative_time_is_ignored(seconds):
    table = CostTable(2)
    table.observe(1, seconds, seconds)
    assert table.measured("verify") == [] and table.measured("draft") == []
    assert verifies(table, 2) == [0.5, 1.0, 1.5, 2.0]


def test_zero_seconds_counts_and_row_counts_beyond_the_table_are_ignored():
    table = CostTable(2)
    table.observe(1, 0.0, 0.0)
    assert table.measured("verify") == [2] and table.measured("draft") == [1]
    table.observe(4, 1.0, 1.0)  # 5 rows and 4 slots: beyond n_max = 2 (counts 0..3 kept)
    assert table.measured("verify") == [2] and table.measured("draft") == [1]
    table.observe(3, 1.0, 1.0)  # 3 slots fit, 4 rows do not
    assert table.measured("verify") == [2] and table.measured("draft") == [1, 3]
    table.observe(2, 1.0, 1.0)  # 3 rows fit (the last row count)
    assert table.measured("verify") == [2, 3] and table.measured("draft") == [1, 2, 3]
    table.observe(1, 0.5, 0.5)  # after an average of 0 s a measurement counts whole (twice 0 would be 0)
    assert table._measured["verify"][2] == pytest.approx(0.25) and table._measured["draft"][1] == pytest.approx(0.25)


def test_shared_verify_costs_are_read_and_updated_by_every_table():
    target = CostTable(3)
    other = CostTable(3, draft_prior=(0.1, 0.0))
    other.share_verify(target)
    target.observe(1, 0.1, 0.6)
    assert other.measured("verify") == [2] and other.measured("draft") == []
    assert verifies(other, 3) == verifies(target, 3) == [0.2, 0.4, 0.6, 0.8, 1.0]
    assert drafts(other, 2) == [0.0, 0.1, 0.1]  # its own draft prior (no one-row verify measured: units of 1)
    other.observe(2, 0.5, 1.2)
    assert target.measured("verify") == [2, 3] and target.measured("draft") == [1]
    assert target.verify(3) == pytest.approx(1.2) and target.verify(4) == pytest.approx(1.8)
    third = CostTable(3)
    third.share_verify(other)  # joins the same group
    other.observe(0, 0.0, 0.3)
    # 0.3 weighed 1:1 with the refitted line's 0.25 (through (1, 0.3), (2, 0.6), (3, 1.2))
    assert third.verify(1) == target.verify(1) == pytest.approx(0.275)
    assert drafts(third, 2) == [0.0, 0.06, 0.075]  # its draft prior in units of the shared one-row verify


def test_tables_for_different_row_counts_cannot_share():
    with pytest.raises(ValueError) as err:
        CostTable(3).share_verify(CostTable(5))
    assert str(err.value) == "tables for different row counts (5 and 3 drafts) cannot share verify costs"


def test_a_static_table_holds_the_given_costs_and_ignores_measurements():
    table = StaticCostTable({1: 1.0, 2: 1.2, 3: 1.4}, {1: 0.1, 2: 0.2})
    assert table.measured("verify") == [1, 2, 3] and table.measured("draft") == [1, 2]
    assert [table.verify(n) for n in (1, 2, 3)] == [1.0, 1.2, 1.4]
    assert drafts(table, 2) == [0.0, 0.1, 0.2]
    table.observe(1, 5.0, 5.0)
    assert table.verify(2) == 1.2 and table.draft(1) == 0.1
    wide = StaticCostTable({1: 1.0, 2: 2.0}, {1: 0.1, 2: 0.2, 3: 0.3})  # n_max from the drafts: 3
    assert wide.draft(3) == 0.3 and wide.verify(4) == pytest.approx(4.0)


def test_a_static_table_is_sized_by_its_largest_verify_or_draft():
    """n_max = the largest verify row count - 1, or the largest draft if more (0 without drafts): a table shares
    verify costs only with one of the same size, whose size the refusal names."""
    StaticCostTable({1: 1.0}, {}).share_verify(CostTable(0))
    StaticCostTable({1: 1.0, 2: 1.5, 3: 2.0}, {1: 0.1}).share_verify(CostTable(2))
    with pytest.raises(ValueError) as err:
        StaticCostTable({1: 1.0}, {}).share_verify(CostTable(1))
    assert str(err.value) == "tables for different row counts (1 and 0 drafts) cannot share verify costs"
    with pytest.raises(ValueError) as err:
        StaticCostTable({1: 1.0, 2: 1.5, 3: 2.0}, {}).share_verify(CostTable(3))
    assert str(err.value) == "tables for different row counts (3 and 2 drafts) cannot share verify costs"


def test_a_chooser_takes_zero_drafts_and_refuses_fewer():
    from pyllama_dspark.draft_length import DraftLengthChooser

    assert DraftLengthChooser(k_max=0).best() == 0
    with pytest.raises(ValueError) as err:
        DraftLengthChooser(k_max=-1)
    assert str(err.value) == "k_max must be >= 0, got -1"


def from_scratch(table, name):
    """A row count's estimate recomputed from the measurements and the last fit (what the table keeps current)."""
    measured, counts, fit = table._measured[name], table._counts[name], table._fits[name]
    return np.where(np.isnan(measured), fit, (counts * np.nan_to_num(measured) + fit) / (counts + 1.0))


def test_the_estimates_kept_between_fits_are_what_the_measurements_and_the_last_fit_give():
    rng = np.random.default_rng(7)
    first, second = CostTable(5, refit_every=1000), CostTable(5, refit_every=1000, draft_prior=(0.3, 0.1))
    second.share_verify(first)
    for round_ in range(300):  # rounds of either table, row counts all over, some beyond the table
        table = (first, second)[int(rng.integers(2))]
        k = int(rng.integers(0, 8))
        table.observe(k, float(rng.uniform(0.001, 0.004)), float(rng.uniform(0.005, 0.02)),
                      k_drafted=k + int(rng.integers(0, 2)))
        for each in (first, second):
            verify, draft = from_scratch(each, "verify"), from_scratch(each, "draft")
            assert [each.verify(n) for n in range(7)] == pytest.approx(verify.tolist(), rel=1e-12)
            assert [each.draft(k) for k in range(1, 7)] == pytest.approx(draft[1:].tolist(), rel=1e-12)
            assert each.draft(0) == 0.0
            rounds = [each.draft(k) + each.verify(k + 1) for k in range(6)]
            assert each.round_seconds(5).tolist() == pytest.approx(rounds, rel=1e-12)
            assert each.round_seconds_list(5) == each.round_seconds(5).tolist()
            assert each.round_seconds_list(2) == each.round_seconds(5).tolist()[:3]


def test_a_round_measured_at_no_time_is_the_best_rate_not_an_error():
    chooser = DraftLengthChooser(2)
    chooser.costs = StaticCostTable(verify={1: 1.0, 2: 0.0, 3: 1.0}, draft={1: 0.0, 2: 0.0})
    assert chooser.best_rate() == (1, float("inf"))
    chooser.costs = StaticCostTable(verify={1: 0.0, 2: 0.0, 3: 0.0}, draft={1: 0.0, 2: 0.0})
    assert chooser.best_rate() == (0, float("inf"))  # all infinite: the first
