"""Rejection sampling keeps the target's distribution (chi-square, fixed seeds)."""

from __future__ import annotations

import numpy as np
import pytest

from drafters import StatelessDrafter
from pyllama_dspark import Batch, Context, Model
from pyllama_dspark.convert.converter import convert
from pyllama_dspark.drafter import DSparkDrafter
from pyllama_dspark.drafter import Draft
from pyllama_dspark.sampling import Sampler, SamplingParams, probabilities
from pyllama_dspark.speculative import Speculator
from pyllama_dspark.testing import TinySpec, tiny_model, write_tiny_dspark_checkpoint
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


class FixedQDrafter(StatelessDrafter):
    """Draws each draft token from a fixed distribution q (unrelated to the target)."""

    block_size = 2

    def __init__(self, q: np.ndarray):
        self.q = q

    def propose(self, anchor, pos, n_max, sampler=None):
        tokens = np.array([sampler.draw(self.q) for _ in range(n_max)], dtype=np.int32)
        return Draft(tokens=tokens, probs=np.tile(self.q, (n_max, 1)))


@pytest.mark.statistical
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
    ctx.clear()
    batch = Batch(len(tokens))
    batch.add_tokens(tokens, 0)
    ctx.decode(batch)
    return ctx.logits(-1).astype(np.float64)


# --------------------------------------------------------------------------
# end to end: the joint distribution of generated tokens 2 and 3 (0-based)
#
# With n_draft = 2 the first round drafts tokens 1 and 2; token 2 is its second slot (or a correction there)
# and token 3 its bonus token (or a later round's first slot), so every kind of sampled position shows up.

N_TOKENS = 4
E2E_TARGET = TinySpec(arch="llama", n_layer=3, n_vocab=32)
E2E_PROMPT = [3, 14, 15, 9]


