"""Plain autoregressive generation: the baseline the speculative loop must reproduce.

One round: sample the next token from the last logits, decode it alone at the
next position, repeat. The prompt is prefilled in chunks of n_batch with
logits on its last row only.
"""

from __future__ import annotations

import codecs
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from . import checks
from .batch import Batch
from .context import Context
from .logprobs import MAX_TOP_LOGPROBS, TokenLogprob, token_logprob
from .sampling import Sampler, SamplingParams
from .stats import SpecStats
from .structured import Grammar, GrammarState


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
        return finish_reason(self.stop_reason)

    @property
    def n_prompt(self) -> int:
        return self.stats.n_prompt

    @property
    def t_prefill(self) -> float:
        return self.stats.t_prefill

    @property
    def t_decode(self) -> float:
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
    """

    token: int
    text: str
    from_draft: bool = False
    stop_reason: str | None = None
    result: GenerationResult | None = field(default=None, repr=False, compare=False)
    logprob: TokenLogprob | None = None

    @property
    def finish_reason(self) -> str | None:
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


def prompt_tokens(ctx: Context, prompt: str | Sequence[int], *, add_special: bool = True) -> np.ndarray:
    """Tokenize a text prompt (or validate given ids) and check it fits the context.

    Raises:
        TypeError: a prompt that is neither text nor integer token ids (bytes, floats, ...).
        ValueError: empty prompt, or a prompt of n_ctx tokens or more (no room to generate).
    """
    prompt = checks.prompt(prompt)
    if isinstance(prompt, str):
        tokens = ctx.model.tokenize(prompt, add_special=add_special, parse_special=True)
    else:
        tokens = ctx.model._checked_tokens(prompt)
    if len(tokens) == 0:
        raise ValueError("empty prompt: give at least one token")
    if len(tokens) >= ctx.n_ctx_seq:
        raise ValueError(f"prompt of {len(tokens)} tokens does not fit n_ctx={ctx.n_ctx_seq} (need room to generate)")
    return tokens


def prefill(ctx: Context, batch: Batch, tokens: np.ndarray, pos0: int = 0, *, seq_id: int = 0) -> None:
    """Decode tokens in chunks of n_batch; logits only on the very last row."""
    step = min(ctx.n_batch, batch.capacity)
    for start in range(0, len(tokens), step):
        chunk = tokens[start:start + step]
        batch.clear()
        is_last = start + step >= len(tokens)
        batch.add_tokens(chunk, pos0 + start, seq_id=seq_id, logits="last" if is_last else "none")
        ctx.decode(batch)


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
        token = sampler(self.guide.mask(row) if self.guide is not None else row)
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

    def verify_rows(self, rows: np.ndarray, drafts: np.ndarray) -> np.ndarray:
        """The verify rows of [anchor, drafts] as the grammar allows them (row i after ``drafts[:i]``)."""
        return rows if self.guide is None else self.guide.mask_rows(rows, drafts)

    def commit(self, rows: np.ndarray, committed: list[int]) -> list[TokenLogprob] | None:
        """Advance the grammar by a round's committed tokens; their logprobs from the raw rows they came from."""
        if self.guide is not None:
            self.guide.advance(committed)
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


def generate_tokens(ctx: Context, tokens: np.ndarray, *, max_tokens: int, sampler: Sampler,
                    stop_at_eog: bool = True, stats: SpecStats | None = None, reuse_prefix: bool = False,
                    rules: OutputRules | None = None) -> Iterator[tuple[int, TokenLogprob | None]]:
    """Yield (token id, logprob) one by one (logprob None unless ``rules`` asks for it); ``stats`` (if given)
    gets the counts, the timings and the stop reason. The context's memory is cleared first, or with
    ``reuse_prefix`` trimmed to the prefix it shares with the last generation on this context
    (``Context._reusable_prefix``). ``rules``: a grammar and logprobs (``OutputRules``)."""
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    stats = stats if stats is not None else SpecStats()
    stats.n_prompt, stats.stop_reason = len(tokens), "max_tokens"
    rules = rules if rules is not None else OutputRules(ctx.model)
    with ctx.generation("plain generation"):  # ContextBusyError if another generation runs on ctx
        yield from _generate_owned(ctx, tokens, max_tokens=max_tokens, sampler=sampler, stop_at_eog=stop_at_eog,
                                   stats=stats, reuse_prefix=reuse_prefix, rules=rules)


PLAIN = "plain generation"  # the owner a plain generation records with its memory


