"""Sampling: logits -> next token, pure numpy.

The transform order matches llama.cpp's common chain for the knobs we expose:
top-k, then temperature, then top-p (nucleus) over the renormalised
distribution. Temperature 0 is exact greedy (first index of the maximum, as
llama.cpp's greedy sampler does).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen from the logits: greedy at temperature 0, else drawn after top-k, temperature
    and top-p, in llama.cpp's order.

    Args:
        temperature: 0 = greedy; > 0 samples from softmax(logits / temperature).
        top_k: keep the k most likely tokens (0 = all).
        top_p: keep the smallest set of tokens whose probability reaches top_p (1.0 = all).
        seed: seed of the random generator (None = nondeterministic).

    Raises:
        ValueError: a negative (or NaN) temperature, a negative top_k, a top_p outside (0, 1].

    Example:
        ```python
        sampler = pyllama_dspark.Sampler(pyllama_dspark.SamplingParams(temperature=0.7, top_p=0.9, seed=1))
        ```
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        """True at temperature 0 (the argmax, no randomness)."""
        return self.temperature == 0.0


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution a sampler with these params draws from (float64, sums to 1)."""
    logits = np.asarray(logits, dtype=np.float64)
    if params.greedy:
        out = np.zeros_like(logits)
        out[int(np.argmax(logits))] = 1.0
        return out
    scaled = np.full_like(logits, -np.inf)
    keep = np.arange(len(logits))
    if 0 < params.top_k < len(logits):
        keep = np.argpartition(-logits, params.top_k - 1)[: params.top_k]
    scaled[keep] = logits[keep] / params.temperature
    probs = np.exp(scaled - scaled[keep].max())
    probs /= probs.sum()
    if params.top_p < 1.0:
        order = _most_likely_first(probs, params.top_p)
        cumulative = np.cumsum(probs[order])
        cut = int(np.searchsorted(cumulative, params.top_p)) + 1  # smallest prefix reaching top_p
        nucleus = np.zeros_like(probs)
        nucleus[order[:cut]] = probs[order[:cut]]
        probs = nucleus / nucleus.sum()
    return probs


def _most_likely_first(probs: np.ndarray, top_p: float, candidates: int = 1024) -> np.ndarray:
    """Token ids by decreasing probability (ties by id), at least as far as the prefix reaching ``top_p``.

    Sorting a whole 50k-150k vocabulary per sampled token costs milliseconds; the nucleus almost always lies
    among the few most likely tokens. Those strictly above the ``candidates``-th largest probability are taken
    by partition and sorted alone when their mass reaches top_p: they are then exactly the full stable sort's
    first ids in the same order, so the cumulative sums, the cut and the result are bit for bit the full sort's.
    """
    if len(probs) > candidates:
        picked = np.argpartition(-probs, candidates - 1)[:candidates]
        above = np.sort(picked[probs[picked] > probs[picked].min()])  # by id, so the stable sort breaks ties alike
        above = above[np.argsort(-probs[above], kind="stable")]
        if above.size and np.cumsum(probs[above])[-1] >= top_p:
            return above
    return np.argsort(-probs, kind="stable")


class Sampler:
    """Draws tokens from logits with fixed params and its own seeded generator.

    Args:
        params: the ``SamplingParams`` (default: greedy).

    Attributes:
        params: the ``SamplingParams``.
        rng: the ``numpy.random.Generator``, seeded with ``params.seed``.
    """

    def __init__(self, params: SamplingParams | None = None):
        self.params = params or SamplingParams()
        self.rng = np.random.default_rng(self.params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        """The next token id for one logits row [n_vocab]: its argmax when greedy, else a draw."""
        if self.params.greedy:
            return int(np.argmax(logits))
        return self.draw(probabilities(logits, self.params))

    def draw(self, probs: np.ndarray) -> int:
        """One index from a probability vector (inverse CDF on one uniform)."""
        cumulative = np.cumsum(probs)
        r = self.rng.random() * cumulative[-1]
        return int(min(np.searchsorted(cumulative, r, side="right"), len(probs) - 1))
