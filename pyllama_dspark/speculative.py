"""The speculative loop: draft a block, verify it in one target decode, commit.

One round, in the order of speculative-simple.cpp's comments:

1. draft: the drafter proposes d0..dk-1 after the anchor (the last committed
   token, at position pos, not yet seen by the target);
2. verify: one target decode of [anchor, d0..dk-1] at positions pos..pos+k,
   logits on every row, dense capture on (when the drafter reads features);
3. accept: greedy, the longest prefix where d_i equals the target's argmax,
   plus one target token (correction or bonus); with temperature > 0,
   rejection sampling with the draft probabilities q and the target's p;
4. commit: ``seq_rm`` drops the rejected cells from the target (a hybrid
   target rolls back through its recurrent snapshots; a removal that cannot be
   honoured raises MemoryOpError, it is never ignored), and the drafter
   observes the committed rows' features (anchor + accepted drafts).

A drafter with several sources (``HybridDrafter``: prompt lookup and DSpark)
is asked for its offers first (prompt lookup's proposal comes free with the
offer); the cost-aware loop then drafts from the source that promises the most
tokens per second (``SourceChooser``), a fixed n_draft takes the drafter's own
pick. ``Step.source`` says which source drafted a round.

After the round the committed tokens occupy positions < pos + n + 1 in the
target's memory and the new anchor (the target's token) sits at pos + n + 1.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

import numpy as np

from . import checks
from .batch import Batch
from .context import Context
from .draft_length import CostTable, DraftLengthChooser, SourceChooser
from .drafter import Draft, Drafter
from .errors import MemoryOpError
from .generate import GenerationResult, OutputRules, output_options, prompt_tokens, sampling_params, stream_events
from .hybrid import GRAMMAR, free_length, grammar_draft, source_name
from .logprobs import TokenLogprob
from .sampling import Sampler, probabilities
from .stats import SpecStats
from .structured import Grammar
from .verify import accept_greedy, accept_stochastic


@dataclass
class Step:
    """One round: the committed tokens (accepted drafts, then the target's token); ``source`` names what drafted
    them ("dspark", "lookup", ...; "" for a plain step, which verified no draft); ``logprobs`` one per token when
    the run was asked for them (``OutputRules``), else None."""

    tokens: list[int]
    n_draft: int
    n_accept: int
    from_draft: list[bool]
    t_draft: float = 0.0
    t_verify: float = 0.0
    source: str = ""
    logprobs: list[TokenLogprob] | None = None


SpecResult = GenerationResult  # the name speculative results had before plain and speculative shared one type


_warned_inexact_verify = False


def _warn_inexact_verify() -> None:
    """Once per process: a GPU backend verifies a batch with kernels chosen by its width."""
    global _warned_inexact_verify
    if not _warned_inexact_verify:
        _warned_inexact_verify = True
        warnings.warn("the target runs on a GPU backend with consistent_numerics=False: a batched verify may "
                      "differ from plain decoding in the last bits, so greedy output may differ from plain greedy "
                      "output (Context(consistent_numerics=True) keeps them equal on Vulkan)", stacklevel=3)


def inexact_verify_said() -> None:
    """The caller has told the user that output may differ from plain decoding (the CLI's and the server's one
    line when the backend has no consistent-numerics mode): the Speculator's own warning is not given again."""
    global _warned_inexact_verify
    _warned_inexact_verify = True


class Speculator:
    """Speculative decoding of a target with a drafter.

    Args:
        target: the target's Context. Hybrid/recurrent targets need ``n_rs_seq >= n_draft`` (use
            ``n_rs_seq=Speculator.target_rs_seq(n_draft)`` in Context).
        drafter: a Drafter (``DSparkDrafter``, or any object with its protocol), or a drafter with several sources
            (``HybridDrafter``: prompt lookup and a model drafter).
        n_draft: draft exactly this many tokens per round (fewer only where the drafter's confidence cut,
            the context or max_tokens say so, or a prompt lookup match is shorter). Larger values are clamped to
            the block size with a warning; a HybridDrafter drafts from prompt lookup when it matches, else from
            its model drafter. Default None: cost-aware, each round picks 0..block size drafts to maximise
            expected tokens per second (``DraftLengthChooser``: running acceptance, the confidence head, and
            verify/draft costs measured on this machine); 0 is a plain decode step. With several sources, the
            source that promises the most tokens per second drafts (``SourceChooser``: one chooser per source).
        n_draft_min: drafts shorter than this are dropped (the round becomes a plain decode).
        grammar_drafts: under a grammar, draft the tokens it forces (source "grammar", free: no drafter call),
            continued where the grammar is free again by the drafter's free sources (prompt lookup, history).
            They are verified like any draft, so the output stays plain constrained decoding's.

    Attributes:
        source_chooser: the cost-aware choice of source and draft length (None with a fixed n_draft); a
            single-source drafter is its one source, named by ``hybrid.source_name`` ("dspark", "lookup"...).

    Raises:
        TypeError: a target that is not a Context, a drafter without the Drafter protocol (e.g. a path).
        ValueError: a negative n_draft, or a hybrid target without enough rollback snapshots.

    Example:
        ```python
        model = pyllama_dspark.Model("target.gguf")
        ctx = pyllama_dspark.Context(model, n_ctx=4096)
        spec = pyllama_dspark.Speculator(ctx, pyllama_dspark.DSparkDrafter("drafter.gguf", ctx))
        result = spec.generate("The capital of France is", max_tokens=32)
        print(result.text, result.stats.accept_rate, result.stats.tau)
        ```
    """

    def __init__(self, target: Context, drafter: Drafter, *, n_draft: int | None = None, n_draft_min: int = 0,
                 grammar_drafts: bool = True):
        checks.instance("target", target, Context, "create one with Context(model)")
        checks.instance("grammar_drafts", grammar_drafts, bool)
        protocol = ("block_size", "capture_layers", "reset", "observe", "propose")
        missing = [name for name in protocol if not hasattr(drafter, name)]
        if missing:
            raise TypeError(f"drafter must be a Drafter (e.g. DSparkDrafter(path, target)), got "
                            f"{type(drafter).__name__} (no {', '.join(missing)})")
        n_draft = checks.optional_integer("n_draft", n_draft)
        n_draft_min = checks.integer("n_draft_min", n_draft_min)
        block = int(drafter.block_size)
        # the drafter's sources and their block sizes: a multi-source drafter lists them (the cheapest first)
        self._multi_source = hasattr(drafter, "offers") and hasattr(drafter, "sources")
        self._source = "" if self._multi_source else source_name(drafter)
        sizes = dict(drafter.sources) if self._multi_source else {self._source: block}
        # under a grammar, the tokens it forces are a free source of their own (listed first: the cheapest)
        self.grammar_drafts = grammar_drafts
        if grammar_drafts:
            sizes = {GRAMMAR: block, **sizes}
        self.source_chooser = SourceChooser(sizes) if n_draft is None else None
        # the drafter's free sources, which continue a grammar's draft where the grammar is free again
        self._free = list(getattr(drafter, "free", {}).values()) or (
            [drafter] if hasattr(drafter, "propose_after") else [])
        # with a fixed n_draft, round costs are measured for plain_tok_s_estimate alone
        self._fixed_costs = CostTable(block) if n_draft is not None else None
        n_draft = block if n_draft is None else int(n_draft)
        if n_draft < 0 or n_draft_min < 0:
            raise ValueError(f"n_draft and n_draft_min must be >= 0, got {n_draft} and {n_draft_min}")
        if n_draft > block:
            warnings.warn(f"n_draft={n_draft} exceeds the drafter's block size {block}; clamped to {block}",
                          stacklevel=2)
            n_draft = block
        model = target.model
        if (model.is_recurrent or model.is_hybrid) and target.n_rs_seq < n_draft:
            raise ValueError(f"{model.arch} target needs recurrent-state snapshots for rollback: create its "
                             f"Context with n_rs_seq >= {n_draft} (has {target.n_rs_seq})")
        if target.offloaded and not target.consistent_numerics:
            _warn_inexact_verify()
        self.target, self.drafter = target, drafter
        self.n_draft, self.n_draft_min = n_draft, int(n_draft_min)
        self._batch = Batch(max(n_draft + 1, target.n_batch))
        self.last_stats = SpecStats()

    @property
    def draft_length(self) -> DraftLengthChooser | None:
        """The cost-aware draft length chooser of the drafter's source (a multi-source drafter's last-listed one:
        a HybridDrafter's model drafter; the others are in ``source_chooser.choosers``); None with a fixed
        n_draft. Its ``costs`` may be replaced (e.g. by a ``StaticCostTable``)."""
        if self.source_chooser is None:
            return None
        return self.source_chooser.choosers[next(reversed(self.source_chooser.choosers))]

    @property
    def costs(self) -> CostTable:
        """The measured round costs (the verify costs are the same in every source's table)."""
        return self._fixed_costs if self.draft_length is None else self.draft_length.costs

    @staticmethod
    def target_rs_seq(n_draft: int) -> int:
        """The n_rs_seq a hybrid target's Context needs for drafts of n_draft tokens: a verify of
        [anchor, d0..dk-1] may have to drop all k drafts."""
        return n_draft

    def plain_tok_s_estimate(self) -> float | None:
        """Tokens per second plain decoding would reach here, from this Speculator's measured rounds: the time of
        a one-row verify (measured when the loop took plain steps, else extrapolated from the measured row counts
        as ``CostTable`` does). An estimate: a plain step here also feeds the drafter, so it errs low. None before
        any round was measured."""
        if not self.costs.measured("verify"):
            return None
        seconds = self.costs.verify(1)
        return 1.0 / seconds if seconds > 0 else None

    # --- the loop ---------------------------------------------------------------------
    def run(self, tokens: np.ndarray, *, max_tokens: int, sampler: Sampler | None = None,
            stop_at_eog: bool = True, stats: SpecStats | None = None, reuse_prefix: bool = False,
            rules: OutputRules | None = None) -> Iterator[Step]:
        """Yield one Step per round until max_tokens, an end-of-generation token or a full context.

        The first Step carries the token sampled from the prompt's logits (n_draft 0). The target's
        and the drafter's memories are cleared first, or with ``reuse_prefix`` trimmed to the prefix the
        prompt shares with this Speculator's last generation (nothing else may have used the context in
        between). ``stats`` (if given) is filled as it goes. ``rules``: a grammar every committed token meets
        (drafts are cut before the first token it refuses, each verify row is masked with the grammar's state
        after the tokens before it) and logprobs from the verify rows (``OutputRules``; one per run).

        A generator: nothing runs until the first Step is asked for, and the context is owned until the last one
        (or until the iterator is closed: the memory is then left consistent for ``reuse_prefix``).

        Args:
            tokens: the prompt's token ids (``Model.tokenize``); they must leave room in the context (``generate``
                checks it).
            max_tokens: most tokens to generate (0: no Step at all).
            sampler: the ``Sampler`` (default: greedy); with temperature > 0 drafts are verified by rejection
                sampling.
            stop_at_eog: stop after an end-of-generation token (it is the last token yielded).
            stats: a ``SpecStats`` to fill (counts, timings, ``stop_reason``), or None.
            reuse_prefix: keep the memory of the prefix shared with this Speculator's last generation.
            rules: an ``OutputRules`` (grammar, logprobs), or None: free text, no logprobs.

        Yields:
            One ``Step`` per round, with its committed ``tokens`` (accepted drafts, then the target's token),
                ``n_draft``, ``n_accept``, ``from_draft``, ``source``, timings and ``logprobs``.

        Raises:
            ValueError: ``max_tokens`` < 0.
            ContextBusyError: another generation owns the target's context.
            MemoryOpError: the target's memory cannot drop rejected drafts.
            GrammarError: the grammar of ``rules`` allows no token, or refuses a committed one (a ValueError).
            DecodeError: a decode failed.

        Example:
            ```python
            tokens = ctx.model.tokenize("Hello")
            for step in spec.run(tokens, max_tokens=64):
                print(step.tokens, f"{step.n_accept}/{step.n_draft} accepted from {step.source or 'no draft'}")
            ```
        """
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        sampler = sampler or Sampler()
        stats = stats if stats is not None else SpecStats()
        stats.n_prompt = len(tokens)
        ctx = self.target
        rules = rules if rules is not None else OutputRules(ctx.model)
        if max_tokens == 0:
            return
        with ctx.generation("speculative generation"):  # ContextBusyError if another generation runs on ctx
            yield from self._run_owned(tokens, max_tokens, sampler, stop_at_eog, stats, reuse_prefix, rules)

    def _run_owned(self, tokens: np.ndarray, max_tokens: int, sampler: Sampler, stop_at_eog: bool,
                   stats: SpecStats, reuse_prefix: bool, rules: OutputRules) -> Iterator[Step]:
        ctx, n_ctx = self.target, self.target.n_ctx_seq
        keep = ctx._reusable_prefix(self, tokens) if reuse_prefix else 0
        ctx._forget()
        if self.source_chooser is not None:
            self.source_chooser.forget_waiting()
        stats.n_reused = keep
        t0 = time.perf_counter()
        anchor, logprob = self._prefill(tokens, sampler, rules, keep)
        stats.t_prefill = time.perf_counter() - t0
        pos, n_left = len(tokens), max_tokens
        in_memory = [int(t) for t in tokens]  # what the target's memory holds, for the next reuse_prefix
        generated: list[int] = []  # what was handed out, for the drafter's history of replies
        clean = False
        t0 = time.perf_counter()
        try:
            step = Step(tokens=[anchor], n_draft=0, n_accept=0, from_draft=[False],
                        logprobs=None if rules.n_logprobs is None else [logprob])
            while True:
                step.tokens = step.tokens[:n_left]
                n_left -= len(step.tokens)
                stats.n_generated += len(step.tokens)
                eog = any(rules.ends(t, stop_at_eog) for t in step.tokens)
                if eog:
                    cut = next(i for i, t in enumerate(step.tokens) if rules.ends(t, stop_at_eog))
                    step.tokens, step.from_draft = step.tokens[:cut + 1], step.from_draft[:cut + 1]
                if step.logprobs is not None:
                    del step.logprobs[len(step.tokens):]
                generated += step.tokens
                try:
                    yield step
                except GeneratorExit:  # the consumer stopped between rounds: the memory is consistent
                    clean = True
                    raise
                if eog or n_left == 0 or pos >= n_ctx:
                    stats.stop_reason = "eog" if eog else "max_tokens" if n_left == 0 else "n_ctx"
                    clean = True
                    return
                n_max = min(self.n_draft, n_ctx - pos - 1, n_left - 1)
                step = self._round(anchor, pos, n_max, sampler, stats, rules)
                in_memory += [anchor] + step.tokens[:-1]  # the anchor and the accepted drafts were kept
                pos += len(step.tokens)
                anchor = step.tokens[-1]
        finally:
            stats.t_decode = time.perf_counter() - t0
            if clean:
                self._remember(tokens, in_memory, stats)
                remember = getattr(self.drafter, "remember", None)
                if remember is not None:
                    remember(tokens, generated)

    def _remember(self, tokens: np.ndarray, in_memory: list[int], stats: SpecStats) -> None:
        """Record what the memory holds for the next ``reuse_prefix``, first dropping accepted drafts past the last
        token handed out (a generation cut inside a round): a recurrent state is reusable only whole."""
        ctx = self.target
        shown = len(tokens) + stats.n_generated
        if len(in_memory) > shown:
            try:
                ctx.seq_rm(0, shown, -1)
            except MemoryOpError:
                return
            del in_memory[shown:]
        ctx._remember(self, np.asarray(in_memory))

    def _prefill(self, tokens: np.ndarray, sampler: Sampler, rules: OutputRules,
                 keep: int = 0) -> tuple[int, TokenLogprob | None]:
        """Decode the prompt from position ``keep`` (dense capture, logits on the last row), feed the drafter
        the same rows (it drops what it held from ``keep`` on), choose token 1 (and its logprob)."""
        ctx, drafter = self.target, self.drafter
        if keep:
            ctx.seq_rm(0, keep, -1)
        else:
            ctx.clear()
            drafter.reset()
        layers = list(drafter.capture_layers)
        if layers:
            ctx.set_capture_layers(layers, masked=False)
        step = min(ctx.n_batch, self._batch.capacity)
        for start in range(keep, len(tokens), step):
            chunk = tokens[start:start + step]
            self._decode_chunk(chunk, start, last=start + step >= len(tokens))
            drafter.observe(chunk, ctx.capture().copy() if layers else None, start)
        return rules.choose(ctx.logits(-1), sampler)

    def _decode_chunk(self, chunk: np.ndarray, pos0: int, *, last: bool) -> None:
        self._batch.clear()
        self._batch.add_tokens(chunk, pos0, logits="last" if last else "none")
        self.target.decode(self._batch)

    def _round(self, anchor: int, pos: int, n_max: int, sampler: Sampler, stats: SpecStats,
               rules: OutputRules) -> Step:
        ctx, drafter = self.target, self.drafter
        t0 = time.perf_counter()
        source, k_planned, draft, offers = self._draft(anchor, pos, n_max, sampler, rules)
        drafts = np.asarray(draft.tokens[:k_planned], dtype=np.int32)
        n_drafted = len(drafts)  # what the draft time paid for, before any cut
        t1 = time.perf_counter()
        if self.source_chooser is not None and n_drafted:
            drafts = drafts[: self.source_chooser.choosers[source].cut(draft.confidence, n_drafted, t1 - t0)]
        drafts, refused = rules.cut_draft(drafts, stats)  # refused: the token the grammar refused, cut with the rest
        if len(drafts) < self.n_draft_min:
            drafts, refused = drafts[:0], None
        # verify: [anchor, d0..dk-1], every row's logits; row i predicts the token after row i's token
        k = len(drafts)
        self._batch.clear()
        self._batch.add_tokens(np.concatenate([[anchor], drafts]), pos, logits="all")
        ctx.decode(self._batch)
        rows = ctx.all_logits()
        n, token = self._accept(drafts, draft, rows, rules, sampler, refused)
        # commit: drop the rejected cells, then give the drafter the committed rows' features
        if n < k:
            ctx.seq_rm(0, pos + n + 1, -1)
        features = ctx.capture()[: n + 1].copy() if drafter.capture_layers else None
        drafter.observe(np.concatenate([[anchor], drafts[:n]]).astype(np.int32), features, pos)
        t2 = time.perf_counter()
        committed = [int(t) for t in drafts[:n]] + [token]
        logprobs = rules.commit(rows, committed)
        stats.observe_round(k, n, source=source if n_drafted else "", t_draft=t1 - t0, forced=draft.forced)
        stats.t_verify += t2 - t1
        if self.source_chooser is not None:
            self.source_chooser.observe_round(source, k, n, t1 - t0, t2 - t1, k_drafted=n_drafted)
            self.source_chooser.observe_commit(committed)
            for name, offer in offers.items():  # a free proposal left unverified still shows how good it was
                if offer is not None and (name != source or k == 0):
                    self.source_chooser.observe_free(name, offer.tokens, committed)
        else:
            self._fixed_costs.observe(k, t1 - t0, t2 - t1, k_drafted=n_drafted)
        return Step(tokens=committed, n_draft=k, n_accept=n, from_draft=[True] * n + [False],
                    t_draft=t1 - t0, t_verify=t2 - t1, source=source if k else "", logprobs=logprobs)

    def _forced(self, anchor: int, pos: int, n_max: int, rules: OutputRules) -> Draft | None:
        """The grammar's draft (``OutputRules.forced_draft``: what it forces after the anchor, continued by the
        free sources where it is free again), or None (no grammar, grammar drafts off, nothing forced)."""
        return grammar_draft(rules, self._free, anchor, pos, n_max) if self.grammar_drafts else None

    def _draft(self, anchor: int, pos: int, n_max: int, sampler: Sampler,
               rules: OutputRules) -> tuple[str, int, Draft, dict]:
        """This round's proposal: (its source, the most of its tokens to verify, the Draft, the free proposals
        the drafter offered). A fixed n_draft takes the drafter's own pick of source; the cost-aware loop lets
        the source chooser pick among the drafter's offers and plan the length."""
        nothing = Draft(np.zeros(0, np.int32))
        forced = self._forced(anchor, pos, n_max, rules)
        if self.source_chooser is None:
            if n_max <= 0:
                return "", 0, nothing, {}
            if forced is not None:
                return GRAMMAR, n_max, forced, {}
            draft = self.drafter.propose(anchor, pos, n_max, sampler=sampler)
            return draft.source or self._source, n_max, draft, {}
        if n_max <= 0:  # nothing may be drafted (end of the context or of max_tokens): nobody is asked
            offers: dict[str, Draft | None] = {}
        elif self._multi_source:
            offers = self.drafter.offers(anchor, pos, n_max, sampler=sampler)
        else:
            offers = {self._source: None}
        if forced is not None:
            offers = {GRAMMAR: forced, **offers}
        available = {name: n_max if offer is None else len(offer.tokens) for name, offer in offers.items()}
        free = [name for name, offer in offers.items() if offer is not None]
        source, k = free_length(offers, *self.source_chooser.choose(available, free=free))
        if k == 0:
            return source, 0, nothing, offers
        draft = offers[source]
        if draft is None:  # a source that pays for its draft is asked only now, for the planned length
            draft = (self.drafter.propose(anchor, pos, k, sampler=sampler, source=source) if self._multi_source
                     else self.drafter.propose(anchor, pos, k, sampler=sampler))
        return source, k, draft, offers

    @staticmethod
    def _accept(drafts: np.ndarray, draft: Draft, rows: np.ndarray, rules: OutputRules, sampler: Sampler,
                refused: int | None = None) -> tuple[int, int]:
        """(accepted drafts, the target's token) from the raw verify rows, as the grammar of ``rules`` allows
        them. ``refused``: a draft token cut after ``drafts`` because the grammar refuses it (p = 0 there).
        Rejection sampling still judges it, so that the token at its row comes from the residual
        norm(max(0, p - q)) as it would had the draft been verified: drawing from p there instead would skew the
        output towards what the drafter proposes."""
        if sampler.params.greedy:
            return accept_greedy(drafts, rules.verify_greedy(rows, drafts))
        rows = rules.verify_rows(rows, drafts)
        p = np.stack([probabilities(row, sampler.params) for row in rows])
        if refused is not None:
            drafts = np.append(drafts, refused).astype(drafts.dtype)
            p = np.concatenate([p, np.zeros_like(p[:1])])  # the bonus row past a refused token is never reached
        q = draft.probs if draft.probs is not None else _greedy_q(drafts, rows.shape[1])
        return accept_stochastic(drafts, q[: len(drafts)], p, sampler.rng.random, sampler.draw)

    # --- convenience ---------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], *, max_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stop: str | Sequence[str] | None = None,
                 stream: bool = False, stop_at_eog: bool = True, add_special: bool = True,
                 reuse_prefix: bool = False, grammar: Grammar | None = None, logprobs: int | None = None):
        """Generate with speculative decoding; temperature 0 reproduces plain greedy decoding exactly.

        Args:
            prompt: text or token ids.
            max_tokens: most tokens to generate.
            temperature, top_k, top_p, seed: sampling (see SamplingParams); > 0 uses rejection sampling.
            stop: a string or a list of strings that end the generation; the text is cut before the stop
                string (also when it spans a block boundary).
            stream: return an iterator of TokenEvent (with ``from_draft``) as tokens are committed.
            reuse_prefix: keep the target's and the drafter's memory of the prefix this prompt shares with
                this Speculator's last generation (see ``pyllama_dspark.generate``).
            grammar, logprobs: structured output and log-probabilities, as ``pyllama_dspark.generate``; the output
                and the logprobs are plain decoding's (at temperature 0, token for token and bit for bit).

        Returns:
            GenerationResult (text, tokens, stop_reason, stats), or an iterator of TokenEvent.

        Raises:
            TypeError: an argument of the wrong type (the message names it).
            ValueError: an empty prompt or one of n_ctx tokens or more, ``max_tokens`` < 0, bad sampling
                parameters, ``logprobs`` above 20; GrammarError (a ValueError): a grammar this vocabulary cannot
                meet.
            InvalidBatchError: a token id outside the vocabulary.
            ContextBusyError: another generation owns the target's context (with ``stream``: while iterating).
            DecodeError: a decode failed.
        """
        max_tokens = checks.integer("max_tokens", max_tokens, minimum=0)
        stop = checks.stop_strings(stop)
        sampler = Sampler(sampling_params(temperature, top_k, top_p, seed))
        grammar, logprobs = output_options(grammar, logprobs)
        tokens = prompt_tokens(self.target, prompt, add_special=add_special)
        rules = OutputRules(self.target.model, grammar, logprobs)
        stats = self.last_stats = SpecStats()  # also readable while streaming
        result = GenerationResult(text="", tokens=[], stop_reason="max_tokens", stats=stats,
                                  logprobs=None if logprobs is None else [])
        steps = self.run(tokens, max_tokens=max_tokens, sampler=sampler, stop_at_eog=stop_at_eog, stats=stats,
                         reuse_prefix=bool(reuse_prefix), rules=rules)
        triples = ((token, drafted, logprob) for step in steps
                   for token, drafted, logprob in zip(step.tokens, step.from_draft,
                                                      step.logprobs or [None] * len(step.tokens)))
        events = stream_events(self.target.model, triples, stop, result, close=steps.close)
        if stream:
            return events
        for _ in events:
            pass
        return result

    def chat(self, messages: Sequence[Mapping[str, str]], **kwargs):
        """``generate`` on the messages formatted with the target's chat template.

        Args:
            messages: the conversation, a list of ``{"role": ..., "content": ...}`` dicts of strings.
            **kwargs: ``generate``'s keyword arguments.

        Returns:
            GenerationResult, or an iterator of TokenEvent with ``stream=True``.

        Raises:
            TypeError: ``messages`` is not a list of dicts with string ``role`` and ``content``.
            ValueError: the target has no chat template, or as ``generate``; ``chat.ChatTemplateError`` (a
                ValueError): the template failed to render.

        Example:
            ```python
            reply = spec.chat([{"role": "user", "content": "Hi!"}], max_tokens=64)
            print(reply.text)
            ```
        """
        return self.generate(self.target.model.apply_chat_template(checks.messages(messages)), **kwargs)


def _greedy_q(drafts: np.ndarray, n_vocab: int) -> np.ndarray:
    """One-hot q for drafters that give no probabilities (a deterministic proposal)."""
    q = np.zeros((len(drafts), n_vocab))
    q[np.arange(len(drafts)), drafts] = 1.0
    return q