def _generate_owned(ctx: Context, tokens: np.ndarray, *, max_tokens: int, sampler: Sampler, stop_at_eog: bool,
                    stats: SpecStats, reuse_prefix: bool,
                    rules: OutputRules) -> Iterator[tuple[int, TokenLogprob | None]]:
    keep = ctx._reusable_prefix(PLAIN, tokens, any_owner=True) if reuse_prefix else 0
    ctx._forget()
    if keep:
        ctx.seq_rm(0, keep, -1)
    else:
        ctx.clear()
    stats.n_reused = keep
    in_memory = [int(t) for t in tokens]
    batch = Batch(min(ctx.n_batch, max(len(tokens) - keep, 1)))
    t0 = time.perf_counter()
    clean = False
    try:
        prefill(ctx, batch, tokens[keep:], keep)
        stats.t_prefill = time.perf_counter() - t0
        pos = len(tokens)
        t0 = time.perf_counter()
        for _ in range(max_tokens):
            token, logprob = rules.choose(ctx.logits(-1), sampler)
            stats.n_generated += 1
            try:
                yield token, logprob
            except GeneratorExit:  # the consumer stopped: the memory is as consistent as after a return
                clean = True
                raise
            if rules.ends(token, stop_at_eog):
                stats.stop_reason = "eog"
                break
            if pos >= ctx.n_ctx_seq:
                stats.stop_reason = "n_ctx"
                break
            batch.clear()
            batch.add(token, pos, logits=True)
            ctx.decode(batch)
            in_memory.append(token)
            pos += 1
        clean = True
    finally:
        stats.t_decode = time.perf_counter() - t0 if stats.n_generated else 0.0
        batch.close()
        if clean:
            ctx._remember(PLAIN, np.asarray(in_memory))


def generate(ctx: Context, prompt: str | Sequence[int], *, max_tokens: int = 128, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stop: str | Sequence[str] | None = None,
             stream: bool = False, stop_at_eog: bool = True, add_special: bool = True, reuse_prefix: bool = False,
             grammar: Grammar | None = None, logprobs: int | None = None):
    """Generate a continuation of ``prompt`` with plain autoregressive decoding.

    Args:
        ctx: a Context (its memory is cleared first).
        prompt: text (tokenized with the model's special tokens) or token ids.
        max_tokens: most tokens to generate.
        temperature, top_k, top_p, seed: see ``SamplingParams``; temperature 0 is exact greedy.
        stop: a string or a list of strings that end the generation; the text is cut before it.
        stream: if True return an iterator of ``TokenEvent`` instead of a result.
        stop_at_eog: stop after an end-of-generation token (it is included in the output ids).
        add_special: let the tokenizer add BOS/EOS as the model asks (text prompts only).
        reuse_prefix: keep the memory of the prefix this prompt shares with the last generation on ``ctx``
            (a chat's next turn) instead of decoding the whole prompt again; ``stats.n_reused`` says how many
            tokens were kept. Off by default: prompts longer than 64 tokens are decoded with batch kernels
            whose last bits depend on how the prompt was split, so a reused prefix may round differently.
        grammar: a ``Grammar`` the output must meet (structured output: JSON schema, regex, Lark); the generation
            ends when the grammar is complete and the model ends it.
        logprobs: report each token's log-probability with this many most likely alternatives (0..20;
            ``pyllama_dspark.logprobs``): ``result.logprobs`` and ``TokenEvent.logprob``. None: none.

    Returns:
        GenerationResult, or an iterator of TokenEvent when ``stream``.

    Raises:
        TypeError: an argument of the wrong type (the message names it), e.g. a Model for ``ctx``.
        ValueError: empty prompt, prompt too long for n_ctx, bad sampling params, logprobs above 20;
            GrammarError (a ValueError): a grammar this vocabulary cannot meet.
    """
    checks.instance("ctx", ctx, Context, "create one with Context(model), or use pyllama_dspark.load(path)")
    max_tokens = checks.integer("max_tokens", max_tokens, minimum=0)
    stop = checks.stop_strings(stop)
    sampler = Sampler(sampling_params(temperature, top_k, top_p, seed))
    grammar, logprobs = output_options(grammar, logprobs)
    tokens = prompt_tokens(ctx, prompt, add_special=add_special)
    rules = OutputRules(ctx.model, grammar, logprobs)
    stats = SpecStats()
    result = GenerationResult(text="", tokens=[], stop_reason="max_tokens", stats=stats,
                              logprobs=None if logprobs is None else [])
    ids = generate_tokens(ctx, tokens, max_tokens=max_tokens, sampler=sampler, stop_at_eog=stop_at_eog, stats=stats,
                          reuse_prefix=bool(reuse_prefix), rules=rules)
    events = stream_events(ctx.model, ((token, False, logprob) for token, logprob in ids), stop, result,
                           close=ids.close)
    if stream:
        return events
    for _ in events:
        pass
    return result


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
