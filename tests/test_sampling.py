"""Sampling transforms on hand-written distributions (pure numpy, no native library)."""

from __future__ import annotations

import numpy as np
import pytest

from pyllama_dspark.sampling import Sampler, SamplingParams, probabilities

LOGITS = np.log(np.array([0.1, 0.4, 0.3, 0.2]))


def test_greedy_is_first_argmax():
    assert Sampler()(np.array([1.0, 3.0, 3.0, 0.0])) == 1
    assert probabilities(LOGITS, SamplingParams()).tolist() == [0, 1, 0, 0]


def test_temperature_one_is_softmax():
    np.testing.assert_allclose(probabilities(LOGITS, SamplingParams(temperature=1.0)), [0.1, 0.4, 0.3, 0.2])


def test_top_k_and_top_p():
    np.testing.assert_allclose(probabilities(LOGITS, SamplingParams(temperature=1.0, top_k=2)), [0, 4 / 7, 3 / 7, 0])
    # 0.4 + 0.3 = 0.7 reaches top_p 0.7 -> keep two
    np.testing.assert_allclose(probabilities(LOGITS, SamplingParams(temperature=1.0, top_p=0.7)), [0, 4 / 7, 3 / 7, 0])
    np.testing.assert_allclose(probabilities(LOGITS, SamplingParams(temperature=1.0, top_p=0.71)),
                               [0, 0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9])


