"""HybridDrafter: prompt lookup and a model drafter (DSpark) behind one Drafter (ARCHITECTURE.md section 9).

Prompt lookup costs next to nothing and is right 80-90 % of the time once the text repeats itself (a quoted
input, code being edited, a list that follows a pattern); a model drafter costs a decode but drafts anywhere.
Each round the speculative loop asks prompt lookup first, for free, and drafts from the source that promises
more committed tokens per second:

    offers(anchor, pos, n_max): {"lookup": its proposal (only when it matches), "dspark": None (drafts on request)}
    Speculator (cost-aware): SourceChooser.choose -> (source, k); a free proposal is cut to k, the model is asked
        with propose(anchor, pos, k, source="dspark"); after the verify, a lookup proposal that was not used is
        scored against the committed tokens, so its acceptance stays measured.
    Speculator (fixed n_draft=K): propose(anchor, pos, K): prompt lookup's proposal when it matches, else the
        model drafter's.

Both sources observe every committed token (and the model drafter its target features) whatever source
drafted the round: a DSpark drafter cannot draft from positions it was never shown.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

import numpy as np

from .drafter import Draft, Drafter, DSparkDrafter, PromptLookupDrafter

LOOKUP = "lookup"


def source_name(drafter) -> str:
    """What the rounds a single-source drafter drafts are called (``Step.source``, ``SpecStats.by_source``): its
    ``source`` attribute ("lookup" for PromptLookupDrafter), "dspark" for a DSparkDrafter, else "draft"."""
    name = getattr(drafter, "source", None)
    if name:
        return str(name)
    return "dspark" if isinstance(drafter, DSparkDrafter) else "draft"


class MultiSourceDrafter(Drafter, Protocol):
    """A Drafter with several draft sources that the cost-aware loop chooses between each round.

    ``sources``: source name -> most tokens it drafts per round, in the order the loop should prefer them when
    they promise the same (the cheapest first).
    """

    sources: dict[str, int]

    def offers(self, anchor: int, pos: int, n_max: int, sampler=None) -> dict[str, Draft | None]:
        """The sources that can draft this round: a free source maps to its proposal (made already), a source
        that pays for a draft maps to None (asked with ``propose(..., source=name)`` once chosen)."""

    def propose(self, anchor: int, pos: int, n_max: int, sampler=None, *, source: str | None = None) -> Draft:
        """Up to n_max tokens from ``source``, or (None) from the drafter's own choice of source."""


class HybridDrafter:
    """Prompt lookup and a model drafter behind one Drafter; see the module docstring.

    Args:
        model_drafter: the drafter that pays for its drafts (a ``DSparkDrafter``, or any Drafter); its
            ``capture_layers`` are the hybrid's, so the loop captures the features it needs.
        lookup: the prompt lookup drafter (default ``PromptLookupDrafter()``: n-grams of 3 down to 1 token,
            at most 8 drafts per round).

    Attributes:
        sources: {"lookup": lookup's block size, model source: the model drafter's block size}; the model
            source is named by ``source_name`` ("dspark" for a DSparkDrafter).
        block_size: the larger of the two.

    Raises:
        TypeError: a model drafter without the Drafter protocol; ValueError: a model drafter whose source is
        also called "lookup" (a PromptLookupDrafter: use it alone).
    """

    def __init__(self, model_drafter: Drafter, lookup: PromptLookupDrafter | None = None):
        protocol = ("block_size", "capture_layers", "reset", "observe", "propose")
        missing = [name for name in protocol if not hasattr(model_drafter, name)]
        if missing:
            raise TypeError(f"model_drafter must be a Drafter (e.g. DSparkDrafter(path, target)), got "
                            f"{type(model_drafter).__name__} (no {', '.join(missing)})")
        self.model_drafter = model_drafter
        self.lookup = lookup if lookup is not None else PromptLookupDrafter()
        self.model_source = source_name(model_drafter)
        if self.model_source == LOOKUP:
            raise ValueError("the model drafter is itself a prompt lookup drafter: use it alone, not in a "
                             "HybridDrafter")
        self.sources = {LOOKUP: int(self.lookup.block_size), self.model_source: int(model_drafter.block_size)}

    @property
    def capture_layers(self) -> list[int]:
        return list(self.model_drafter.capture_layers)

    @property
    def block_size(self) -> int:
        return max(self.sources.values())

    def observe(self, tokens: np.ndarray, rows: np.ndarray | None, pos0: int) -> None:
        """Committed tokens at pos0.. (and the model drafter's feature rows): both sources see all of them."""
        self.model_drafter.observe(tokens, rows, pos0)
        self.lookup.observe(tokens, None, pos0)

    def reset(self) -> None:
        self.model_drafter.reset()
        self.lookup.reset()

    def close(self) -> None:
        """Close the model drafter (if it has a ``close``); prompt lookup holds nothing native."""
        close = getattr(self.model_drafter, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> HybridDrafter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def offers(self, anchor: int, pos: int, n_max: int, sampler=None) -> dict[str, Draft | None]:
        """Prompt lookup's proposal of up to n_max tokens when it matches (asked now: it is free), and the model
        drafter, which drafts on request (None)."""
        offers: dict[str, Draft | None] = {}
        found = self._lookup(anchor, pos, n_max, sampler)
        if len(found.tokens):
            offers[LOOKUP] = found
        offers[self.model_source] = None
        return offers

    def propose(self, anchor: int, pos: int, n_max: int | None = None, sampler=None, *,
                source: str | None = None) -> Draft:
        """Up to n_max (default: the block size) tokens after ``anchor`` at ``pos``, from ``source``; None (a
        fixed draft length) takes prompt lookup's proposal when it matches, else the model drafter's.
        ``Draft.source`` says which drafted.

        Raises:
            ValueError: a source this drafter does not have.
        """
        n_max = self.block_size if n_max is None else int(n_max)
        if source not in (None, LOOKUP, self.model_source):
            raise ValueError(f"unknown draft source {source!r}; this drafter has {', '.join(self.sources)}")
        if source in (None, LOOKUP):
            found = self._lookup(anchor, pos, n_max, sampler)
            if len(found.tokens) or source == LOOKUP:
                return found
        # the model drafter's own block bounds it (the hybrid's block may be the lookup's, larger)
        draft = self.model_drafter.propose(anchor, pos, min(n_max, self.sources[self.model_source]), sampler=sampler)
        return replace(draft, source=self.model_source)

    def _lookup(self, anchor: int, pos: int, n_max: int, sampler) -> Draft:
        found = self.lookup.propose(anchor, pos, n_max, sampler=sampler)
        found.source = LOOKUP  # a fresh Draft: named in place (dataclasses.replace costs ~10 us a round)
        return found
