"""Acceptance of a draft (pyllama_dspark/verify.py) with scripted draws: every branch's result and the exact
distribution handed to the draw (the statistical tests in test_rejection.py check the same code in distribution;
these pin each step so a changed comparison, residual or fallback fails by name)."""

from __future__ import annotations

import numpy as np
import pytest

from pyllama_dspark.verify import accept_greedy, accept_stochastic


@pytest.mark.parametrize("draft, target, expected", [
    ([1, 2, 3], [1, 2, 3, 4], (3, 4)),  # all accepted: the bonus token
    ([1, 2, 3], [1, 9, 3, 4], (1, 9)),  # the first mismatch: the target's correction there
    ([1, 2, 3], [8, 2, 3, 4], (0, 8)),
    ([1, 2, 3], [1, 2, 7, 4], (2, 7)),
    ([], [5], (0, 5)),                  # no drafts: the target's own next token
])
def test_accept_greedy_takes_the_longest_matching_prefix(draft, target, expected):
    n, token = accept_greedy(np.array(draft, dtype=np.int64), np.array(target, dtype=np.int64))
    assert (n, token) == expected and type(n) is int and type(token) is int


def test_accept_greedy_refuses_a_wrong_number_of_target_rows():
    with pytest.raises(ValueError) as err:
        accept_greedy(np.array([1, 2, 3]), np.array([1, 2, 3]))
    assert str(err.value) == "expected 4 target rows for 3 drafts, got 3"


class Script:
    """uniform() returns the given values in order; draw(v) records v and returns the given index."""

    def __init__(self, uniforms, index=0):
        self.uniforms = list(uniforms)
        self.index = index
        self.drawn = []

    def uniform(self):
        return self.uniforms.pop(0)

    def draw(self, probabilities):
        self.drawn.append(np.array(probabilities, copy=True))
        return self.index


def run(draft, q, p, script):
    return accept_stochastic(np.array(draft), np.array(q, dtype=np.float64), np.array(p, dtype=np.float64),
                             script.uniform, script.draw)


Q = [[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]]
P = [[0.25, 0.5, 0.25, 0.0], [0.1, 0.2, 0.3, 0.4], [0.0, 0.0, 0.5, 0.5]]


def test_all_accepted_draws_the_bonus_from_the_last_target_row():
    script = Script([0.0, 0.0], index=3)
    assert run([1, 2], Q, P, script) == (2, 3)
    assert len(script.drawn) == 1
    np.testing.assert_array_equal(script.drawn[0], P[2])


def test_a_draw_is_accepted_below_p_over_q_and_rejected_at_it():
    # slot 0: d = 0, p/q = 0.25 / 0.5 = 0.5: r = 0.4999 accepts, r = 0.5 rejects
    script = Script([0.4999, 0.0])
    assert run([0, 2], Q, P, script)[0] == 2
    script = Script([0.5], index=2)
    assert run([0, 2], Q, P, script) == (0, 2)


def test_a_rejection_draws_from_the_normalised_positive_part_of_p_minus_q():
    script = Script([0.9], index=1)
    assert run([0, 2], Q, P, script) == (0, 1)
    # p - q = [-0.25, 0, 0.25, 0] -> [0, 0, 0.25, 0] -> normalised [0, 0, 1, 0]
    np.testing.assert_array_equal(script.drawn[0], [0.0, 0.0, 1.0, 0.0])
    # at slot 1 (d = 1, p/q = 0.2 / 0.25 = 0.8): p - q = [-0.15, -0.05, 0.05, 0.15] -> [0, 0, 0.25, 0.75]
    script = Script([0.0, 0.8], index=3)
    assert run([1, 1], Q, P, script) == (1, 3)
    np.testing.assert_allclose(script.drawn[0], [0.0, 0.0, 0.25, 0.75], rtol=1e-12)
    assert script.drawn[0].sum() == pytest.approx(1.0)


def test_a_ratio_above_one_always_accepts():
    # slot 0, d = 1: p/q = 0.5 / 0.5 = 1; slot 1, d = 3: 0.4 / 0.25 = 1.6 -> capped at 1
    script = Script([0.999999, 0.999999], index=0)
    assert run([1, 3], Q, P, script) == (2, 0)


def test_a_rejection_where_p_equals_q_draws_from_p():
    """p == q leaves no positive residual (rejection then has probability 0 for r < 1; a scripted r = 1 forces
    it): the fallback draws from p itself instead of dividing by zero."""
    same = [[0.25, 0.25, 0.5, 0.0]]
    script = Script([1.0], index=2)
    assert run([2], same, same + [[1.0, 0.0, 0.0, 0.0]], script) == (0, 2)
    np.testing.assert_array_equal(script.drawn[0], same[0])


def test_a_draft_token_with_zero_draft_probability_is_refused():
    with pytest.raises(ValueError) as err:
        run([2, 0], Q, P, Script([0.0]))
    assert str(err.value) == "draft token 2 at slot 0 has q = 0: it cannot have been drawn from q"


@pytest.mark.parametrize("q, p", [(Q[:1], P), (Q, P[:2])])
def test_shapes_must_match_the_draft(q, p):
    with pytest.raises(ValueError) as err:
        run([1, 2], q, p, Script([]))
    shape_q, shape_p = np.array(q).shape, np.array(p).shape
    assert str(err.value) == f"expected q [2, V] and p [3, V], got {shape_q} and {shape_p}"
