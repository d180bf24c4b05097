"""One-line loading and the calls llama-cpp-python and mlx-lm users know, over Model, Context,
DSparkDrafter and Speculator (which stay the API for finer control).

    llm = pyllama_dspark.load("target.gguf", drafter="drafter.gguf")
    print(llm.generate("Hello", max_tokens=32).text)
    for event in llm.stream("Hello"):
        print(event.text, end="")
    reply = llm.create_chat_completion([{"role": "user", "content": "Hi"}])
    print(reply["choices"][0]["message"]["content"], reply["usage"])

With a drafter the generation is speculative (exactly plain greedy decoding's tokens at temperature 0);
without one it is plain decoding. Results and stream events are the same types either way.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from . import checks
from .batching import BatchRequest, BatchScheduler
from .completions import completion, completion_chunks, completion_head
from .context import CancelToken, Context
from .drafter import DSparkDrafter, HistoryDrafter, PromptLookupDrafter
from .errors import DecodeAbortedError
from .generate import (GenerationResult, OutputRules, TokenEvent, generate, output_options, prompt_tokens,
                       sampling_params)
from .history import DEFAULT_HISTORY_TOKENS, HISTORY_BLOCK, HistoryStore
from .hybrid import HybridDrafter
from .model import Model, read_header
from .sampling import Sampler
from .speculative import Speculator
from .stats import SpecStats
from .structured import Grammar
from .tools import call_grammar, check_tool_choice, check_tools, prompt_messages


def load(target: str | os.PathLike[str] | Model, drafter: str | os.PathLike[str] | Any | None = None, *,
         n_ctx: int = 4096, n_threads: int | None = None, n_draft: int | None = None, n_draft_min: int = 0,
         p_min: float = 0.0, prompt_lookup: bool | None = None, history_tokens: int = DEFAULT_HISTORY_TOKENS,
         grammar_drafts: bool = True, n_gpu_layers: int | None = None,
         rpc_servers: Sequence[str] = (), tensor_split: Sequence[float] | None = None, **context_kwargs) -> LLM:
    """Load a target model (and optionally a DSpark drafter) ready to generate.

    Args:
        target: a GGUF path, or an open Model (then it stays yours to close).
        drafter: a DSpark drafter GGUF path, any Drafter object (e.g. ``PromptLookupDrafter()``), or None
            for plain decoding.
        n_ctx: context size in tokens.
        n_threads: CPU threads (None: llama.cpp's default).
        n_draft: drafts per round; None picks it per round from measured costs (see ``Speculator``).
        n_draft_min: drafts shorter than this are dropped (the round becomes a plain decode step).
        p_min: a DSpark drafter's drafts are cut at the first slot whose confidence is below p_min.
        prompt_lookup: also draft by prompt lookup: the drafter is wrapped in a ``HybridDrafter``, which drafts
            each round from prompt lookup (when the text's last tokens occurred before) or the drafter, whichever
            promises more tokens per second (with a fixed n_draft: lookup whenever it matches). Without a
            drafter, prompt lookup alone (``PromptLookupDrafter()``). Default (None): on with a DSpark drafter
            given as a path, off otherwise (plain decoding stays plain, a Drafter object stays as given). The
            hybrid is the default because it beat the DSpark drafter alone on every task category measured and
            was level with prompt lookup alone overall (docs/configuration.md); False keeps the DSpark
            drafter alone.
        history_tokens: with prompt lookup beside a DSpark drafter (the default configuration), a third free
            source drafts from the replies of this LLM's earlier generations (``HistoryStore``: the continuation
            of the text's longest suffix found there), kept up to this many tokens, the oldest dropped first;
            the store is shared by ``generate``, ``generate_batch`` and the server's slots. 0: no history.
        grammar_drafts: under a grammar, draft the tokens it forces (continued by prompt lookup or history
            where it is free again); verified like any draft. False: the grammar only masks.
        n_gpu_layers: target layers to offload to a GPU or the RPC servers (default: all with ``rpc_servers``,
            else 0). A DSpark drafter's own layers stay local unless it is given.
        rpc_servers: ``"host:port"`` endpoints of rpc-servers that hold the target's offloaded layers (see
            ``Model``); a path target only.
        tensor_split: the share of the offloaded layers per RPC device (see ``Model``); a path target only.
        **context_kwargs: further ``Context`` arguments (``n_batch``, ``kv_type``, ``consistent_numerics``...).

    Returns:
        The loaded ``LLM``, ready to ``generate``, ``stream``, ``chat`` and ``create_chat_completion``. It owns its
            context and drafter, and the model when ``target`` is a path: ``close()`` it, or use it in a ``with``
            block.

    Raises:
        TypeError: an argument of the wrong type (the message names it), e.g. a ``target`` that is neither a path
            nor a Model, or a ``drafter`` without the Drafter protocol.
        ValueError: a size out of range (``n_ctx`` < 1, ``n_threads`` < 1, ``history_tokens`` < 0, a negative
            ``n_draft``, a bad ``Context`` argument), or ``rpc_servers`` / ``tensor_split`` with an open Model.
        FileNotFoundError: the target's or the drafter's file does not exist.
        ModelLoadError: llama.cpp refused a file (not GGUF, truncated, corrupt, unsupported architecture).
        DrafterError: a drafter that does not fit the target (a ValueError).
        ContextInitError: llama.cpp could not create the target's (or the drafter's) context.
        UnsupportedModeError: consistent numerics (on by default) cannot be promised on this model or backend.
        RpcError: an RPC server cannot be used.

    Example:
        ```python
        import pyllama_dspark

        with pyllama_dspark.load("target.gguf", drafter="drafter.gguf", n_ctx=8192) as llm:
            print(llm.generate("The capital of France is", max_tokens=16).text)
        ```
    """
    n_ctx = checks.integer("n_ctx", n_ctx, minimum=1)
    n_threads = checks.optional_integer("n_threads", n_threads, minimum=1)
    history_tokens = checks.integer("history_tokens", history_tokens, minimum=0)
    checks.instance("grammar_drafts", grammar_drafts, bool)
    if prompt_lookup is not None:
        checks.instance("prompt_lookup", prompt_lookup, bool)
    if not isinstance(target, (Model, str, os.PathLike)):
        raise TypeError(f"target must be a GGUF path or a Model, got {type(target).__name__}")
    owns_model = not isinstance(target, Model)
    if not owns_model and (rpc_servers or tensor_split is not None):
        raise ValueError("rpc_servers and tensor_split are for a path target; an open Model keeps its own placement")
    model = Model(target, n_gpu_layers=n_gpu_layers, rpc_servers=rpc_servers,
                  tensor_split=tensor_split) if owns_model else target
    try:
        return LLM(model, drafter, owns_model=owns_model, n_ctx=n_ctx, n_threads=n_threads, n_draft=n_draft,
                   n_draft_min=n_draft_min, p_min=p_min, prompt_lookup=prompt_lookup, n_gpu_layers=n_gpu_layers or 0,
                   history_tokens=history_tokens, grammar_drafts=grammar_drafts, **context_kwargs)
    except BaseException:
        if owns_model:
            model.close()
        raise


class LLM:
    """A target (and drafter) loaded by ``load``: generate, stream, chat, OpenAI-shaped completions.

    Make one with ``load``, which checks the arguments and opens the model; the constructor takes an open Model
    and ``load``'s other arguments. With a drafter every call decodes speculatively (at temperature 0 exactly the
    tokens of plain greedy decoding); without one it decodes plainly. One generation runs at a time on an LLM
    (a second one raises ``ContextBusyError``); ``generate_batch`` runs many together. ``with load(...) as llm:``
    closes it.

    Args:
        model: the target's open Model.
        drafter: as ``load``'s ``drafter``: a DSpark drafter path, a Drafter object, or None.
        owns_model: whether ``close`` closes ``model`` too (``load`` sets it when it opened the file).
        n_ctx: context size in tokens, as ``load``.
        n_threads: CPU threads, as ``load``.
        n_draft: drafts per round, as ``load``.
        n_gpu_layers: target layers offloaded, as ``load`` (0: none).
        n_draft_min: as ``load``.
        p_min: as ``load``.
        prompt_lookup: as ``load``.
        history_tokens: as ``load``.
        grammar_drafts: as ``load``.
        **context_kwargs: further ``Context`` arguments, as ``load``.

    Raises:
        TypeError, ValueError, FileNotFoundError, ModelLoadError, DrafterError, ContextInitError: as ``load``.

    Example:
        ```python
        llm = pyllama_dspark.load("target.gguf", drafter="drafter.gguf")
        print(llm.generate("Hello", max_tokens=32).text)
        llm.close()
        ```

    Attributes:
        model: the target's Model.
        ctx: the target's Context.
        drafter: the Drafter (a ``HybridDrafter`` with ``prompt_lookup``), or None for plain decoding.
        history: the ``HistoryStore`` of earlier replies the hybrid drafts from (None: no history source).
        speculator: the Speculator over ctx and drafter, or None.
    """

    def __init__(self, model: Model, drafter, *, owns_model: bool, n_ctx: int, n_threads: int | None,
                 n_draft: int | None, n_gpu_layers: int, n_draft_min: int = 0, p_min: float = 0.0,
                 prompt_lookup: bool | None = None, history_tokens: int = DEFAULT_HISTORY_TOKENS,
                 grammar_drafts: bool = True, **context_kwargs):
        self.model, self._owns_model = model, owns_model
        is_path = isinstance(drafter, (str, os.PathLike))
        if prompt_lookup is None:  # the default configuration: a DSpark drafter with prompt lookup
            prompt_lookup = is_path
        # the drafter file's header, read once: its block size now, then the drafter's Model and checks (and the
        # batch schedulers' drafters) take it as it is
        self._drafter_header = read_header(drafter) if is_path else None
        block = (int(self._drafter_header.value("dflash.block_size", 0)) if is_path
                 else getattr(drafter, "block_size", 0))
        # made before the target's context, whose rollback snapshots must cover the larger of the two blocks
        lookup = PromptLookupDrafter() if prompt_lookup else None
        # earlier replies, a free source beside prompt lookup in the hybrid (shared with the batch schedulers)
        self.history = HistoryStore(history_tokens) if lookup is not None and is_path and history_tokens else None
        history = None if self.history is None else HistoryDrafter(self.history)
        if lookup is not None:
            block = max(block, lookup.block_size, 0 if history is None else history.block_size)
        if (model.is_hybrid or model.is_recurrent) and (drafter is not None or lookup is not None):
            context_kwargs.setdefault("n_rs_seq", Speculator.target_rs_seq(min(n_draft or block, block)))
        self.ctx = Context(model, n_ctx=n_ctx, n_threads=n_threads, **context_kwargs)
        # what a batch scheduler's own context and drafter are made with (batch_scheduler)
        self._batch_settings = dict(n_threads=n_threads, n_gpu_layers=n_gpu_layers, p_min=p_min, n_draft=n_draft,
                                    grammar_drafts=grammar_drafts, context_kwargs=dict(context_kwargs))
        self._schedulers: dict[int, tuple] = {}
        try:
            if is_path:
                drafter = DSparkDrafter(drafter, self.ctx, n_threads=n_threads, n_gpu_layers=n_gpu_layers,
                                        p_min=p_min, header=self._drafter_header)
            if lookup is not None:
                drafter = lookup if drafter is None else HybridDrafter(drafter, lookup=lookup, history=history)
            self.drafter = drafter
            self.speculator = (Speculator(self.ctx, drafter, n_draft=n_draft, n_draft_min=n_draft_min,
                                          grammar_drafts=grammar_drafts) if drafter is not None else None)
        except BaseException:
            self.ctx.close()
            raise

    # --- generation ---------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], *, cancel: CancelToken | None = None,
                 **kwargs) -> GenerationResult:
        """Generate from a text or token-id prompt. Keyword arguments as ``pyllama_dspark.generate``
        (``max_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop``, ``stop_at_eog``, ``grammar``,
        ``logprobs``...), and OpenAI's ``response_format`` (``{"type": "json_object"}`` or ``{"type":
        "json_schema", "json_schema": {"schema": ...}}``) for a grammar.

        ``cancel``: a ``CancelToken``; once another thread cancels it the generation stops at the next round (or
        inside a long prefill) and ends with ``stop_reason`` "cancelled" and the tokens committed so far.

        Args:
            prompt: text (tokenized with the model's special tokens) or token ids.
            cancel: a ``CancelToken`` that stops the generation early (see above), or None.
            **kwargs: ``pyllama_dspark.generate``'s keyword arguments (``stream`` excepted: use ``stream``), and
                ``response_format`` (OpenAI's; not together with ``grammar``).

        Returns:
            The result, with ``text`` (cut before a stop string), ``tokens``, ``stop_reason`` ("eog", "stop",
                "max_tokens", "n_ctx" or "cancelled"), ``stats`` (a ``SpecStats``) and ``logprobs`` when asked for.

        Raises:
            TypeError: an argument of the wrong type (the message names it), an unknown keyword, ``stream=True``,
                or a ``cancel`` that is not a CancelToken.
            ValueError: an empty prompt, a prompt of n_ctx tokens or more, bad sampling parameters, ``logprobs``
                above 20, or both ``response_format`` and ``grammar``.
            GrammarError: a ``response_format`` that is malformed or does not compile, or a grammar this model's
                vocabulary cannot meet (a ValueError).
            InvalidBatchError: a token id outside the vocabulary.
            ContextBusyError: another generation (an unfinished ``stream``) is running on this LLM.
            ClosedHandleError: the LLM is closed.
            DecodeError: a decode failed (``KvCacheFullError``, ``FatalDecodeError``, ...).

        Example:
            ```python
            llm = pyllama_dspark.load("target.gguf", drafter="drafter.gguf")
            result = llm.generate("The capital of France is", max_tokens=16)
            print(result.text, result.stop_reason, result.stats.tau)
            ```
        """
        if kwargs.pop("stream", False):
            raise TypeError("use LLM.stream(...) for a stream of events")
        return self._run(prompt, kwargs, stream=False, cancel=cancel)

    def stream(self, prompt: str | Sequence[int], *, cancel: CancelToken | None = None,
               **kwargs) -> Iterator[TokenEvent]:
        """Like ``generate``, as TokenEvents (text, ``from_draft``; the last event carries the stop reason and the
        ``result``).

        The arguments are checked at the call; the generation runs as the iterator is consumed, a round at a time,
        and owns the LLM's context until it ends or the iterator is closed (``close()``, or leaving a ``for`` loop
        over it and dropping it).

        Args:
            prompt: text (tokenized with the model's special tokens) or token ids.
            cancel: a ``CancelToken``; once cancelled the stream ends with a "cancelled" event.
            **kwargs: as ``generate``.

        Yields:
            One event per generated token (its ``text`` is "" while a UTF-8 sequence is incomplete or the text
                could still begin a stop string), then a last event of token -1 whose ``stop_reason`` says why the
                generation ended and whose ``result`` is the whole ``GenerationResult``.

        Raises:
            TypeError, ValueError, GrammarError, InvalidBatchError, ClosedHandleError: as ``generate``, at the call.
            ContextBusyError: another generation is running on this LLM (when the first event is asked for).
            DecodeError: a decode failed (while iterating).

        Example:
            ```python
            llm = pyllama_dspark.load("target.gguf", drafter="drafter.gguf")
            for event in llm.stream("Write a haiku about the sea.", max_tokens=64):
                print(event.text, end="", flush=True)
            ```
        """
        return self._run(prompt, kwargs, stream=True, cancel=cancel)

    def chat(self, messages: Sequence[Mapping[str, str]], *, stream: bool = False,
             cancel: CancelToken | None = None, **kwargs):
        """``generate`` (or ``stream``) on the messages formatted with the model's chat template; the memory of
        the conversation so far is kept between turns (``reuse_prefix``).

        Pass the whole conversation each turn: the prefix it shares with the previous turn is not decoded again.

        Args:
            messages: the conversation, a list of ``{"role": ..., "content": ...}`` dicts of strings.
            stream: return an iterator of ``TokenEvent`` (as ``stream``) instead of a result.
            cancel: a ``CancelToken`` that stops the generation early, as ``generate``.
            **kwargs: as ``generate`` (``reuse_prefix`` defaults to True here).

        Returns:
            The reply, a ``GenerationResult`` as ``generate`` returns; with ``stream``, an iterator of ``TokenEvent``.

        Raises:
            TypeError: ``messages`` is not a list of dicts with string ``role`` and ``content``; or as ``generate``.
            ValueError: the model has no chat template, or as ``generate``; ``chat.ChatTemplateError`` (a
                ValueError): the template failed to render.
            GrammarError, ContextBusyError, ClosedHandleError, DecodeError: as ``generate``.

        Example:
            ```python
            llm = pyllama_dspark.load("target.gguf", drafter="drafter.gguf")
            messages = [{"role": "user", "content": "Name three colours."}]
            reply = llm.chat(messages, max_tokens=64)
            messages += [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "Three more?"}]
            ```
        """
        prompt = self.model.apply_chat_template(checks.messages(messages))
        kwargs.setdefault("reuse_prefix", True)
        return self._run(prompt, kwargs, stream=stream, cancel=cancel)

    def _run(self, prompt, kwargs, *, stream: bool, cancel: CancelToken | None = None):
        if "response_format" in kwargs:
            kwargs = dict(kwargs)
            kwargs["grammar"] = self._grammar(kwargs.pop("response_format"), kwargs.get("grammar"))
        if cancel is not None:
            checks.instance("cancel", cancel, CancelToken)
            events = self._watch(self._run(prompt, kwargs, stream=True), cancel)  # arguments checked here
            if stream:
                return events
            for event in events:
                if event.result is not None:
                    return event.result
        if self.speculator is not None:
            return self.speculator.generate(prompt, stream=stream, **kwargs)
        return generate(self.ctx, prompt, stream=stream, **kwargs)

    def _watch(self, events: Iterator[TokenEvent], cancel: CancelToken) -> Iterator[TokenEvent]:
        """``events``, stopped between rounds once ``cancel`` is cancelled (a round's tokens come out together, and
        the next round is decoded only when its first event is asked for), and inside a decode by the abort
        callback; a cancelled stream ends with a "cancelled" event."""
        tokens: list[int] = []
        pieces: list[str] = []
        with self.ctx.abortable(cancel):
            try:
                while not cancel.cancelled:
                    event = next(events, None)
                    if event is None:
                        return
                    yield event
                    if event.stop_reason is not None:
                        return
                    tokens.append(event.token)
                    pieces.append(event.text)
            except DecodeAbortedError:
                if not cancel.cancelled:
                    raise
            finally:
                events.close()  # releases the context now, before the cancelled event
        stats = self.speculator.last_stats if self.speculator is not None else SpecStats()
        stats.stop_reason = "cancelled"
        result = GenerationResult("".join(pieces), tokens, "cancelled", stats)
        yield TokenEvent(token=-1, text="", stop_reason="cancelled", result=result)

    # --- continuous batching ------------------------------------------------------------------
    def generate_batch(self, prompts: Sequence[str | Sequence[int]], *, parallel: int = 4, max_tokens: int = 128,
                       temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                       stop: str | Sequence[str] | None = None, stop_at_eog: bool = True,
                       add_special: bool = True, grammar: Grammar | None = None,
                       logprobs: int | None = None) -> list[GenerationResult]:
        """Generate for many prompts, ``parallel`` at a time sharing every decode (continuous batching); the
        results in prompt order. At temperature 0 each result is exactly what ``generate`` gives for that prompt
        alone. With ``seed``, prompt i samples with seed + i. ``grammar`` and ``logprobs`` as ``generate``, for
        every prompt.

        Args:
            prompts: a list of prompts, each text or token ids.
            parallel: most prompts decoded together (the sequences of the ``batch_scheduler`` context).
            max_tokens: most tokens to generate per prompt.
            temperature: 0 is exact greedy; see ``SamplingParams``.
            top_k: see ``SamplingParams``.
            top_p: see ``SamplingParams``.
            seed: the first prompt's seed (prompt i samples with seed + i); None: nondeterministic.
            stop: a string or a list of strings that end a generation (its text is cut before it).
            stop_at_eog: stop after an end-of-generation token.
            add_special: let the tokenizer add BOS/EOS as the model asks (text prompts only).
            grammar: a ``Grammar`` every output must meet.
            logprobs: report each token's log-probability with this many alternatives (0..20); None: none.

        Returns:
            One ``GenerationResult`` per prompt, in prompt order.

        Raises:
            TypeError: ``prompts`` is not a list of prompts, or an argument of the wrong type (as ``generate``, for
                any of the prompts, checked before any decode).
            ValueError: ``parallel`` < 1 or above the context's ``n_batch``, ``max_tokens`` < 0, an empty prompt or
                one of n_ctx tokens or more, bad sampling parameters, ``logprobs`` above 20 (checked before any
                decode).
            GrammarError: a grammar this vocabulary cannot meet (a ValueError).
            ContextInitError: llama.cpp could not create the scheduler's context.
            DecodeError: a decode failed (the scheduler is emptied, ready for the next call).

        Example:
            ```python
            results = llm.generate_batch(["Hello", "Bonjour", "Hallo"], parallel=3, max_tokens=32)
            print([r.text for r in results])
            ```
        """
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise TypeError(f"prompts must be a list of prompts (text or token ids), got {type(prompts).__name__}")
        scheduler = self.batch_scheduler(checks.integer("parallel", parallel, minimum=1))
        max_tokens = checks.integer("max_tokens", max_tokens, minimum=0)
        stop = checks.stop_strings(stop)
        seed = checks.optional_integer("seed", seed)
        grammar, logprobs = output_options(grammar, logprobs)
        requests = []
        for i, prompt in enumerate(prompts):
            tokens = prompt_tokens(scheduler.ctx, prompt, add_special=add_special)
            params = sampling_params(temperature, top_k, top_p, None if seed is None else seed + i)
            requests.append(BatchRequest(tokens, max_tokens, Sampler(params), stop, stop_at_eog=stop_at_eog,
                                         rules=OutputRules(self.model, grammar, logprobs)))
        try:
            return scheduler.run(requests)
        except BaseException:  # an interrupt or a failed decode: the next call starts from an empty scheduler
            scheduler.reset()
            raise

    def batch_scheduler(self, parallel: int) -> BatchScheduler:
        """The ``BatchScheduler`` behind ``generate_batch`` and ``serve --parallel``: a second Context on this
        model with ``parallel`` sequences of this LLM's n_ctx each, and this LLM's draft sources for all of them:
        its DSpark drafter's file loaded again on that context, and its prompt lookup's settings for each
        sequence's own lookup. Made once per ``parallel``, closed with the LLM.

        Args:
            parallel: the number of sequences (concurrent generations).

        Returns:
            The scheduler for ``parallel`` (the same object on every call with that value); its ``run`` takes
                ``BatchRequest``s.

        Raises:
            ValueError: ``parallel`` is not a positive int, or exceeds the context's ``n_batch``.
            ContextInitError: llama.cpp could not create the second context.
            ClosedHandleError: the LLM is closed.
        """
        if parallel not in self._schedulers:
            settings = self._batch_settings
            dspark = self.drafter.model_drafter if isinstance(self.drafter, HybridDrafter) else self.drafter
            dspark = dspark if isinstance(dspark, DSparkDrafter) else None
            lookup = self.drafter.lookup if isinstance(self.drafter, HybridDrafter) else self.drafter
            lookup = lookup if isinstance(lookup, PromptLookupDrafter) else None
            block = max(0 if dspark is None else dspark.block_size, 0 if lookup is None else lookup.block_size,
                        HISTORY_BLOCK if self.history is not None else 0)
            kwargs = dict(settings["context_kwargs"])
            if block and (self.model.is_hybrid or self.model.is_recurrent):
                kwargs["n_rs_seq"] = Speculator.target_rs_seq(min(settings["n_draft"] or block, block))
            kwargs.setdefault("n_batch", self.ctx.n_batch)
            ctx = Context(self.model, n_ctx=self.ctx.n_ctx_seq * parallel, n_seq_max=parallel,
                          n_threads=settings["n_threads"], **kwargs)
            try:
                drafter = None if dspark is None else DSparkDrafter(
                    dspark.model.path, ctx, n_threads=settings["n_threads"], n_gpu_layers=settings["n_gpu_layers"],
                    p_min=settings["p_min"], header=dspark.model.gguf_header)
                scheduler = BatchScheduler(ctx, drafter, n_draft=settings["n_draft"], prompt_lookup=lookup,
                                           history=self.history, grammar_drafts=settings["grammar_drafts"])
                self._schedulers[parallel] = (scheduler, ctx, drafter)
            except BaseException:
                ctx.close()
                raise
        return self._schedulers[parallel][0]

    # --- OpenAI-shaped completions (llama-cpp-python's names) ----------------------------
    def create_completion(self, prompt: str | Sequence[int], *, max_tokens: int | None = 16, temperature: float = 0.0,
                          top_p: float = 1.0, top_k: int = 0, stop: str | Sequence[str] | None = None,
                          seed: int | None = None, stream: bool = False, logprobs: int | None = None,
                          response_format: Mapping[str, Any] | None = None, grammar: Grammar | None = None):
        """A ``text_completion`` dict (``choices[0].text``, ``finish_reason``, ``usage``, and ``speculative``
        statistics when a drafter runs), or with ``stream`` an iterator of chunk dicts. Temperature 0 (the
        default here, unlike llama-cpp-python's 0.8) is exact greedy decoding. ``logprobs``: each token's
        log-probability and this many alternatives (``choices[0].logprobs``: tokens, token_logprobs,
        top_logprobs, text_offset); ``response_format`` / ``grammar``: structured output.

        Args:
            prompt: text or token ids.
            max_tokens: most tokens to generate; None: until the end of generation or of the context.
            temperature: 0 (the default) is exact greedy decoding; see ``SamplingParams``.
            top_p: see ``SamplingParams``.
            top_k: see ``SamplingParams``.
            stop: a string or a list of strings that end the generation (the text is cut before it).
            seed: seed of the sampler; None: nondeterministic.
            stream: return an iterator of chunk dicts instead of one dict.
            logprobs: report each token's log-probability with this many alternatives (0..20); None: none.
            response_format: OpenAI's ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema":
                {"schema": {...}}}`` (``{"type": "text"}``: free text).
            grammar: a ``Grammar`` (instead of ``response_format``).

        Returns:
            A ``text_completion`` dict (``id``, ``created``, ``model``, ``choices[0]`` with ``text``, ``logprobs``
                and ``finish_reason``, ``usage``, and ``speculative`` with a drafter); with ``stream``, an iterator of
                ``text_completion`` chunk dicts, the last with the ``finish_reason``.

        Raises:
            TypeError: an argument of the wrong type (the message names it).
            ValueError: an empty or too long prompt, ``max_tokens`` < 0, bad sampling parameters, ``logprobs``
                above 20, or both ``response_format`` and ``grammar``.
            GrammarError: a ``response_format`` that is malformed or does not compile, or a grammar this model's
                vocabulary cannot meet (a ValueError).
            ContextBusyError: another generation is running on this LLM (with ``stream``: while iterating).
            DecodeError: a decode failed.
        """
        knobs = self._knobs(max_tokens, temperature, top_p, top_k, stop, seed)
        knobs.update(logprobs=logprobs, grammar=self._grammar(response_format, grammar))
        return self._completion(prompt, knobs, stream, chat=False)

    def create_chat_completion(self, messages: Sequence[Mapping[str, Any]], *, max_tokens: int | None = None,
                               temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                               stop: str | Sequence[str] | None = None, seed: int | None = None, stream: bool = False,
                               logprobs: bool = False, top_logprobs: int | None = None,
                               response_format: Mapping[str, Any] | None = None, grammar: Grammar | None = None,
                               tools: Sequence[Mapping[str, Any]] | None = None, tool_choice: Any = None):
        """A ``chat.completion`` dict (``choices[0].message``, ``finish_reason``, ``usage``, ``speculative``),
        or with ``stream`` an iterator of ``chat.completion.chunk`` dicts (``delta``). ``max_tokens`` None
        generates until the end of generation or of the context.

        ``logprobs`` / ``top_logprobs`` (0..20): OpenAI's ``choices[0].logprobs.content``. ``response_format``
        (``{"type": "json_object"}``, ``{"type": "json_schema", ...}``) or ``grammar``: structured output.
        ``tools`` and ``tool_choice`` ("auto", "none", "required", or ``{"type": "function", "function": {"name":
        ...}}``): function calling (``pyllama_dspark.tools``); a reply that calls a tool has ``message.tool_calls``
        and ``finish_reason`` "tool_calls".

        Args:
            messages: OpenAI's chat messages (``role`` and ``content`` strings; an assistant message may carry
                ``tool_calls``, its ``content`` then may be None).
            max_tokens: most tokens to generate; None: until the end of generation or of the context.
            temperature: 0 (the default) is exact greedy decoding; see ``SamplingParams``.
            top_p: see ``SamplingParams``.
            top_k: see ``SamplingParams``.
            stop: a string or a list of strings that end the generation (the text is cut before it).
            seed: seed of the sampler; None: nondeterministic.
            stream: return an iterator of ``chat.completion.chunk`` dicts instead of one dict.
            logprobs: report each token's log-probability (``choices[0].logprobs.content``).
            top_logprobs: with ``logprobs``, this many most likely alternatives per token (0..20).
            response_format: OpenAI's ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema":
                {"schema": {...}}}`` (``{"type": "text"}``: free text).
            grammar: a ``Grammar`` (instead of ``response_format``).
            tools: OpenAI's ``{"type": "function", "function": {"name", "description", "parameters"}}`` objects.
            tool_choice: "auto" (the default with tools), "none", "required", or a function to call (``{"type":
                "function", "function": {"name": ...}}``); "required" and a named function force a call.

        Returns:
            A ``chat.completion`` dict (``id``, ``created``, ``model``, ``choices[0]`` with ``message``, ``logprobs``
                and ``finish_reason``, ``usage``, and ``speculative`` with a drafter); with ``stream``, an iterator of
                ``chat.completion.chunk`` dicts: a first ``{"role": "assistant"}`` delta, the content deltas (a tool
                call as one ``tool_calls`` delta), then one with the ``finish_reason``.

        Raises:
            ToolError: a malformed ``tools`` list or ``tool_choice`` (a ValueError; ``param`` names the field).
            GrammarError: a ``response_format`` that is malformed or does not compile, or a grammar this model's
                vocabulary cannot meet (a ValueError).
            TypeError: an argument of the wrong type, e.g. a non-bool ``logprobs`` or a malformed message.
            ValueError: ``top_logprobs`` without ``logprobs`` or above 20, both ``response_format`` and
                ``grammar``, a forced tool call together with either, a model without a chat template, an empty or
                too long prompt, bad sampling parameters.
            ContextBusyError: another generation is running on this LLM (with ``stream``: while iterating).
            DecodeError: a decode failed.

        Example:
            ```python
            llm = pyllama_dspark.load("target.gguf", drafter="drafter.gguf")
            reply = llm.create_chat_completion([{"role": "user", "content": "Name a colour."}], max_tokens=16)
            print(reply["choices"][0]["message"]["content"], reply["usage"]["completion_tokens"])
            ```
        """
        checks.instance("logprobs", logprobs, bool)
        top = checks.optional_integer("top_logprobs", top_logprobs, minimum=0)
        if top is not None and not logprobs:
            raise ValueError("top_logprobs needs logprobs=True")
        offered = check_tools(tools) if tools is not None else []
        choice = check_tool_choice(tool_choice, offered)
        grammar = self._grammar(response_format, grammar)
        forced = call_grammar(offered, choice)
        if forced is not None:
            if grammar is not None:
                raise ValueError(f"tool_choice {tool_choice!r} constrains the reply to a tool call: it cannot be "
                                 "combined with response_format or grammar")
            grammar = forced
        shown = offered if choice != "none" else []
        rendered = prompt_messages(messages, offered, choice, template_renders_tools=self.model.renders_tools)
        prompt = self.model.apply_chat_template(checks.messages(rendered),
                                                tools=[t.as_openai() for t in shown] or None)
        knobs = self._knobs(max_tokens, temperature, top_p, top_k, stop, seed)
        knobs.update(logprobs=(top or 0) if logprobs else None, grammar=grammar)
        return self._completion(prompt, knobs, stream, chat=True, tools=shown)

    @staticmethod
    def _grammar(response_format, grammar) -> Grammar | None:
        from_format = Grammar.from_response_format(response_format) if response_format is not None else None
        if from_format is not None and grammar is not None:
            raise ValueError("give response_format or grammar, not both")
        return from_format if from_format is not None else grammar

    def _knobs(self, max_tokens, temperature, top_p, top_k, stop, seed) -> dict:
        max_tokens = self.ctx.n_ctx if max_tokens is None else checks.integer("max_tokens", max_tokens, minimum=0)
        return dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, stop=stop, seed=seed)

    def _completion(self, prompt, knobs: dict, stream: bool, *, chat: bool, tools=()):
        head = completion_head(chat=chat, model_name=Path(self.model.path).name)
        piece = self.model.token_to_piece
        if stream:
            return completion_chunks(self._run(prompt, dict(knobs), stream=True), head, chat=chat, piece=piece,
                                     tools=list(tools))
        result = self._run(prompt, dict(knobs), stream=False)
        return completion(result, head, chat=chat, speculative=self.speculator is not None, piece=piece,
                          tools=list(tools))

    # --- lifetime ----------------------------------------------------------------------
    def close(self) -> None:
        """Close the drafter, the context and (if ``load`` opened it) the model.

        Also closes the ``batch_scheduler`` contexts. Safe to call more than once; afterwards its generation methods
        raise ``ClosedHandleError``. A Model given to ``load`` stays open (it is the caller's to close).
        """
        for scheduler, ctx, drafter in self._schedulers.values():
            scheduler.close()
            if drafter is not None:
                drafter.close()
            ctx.close()
        self._schedulers.clear()
        close = getattr(self.drafter, "close", None)
        if close is not None:
            close()
        self.ctx.close()
        if self._owns_model:
            self.model.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

