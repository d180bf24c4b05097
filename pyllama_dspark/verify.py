"""Acceptance of a draft against the target, pure numpy.

Names follow the speculative-sampling papers: p is the target distribution,
q the draft distribution, r a uniform draw, n the number of accepted draft
tokens. Both p and q must come from the same temperature/top-k/top-p
transform (``sampling.probabilities``) for the output to follow the target.
"""

from __future__ import annotations

from typing import Callable

import numpy as np


def accept_greedy(draft: np.ndarray, target_argmax: np.ndarray) -> tuple[int, int]:
    """Longest prefix where the draft equals the target's argmax, plus the target's next token.

    Args:
        draft: k draft tokens.
        target_argmax: k + 1 target argmax tokens (row i predicts the token after draft[i-1]).

    Returns:
        (n, token): n accepted drafts and the target's token at position n (correction or bonus).
    """
    k = len(draft)
    if len(target_argmax) != k + 1:
        raise ValueError(f"expected {k + 1} target rows for {k} drafts, got {len(target_argmax)}")
    mismatch = np.flatnonzero(np.asarray(draft) != np.asarray(target_argmax[:k]))
    n = int(mismatch[0]) if mismatch.size else k
    return n, int(target_argmax[n])


def accept_stochastic(draft: np.ndarray, q: np.ndarray, p: np.ndarray, uniform: Callable[[], float],
                      draw: Callable[[np.ndarray], int]) -> tuple[int, int]:
    """Rejection sampling (lossless in distribution).

    Accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); on the first rejection sample the
    token from norm(max(0, p_i - q_i)); when all k are accepted, sample a bonus from p_k.

    Args:
        draft: k draft tokens, d_i drawn from q_i.
        q: [k, V] draft probabilities.
        p: [k + 1, V] target probabilities.
        uniform: r ~ U[0, 1).
        draw: index ~ a probability vector.
    """
    k = len(draft)
    if q.shape[0] != k or p.shape[0] != k + 1:
        raise ValueError(f"expected q [{k}, V] and p [{k + 1}, V], got {q.shape} and {p.shape}")
    for i, d in enumerate(draft):
        d = int(d)
        if q[i, d] <= 0.0:
            raise ValueError(f"draft token {d} at slot {i} has q = 0: it cannot have been drawn from q")
        if uniform() < min(1.0, p[i, d] / q[i, d]):
            continue
        residual = np.maximum(p[i] - q[i], 0.0)
        total = residual.sum()
        # total == 0 only when p == q exactly, where rejection has probability 0; fall back to p
        return i, draw(residual / total if total > 0 else p[i])
    return k, draw(p[k])
