"""What a generation is asked for and what it gives back, in pure Python (no native imports): the request's
output rules (``OutputRules``: grammar and logprobs), ``BatchRequest``, the streamed ``TokenEvent`` records, the
``GenerationResult`` and the incremental text of a stream (``TextStream``: UTF-8 and stop strings).

``generate``, the speculative loop, the batch scheduler and the server's engine share them; the engine imports
them from here, so the server never imports a module that calls native code (``generate`` and ``batching``
re-export them where they were).
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from . import checks
from .cancel import CancelToken
from .logprobs import MAX_TOP_LOGPROBS, TokenLogprob, token_logprob
from .sampling import Sampler, SamplingParams
from .stats import SpecStats
from .structured import Grammar, GrammarState

EXACT_UBATCH = 64  # most tokens a ubatch may have for consistent numerics to hold (patches 0005, 0012)
MAX_EXACT_ROWS = EXACT_UBATCH  # rows a decode may have for consistent numerics to hold


@dataclass
class GenerationResult:
    """What ``generate`` and ``Speculator.generate`` return (one type for plain and speculative decoding).

    Attributes:
        text: the generated text (prompt excluded; cut before a stop string).
        tokens: generated token ids.
        stop_reason: "eog" (end-of-generation token), "stop" (a stop string), "max_tokens", "n_ctx"
            (context full) or "cancelled" (a ``CancelToken``). ``finish_reason`` gives it in OpenAI's terms
            ("stop" or "length").
        stats: ``SpecStats`` (prompt and generated counts, timings; drafting figures stay 0 for plain decoding).
        logprobs: one ``TokenLogprob`` per token when the generation was asked for ``logprobs``, else None.
    """

    text: str
    tokens: list[int]
    stop_reason: str
    stats: SpecStats = field(default_factory=SpecStats)
    logprobs: list[TokenLogprob] | None = None

    @property
    def finish_reason(self) -> str:
        """``stop_reason`` in OpenAI's terms: "stop" (end of generation, stop string), "length" or "cancelled"."""
        return finish_reason(self.stop_reason)

    @property
    def n_prompt(self) -> int:
        """Prompt tokens (``stats.n_prompt``)."""
        return self.stats.n_prompt

    @property
    def t_prefill(self) -> float:
        """Seconds spent decoding the prompt (``stats.t_prefill``)."""
        return self.stats.t_prefill

    @property
    def t_decode(self) -> float:
        """Seconds spent generating after the prompt (``stats.t_decode``)."""
        return self.stats.t_decode

    @property
    def decode_tok_s(self) -> float:
        """Generated tokens per second of decode time (prefill excluded)."""
        return len(self.tokens) / self.t_decode if self.t_decode > 0 else 0.0


def finish_reason(stop_reason: str) -> str:
    """OpenAI's finish_reason for one of our stop reasons: "stop" (end of generation, stop string), "length", or
    "cancelled" (a ``CancelToken``; no OpenAI client sees it, its request is gone)."""
    if stop_reason == "cancelled":
        return "cancelled"
    return "stop" if stop_reason in ("eog", "stop") else "length"


@dataclass
class TokenEvent:
    """One streamed token: its id, the text it releases, whether a draft proposed it, and its ``logprob`` (a
    ``TokenLogprob`` when the generation was asked for ``logprobs``).

    ``text`` is "" while a UTF-8 sequence is incomplete or while the text could still begin a stop string.
    Every stream ends with one event of token -1 whose ``stop_reason`` (and ``finish_reason``) says why
    the generation ended; its text is what was left (an incomplete UTF-8 tail as U+FFFD), usually "", and its
    ``result`` is the whole generation's ``GenerationResult`` (text, tokens, stats).

    Attributes:
        token: the token id; -1 in the last event.
        text: the text this token releases (see above).
        from_draft: True when a draft proposed the token and the target accepted it.
        stop_reason: None, except in the last event: "eog", "stop", "max_tokens", "n_ctx" or "cancelled".
        result: None, except in the last event: the ``GenerationResult``.
        logprob: the token's ``TokenLogprob`` when the generation was asked for ``logprobs``, else None.
    """

    token: int
    text: str
    from_draft: bool = False
    stop_reason: str | None = None
    result: GenerationResult | None = field(default=None, repr=False, compare=False)
    logprob: TokenLogprob | None = None

    @property
    def finish_reason(self) -> str | None:
        """``stop_reason`` in OpenAI's terms ("stop", "length" or "cancelled"); None before the last event."""
        return None if self.stop_reason is None else finish_reason(self.stop_reason)


