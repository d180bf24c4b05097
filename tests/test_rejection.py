"""Rejection sampling keeps the target's distribution (chi-square, fixed seeds)."""

from __future__ import annotations

import numpy as np
import pytest

from pyllama_dspark import Context, Model
from pyllama_dspark.drafter import Draft
from pyllama_dspark.sampling import Sampler, SamplingParams, probabilities
from pyllama_dspark.speculative import Speculator
from pyllama_dspark.verify import accept_greedy, accept_stochastic



def chi2_critical(dof: int, z: float = 3.09) -> float:
    """Upper critical value at p = 0.001 (z = 3.09), Wilson-Hilferty approximation."""
    return dof * (1 - 2 / (9 * dof) + z * np.sqrt(2 / (9 * dof))) ** 3


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token the target gives probability 0 was produced"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_greedy_acceptance():
    assert accept_greedy(np.array([5, 6, 7]), np.array([5, 6, 9, 1])) == (2, 9)
    assert accept_greedy(np.array([5, 6]), np.array([5, 6, 3])) == (2, 3)
    assert accept_greedy(np.array([], dtype=int), np.array([4])) == (0, 4)
    with pytest.raises(ValueError):
        accept_greedy(np.array([1]), np.array([1]))


def test_stochastic_acceptance_preserves_p():
    rng = np.random.default_rng(0)
    vocab = 8
    p = rng.dirichlet(np.ones(vocab), size=3)        # target rows for slots 0, 1 and the bonus
    q = rng.dirichlet(np.ones(vocab) * 0.5, size=2)  # a draft that differs from p
    sampler = Sampler(SamplingParams(temperature=1.0, seed=1))
    first, second = np.zeros(vocab, int), np.zeros((vocab, vocab), int)
    for _ in range(20000):
        draft = np.array([sampler.draw(q[0]), sampler.draw(q[1])])
        n, token = accept_stochastic(draft, q, p, sampler.rng.random, sampler.draw)
        out = list(draft[:n]) + [token]
        first[out[0]] += 1
        if len(out) > 1:
            second[out[0], out[1]] += 1
    assert chi_square(first, p[0]) < chi2_critical(vocab - 1)
    # given the first token was accepted from the draft, the second follows p[1]
    assert chi_square(second.sum(axis=0), p[1]) < chi2_critical(vocab - 1)
    # the test has teeth: the draft's own distribution is rejected
    drawn = np.bincount([sampler.draw(q[0]) for _ in range(20000)], minlength=vocab)
    assert chi_square(drawn, p[0]) > chi2_critical(vocab - 1)


class FixedQDrafter:
    """Draws each draft token from a fixed distribution q (unrelated to the target)."""

    capture_layers: list[int] = []
    block_size = 2

    def __init__(self, q: np.ndarray):
        self.q = q

    def reset(self):
        pass

    def observe(self, tokens, rows, pos0):
        pass

    def propose(self, anchor, pos, n_max, sampler=None):
        tokens = np.array([sampler.draw(self.q) for _ in range(n_max)], dtype=np.int32)
        return Draft(tokens=tokens, probs=np.tile(self.q, (n_max, 1)))


def test_speculative_sampling_follows_the_target(make_model):
    """Marginal of the 2nd generated token (the first one that goes through rejection sampling)
    against the target's exact marginal sum_t1 p(t1) p(t2 | t1)."""
    vocab = 32
    prompt = [3, 14, 15, 9]
    params = SamplingParams(temperature=1.0, top_k=8)
    with Model(make_model(arch="llama", n_vocab=vocab)) as model:
        ctx = Context(model, n_ctx=64, n_batch=16)
        p1 = probabilities(_logits_after(ctx, prompt), params)
        expected = sum(p1[t] * probabilities(_logits_after(ctx, prompt + [t]), params)
                       for t in np.flatnonzero(p1))
        q = np.random.default_rng(7).dirichlet(np.ones(vocab))
        spec = Speculator(ctx, FixedQDrafter(q), n_draft=2)
        sampler = Sampler(SamplingParams(temperature=1.0, top_k=8, seed=3))
        counts = np.zeros(vocab, int)
        for _ in range(3000):
            tokens = [t for step in spec.run(np.array(prompt), max_tokens=2, sampler=sampler, stop_at_eog=False)
                      for t in step.tokens]
            counts[tokens[1]] += 1
    dof = int((expected > 0).sum()) - 1
    assert chi_square(counts, expected) < chi2_critical(dof)


def _logits_after(ctx, tokens):
    from pyllama_dspark import Batch

    ctx.clear()
    batch = Batch(len(tokens))
    batch.add_tokens(tokens, 0)
    ctx.decode(batch)
    return ctx.logits(-1).astype(np.float64)