def reference_probs(logits, temperature, top_k=0, top_p=1.0):
    """softmax(logits / T) over the top_k largest logits, cut to the smallest head reaching top_p.
    Written here, independently of sampling.probabilities."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    order = np.argsort(-z, kind="stable")[: top_k or None]
    w = np.exp(z[order] - z[order[0]])
    w /= w.sum()
    if top_p < 1.0:
        n_keep = next(i + 1 for i, c in enumerate(np.cumsum(w)) if c >= top_p)
        order, w = order[:n_keep], w[:n_keep] / w[:n_keep].sum()
    out = np.zeros(len(z))
    out[order] = w
    return out


def exact_conditionals(ctx, prompt, sampling):
    """generated prefix (tuple) -> the target's next-token distribution, for every reachable prefix
    shorter than N_TOKENS (plain decodes of prompt + prefix)."""
    table = {}

    def walk(prefix):
        p = reference_probs(_logits_after(ctx, prompt + list(prefix)), **sampling)
        table[prefix] = p
        if len(prefix) + 1 < N_TOKENS:
            for t in np.flatnonzero(p):
                walk(prefix + (int(t),))

    walk(())
    return table


def exact_joint_2_3(table) -> dict:
    joint: dict = {}

    def walk(prefix, prob):
        if len(prefix) == N_TOKENS:
            joint[prefix[2:]] = joint.get(prefix[2:], 0.0) + prob
            return
        p = table[prefix]
        for t in np.flatnonzero(p):
            walk(prefix + (int(t),), prob * p[t])

    walk((), 1.0)
    return joint


def pooled_chi_square(counts: dict, expected: dict, n: int) -> tuple[float, int]:
    """Chi-square over cells with >= 5 expected draws, the rest pooled into one cell: (statistic, dof);
    infinite when a pair outside the expected support was drawn."""
    if not set(counts) <= set(expected):
        return float("inf"), 0
    big = [k for k, v in expected.items() if v * n >= 5]
    small = [k for k in expected if k not in big]
    observed = [counts.get(k, 0) for k in big] + ([sum(counts.get(k, 0) for k in small)] if small else [])
    want = [expected[k] * n for k in big] + ([sum(expected[k] for k in small) * n] if small else [])
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, want))
    return stat, len(want) - 1


class NoisyOracleDrafter:
    """Draws each slot from q = half the target's exact next-token distribution, half uniform: its drafts
    are accepted often enough to reach the second slot and the bonus token, and rejected often too."""

    capture_layers: list[int] = []
    block_size = 2

    def __init__(self, table, prompt_len, n_vocab):
        self.table, self.prompt_len, self.n_vocab = table, prompt_len, n_vocab
        self.text: list[int] = []

    def reset(self):
        self.text = []

    def observe(self, tokens, rows, pos0):
        self.text = self.text[:pos0] + [int(t) for t in tokens]

    def propose(self, anchor, pos, n_max, sampler=None):
        generated = (self.text[:pos] + [int(anchor)])[self.prompt_len:]
        tokens, probs = [], []
        for _ in range(n_max):
            exact = self.table.get(tuple(generated), np.full(self.n_vocab, 1.0 / self.n_vocab))
            q = 0.5 * exact + 0.5 / self.n_vocab
            t = sampler.draw(q)
            tokens.append(t)
            probs.append(q)
            generated.append(t)
        return Draft(tokens=np.array(tokens, dtype=np.int32), probs=np.array(probs))


def sample_pairs(ctx, drafter, sampling, n_runs, seed):
    spec = Speculator(ctx, drafter, n_draft=2)
    sampler = Sampler(SamplingParams(seed=seed, **sampling))
    counts: dict = {}
    first_rounds = np.zeros(3, int)  # how many of the first round's two drafts were accepted
    for _ in range(n_runs):
        steps = list(spec.run(np.array(E2E_PROMPT), max_tokens=N_TOKENS, sampler=sampler, stop_at_eog=False))
        tokens = [t for step in steps for t in step.tokens]
        assert len(tokens) == N_TOKENS
        counts[tuple(tokens[2:])] = counts.get(tuple(tokens[2:]), 0) + 1
        first_rounds[steps[1].n_accept] += 1
    return counts, first_rounds


@pytest.mark.statistical
@pytest.mark.parametrize("sampling", [dict(temperature=0.7, top_k=4), dict(temperature=1.3, top_p=0.5)],
                         ids=["T0.7-top_k4", "T1.3-top_p0.5"])
def test_tokens_2_and_3_follow_the_targets_joint_distribution(model_dir, sampling):
    n_runs = 4000
    with Model(tiny_model(E2E_TARGET, cache_dir=model_dir)) as model:
        ctx = Context(model, n_ctx=64, n_batch=16)
        table = exact_conditionals(ctx, E2E_PROMPT, sampling)
        expected = exact_joint_2_3(table)
        drafter = NoisyOracleDrafter(table, len(E2E_PROMPT), model.n_vocab)
        counts, first_rounds = sample_pairs(ctx, drafter, sampling, n_runs, seed=5)
        untempered = exact_joint_2_3(_retempered(table, ctx, sampling))
    # every path was taken: slot 0 rejected, slot 1 rejected, both accepted (the bonus token sampled)
    assert (first_rounds > n_runs // 20).all(), first_rounds
    assert set(counts) <= set(expected), f"pairs the target cannot produce: {sorted(set(counts) - set(expected))}"
    stat, dof = pooled_chi_square(counts, expected, n_runs)
    assert stat < chi2_critical(dof), f"tokens 2 and 3 do not follow the target: chi2 {stat:.1f}, {dof} dof"
    # the test has teeth: the same counts against the untempered (T = 1) target are rejected
    assert pooled_chi_square(counts, untempered, n_runs)[0] > chi2_critical(dof)


def _retempered(table, ctx, sampling):
    other = {**sampling, "temperature": 1.0}
    return {prefix: reference_probs(_logits_after(ctx, E2E_PROMPT + list(prefix)), **other) for prefix in table}


@pytest.mark.statistical
@pytest.mark.parametrize("draft_vocab_size", [None, 20], ids=["full-vocabulary", "reduced-vocabulary"])
def test_tokens_2_and_3_follow_the_target_with_the_dspark_drafters_probabilities(model_dir, tmp_path,
                                                                                 draft_vocab_size):
    """With a reduced draft vocabulary (d2t) q is 0 outside it: tokens the drafter cannot propose come from the
    residual distribution alone, and the output still follows the target."""
    sampling = dict(temperature=0.8, top_k=3)
    n_runs = 3000
    target = tiny_model(E2E_TARGET, cache_dir=model_dir)
    ck = write_tiny_dspark_checkpoint(tmp_path / "ck", target=E2E_TARGET, block_size=2, dtype="f32",
                                      target_cache_dir=model_dir, draft_vocab_size=draft_vocab_size)
    drafter_path = convert(ck, tmp_path / "drafter.gguf", outtype="f32", target_gguf=target).path
    with Model(target) as model:
        ctx = Context(model, n_ctx=64, n_batch=16)
        expected = exact_joint_2_3(exact_conditionals(ctx, E2E_PROMPT, sampling))
        drafter = DSparkDrafter(drafter_path, ctx)
        counts, first_rounds = sample_pairs(ctx, drafter, sampling, n_runs, seed=9)
        drafter.close()
    assert first_rounds[1:].sum() > n_runs // 50, first_rounds  # the drafter's q was accepted at times
    assert set(counts) <= set(expected), f"pairs the target cannot produce: {sorted(set(counts) - set(expected))}"
    stat, dof = pooled_chi_square(counts, expected, n_runs)
    assert stat < chi2_critical(dof), f"tokens 2 and 3 do not follow the target: chi2 {stat:.1f}, {dof} dof"