class TextStream:
    """Token ids -> text, incrementally: pieces are decoded so that UTF-8 split across tokens comes out
    whole, and text that could begin a stop string is held back until it cannot."""

    def __init__(self, model, stop: Sequence[str] = ()):
        self.model, self.stop = model, list(stop)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._has_vocab = model.has_vocab
        self.text = ""  # everything decoded so far (cut before the stop string once one completes)
        self.stopped = False
        self._emitted = 0

    def add(self, token: int) -> str:
        """Decode one more token; return the text it releases. Sets ``stopped`` when a stop string completes."""
        self.text += self._decoder.decode(self.model.token_to_piece(token)) if self._has_vocab else ""
        cut = _find_stop(self.text, self._emitted, self.stop)
        if cut is not None:
            self.text, self.stopped = self.text[:cut], True
        end = len(self.text) if self.stopped else len(self.text) - _held_back(self.text, self.stop)
        out, self._emitted = self.text[self._emitted:end], end
        return out

    def finish(self) -> str:
        """What is left at the end: an incomplete UTF-8 tail and text held back for a stop string that never came."""
        if not self.stopped:
            self.text += self._decoder.decode(b"", final=True)
        out, self._emitted = self.text[self._emitted:], len(self.text)
        return out


def _find_stop(text: str, emitted: int, stop: list[str]) -> int | None:
    """Where the earliest stop string starts in text, looking only where one could newly complete."""
    if not stop:
        return None
    base = max(0, emitted - max(len(s) for s in stop))
    hits = [h for h in (text.find(s, base) for s in stop if s) if h >= 0]
    return min(hits) if hits else None


