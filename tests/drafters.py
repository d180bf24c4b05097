"""Drafters of known behaviour for loop tests (mlx-lm's draft = target idea).

Each knows the target's greedy continuation of the prompt (``expected`` holds
prompt + continuation, indexed by position) and proposes from it.
"""

from __future__ import annotations

import numpy as np

from pyllama_dspark.drafter import Draft


class StatelessDrafter:
    """The Drafter protocol's bookkeeping for a drafter that reads nothing: no capture layers, nothing to observe
    or forget. Subclasses set ``block_size`` and write ``propose``."""

    capture_layers: list[int] = []

    def reset(self) -> None:
        pass

    def observe(self, tokens, rows, pos0: int) -> None:
        pass


class ScriptedDrafter:
    """Proposes expected[pos+1 ...] with the first ``right`` tokens correct and the rest wrong.

    With ``capture_layers`` the loop captures those target layers and hands their rows to observe;
    every observe call is recorded in ``observed`` as (pos0, tokens, a copy of the rows or None).
    """

    def __init__(self, expected, *, n_vocab: int, block_size: int = 4, right: int | None = None,
                 capture_layers=()):
        self.expected = list(expected)
        self.n_vocab = n_vocab
        self.block_size = block_size
        self.right = block_size if right is None else right
        self.capture_layers = list(capture_layers)
        self.observed: list[tuple[int, list[int], np.ndarray | None]] = []

    def reset(self) -> None:
        self.observed.clear()

    def observe(self, tokens, rows, pos0: int) -> None:
        assert (rows is None) == (not self.capture_layers), "rows exactly when capture layers are asked for"
        self.observed.append((pos0, [int(t) for t in tokens], None if rows is None else np.array(rows)))

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
