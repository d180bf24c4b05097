"""HybridDrafter: free draft sources and a model drafter (DSpark) behind one Drafter (ARCHITECTURE.md sections 9
and 16).

Prompt lookup costs next to nothing and is right 80-90 % of the time once the text repeats itself (a quoted
input, code being edited, a list that follows a pattern); the history source (``HistoryDrafter``) does the same
over earlier replies; a model drafter costs a decode but drafts anywhere. Each round the speculative loop asks
the free sources first and drafts from the source that promises more committed tokens per second:

    offers(anchor, pos, n_max): {"lookup": its proposal (only when it matches), "history": likewise (with a
        store), "dspark": None (drafts on request)}
    Speculator (cost-aware): SourceChooser.choose -> (source, k); a free proposal is cut to k, the model is asked
        with propose(anchor, pos, k, source="dspark"); after the verify, a free proposal that was not used is
        scored against the committed tokens, so its acceptance stays measured.
    Speculator (fixed n_draft=K): propose(anchor, pos, K): the first free proposal that matches, else the
        model drafter's.

Under a grammar the loop adds a fourth source, "grammar" (the tokens it forces, continued by ``continuation``
where it is free again). Every source observes every committed token (and the model drafter its target
features) whatever source drafted the round: a DSpark drafter cannot draft from positions it was never shown.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

import numpy as np

from .drafter import Draft, Drafter, DSparkDrafter, PromptLookupDrafter

LOOKUP, HISTORY, GRAMMAR = "lookup", "history", "grammar"  # the free sources' names


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
        history: a ``HistoryDrafter`` over earlier replies (``pyllama_dspark.history``), a third source, free
            like prompt lookup; None: none. ``remember`` adds a finished reply to its store.

    Attributes:
        sources: {"lookup": lookup's block size, ["history": its block size,] model source: the model drafter's
            block size}; the model source is named by ``source_name`` ("dspark" for a DSparkDrafter).
        free: the free sources by name (prompt lookup, history).
        block_size: the largest.

    Raises:
        TypeError: a model drafter without the Drafter protocol; ValueError: a model drafter whose source is
        also called "lookup" or "history" (a PromptLookupDrafter or HistoryDrafter: use it alone).
    """

    def __init__(self, model_drafter: Drafter, lookup: PromptLookupDrafter | None = None,
                 history: PromptLookupDrafter | None = None):
        protocol = ("block_size", "capture_layers", "reset", "observe", "propose")
        missing = [name for name in protocol if not hasattr(model_drafter, name)]
        if missing:
            raise TypeError(f"model_drafter must be a Drafter (e.g. DSparkDrafter(path, target)), got "
                            f"{type(model_drafter).__name__} (no {', '.join(missing)})")
        self.model_drafter = model_drafter
        self.lookup = lookup if lookup is not None else PromptLookupDrafter()
        self.history = history
        self.model_source = source_name(model_drafter)
        if self.model_source in (LOOKUP, HISTORY):
            raise ValueError(f"the model drafter is itself a free source ({self.model_source}): use it alone, "
                             "not in a HybridDrafter")
        # the free sources (asked every round, cheapest first), then the model drafter
        self.free = {LOOKUP: self.lookup, **({HISTORY: history} if history is not None else {})}
        self.sources = {**{name: int(source.block_size) for name, source in self.free.items()},
                        self.model_source: int(model_drafter.block_size)}

    @property
    def capture_layers(self) -> list[int]:
        return list(self.model_drafter.capture_layers)

    @property
    def block_size(self) -> int:
        return max(self.sources.values())

    def observe(self, tokens: np.ndarray, rows: np.ndarray | None, pos0: int) -> None:
        """Committed tokens at pos0.. (and the model drafter's feature rows): every source sees all of them."""
        self.model_drafter.observe(tokens, rows, pos0)
        for source in self.free.values():
            source.observe(tokens, None, pos0)

    def reset(self) -> None:
        """Forget what every source observed (a new generation); the history store keeps its replies."""
        self.model_drafter.reset()
        for source in self.free.values():
            source.reset()

    def remember(self, prompt, reply) -> None:
        """A finished generation's reply, for the history source's store (nothing without one)."""
        if self.history is not None:
            self.history.remember(prompt, reply)

    def close(self) -> None:
        """Close the model drafter (if it has a ``close``); the free sources hold nothing native."""
        close = getattr(self.model_drafter, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> HybridDrafter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def offers(self, anchor: int, pos: int, n_max: int, sampler=None) -> dict[str, Draft | None]:
        """Each free source's proposal of up to n_max tokens when it has one (asked now: they are free), and
        the model drafter, which drafts on request (None)."""
        offers: dict[str, Draft | None] = {}
        for name in self.free:
            found = self._free(name, anchor, pos, n_max, sampler)
            if len(found.tokens):
                offers[name] = found
        offers[self.model_source] = None
        return offers

    def continuation(self, anchor: int, pos: int, ahead, n_max: int) -> list[int]:
        """The longest free proposal after ``ahead`` (tokens a grammar forces after the anchor): how a grammar's
        draft goes on where the grammar is free again (``GrammarState.forced_draft``)."""
        return free_continuation(self.free.values(), anchor, pos, ahead, n_max)

    def propose(self, anchor: int, pos: int, n_max: int | None = None, sampler=None, *,
                source: str | None = None) -> Draft:
        """Up to n_max (default: the block size) tokens after ``anchor`` at ``pos``, from ``source``; None (a
        fixed draft length) takes the first free source's proposal that matches (prompt lookup, then history),
        else the model drafter's. ``Draft.source`` says which drafted.

        Raises:
            ValueError: a source this drafter does not have.
        """
        n_max = self.block_size if n_max is None else int(n_max)
        if source is not None and source not in self.sources:
            raise ValueError(f"unknown draft source {source!r}; this drafter has {', '.join(self.sources)}")
        if source in self.free:
            return self._free(source, anchor, pos, n_max, sampler)
        if source is None:
            for name in self.free:
                found = self._free(name, anchor, pos, n_max, sampler)
                if len(found.tokens):
                    return found
        # the model drafter's own block bounds it (the hybrid's block may be a free source's, larger)
        draft = self.model_drafter.propose(anchor, pos, min(n_max, self.sources[self.model_source]), sampler=sampler)
        return replace(draft, source=self.model_source)

    def _free(self, name: str, anchor: int, pos: int, n_max: int, sampler) -> Draft:
        found = self.free[name].propose(anchor, pos, n_max, sampler=sampler)
        found.source = name  # a fresh Draft: named in place (dataclasses.replace costs ~10 us a round)
        return found


def free_length(offers, source: str, k: int) -> tuple[str, int]:
    """A round's (source, k) from the chooser's pick, with two free sources that size their own drafts:

    - a grammar's draft, when on offer, drafts: at least its leading forced tokens (a forced token is right
      unless the target spells the forced bytes otherwise, so its verify row all but always buys a token, at
      0.2-0.3 of a token's cost on a CPU) and at least the k planned for the source picked, within the grammar's
      draft (its forced tokens and their free continuation);
    - the history, once picked, drafts its whole proposal: its length already grows with the match and stops
      where earlier replies disagree (``HistoryStore.propose``), as SuffixDecoding sizes its drafts, while the
      chooser's running acceptance mixes long repeats with short matches and would plan both alike. Where prompt
      lookup is picked and the history's proposal begins with the k tokens planned from it, the two agree and the
      history's longer proposal drafts."""
    draft = offers.get(GRAMMAR)
    if draft is not None:
        forced = draft.forced if draft.forced is not None else ()
        lead = next((i for i, flag in enumerate(forced) if not flag), len(forced))
        return GRAMMAR, min(len(draft.tokens), max(k, lead))
    history = offers.get(HISTORY)
    if history is None or k == 0:
        return source, k
    if source == HISTORY:
        return source, max(k, len(history.tokens))
    picked = offers.get(source)
    if (picked is not None and len(history.tokens) > k
            and np.array_equal(history.tokens[:k], np.asarray(picked.tokens[:k], dtype=history.tokens.dtype))):
        return HISTORY, len(history.tokens)
    return source, k


def grammar_draft(rules, free_sources, anchor: int, pos: int, n_max: int) -> Draft | None:
    """The grammar's draft after the anchor at ``pos``: what ``rules`` (``OutputRules``) force, continued where the
    grammar is free again by the longest proposal of the ``free_sources`` (``GrammarState.forced_draft``), as a
    Draft of source "grammar" with its ``forced`` flags; None without a grammar or where it forces nothing."""
    if rules.guide is None or n_max <= 0:
        return None
    free_sources = list(free_sources)

    def continuation(ahead):
        return free_continuation(free_sources, anchor, pos, ahead, n_max - len(ahead))

    tokens, forced = rules.forced_draft(n_max, continuation if free_sources else None)
    if not tokens:
        return None
    return Draft(np.asarray(tokens, np.int32), source=GRAMMAR, forced=np.asarray(forced, bool))


def free_continuation(sources, anchor: int, pos: int, ahead, n_max: int) -> list[int]:
    """The longest proposal of the free ``sources`` (prompt lookup, history) after ``ahead``, tokens not
    committed yet that follow the anchor at ``pos``."""
    best: list[int] = []
    for source in sources:
        found = source.propose_after(anchor, pos, ahead, n_max)
        if len(found.tokens) > len(best):
            best = [int(t) for t in found.tokens]
    return best
