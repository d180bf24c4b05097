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

from .batch import Batch
from .context import Context
from .sampling import Sampler, SamplingParams


@dataclass
class GenerationResult:
    """What ``generate`` returns.

    Attributes:
        text: the generated text (prompt excluded).
        tokens: generated token ids.
        n_prompt: prompt length in tokens.
        stop_reason: "eog" (end-of-generation token), "max_tokens" or "n_ctx" (context full).
        t_prefill, t_decode: seconds spent on the prompt and on generating.
    """

    text: str
    tokens: list[int]
    n_prompt: int
    stop_reason: str
    t_prefill: float = 0.0
    t_decode: float = 0.0

    @property
    def decode_tok_s(self) -> float:
        """Generated tokens per second of decode time (prefill excluded)."""
        return len(self.tokens) / self.t_decode if self.t_decode > 0 else 0.0


@dataclass
class TokenEvent:
    """One streamed token: its id and the text it completes ("" while a UTF-8 sequence is incomplete).

    A final event with token -1 flushes a UTF-8 sequence left incomplete by the last token (as U+FFFD).
    """

    token: int
    text: str


@dataclass
class _Timing:
    t_prefill: float = 0.0
    t_decode: float = 0.0
    stop_reason: str = "max_tokens"
    tokens: list[int] = field(default_factory=list)


def prompt_tokens(ctx: Context, prompt: str | Sequence[int], *, add_special: bool = True) -> np.ndarray:
    """Tokenize a text prompt (or validate given ids) and check it fits the context.

    Raises:
        ValueError: empty prompt, or a prompt of n_ctx tokens or more (no room to generate).
    """
    if isinstance(prompt, str):
        tokens = ctx.model.tokenize(prompt, add_special=add_special, parse_special=True)
    else:
        tokens = ctx.model._checked_tokens(prompt)
    if len(tokens) == 0:
        raise ValueError("empty prompt: give at least one token")
    if len(tokens) >= ctx.n_ctx:
        raise ValueError(f"prompt of {len(tokens)} tokens does not fit n_ctx={ctx.n_ctx} (need room to generate)")
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


def generate_tokens(ctx: Context, tokens: np.ndarray, *, max_tokens: int, sampler: Sampler,
                    stop_at_eog: bool = True, timing: _Timing | None = None) -> Iterator[int]:
    """Yield generated token ids one by one (the context's memory is cleared first)."""
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    timing = timing if timing is not None else _Timing()
    with ctx.generation("plain generation"):  # ContextBusyError if another generation runs on ctx
        yield from _generate_owned(ctx, tokens, max_tokens=max_tokens, sampler=sampler, stop_at_eog=stop_at_eog,
                                   timing=timing)


def _generate_owned(ctx: Context, tokens: np.ndarray, *, max_tokens: int, sampler: Sampler, stop_at_eog: bool,
                    timing: _Timing) -> Iterator[int]:
    ctx.clear()
    batch = Batch(min(ctx.n_batch, max(len(tokens), 1)))
    try:
        t0 = time.perf_counter()
        prefill(ctx, batch, tokens)
        timing.t_prefill = time.perf_counter() - t0
        pos = len(tokens)
        t0 = time.perf_counter()
        for _ in range(max_tokens):
            token = sampler(ctx.logits(-1))
            timing.tokens.append(token)
            yield token
            if stop_at_eog and ctx.model.is_eog(token):
                timing.stop_reason = "eog"
                return
            if pos >= ctx.n_ctx:
                timing.stop_reason = "n_ctx"
                return
            batch.clear()
            batch.add(token, pos, logits=True)
            ctx.decode(batch)
            pos += 1
    finally:
        timing.t_decode = time.perf_counter() - t0 if timing.tokens else 0.0
        batch.close()


def generate(ctx: Context, prompt: str | Sequence[int], *, max_tokens: int = 128, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stream: bool = False,
             stop_at_eog: bool = True, add_special: bool = True):
    """Generate a continuation of ``prompt`` with plain autoregressive decoding.

    Args:
        ctx: a Context (its memory is cleared first).
        prompt: text (tokenized with the model's special tokens) or token ids.
        max_tokens: most tokens to generate.
        temperature, top_k, top_p, seed: see ``SamplingParams``; temperature 0 is exact greedy.
        stream: if True return an iterator of ``TokenEvent`` instead of a result.
        stop_at_eog: stop after an end-of-generation token (it is included in the output ids).
        add_special: let the tokenizer add BOS/EOS as the model asks (text prompts only).

    Returns:
        GenerationResult, or an iterator of TokenEvent when ``stream``.

    Raises:
        ValueError: empty prompt, prompt too long for n_ctx, bad sampling params.
    """
    sampler = Sampler(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed))
    tokens = prompt_tokens(ctx, prompt, add_special=add_special)
    timing = _Timing()
    events = _events(ctx, generate_tokens(ctx, tokens, max_tokens=max_tokens, sampler=sampler,
                                          stop_at_eog=stop_at_eog, timing=timing))
    if stream:
        return events
    text = "".join(event.text for event in events)
    return GenerationResult(text=text, tokens=timing.tokens, n_prompt=len(tokens), stop_reason=timing.stop_reason,
                            t_prefill=timing.t_prefill, t_decode=timing.t_decode)


def _events(ctx: Context, token_ids: Iterator[int]) -> Iterator[TokenEvent]:
    """Attach text to token ids; pieces are decoded incrementally so UTF-8 split across tokens is whole."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    has_vocab = ctx.model.has_vocab
    for token in token_ids:
        piece = ctx.model.token_to_piece(token) if has_vocab else b""
        yield TokenEvent(token=token, text=decoder.decode(piece))
    tail = decoder.decode(b"", final=True)
    if tail:
        yield TokenEvent(token=-1, text=tail)
