"""Plain autoregressive generation: the baseline the speculative loop must reproduce.

One round: sample the next token from the last logits, decode it alone at the
next position, repeat. The prompt is prefilled in chunks of n_batch with
logits on its last row only.
"""

from __future__ import annotations

import time
from typing import Iterator, Sequence

import numpy as np

from . import checks
from .batch import Batch
from .context import Context
from .events import (GenerationResult, OutputRules, TextStream, TokenEvent, _find_stop, _held_back,  # noqa: F401
                     finish_reason, output_options, sampling_params, stream_events)
from .logprobs import TokenLogprob
from .sampling import Sampler
from .stats import SpecStats
from .structured import Grammar


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

    Example:
        ```python
        model = pyllama_dspark.Model("target.gguf")
        ctx = pyllama_dspark.Context(model, n_ctx=4096)
        print(pyllama_dspark.generate(ctx, "The capital of France is", max_tokens=16).text)
        ```
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
