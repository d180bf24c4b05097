"""A reduced draft vocabulary: the target ids a drafter can draft (the GGUF's ``d2t``).

The drafter's output head and Markov ``w2`` then have one row per kept id instead of one per target token,
so a draft costs a fraction of a full-vocabulary one. A token outside the vocabulary is never drafted (its
draft probability is 0), so acceptance is bounded by the coverage: the share of the target's own output
tokens that are inside. The ids kept are the most frequent tokens of the target's outputs in the training
data, plus every token a chat needs whatever its frequency: control and special tokens (but placeholders
such as Gemma's ``<unusedN>``), end-of-generation tokens and the tokens the chat template writes. The mask
token is never kept (it must never be drafted).
"""

from __future__ import annotations

import re
from typing import Iterable, Sequence

import numpy as np


PLACEHOLDER = re.compile(r"^(<unused\d+>|\[unused\d+\]|<\|reserved_special_token_\d+\|>)$")


def is_placeholder(text: str) -> bool:
    """A control token reserved for later use (Gemma's 6,242 ``<unusedN>``, Llama 3's
    ``<|reserved_special_token_N|>``, BERT's ``[unusedN]``): no chat writes it, so a draft vocabulary does not
    keep it unless the target generated it."""
    return PLACEHOLDER.match(text) is not None


def placeholder_tokens(model) -> set[int]:
    """The control tokens of ``model`` that are placeholders (see :func:`is_placeholder`)."""
    return {t for t in range(model.n_vocab)
            if model.is_control(t) and is_placeholder(model.detokenize([t], unparse_special=True))}


def required_tokens(model) -> set[int]:
    """Ids a draft vocabulary always keeps: control/special tokens but placeholders, end-of-generation tokens,
    and every token of a chat rendered with the model's template (role markers, separators, its default system
    prompt)."""
    n_vocab = model.n_vocab
    placeholders = placeholder_tokens(model)
    keep = {t for t in range(n_vocab) if model.is_eog(t) or (model.is_control(t) and t not in placeholders)}
    keep |= {t for t in model.special_tokens.values() if 0 <= t < n_vocab}
    if model.chat_template is not None:
        chat = [{"role": "system", "content": "Hi."}, {"role": "user", "content": "Hi."},
                {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Hi."}]
        for messages in (chat, chat[1:]):  # with and without a system message: templates add a default one
            text = model.apply_chat_template(messages)
            keep |= {int(t) for t in model.tokenize(text, parse_special=True)}
    return keep


def output_counts(sequences: Iterable[tuple[np.ndarray, int]], n_vocab: int) -> np.ndarray:
    """How often each id occurs in the generated part (tokens[prompt_len:]) of (tokens, prompt_len) pairs."""
    counts = np.zeros(n_vocab, dtype=np.int64)
    for tokens, prompt_len in sequences:
        np.add.at(counts, np.asarray(tokens[prompt_len:], dtype=np.int64), 1)
    return counts


def choose_draft_vocab(counts: np.ndarray, size: int, required: Iterable[int], mask_token: int,
                       last: Iterable[int] = ()) -> np.ndarray:
    """The ``size`` ids to keep, sorted: every required id (but the mask token), then the most frequent others
    (ties broken by the lower id, so the choice is a pure function of the counts). Ids in ``last`` (placeholders)
    that never occur in ``counts`` come after every other unseen id: a vocabulary larger than the tokens seen
    fills with real tokens first.

    Raises:
        ValueError: ``size`` outside [1, n_vocab - 1], or smaller than the required ids.
    """
    n_vocab = len(counts)
    must = check_size(size, required, mask_token, n_vocab)
    unseen_last = np.zeros(n_vocab, dtype=bool)
    unseen_last[[int(t) for t in last if 0 <= int(t) < n_vocab]] = True
    unseen_last &= counts == 0
    order = np.lexsort((np.arange(n_vocab), unseen_last, -counts))  # most frequent first, then by id
    taken = np.zeros(n_vocab, dtype=bool)
    taken[must] = True
    taken[int(mask_token)] = True  # never drafted, so never kept
    extra = [int(t) for t in order if not taken[t]][: size - len(must)]
    ids = np.array(sorted(must + extra), dtype=np.int64)
    return ids


def check_size(size: int, required: Iterable[int], mask_token: int, n_vocab: int) -> list[int]:
    """The required ids a vocabulary of ``size`` keeps (sorted, the mask token left out).

    Raises:
        ValueError: ``size`` outside [1, n_vocab - 1], or smaller than the required ids.
    """
    if not 1 <= size <= n_vocab - 1:
        raise ValueError(f"a draft vocabulary needs 1..{n_vocab - 1} tokens (all but the mask token), got {size}")
    must = sorted({int(t) for t in required if 0 <= int(t) < n_vocab} - {int(mask_token)})
    if len(must) > size:
        raise ValueError(f"a draft vocabulary of {size} tokens cannot hold the {len(must)} control, end-of-generation "
                         f"and chat-template tokens it must keep")
    return must


def coverage(ids: np.ndarray, tokens: Sequence[int]) -> float:
    """The share of ``tokens`` inside the draft vocabulary ``ids`` (what bounds acceptance)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    return float(np.isin(tokens, ids).mean()) if tokens.size else 0.0
