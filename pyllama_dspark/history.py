"""Drafts from earlier replies: a bounded store of past outputs searched by suffix (ARCHITECTURE.md section 16).

Requests come back: the same task in other words, an agent loop run again, another edit of the same file. The
reply then repeats much of an earlier reply, which the request's own prompt does not hold. ``HistoryStore`` keeps
the replies of earlier generations (with a few prompt tokens before each, so a reply's first tokens can be
matched too), up to a budget of tokens, the oldest dropped first. ``drafter.HistoryDrafter`` is the draft source
over it. This module is pure Python and numpy.

A proposal, in the manner of SuffixDecoding (Arctic Inference):

1. find the longest suffix of the request's text (anchor included, at most ``max_depth`` tokens) that occurs in
   the store, through an index of every stored position by the ``KEY`` tokens ending there;
2. among the occurrences of that suffix (the ``max_occurrences`` most recent), follow the continuations token by
   token, taking the most frequent next token each time and keeping only the occurrences that agree; the draft's
   estimated probability is the product of those frequencies, and it stops before it falls below
   ``min_probability``;
3. draft at most ``spec_factor`` x the match length: a long match predicts a long continuation.

A proposal is a few dictionary lookups and Python comparisons over at most ``max_occurrences`` positions: tens
of microseconds at any budget (``scripts/bench_tasks.py`` writes the measured figure to its JSON), against
milliseconds for a decode.

The store is shared by every generation of an ``LLM``, its batch schedulers and the server's slots, so it is
guarded by a lock. A shared store is a timing side channel: a reply that repeats another client's reply comes
back faster. ``serve --history-per-request`` keeps no store (each request drafts from its own text only).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Sequence

import numpy as np

KEY = 2  # tokens in an index key: the shortest match the store drafts from
_SEPARATOR = -1  # between entries: no match or continuation crosses it
_TOKEN_BITS = 21  # token ids below 2^21 (2M): two of them make one integer key
DEFAULT_HISTORY_TOKENS = 65536  # about 1 MB of tokens and a few MB of index
HISTORY_BLOCK = 16  # most drafts per round from the history (its matches run long: a repeated reply)


def _key(a: int, b: int) -> int:
    return (a << _TOKEN_BITS) | b


class HistoryStore:
    """Earlier replies, up to ``budget`` tokens (prompt context, replies and one separator each), oldest out.

    Args:
        budget: most tokens kept; 0 keeps nothing (``add`` does nothing, ``propose`` finds nothing).
        context: prompt tokens kept before each reply (its first tokens are matched from them).

    Thread-safe: ``add`` and ``propose`` take a lock.

    Raises:
        ValueError: a negative budget or context.
    """

    def __init__(self, budget: int = DEFAULT_HISTORY_TOKENS, *, context: int = 16):
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise ValueError(f"history budget must be an integer >= 0 tokens, got {budget!r}")
        if isinstance(context, bool) or not isinstance(context, int) or context < 0:
            raise ValueError(f"history context must be an integer >= 0 tokens, got {context!r}")
        self.budget, self.context = budget, context
        self._lock = threading.Lock()
        # the live tokens are global positions [_start, _end); _buf[g - _base] holds position g
        self._buf = np.full(max(64, min(budget, 1 << 16)), _SEPARATOR, np.int64)
        self._base = self._start = self._end = 0
        self._entries: deque[tuple[int, int]] = deque()  # (first position, end position) of each entry, oldest first
        self._index: dict[int, deque[int]] = {}  # key of the 2 tokens ending at g -> positions g, oldest first
        self._postings = 0

    # --- figures -----------------------------------------------------------------------
    @property
    def n_tokens(self) -> int:
        """Tokens held (at most ``budget``)."""
        return self._end - self._start

    @property
    def n_entries(self) -> int:
        return len(self._entries)

    @property
    def n_postings(self) -> int:
        """Positions in the index (at most ``n_tokens``)."""
        return self._postings

    @property
    def n_keys(self) -> int:
        return len(self._index)

    def clear(self) -> None:
        with self._lock:
            self._index.clear()
            self._entries.clear()
            self._base = self._start = self._end = self._postings = 0

    # --- writing -----------------------------------------------------------------------
    def add(self, reply: Sequence[int], prompt: Sequence[int] = ()) -> None:
        """Keep a finished generation's ``reply`` (token ids), after the last ``context`` tokens of its ``prompt``.
        A reply too short to match (under ``KEY`` tokens) is not kept; an entry larger than the budget keeps its
        last ``budget`` tokens."""
        reply = [int(t) for t in reply]
        if self.budget == 0 or len(reply) < KEY:
            return
        if any(t < 0 or t >= 1 << _TOKEN_BITS for t in reply):
            raise ValueError(f"token ids must lie in [0, {1 << _TOKEN_BITS}), got {min(reply)}..{max(reply)}")
        before = [int(t) for t in prompt[len(prompt) - self.context:]] if self.context and len(prompt) else []
        entry = (before + reply + [_SEPARATOR])[-self.budget:]
        with self._lock:
            while self._entries and self.n_tokens + len(entry) > self.budget:
                self._evict_oldest()
            self._append(entry)

    def _append(self, entry: list[int]) -> None:
        need = self._end - self._base + len(entry)
        if need > len(self._buf):  # compact first: the evicted part at the front goes
            live = self._buf[self._start - self._base:self._end - self._base].copy()
            size = len(self._buf)
            while size < len(live) + len(entry):
                size *= 2
            self._buf = np.full(size, _SEPARATOR, np.int64)
            self._buf[:len(live)] = live
            self._base = self._start
        first = self._end
        at = first - self._base
        self._buf[at:at + len(entry)] = entry
        self._end += len(entry)
        self._entries.append((first, self._end))
        for g in range(first + KEY - 1, self._end):
            a, b = entry[g - first - 1], entry[g - first]
            if a >= 0 and b >= 0:
                self._index.setdefault(_key(a, b), deque()).append(g)
                self._postings += 1

    def _evict_oldest(self) -> None:
        first, end = self._entries.popleft()
        tokens = self._buf[first - self._base:end - self._base].tolist()
        for i in range(KEY - 1, len(tokens)):
            a, b = tokens[i - 1], tokens[i]
            if a < 0 or b < 0:
                continue
            key = _key(a, b)
            postings = self._index[key]
            postings.popleft()  # positions are appended in order, so this entry's are the oldest of the key's
            self._postings -= 1
            if not postings:
                del self._index[key]
        self._start = end

    # --- reading -----------------------------------------------------------------------
    def propose(self, tail: Sequence[int], n_max: int, *, max_depth: int = 24, spec_factor: float = 1.0,
                min_probability: float = 0.1, max_occurrences: int = 32) -> tuple[list[int], int]:
        """(draft tokens, match length): the continuation of the longest suffix of ``tail`` (the request's last
        tokens, its anchor last) found in the store; ([], 0) when none is."""
        if n_max <= 0 or len(tail) < KEY:
            return [], 0
        tail = [int(t) for t in tail[-max_depth:]]
        with self._lock:
            postings = self._index.get(_key(tail[-2], tail[-1]))
            if not postings:
                return [], 0
            buf, base = self._buf, self._base
            ends = list(postings)[-max_occurrences:]
            # match length of each occurrence, backwards from the key (bounded by the tail and the separator)
            best, found = 0, []
            for g in ends:
                m, at = KEY, g - KEY - base
                while m < len(tail) and at >= 0 and buf[at] == tail[-1 - m]:
                    m += 1
                    at -= 1
                if m > best:
                    best, found = m, [g]
                elif m == best:
                    found.append(g)
            limit = min(n_max, int(spec_factor * best))
            draft, probability, alive = [], 1.0, found
            end = self._end - base
            while len(draft) < limit:
                offset = len(draft) + 1
                counts: dict[int, int] = {}
                for g in alive:
                    at = g - base + offset
                    if at < end:
                        token = int(buf[at])
                        if token >= 0:
                            counts[token] = counts.get(token, 0) + 1
                if not counts:
                    break
                token, count = max(counts.items(), key=lambda item: item[1])
                probability *= count / len(alive)
                if probability < min_probability:
                    break
                draft.append(token)
                alive = [g for g in alive if g - base + offset < end and int(buf[g - base + offset]) == token]
            return draft, best
