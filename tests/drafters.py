"""Drafters of known behaviour for loop tests (mlx-lm's draft = target idea).

Each knows the target's greedy continuation of the prompt (``expected`` holds
prompt + continuation, indexed by position) and proposes from it.
"""

from __future__ import annotations

import numpy as np

from pyllama_dspark.drafter import Draft


class ScriptedDrafter:
    """Proposes expected[pos+1 ...] with the first ``right`` tokens correct and the rest wrong."""

    capture_layers: list[int] = []

    def __init__(self, expected, *, n_vocab: int, block_size: int = 4, right: int | None = None):
        self.expected = list(expected)
        self.n_vocab = n_vocab
        self.block_size = block_size
        self.right = block_size if right is None else right
        self.observed: list[tuple[int, int]] = []  # (pos0, n) of each observe call

    def reset(self) -> None:
        self.observed.clear()

    def observe(self, tokens, rows, pos0: int) -> None:
        assert rows is None
        self.observed.append((pos0, len(tokens)))

    def propose(self, anchor: int, pos: int, n_max: int, sampler=None) -> Draft:
        assert anchor == self.expected[pos], "the anchor must be the committed token at pos"
        truth = self.expected[pos + 1: pos + 1 + n_max]
        tokens = [t if i < self.right else (t + 1) % self.n_vocab for i, t in enumerate(truth)]
        return Draft(tokens=np.asarray(tokens, dtype=np.int32))


def oracle(expected, n_vocab, block_size=4):
    return ScriptedDrafter(expected, n_vocab=n_vocab, block_size=block_size)


def never(expected, n_vocab, block_size=4):
    return ScriptedDrafter(expected, n_vocab=n_vocab, block_size=block_size, right=0)


def prefix(expected, n_vocab, j, block_size=4):
    return ScriptedDrafter(expected, n_vocab=n_vocab, block_size=block_size, right=j)
