"""Log-probabilities of generated tokens, from the target's logits, pure numpy.

The values are the target model's own distribution at each position: log-softmax of the logits row the token was
chosen from, before temperature, top-k, top-p and any grammar mask (vLLM's default "raw" logprobs; llama-server
reports probabilities after its samplers). Speculative decoding reads them from the verify rows, which under
consistent numerics are bit for bit plain decoding's rows, so the values are identical to plain decoding's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability, and the ``top`` most likely tokens at its position as
    (token, logprob) pairs, most likely first (ties by token id).

    Attributes:
        token: the token id.
        logprob: its natural log-probability under the target's raw logits (log-softmax before temperature,
            top-k, top-p and any grammar mask).
        top: the most likely (token, logprob) pairs at its position, as many as ``logprobs`` asked for.
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprob(row: np.ndarray, token: int, n_top: int = 0) -> TokenLogprob:
    """``token``'s log-probability under the logits ``row`` (log-softmax in float64), with the ``n_top`` most
    likely tokens."""
    logits = np.asarray(row, dtype=np.float64)
    peak = logits.max()
    log_total = peak + np.log(np.exp(logits - peak).sum())
    top: tuple[tuple[int, float], ...] = ()
    if n_top > 0:
        n_top = min(n_top, len(logits))
        picked = np.argpartition(-logits, n_top - 1)[:n_top]
        picked = picked[np.lexsort((picked, -logits[picked]))]
        top = tuple((int(t), float(logits[t] - log_total)) for t in picked)
    return TokenLogprob(int(token), float(logits[int(token)] - log_total), top)
