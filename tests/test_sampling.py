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