def _held_back(text: str, stop: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string."""
    best = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class OutputRules:
    """What a generation's tokens must meet and report beside the sampler: a grammar (``GrammarState``; None for
    free text) and the number of most likely alternatives to report with each token's log-probability (None: no
    logprobs). One per generation: the grammar state advances with it."""

    def __init__(self, model, grammar: Grammar | None = None, logprobs: int | None = None):
        self.guide = GrammarState(grammar, model) if grammar is not None else None
        self.n_logprobs = logprobs
        self._model = model

    def choose(self, row: np.ndarray, sampler: Sampler) -> tuple[int, TokenLogprob | None]:
        """The next token from one logits row (masked by the grammar), its logprob; the grammar advances."""
        if self.guide is None:
            token = sampler(row)
        elif sampler.params.greedy:
            token = self.guide.greedy(row)  # the masked argmax, without masking the whole row where it can
        else:
            token = sampler(self.guide.mask(row))
        if self.guide is not None:
            self.guide.advance([token])
        return token, self.logprob(row, token)

    def logprob(self, row: np.ndarray, token: int) -> TokenLogprob | None:
        return None if self.n_logprobs is None else token_logprob(row, token, self.n_logprobs)

    def cut_draft(self, drafts: np.ndarray, stats: SpecStats) -> tuple[np.ndarray, int | None]:
        """A draft cut before its first token the grammar refuses, and that token (None when nothing was cut);
        ``stats.n_draft_invalid`` counts the tokens cut."""
        if self.guide is None or not len(drafts):
            return drafts, None
        n_valid = self.guide.valid_prefix(drafts)
        if n_valid == len(drafts):
            return drafts, None
        stats.n_draft_invalid += len(drafts) - n_valid
        return drafts[:n_valid], int(drafts[n_valid])

    def forced_draft(self, n_max: int, continuation=None) -> tuple[list[int], list[bool]]:
        """The grammar's forced tokens from here, continued where it is free by ``continuation``
        (``GrammarState.forced_draft``); ([], []) without a grammar or where it forces nothing."""
        if self.guide is None:
            return [], []
        return self.guide.forced_draft(n_max, continuation)

    def verify_rows(self, rows: np.ndarray, drafts: np.ndarray) -> np.ndarray:
        """The verify rows of [anchor, drafts] as the grammar allows them (row i after ``drafts[:i]``)."""
        return rows if self.guide is None else self.guide.mask_rows(rows, drafts)

    def verify_greedy(self, rows: np.ndarray, drafts: np.ndarray) -> np.ndarray:
        """Each verify row's greedy token as the grammar allows it (``np.argmax(verify_rows(rows, drafts), axis=1)``,
        without masking the rows whose raw argmax the grammar allows)."""
        return np.argmax(rows, axis=1) if self.guide is None else self.guide.greedy_rows(rows, drafts)

    def commit(self, rows: np.ndarray, committed: list[int]) -> list[TokenLogprob] | None:
        """Advance the grammar by a round's committed tokens, up to the first end of generation (an accepted
        end-of-generation draft ends the output, the tokens after it are never handed out, and the grammar admits
        nothing after it); their logprobs from the raw rows they came from."""
        if self.guide is not None:
            end = next((i + 1 for i, t in enumerate(committed) if self._model.is_eog(int(t))), len(committed))
            self.guide.advance(committed[:end])
        return None if self.n_logprobs is None else [self.logprob(rows[i], t) for i, t in enumerate(committed)]

    def ends(self, token: int, stop_at_eog: bool) -> bool:
        """Whether ``token`` ends the generation: an end-of-generation token with ``stop_at_eog``, and always
        under a grammar (it admits nothing after one)."""
        return (stop_at_eog or self.guide is not None) and self._model.is_eog(token)


def output_options(grammar, logprobs) -> tuple[Grammar | None, int | None]:
    """``grammar`` and ``logprobs`` arguments checked: a Grammar or None; None or 0..20 alternatives."""
    if grammar is not None:
        checks.instance("grammar", grammar, Grammar, "build one with Grammar.json_schema(...), Grammar.regex(...)")
    logprobs = checks.optional_integer("logprobs", logprobs, minimum=0)
    if logprobs is not None and logprobs > MAX_TOP_LOGPROBS:
        raise ValueError(f"logprobs must be at most {MAX_TOP_LOGPROBS} alternatives, got {logprobs}")
    return grammar, logprobs


def sampling_params(temperature, top_k, top_p, seed) -> SamplingParams:
    """SamplingParams from user arguments, their types checked (TypeError naming the argument)."""
    return SamplingParams(temperature=checks.number("temperature", temperature),
                          top_k=checks.integer("top_k", top_k), top_p=checks.number("top_p", top_p),
                          seed=checks.optional_integer("seed", seed))


def stream_events(model, tokens: Iterator[tuple[int, bool, TokenLogprob | None]], stop: list[str],
                  result: GenerationResult, close) -> Iterator[TokenEvent]:
    """TokenEvents for (token, from_draft, logprob) triples, filling ``result`` as they go (its ``logprobs`` too
    when it has a list); a completed stop string ends the generation (``close`` stops the producer). The last
    event (token -1) carries the stop reason."""
    text = TextStream(model, stop)
    try:
        for token, from_draft, logprob in tokens:
            result.tokens.append(token)
            if result.logprobs is not None:
                result.logprobs.append(logprob)
            piece = text.add(token)
            yield TokenEvent(token=token, text=piece, from_draft=from_draft, logprob=logprob)
            if text.stopped:
                result.stats.stop_reason = "stop"
                break
    finally:  # also when the consumer stops early: the producer releases its context now
        close()
    tail = text.finish()
    result.text, result.stop_reason = text.text, result.stats.stop_reason
    yield TokenEvent(token=-1, text=tail, stop_reason=result.stop_reason, result=result)


@dataclass
class BatchRequest:
    """One generation for the scheduler: prompt token ids and its own sampler (seeded per request); ``rules``: a
    grammar and logprobs (``OutputRules``, one per request; None: free text, no logprobs)."""

    tokens: np.ndarray
    max_tokens: int
    sampler: Sampler = field(default_factory=Sampler)
    stop: list[str] = field(default_factory=list)
    stop_at_eog: bool = True
    cancel: CancelToken | None = None
    stop_tokens: frozenset[int] = frozenset()  # ids that end the generation (kept), besides end-of-generation
    rules: OutputRules | None = None