def test_draws_follow_the_distribution():
    sampler = Sampler(SamplingParams(temperature=1.0, seed=0))
    counts = np.bincount([sampler(LOGITS) for _ in range(20000)], minlength=4) / 20000
    np.testing.assert_allclose(counts, [0.1, 0.4, 0.3, 0.2], atol=0.015)


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)])
def test_bad_params(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_scales_the_logits_before_the_softmax(temperature):
    """Expected values written out by hand, not through the function under test."""
    logits = np.array([1.0, 2.0, 0.5, -1.0])
    e = np.exp(logits / temperature)
    np.testing.assert_allclose(probabilities(logits, SamplingParams(temperature=temperature)), e / e.sum(),
                               rtol=1e-12)


def test_top_k_and_top_p_at_a_temperature_other_than_one():
    logits = np.array([3.0, 1.0, 2.0, 0.0])
    # top-k 2 at T = 0.5: tokens 0 and 2, weights e^6 and e^4
    p = probabilities(logits, SamplingParams(temperature=0.5, top_k=2))
    w = np.array([np.exp(6.0), 0.0, np.exp(4.0), 0.0])
    np.testing.assert_allclose(p, w / w.sum(), rtol=1e-12)
    # top-p 0.8 at T = 2: softmax(logits / 2) = [.4551, .1674, .2760, .1015]; .4551 + .2760 = .7311 < 0.8, so
    # token 1 (.1674) is kept too and token 3 is cut
    full = np.exp(logits / 2.0) / np.exp(logits / 2.0).sum()
    p = probabilities(logits, SamplingParams(temperature=2.0, top_p=0.8))
    keep = np.array([1.0, 1.0, 1.0, 0.0])
    np.testing.assert_allclose(p, full * keep / (full * keep).sum(), rtol=1e-12)


def test_top_p_over_a_large_vocabulary_equals_the_full_sort_bit_for_bit():
    """probabilities sorts only the most likely tokens when they reach top_p (a full sort of 49k ids per token
    cost milliseconds); the result must be the full stable sort's, ties included, and for flat distributions
    (where the nucleus spans more than the partitioned candidates) too."""
    rng = np.random.default_rng(0)

    def full_sort(logits, temperature, top_p):
        probs = np.exp(logits / temperature - (logits / temperature).max())
        probs /= probs.sum()
        order = np.argsort(-probs, kind="stable")
        cut = int(np.searchsorted(np.cumsum(probs[order]), top_p)) + 1
        probs[order[cut:]] = 0.0
        return probs / probs.sum()

    for scale, rounding, top_p in [(8.0, None, 0.95), (2.0, 1, 0.9), (0.3, None, 0.99), (0.05, 2, 0.5)]:
        logits = rng.standard_normal(49152) * scale
        if rounding is not None:
            logits = np.round(logits, rounding)  # many exact ties, at the nucleus' edge too
        got = probabilities(logits, SamplingParams(temperature=0.8, top_p=top_p))
        np.testing.assert_array_equal(got, full_sort(logits.astype(np.float64), 0.8, top_p))


def test_greedy_probabilities_are_one_at_the_first_maximum():
    """Temperature 0: all the mass on the first index of the maximum (llama.cpp's greedy choice), as float64."""
    p = probabilities(np.array([0.5, 2.0, 2.0, -1.0], dtype=np.float32), SamplingParams(temperature=0.0))
    assert p.dtype == np.float64 and p.tolist() == [0.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), "temperature must be >= 0, got -0.1"),
    (dict(temperature=float("nan")), "temperature must be >= 0, got nan"),
    (dict(top_k=-1), "top_k must be >= 0, got -1"),
    (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0"),
    (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
])
def test_sampling_params_refusals_name_the_knob(kwargs, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert str(err.value) == message


def test_the_edges_of_the_knobs_are_accepted():
    assert SamplingParams(temperature=0.0, top_k=0, top_p=1.0).greedy
    assert not SamplingParams(temperature=1e-6).greedy


def test_top_k_of_one_keeps_only_the_maximum_and_the_result_is_float64():
    logits = np.array([0.1, 3.0, 2.9, -2.0], dtype=np.float32)
    assert probabilities(logits, SamplingParams(temperature=1.0, top_k=1)).tolist() == [0.0, 1.0, 0.0, 0.0]
    assert probabilities(logits, SamplingParams(temperature=1.0)).dtype == np.float64


class ScriptedRng:
    def __init__(self, values):
        self.values = list(values)

    def random(self):
        return self.values.pop(0)


@pytest.mark.parametrize("probs, uniforms, expected", [
    ([0.25, 0.25, 0.5], [0.0, 0.25, 0.4999, 0.5, 0.9999], [0, 1, 1, 2, 2]),  # a draw on a boundary goes right
    ([1.0, 1.0, 2.0], [0.2, 0.5, 0.6], [0, 2, 2]),  # unnormalised: r scales with the total (r = 0.8, 2.0, 2.4)
    ([0.5, 0.5], [1.0], [1]),                        # never past the last index
])
def test_draw_is_the_inverse_cdf_of_one_uniform(probs, uniforms, expected):
    sampler = Sampler(SamplingParams(temperature=1.0))
    sampler.rng = ScriptedRng(uniforms)
    assert [sampler.draw(np.array(probs)) for _ in uniforms] == expected


def test_the_seed_fixes_the_draws():
    logits = np.zeros(100)
    first, same, other = ([sampler(logits) for _ in range(20)] for sampler in
                          (Sampler(SamplingParams(temperature=1.0, seed=seed)) for seed in (5, 5, 6)))
    assert first == same and first != other


def full_stable_order(probs: np.ndarray) -> np.ndarray:
    return np.argsort(-probs, kind="stable")


def test_most_likely_first_sorts_only_the_candidates_above_the_boundary_when_they_reach_top_p():
    from pyllama_dspark.sampling import _most_likely_first

    # 0.5, 0.25, 0.125 are exact in binary: their mass is 0.875 exactly
    probs = np.array([0.03, 0.5, 0.01, 0.25, 0.01, 0.125, 0.01, 0.005, 0.01, 0.005, 0.005, 0.0375])
    assert _most_likely_first(probs, 0.5, candidates=4).tolist() == [1, 3, 5]  # not id 11, the 4th largest
    assert _most_likely_first(probs, 0.875, candidates=4).tolist() == [1, 3, 5]  # the mass reaches top_p exactly
    # past the candidates' mass, or with no more ids than candidates: the full stable sort
    assert _most_likely_first(probs, 0.9, candidates=4).tolist() == full_stable_order(probs).tolist()
    assert _most_likely_first(probs, 0.5, candidates=12).tolist() == full_stable_order(probs).tolist()
    assert _most_likely_first(probs, 0.5, candidates=11).tolist() == [1, 3, 5, 11, 0, 2, 4, 6, 8]  # not the 0.005s
    # the 4th and 5th largest tie: neither is taken, whichever the partition picked
    tied = np.array([0.5, 0.2, 0.05, 0.2, 0.05, 0.0, 0.0])
    assert _most_likely_first(tied, 0.6, candidates=4).tolist() == [0, 1, 3]
    # every candidate ties: none is above the boundary, so the full sort
    flat = np.full(9, 1 / 9)
    assert _most_likely_first(flat, 0.5, candidates=3).tolist() == list(range(9))


def test_most_likely_first_breaks_ties_by_id_like_the_full_stable_sort():
    from pyllama_dspark.sampling import _most_likely_first

    rng = np.random.default_rng(5)
    fast_paths = 0
    for trial in range(300):
        size = int(rng.integers(6, 60))
        probs = np.round(rng.exponential(size=size) ** 3, 1) + 1e-3  # many exact ties
        probs /= probs.sum()
        top_p = float(rng.uniform(0.05, 1.0))
        candidates = int(rng.integers(2, size))
        got = _most_likely_first(probs, top_p, candidates=candidates)
        want = full_stable_order(probs)
        cut = int(np.searchsorted(np.cumsum(probs[want]), top_p)) + 1
        assert got[:cut].tolist() == want[:cut].tolist(), trial
        np.testing.assert_array_equal(np.cumsum(probs[got])[:cut], np.cumsum(probs[want])[:cut])
        if len(got) < size:
            fast_paths += 1
            assert np.cumsum(probs[got])[-1] >= top_p
    assert fast_paths > 50  # the partition path was taken, not only the full sort


def test_top_p_over_more_than_1024_tokens_equals_the_full_sort():
    """probabilities() itself on a vocabulary just past the 1024 candidates (the 49k test above is the real size)."""
    rng = np.random.default_rng(1)
    for scale, top_p in [(6.0, 0.9), (0.05, 0.5), (3.0, 0.999)]:
        logits = np.round(rng.standard_normal(1500) * scale, 1)
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        order = full_stable_order(probs)
        cut = int(np.searchsorted(np.cumsum(probs[order]), top_p)) + 1
        want = np.zeros_like(probs)
        want[order[:cut]] = probs[order[:cut]]
        np.testing.assert_array_equal(probabilities(logits, SamplingParams(temperature=1.0, top_p=top_p)),
                                      want / want.sum())


def test_top_p_of_one_keeps_even_negligible_tokens():
    # the cumulative sum reaches 1.0 at the first token already: a nucleus cut would drop the second
    p = probabilities(np.array([0.0, -50.0, -60.0]), SamplingParams(temperature=1.0, top_p=1.0))
    assert p[1] == pytest.approx(np.exp(-50.0)) and p[2] > 0.0
    cut = probabilities(np.array([0.0, -50.0, -60.0]), SamplingParams(temperature=1.0, top_p=0.999999))
    assert cut.tolist() == [1.0, 0.0, 0.0]


def test_top_k_keeps_exactly_the_k_largest_logits():
    # numpy's partition leaves the elements next to the k-th in order for most inputs, so a partition at the
    # wrong rank keeps the right set almost always: seeds 146, 384, 424, 1069, 1271, 1305 are ones where it would not
    for seed in [146, 384, 424, 1069, 1271, 1305, *range(40)]:
        rng = np.random.default_rng(seed)
        size, top_k = int(rng.integers(30, 3000)), int(rng.integers(1, 200))
        logits = rng.standard_normal(size)  # distinct values
        kept = np.flatnonzero(probabilities(logits, SamplingParams(temperature=1.0, top_k=top_k)))
        assert sorted(kept.tolist()) == sorted(np.argsort(-logits)[:top_k].tolist()), seed


def test_most_likely_first_never_splits_a_tie_at_the_candidate_boundary():
    """One likely token, then a tie group straddling the candidates: the nucleus must take the tied ids by id
    (the full stable sort's choice), never the one a partition happened to pick."""
    from pyllama_dspark.sampling import _most_likely_first

    rng = np.random.default_rng(11)
    for trial in range(100):
        probs = np.full(200, 0.37 / 190)
        ids = rng.permutation(200)
        probs[ids[0]] = 0.6
        probs[ids[1:11]] = 0.003  # ten tied ids
        probs /= probs.sum()
        got = _most_likely_first(probs, 0.6025, candidates=3)
        want = full_stable_order(probs)
        cut = int(np.searchsorted(np.cumsum(probs[want]), 0.6025)) + 1
        assert got[:cut].tolist() == want[:cut].tolist(), trial
