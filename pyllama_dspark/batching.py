"""Continuous batching: several generations share every target decode, and each one's output is still exactly its
solo output (its plain greedy output at temperature 0).

Why it stays exact:

- each sequence has a KV stream of its own (llama.cpp's non-unified cache, the default with ``n_seq_max > 1``), so
  attention over one sequence's cells never meets another's, or a hole another's ``seq_rm`` left;
- a verify batch stays within the rows the consistent-numerics mode covers (``max_rows``, 64): every row is then
  computed by the same kernels as a single token, whatever else is in the batch;
- a prompt is prefilled alone, in the chunks a solo generation uses (``n_batch`` tokens), one chunk per step, so a
  long prompt never stalls the others for more than one chunk and its cells are the solo run's bit for bit.

One step (``BatchScheduler.step``): admit waiting requests into free sequences; end the cancelled ones; decode the
next prompt chunk of one prefilling sequence (with its ``CancelToken`` as the abort flag); ask each decoding
sequence's prompt lookup (when the scheduler has one: each sequence looks up its own prompt and output) and choose
its source and draft length; draft for every sequence that drafts from the DSpark drafter in one drafter decode
(``DSparkDrafter.propose_many``); verify every decoding sequence's [anchor, drafts] in one target decode; accept, roll
back each sequence's rejected cells, feed the drafter and the lookup the committed rows; end the sequences that hit
end-of-generation, a stop string, ``max_tokens`` or their context.
A finished sequence's KV (and recurrent state) is freed at once, unless the scheduler caches prompts. Each step
returns the new ``TokenEvent``s of every sequence, the last one of a finished sequence carrying its
``GenerationResult``.

The prompt cache (``cache_prompts``): a finished sequence leaves its memory in its slot (the target's KV, a hybrid
target's recurrent state, the drafter's memory of the captured features) with the token ids it holds. A new request
goes to the free slot whose ids share the longest prefix with its prompt, when that prefix is at least
``min_prefix_share`` of the prompt; else to an empty slot, or the one least recently used. Every memory of the slot
is trimmed to the shared prefix (``seq_rm`` on the target, the drafter drops what it held from there on when the
prefill feeds it) and only the rest is prefilled. The last prompt token is always decoded again (its logits are
needed). A recurrent state cannot be rewound, so a hybrid or recurrent target keeps all of a slot's ids or none.
With ``cache_ram_bytes``, a slot's memory that a request is about to cut or replace is first copied to host memory
(``Context.seq_state``, the drafter's ``saved``), within that many bytes, least recently used copies dropped first;
a request whose longest prefix is in such a copy has it copied back into the spare slot. So more conversations than
slots keep their memory: with 8 clients on 4 slots, each turn would otherwise find its slot taken by another.

The source and the draft length are chosen per sequence: a fixed ``n_draft`` (from prompt lookup where it matches,
else from the DSpark drafter, as ``HybridDrafter.propose``), or the cost-aware ``SourceChooser`` of that sequence.
A sequence's verify cost is what its rows add to the batched decode: ``VerifyCostModel`` fits each decode's time as
a fixed part per pass plus a cost per row that grows with the context the row attends to, and a sequence is charged
its share of the fixed part of each pass it is in plus the marginal cost of its own rows at its own context length
(until the fit has enough steps, the share of the decode its rows are). A pass is a ubatch: llama.cpp computes a
batch over per-sequence KV streams in passes of consecutive sequences with equal rows each (``ubatch_passes``), so
a sequence that drafts more than the others, or that sits after a free slot, costs a pass of its own. Rows are
cheap in a batch, a pass is not, so a sequence drafts where its drafts pay for what they add, not for an average of
everyone's decode. Its draft cost is its share of the drafter's decode (by drafted tokens), or the time of its own
prompt lookup.
"""

from __future__ import annotations

import collections
import time
from typing import Sequence

import numpy as np

from . import checks
from .batch import Batch
from .context import Context
from .draft_length import SourceChooser, expected_tokens_by_k
from .drafter import Draft, HistoryDrafter, PromptLookupDrafter
from .errors import DecodeAbortedError, MemoryOpError
from .events import (MAX_EXACT_ROWS, BatchRequest, CancelToken, GenerationResult, OutputRules,  # noqa: F401
                     TextStream, TokenEvent)
from .history import HISTORY_BLOCK, HistoryStore
from .hybrid import GRAMMAR, HISTORY, free_length, grammar_draft
from .stats import SpecStats

_NOTHING = np.zeros(0, dtype=np.int64)
_NO_DRAFT = Draft(np.zeros(0, np.int32))
LOOKUP, DSPARK = "lookup", "dspark"  # the draft sources' names (``SpecStats.by_source``, as the single-sequence loop)
MIN_SAVED_TOKENS = 16  # a slot's memory is copied to host memory before it is cut only when this much is cut


class _Saved:
    """A slot's memory copied to host memory: the ids it holds, the target's and the drafter's copies."""

    def __init__(self, tokens: np.ndarray, target: bytearray, drafter: tuple | None):
        self.tokens, self.target, self.drafter = tokens, target, drafter
        self.nbytes = len(target) + tokens.nbytes
        if drafter is not None:
            state, (chunks, _) = drafter
            self.nbytes += len(state) + sum(chunk.nbytes for chunk in chunks)


def ubatch_passes(rows: Sequence[tuple[int, int]], n_ubatch: int) -> list[dict[int, int]]:
    """How llama.cpp splits a batch over per-sequence KV streams into ubatches, each one pass through the model:
    ``rows`` is (seq_id, rows) in batch order, each sequence's rows together; each pass is {seq_id: rows}.

    A pass takes a run of consecutive sequence ids (the streams it attends to are one view), starting at the
    first sequence with rows left, and the same number of rows from each (split_equal with ``sequential``). So
    [5, 1, 1, 1] rows on sequences 0-3 take two passes (one row each, then sequence 0's other four), and one row
    on sequences 0 and 2 two passes as well."""
    left = {seq: n for seq, n in rows if n > 0}
    order = [seq for seq, n in rows if n > 0]
    passes = []
    while left:
        group = []
        for seq in order:
            if seq in left and (not group or seq == group[-1] + 1):
                group.append(seq)
        take = max(1, min(min(left[seq] for seq in group), n_ubatch // len(group)))
        passes.append({seq: take for seq in group})
        for seq in group:
            left[seq] -= take
            if left[seq] == 0:
                del left[seq]
    return passes


def verify_cells(pos: int, k: int) -> int:
    """Cells a sequence's k + 1 verify rows attend to in all, its anchor at ``pos``: pos + 1, ..., pos + k + 1."""
    return (k + 1) * (pos + 1) + k * (k + 1) // 2


def forced_accepted(accept: np.ndarray, forced: np.ndarray | None) -> np.ndarray:
    """Per-slot acceptance of a draft with the slots a grammar forced (``Draft.forced``) at 1.0: the chooser's
    running figure for the grammar source mixes forced tokens with their free continuations, and a cap planned
    from it would cut a forced run that all but always commits whole (on the structured task set at 4 sequences
    the cap cut 1,591 of 1,997 forced drafts, and drafting ran 0.89x plain batching)."""
    if forced is None:
        return accept
    return np.where(forced[:len(accept)], 1.0, accept)


def best_common_cap(drafts: Sequence[tuple[int, int, int, np.ndarray]], coef: np.ndarray, n_ubatch: int) -> int:
    """The most drafts any sequence keeps this round, chosen for the whole batch: ``drafts`` is (seq_id, anchor
    position, k drafted, E[tokens | j] for j = 0..k) in batch order, ``coef`` a ``VerifyCostModel``'s
    coefficients. Each cap c keeps min(k, c) of every draft; the cap with the most expected tokens per predicted
    second of verify wins (the largest among equals).

    Why: a pass through the model takes the same number of rows from each sequence in it, so one sequence's
    lone draft costs the batch a whole pass more (one draft token on one of four sequences: two passes where
    there was one). Each sequence's chooser cannot see that; a common cap trades its drafts against the passes
    they cost all of them."""
    top = max((k for _, _, k, _ in drafts), default=0)
    best, best_rate = top, -1.0
    for cap in range(top, -1, -1):
        rows = [(seq, min(k, cap) + 1) for seq, _, k, _ in drafts]
        n_passes = len(ubatch_passes(rows, n_ubatch))
        cells = sum(verify_cells(pos, min(k, cap)) for _, pos, k, _ in drafts)
        seconds = coef[0] * n_passes + coef[1] * sum(n for _, n in rows) + coef[2] * cells / 1000.0
        tokens = sum(float(gain[min(k, cap)]) for _, _, k, gain in drafts)
        rate = tokens / seconds if seconds > 0 else 0.0
        if rate > best_rate * (1.0 + 1e-9):
            best, best_rate = cap, rate
    return best


class VerifyCostModel:
    """Seconds of a batched verify as ``fixed * passes + per_row * rows + per_cell * cells``, where ``passes`` are
    the ubatches the decode split into (``ubatch_passes``) and ``cells`` sums over the rows the context each
    attends to; fitted by exponentially weighted least squares (``decay`` per step) over the scheduler's decodes.
    ``share`` is what one sequence's rows cost: its part of the fixed cost of each pass it is in, and the marginal
    cost of its rows. Until ``ready`` (``min_steps`` decodes, two row counts at least, a fit with no negative
    part), ``share`` is the proportional share of the decode instead."""

    def __init__(self, *, decay: float = 0.97, min_steps: int = 8):
        self.decay, self.min_steps = float(decay), int(min_steps)
        self._xtx = np.zeros((3, 3))
        self._xty = np.zeros(3)
        self._steps = 0
        self._rows_seen: set[int] = set()
        self._coef: np.ndarray | None = None

    def observe(self, rows: int, cells: int, seconds: float, passes: int = 1) -> None:
        if rows < 1 or passes < 1 or not np.isfinite(seconds) or seconds <= 0:
            return
        x = np.array([float(passes), float(rows), cells / 1000.0])
        self._xtx = self.decay * self._xtx + np.outer(x, x)
        self._xty = self.decay * self._xty + x * seconds
        self._steps += 1
        self._rows_seen.add(int(rows))
        self._coef = None

    def coefficients(self) -> np.ndarray | None:
        """(fixed seconds per pass, seconds per row, seconds per row and 1000 cells), or None while not ready."""
        if self._coef is None and self._steps >= self.min_steps and len(self._rows_seen) >= 2:
            # a little ridge on the per-cell term: contexts may barely vary between steps
            ridge = np.diag([0.0, 0.0, 1e-9 + 1e-6 * self._xtx[2, 2]])
            try:
                coef = np.linalg.solve(self._xtx + ridge, self._xty)
            except np.linalg.LinAlgError:
                return None
            if coef[2] < 0:  # no measurable growth with context: refit without it
                sub = np.linalg.lstsq(self._xtx[:2, :2], self._xty[:2], rcond=None)[0]
                coef = np.array([sub[0], sub[1], 0.0])
            if np.all(coef >= 0) and coef[1] > 0:
                self._coef = coef
        return self._coef

    @property
    def ready(self) -> bool:
        return self.coefficients() is not None

    def share(self, seconds: float, rows: int, total_rows: int, n_sequences: int, cells: int,
              passes_share: float | None = None) -> float:
        """One sequence's part of a decode that took ``seconds``: its ``rows`` (of ``total_rows``, over
        ``n_sequences``) attending to ``cells`` cells in all; ``passes_share``: the sum, over the passes its rows
        were in, of 1 / the sequences in that pass (default: one pass shared by all)."""
        coef = self.coefficients()
        if coef is None:
            return seconds * rows / total_rows
        passes_share = 1.0 / n_sequences if passes_share is None else float(passes_share)
        return float(coef[0] * passes_share + coef[1] * rows + coef[2] * cells / 1000.0)


class BatchSequence:
    """A request inside the scheduler (its handle): ``seq_id`` once admitted, ``result`` once finished."""

    def __init__(self, request: BatchRequest, text: TextStream, chooser: SourceChooser | None,
                 lookup: PromptLookupDrafter | None = None, history: HistoryDrafter | None = None):
        self.request = request
        self.rules = request.rules if request.rules is not None else OutputRules(text.model)
        self.seq_id: int | None = None
        self.stats = SpecStats()
        self.stats.n_prompt, self.stats.stop_reason = len(request.tokens), "max_tokens"
        self.text = text
        self.tokens: list[int] = []
        self.logprobs: list | None = None if self.rules.n_logprobs is None else []
        self.chooser = chooser
        self.lookup = lookup  # this sequence's own prompt lookup (its prompt and output), or None
        self.history = history  # the history source over the scheduler's store, reading this sequence's text
        self.free = {name: source for name, source in ((LOOKUP, lookup), (HISTORY, history)) if source is not None}
        for source in self.free.values():
            source.observe(request.tokens, None, 0)
        self.prefilled = 0  # prompt tokens decoded so far (from the kept prefix on, with the prompt cache)
        self.in_memory: list[int] | None = []  # the ids the sequence's memory holds; None: unknown (an aborted decode)
        self.pos = 0  # the anchor's position, once prefilled
        self.anchor = -1
        self.result: GenerationResult | None = None
        self._t0 = time.perf_counter()
        self._t_decode0 = 0.0

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.request.tokens)

    @property
    def finished(self) -> bool:
        return self.result is not None


class BatchScheduler:
    """Runs many generations on one multi-sequence target Context (and drafter), one batched step at a time.

    Args:
        ctx: the target's Context, with ``n_seq_max`` sequences (one per concurrent generation) and per-sequence KV
            (the default); it is this scheduler's alone. Hybrid targets need ``n_rs_seq`` >= the drafts per round.
        drafter: a ``DSparkDrafter`` with at least ``ctx.n_seq_max`` sequences (``n_seq_max``), or None: no model
            drafter (plain decoding, batched, unless ``prompt_lookup`` drafts).
        prompt_lookup: a ``PromptLookupDrafter`` whose settings (n-gram lengths, block size) each sequence's own
            prompt lookup takes, or None: no prompt lookup. With a drafter too, each round each sequence drafts
            from the source that promises it the most tokens per second (a ``HybridDrafter``'s choice, per
            sequence).
        n_draft: drafts per round per sequence; None: cost-aware per sequence.
        max_rows: most rows in one verify decode (at most 64, where the exact mode holds; the scheduler's
            ``max_rows`` is also at most the context's n_batch).
        cache_prompts: keep a finished sequence's memory in its slot and reuse its longest common prefix with a new
            request (the prompt cache; see the module's docstring). ``stats.n_reused`` says how many prompt tokens
            a request found there.
        min_prefix_share: the share of a prompt a slot's kept ids must cover for the request to take that slot
            rather than an empty or the least recently used one (llama-server's slot similarity).
        cache_ram_bytes: with the prompt cache, a slot's memory about to be cut or replaced is first copied to host
            memory, up to this many bytes in all (the least recently used copies go first); a request whose prefix
            is longest in such a copy has it brought back into its slot. 0: slots only.
        on_rows: called as ``on_rows(sequence, capture_rows, logit_rows)`` with what each decode gave a sequence:
            the capture rows (dense, when the context captures) of the positions it decoded and keeps (a prompt
            chunk's, or the anchor and accepted drafts of a round), and the logit rows its committed tokens were
            sampled from (None for a prompt chunk that is not the last). Views: copy what you keep. The drafter
            training data generator records its features and teacher probabilities this way.

    Raises:
        TypeError, ValueError: a bad argument (a drafter with too few sequences, max_rows outside [1, 64]).
    """

    def __init__(self, ctx: Context, drafter=None, *, n_draft: int | None = None, max_rows: int = MAX_EXACT_ROWS,
                 on_rows=None, cache_prompts: bool = False, min_prefix_share: float = 0.1, cache_ram_bytes: int = 0,
                 prompt_lookup: PromptLookupDrafter | None = None, history: HistoryStore | None = None,
                 grammar_drafts: bool = True):
        checks.instance("ctx", ctx, Context)
        checks.instance("grammar_drafts", grammar_drafts, bool)
        if history is not None:
            checks.instance("history", history, HistoryStore, "HistoryStore(budget) or None")
        min_prefix_share = checks.number("min_prefix_share", min_prefix_share)
        if not 0.0 <= min_prefix_share <= 1.0:
            raise ValueError(f"min_prefix_share must be in [0, 1], got {min_prefix_share}")
        max_rows = checks.integer("max_rows", max_rows, minimum=1)
        if max_rows > MAX_EXACT_ROWS:
            raise ValueError(f"max_rows must be <= {MAX_EXACT_ROWS} (the rows consistent numerics covers), got "
                             f"{max_rows}")
        self.n_slots = ctx.n_seq_max
        rows = min(max_rows, ctx.n_batch)  # one decode takes at most n_batch tokens
        if self.n_slots > rows:
            raise ValueError(f"{self.n_slots} sequences cannot share a verify of {rows} rows (max_rows={max_rows}, "
                             f"the context's n_batch={ctx.n_batch})")
        max_rows = rows
        if prompt_lookup is not None:
            checks.instance("prompt_lookup", prompt_lookup, PromptLookupDrafter, "PromptLookupDrafter() or None")
        self.sources: dict[str, int] = {}  # source -> most drafts per round (prompt lookup first: it is free)
        if prompt_lookup is not None:
            self.sources[LOOKUP] = int(prompt_lookup.block_size)
        self.history = history if history is not None and history.budget > 0 else None
        if self.history is not None:
            self.sources[HISTORY] = HISTORY_BLOCK
        if drafter is not None:
            if not hasattr(drafter, "propose_many"):
                raise TypeError(f"drafter must draft for several sequences (DSparkDrafter), got "
                                f"{type(drafter).__name__} (prompt lookup batches as prompt_lookup=)")
            if drafter.n_seq_max < self.n_slots:
                raise ValueError(f"the drafter has {drafter.n_seq_max} sequences, the target context "
                                 f"{self.n_slots}: create it with n_seq_max={self.n_slots}")
            self.sources[DSPARK] = int(drafter.block_size)
        n_draft = checks.optional_integer("n_draft", n_draft, minimum=0)
        block = max(self.sources.values(), default=0)
        if self.sources and grammar_drafts:  # under a grammar, the tokens it forces (free; listed first)
            self.sources = {GRAMMAR: block, **self.sources}
        self.grammar_drafts = grammar_drafts
        self.n_draft = block if n_draft is None else min(n_draft, block)
        if self.n_draft and (ctx.model.is_recurrent or ctx.model.is_hybrid) and ctx.n_rs_seq < self.n_draft:
            raise ValueError(f"{ctx.model.arch} target needs n_rs_seq >= {self.n_draft} for rollback")
        if drafter is not None:
            ctx.set_capture_layers(list(drafter.capture_layers), masked=False)
        self.cost_aware = bool(self.sources) and n_draft is None
        self.prompt_lookup = prompt_lookup
        self.ctx, self.drafter, self.max_rows, self.on_rows = ctx, drafter, max_rows, on_rows
        self._capturing = bool(ctx.capture_layers)
        self.verify_costs = VerifyCostModel()
        self._batch = Batch(max(ctx.n_batch, max_rows), n_seq_max=self.n_slots)
        self._waiting: collections.deque[BatchSequence] = collections.deque()
        self._slots: list[BatchSequence | None] = [None] * self.n_slots
        self.min_prefix_share = min_prefix_share
        self._cache_prompts = bool(cache_prompts)
        self._held: list[np.ndarray] = [_NOTHING] * self.n_slots  # the ids each idle slot's memory holds
        self._last_used = [0] * self.n_slots  # admission count at which each slot was last taken
        self._admissions = 0
        self._recurrent = ctx.model.is_recurrent or ctx.model.is_hybrid
        self.cache_ram_bytes = checks.integer("cache_ram_bytes", cache_ram_bytes, minimum=0)
        self._saved: collections.OrderedDict[int, _Saved] = collections.OrderedDict()  # least recently used first
        self._saved_key = 0
        self.saved_bytes = 0  # what the saved memories take
        self.cache_hits_saved = 0  # requests that found their prefix in host memory
        ctx.clear()
        if drafter is not None:
            drafter.reset()

    # --- requests -------------------------------------------------------------------------------------
    def submit(self, request: BatchRequest) -> BatchSequence:
        """Queue a generation; it is admitted at the next step with a free sequence.

        Raises:
            ValueError: an empty prompt, or one that does not fit a sequence's context.
        """
        n_ctx = self.ctx.n_ctx_seq
        checks.integer("max_tokens", request.max_tokens, minimum=0)
        if len(request.tokens) == 0:
            raise ValueError("empty prompt: give at least one token")
        if len(request.tokens) >= n_ctx:
            raise ValueError(f"prompt of {len(request.tokens)} tokens does not fit a sequence's context of {n_ctx}")
        chooser = SourceChooser(self.sources) if self.cost_aware else None
        template = self.prompt_lookup
        lookup = None if template is None else PromptLookupDrafter(
            ngram_max=template.ngram_max, ngram_min=template.ngram_min, block_size=template.block_size)
        history = None if self.history is None else HistoryDrafter(self.history)
        seq = BatchSequence(request, TextStream(self.ctx.model, request.stop), chooser, lookup, history)
        self._waiting.append(seq)
        return seq

    @property
    def active(self) -> list[BatchSequence]:
        return [s for s in self._slots if s is not None]

    @property
    def n_waiting(self) -> int:
        return len(self._waiting)

    @property
    def idle(self) -> bool:
        return not self._waiting and not self.active

    # --- one step ---------------------------------------------------------------------------------------
    def step(self) -> dict[BatchSequence, list[TokenEvent]]:
        """Advance every sequence by one round (a prefilling one by one prompt chunk); the new events by sequence."""
        events: dict[BatchSequence, list[TokenEvent]] = collections.defaultdict(list)
        self._admit(events)
        for seq in self.active:
            if seq.request.cancel is not None and seq.request.cancel.cancelled:
                self._finish(seq, "cancelled", events)
        prefilling = next((s for s in self.active if s.prefilling), None)
        if prefilling is not None:
            self._prefill_chunk(prefilling, events)
        decoding = [s for s in self.active if not s.prefilling and s is not prefilling]
        if decoding:
            self._round(decoding, events)
        return dict(events)

    def run(self, requests: Sequence[BatchRequest]) -> list[GenerationResult]:
        """Submit these requests and step until all are done; their results in order."""
        handles = [self.submit(r) for r in requests]
        while not all(h.finished for h in handles):
            self.step()
        return [h.result for h in handles]

    @property
    def cache_prompts(self) -> bool:
        """Whether a finished sequence's memory stays in its slot for the next request (the prompt cache)."""
        return self._cache_prompts

    @cache_prompts.setter
    def cache_prompts(self, enabled: bool) -> None:
        self._cache_prompts = bool(enabled)
        if not enabled:
            for slot, seq in enumerate(self._slots):
                if seq is None:
                    self._forget_slot(slot)
            self._saved.clear()
            self.saved_bytes = 0

    @property
    def held(self) -> list[list[int]]:
        """The token ids each slot's memory keeps for the next request ([] for a slot holding nothing or busy)."""
        return [held.tolist() if seq is None else [] for held, seq in zip(self._held, self._slots)]

    def _admit(self, events) -> None:
        while self._waiting and None in self._slots:
            seq = self._waiting.popleft()
            tokens = seq.request.tokens
            slot, keep, saved = self._choose_slot(tokens)
            self._admissions += 1
            self._last_used[slot] = self._admissions
            seq.seq_id = slot
            self._slots[slot] = seq
            if saved is not None:  # out of the host memory's accounting while the slot's own memory is saved
                self._drop_saved(next(k for k, m in self._saved.items() if m is saved))
            self._save_slot(slot, keep if saved is None else 0)
            if saved is not None:
                self._restore_slot(slot, saved, keep)
                if not self._window_holds(self.ctx.seq_pos_min(slot), keep):
                    # a window-sized sliding-window cache restores only the last window of the copy: the prompt is
                    # prefilled whole instead (cutting there would raise MemoryOpError)
                    self._forget_slot(slot)
                    keep = 0
            if keep:
                self.ctx.seq_rm(slot, keep, -1)  # the drafter drops its stale part when the prefill feeds it
            elif len(self._held[slot]):
                self._forget_slot(slot)
            self._held[slot] = _NOTHING
            seq.prefilled = seq.stats.n_reused = keep
            seq.in_memory = [int(t) for t in tokens[:keep]]
            if seq.request.max_tokens == 0:
                self._finish(seq, "max_tokens", events)

    def _choose_slot(self, tokens: np.ndarray) -> tuple[int, int, _Saved | None]:
        """The free slot for a prompt, how many of its leading tokens will be kept, and the saved memory to bring
        into the slot first (None: the slot's own)."""
        free = [i for i, seq in enumerate(self._slots) if seq is None]
        if not self._cache_prompts:
            return free[0], 0, None
        kept = {i: self._slot_reusable(i, tokens) for i in free}
        best = max(free, key=lambda i: (kept[i], self._last_used[i]))
        # a short match: spare the other slots' memories, take an empty slot or the least recently used one
        spare = min(free, key=lambda i: (len(self._held[i]) > 0, self._last_used[i]))
        slot = best if kept[best] and kept[best] >= self.min_prefix_share * len(tokens) else spare
        saved = max(self._saved.values(), key=lambda m: self._reusable(m.tokens, tokens), default=None)
        if saved is not None:
            from_saved = self._reusable(saved.tokens, tokens)
            if from_saved > kept[slot]:  # brought into the spare slot: no slot's own memory is cut for it
                return spare, from_saved, saved
        return slot, kept[slot], None

    def _slot_reusable(self, slot: int, tokens: np.ndarray) -> int:
        """``_reusable`` for a slot's memory; nothing when the memory no longer ends where its ids do (something
        else touched the context)."""
        held = self._held[slot]
        if len(held) == 0 or self.ctx.seq_pos_max(slot) != len(held) - 1:
            return 0
        keep = self._reusable(held, tokens)
        return keep if self._window_holds(self.ctx.seq_pos_min(slot), keep) else 0

    def _window_holds(self, pos_min: int, keep: int) -> bool:
        """Whether a memory whose lowest position is ``pos_min`` can be cut to ``keep`` tokens and decoded on: a
        window-sized sliding-window cache (``swa_full=False``) must still hold the window of position ``keep``."""
        n_swa = self.ctx.model.n_swa
        return not (keep and n_swa and not self.ctx.swa_full and pos_min > max(0, keep - n_swa + 1))

    def _reusable(self, held: np.ndarray, tokens: np.ndarray) -> int:
        """Leading prompt tokens a memory holding ``held`` keeps: the common prefix, short of the prompt's last token
        (its logits are needed); for a recurrent state all of ``held`` or nothing."""
        n = min(len(held), len(tokens) - 1)
        if n <= 0:
            return 0
        differs = np.flatnonzero(held[:n] != np.asarray(tokens[:n]))
        keep = int(differs[0]) if differs.size else n
        if self._recurrent and keep != len(held):
            return 0
        return keep

    def _save_slot(self, slot: int, keep: int) -> None:
        """Before a slot's memory is cut to ``keep`` tokens: copy it to host memory, when the prompt cache has room
        for it and what is cut is worth keeping (``MIN_SAVED_TOKENS``)."""
        held = self._held[slot]
        if self.cache_ram_bytes <= 0 or len(held) - keep < MIN_SAVED_TOKENS:
            return
        if self.ctx.seq_pos_max(slot) != len(held) - 1:
            return
        self._keep_saved(_Saved(held, self.ctx.seq_state(slot),
                                None if self.drafter is None else self.drafter.saved(slot)))

    def _keep_saved(self, saved: _Saved) -> None:
        """Add a copy to host memory as the most recently used, dropping the least recently used ones past the
        budget (and copies of a prefix of its ids, which it serves as well)."""
        if saved.nbytes > self.cache_ram_bytes:
            return
        held = saved.tokens
        if not self._recurrent:  # a saved prefix of these ids serves nothing this one does not
            for key in [k for k, m in self._saved.items() if len(m.tokens) <= len(held)
                        and np.array_equal(m.tokens, held[:len(m.tokens)])]:
                self._drop_saved(key)
        self._saved_key += 1
        self._saved[self._saved_key] = saved
        self.saved_bytes += saved.nbytes
        while self.saved_bytes > self.cache_ram_bytes:
            self._drop_saved(next(iter(self._saved)))  # the least recently used

    def _restore_slot(self, slot: int, saved: _Saved, keep: int) -> None:
        """Bring a saved memory into a slot; it stays in host memory too when the slot keeps only part of it."""
        self.ctx.set_seq_state(slot, saved.target)
        if self.drafter is not None:
            self.drafter.restore(slot, saved.drafter)
        self._held[slot] = saved.tokens
        if keep < len(saved.tokens):
            self._keep_saved(saved)
        self.cache_hits_saved += 1

    def _drop_saved(self, key: int) -> None:
        self.saved_bytes -= self._saved.pop(key).nbytes

    def _forget_slot(self, slot: int) -> None:
        self.ctx.seq_rm(slot)
        if self.drafter is not None:
            self.drafter.reset(slot)
        self._held[slot] = _NOTHING

    def _prefill_chunk(self, seq: BatchSequence, events) -> None:
        """The next n_batch prompt tokens of one sequence, alone in its decode (the chunks a solo run decodes)."""
        tokens, start = seq.request.tokens, seq.prefilled
        chunk = tokens[start:start + self.ctx.n_batch]
        last = start + len(chunk) >= len(tokens)
        self._batch.clear()
        self._batch.add_tokens(chunk, start, seq_id=seq.seq_id, logits="last" if last else "none")
        t0 = time.perf_counter()
        try:
            if seq.request.cancel is not None:
                with self.ctx.abortable(seq.request.cancel):
                    self.ctx.decode(self._batch)
            else:
                self.ctx.decode(self._batch)
        except DecodeAbortedError:
            seq.in_memory = None  # an aborted decode may have left some of the chunk's cells
            self._finish(seq, "cancelled", events)
            return
        rows = self.ctx.capture() if self._capturing else None
        if self.drafter is not None:
            self.drafter.observe(chunk, rows, start, seq_id=seq.seq_id)
        if self.on_rows is not None:
            self.on_rows(seq, rows, None)
        seq.stats.t_prefill += time.perf_counter() - t0
        seq.prefilled += len(chunk)
        seq.in_memory.extend(int(t) for t in chunk)
        if last:
            seq.pos = len(tokens)
            seq._t_decode0 = time.perf_counter()
            logits = self.ctx.logits(-1)
            token, logprob = seq.rules.choose(logits, seq.request.sampler)
            self._commit(seq, [token], [False], events, logits=logits[None], logprobs=[logprob])

    def _round(self, decoding: list[BatchSequence], events) -> None:
        n_ctx = self.ctx.n_ctx_seq
        plans, sources, offers, t_lookup = {}, {}, {}, {}
        for seq in decoding:
            n_left = seq.request.max_tokens - len(seq.tokens)
            n_max = min(self.n_draft, n_ctx - seq.pos - 1, n_left - 1)
            t0 = time.perf_counter()
            offers[seq] = self._offers(seq, n_max)
            t_lookup[seq] = time.perf_counter() - t0
            sources[seq], plans[seq] = self._plan(seq, offers[seq], n_max)
        self._fit_rows(plans)
        drafting = [s for s in decoding if plans[s] > 0 and sources[s] == DSPARK]
        t0 = time.perf_counter()
        drafts: dict[BatchSequence, Draft] = {}
        if drafting:
            made = self.drafter.propose_many([(s.seq_id, s.anchor, s.pos, plans[s], s.request.sampler)
                                              for s in drafting])
            drafts = dict(zip(drafting, made))
        t_draft = time.perf_counter() - t0
        n_drafted_all = sum(len(d.tokens) for d in drafts.values()) or 1
        # what each sequence's draft cost: its lookup (asked every round, as the single-sequence loop's offers), and
        # its share of the drafter's decode
        draft_seconds = dict(t_lookup)
        chosen, refused, n_drafted, kept = {}, {}, {}, {}
        for seq in decoding:
            if sources[seq] == DSPARK:
                draft = drafts.get(seq, _NO_DRAFT)
                draft_seconds[seq] += t_draft * len(draft.tokens) / n_drafted_all
            else:
                draft = (offers[seq].get(sources[seq]) if plans[seq] else None) or _NO_DRAFT
            k = n_drafted[seq] = min(plans[seq], len(draft.tokens))  # what the draft time paid for, before any cut
            if seq.chooser is not None and k:
                k = seq.chooser.choosers[sources[seq]].cut(draft.confidence, k, draft_seconds[seq])
            chosen[seq], kept[seq] = draft, k
        cap = self._common_cap(decoding, sources, kept, chosen)
        for seq in decoding:
            # the cap reads draft lengths and running figures, never the sampled tokens: rejection sampling stays
            # exact (the grammar's cut, which reads the tokens, comes after it)
            drafts_k, refused[seq] = seq.rules.cut_draft(
                np.asarray(chosen[seq].tokens[:min(kept[seq], cap)], dtype=np.int32), seq.stats)
            chosen[seq] = (chosen[seq], drafts_k)
        # verify: every sequence's [anchor, d0..dk-1], each at its positions in its own sequence
        self._batch.clear()
        starts = {}
        for seq in decoding:
            starts[seq] = self._batch.add_tokens(np.concatenate([[seq.anchor], chosen[seq][1]]), seq.pos,
                                                 seq_id=seq.seq_id, logits="all")
        t1 = time.perf_counter()
        self.ctx.decode(self._batch)
        logits = self.ctx.all_logits()
        features = self.ctx.capture() if self._capturing else None
        n_rows = self._batch.n_tokens
        t_verify = time.perf_counter() - t1
        # each of a sequence's k + 1 rows attends to its cells up to its own position: pos + 1, ..., pos + k + 1
        cells = {seq: verify_cells(seq.pos, len(chosen[seq][1])) for seq in decoding}
        passes = ubatch_passes([(seq.seq_id, len(chosen[seq][1]) + 1) for seq in decoding], self.ctx.n_ubatch)
        self.verify_costs.observe(n_rows, sum(cells.values()), t_verify, passes=len(passes))
        from .speculative import Speculator  # the accept rule of the single-sequence loop, shared

        for seq in decoding:
            draft, drafts_k = chosen[seq]
            k, start = len(drafts_k), starts[seq]
            rows_k = logits[start:start + k + 1]
            n, token = Speculator._accept(drafts_k, draft, rows_k, seq.rules,
                                          seq.request.sampler, refused[seq])
            committed = [int(t) for t in drafts_k[:n]] + [token]
            logprobs = seq.rules.commit(rows_k, committed)
            if n < k:
                self.ctx.seq_rm(seq.seq_id, seq.pos + n + 1, -1)
            seq.in_memory.append(int(seq.anchor))
            seq.in_memory.extend(int(t) for t in drafts_k[:n])
            rows = None if features is None else features[start:start + n + 1]
            committed_rows = np.concatenate([[seq.anchor], drafts_k[:n]]).astype(np.int32)
            if self.drafter is not None:
                self.drafter.observe(committed_rows, rows, seq.pos, seq_id=seq.seq_id)
            for free in seq.free.values():
                free.observe(committed_rows, None, seq.pos)
            share_draft = draft_seconds[seq]
            in_passes = sum(1.0 / len(p) for p in passes if seq.seq_id in p)
            share_verify = self.verify_costs.share(t_verify, k + 1, n_rows, len(decoding), cells[seq], in_passes)
            source = sources[seq]
            seq.stats.observe_round(k, n, source=source if n_drafted[seq] else "", t_draft=share_draft,
                                    forced=draft.forced)
            seq.stats.t_verify += share_verify
            if seq.chooser is not None:
                seq.chooser.observe_round(source, k, n, share_draft, share_verify, k_drafted=n_drafted[seq])
                seq.chooser.observe_commit(committed)
                for name, offer in offers[seq].items():  # a free proposal left unverified still shows how good
                    if offer is not None and (name != source or k == 0):
                        seq.chooser.observe_free(name, offer.tokens, committed)
                if k == 0 and n_drafted[seq] and offers[seq].get(source) is None:
                    # a draft the common cap dropped whole (a probe, mostly) is scored against the committed token,
                    # as a free proposal: its acceptance stays measured for the price of the drafter's decode
                    seq.chooser.observe_free(source, draft.tokens[:n_drafted[seq]], committed)
            seq.pos += n + 1
            self._commit(seq, committed, [True] * n + [False], events, rows=rows, logits=logits[start:start + n + 1],
                         logprobs=logprobs)

    def _common_cap(self, decoding: list[BatchSequence], sources: dict, kept: dict, chosen: dict) -> int:
        """The most drafts a sequence verifies this round (``best_common_cap``), from each cost-aware sequence's
        running acceptance of its source and the fitted verify costs; no cap while the cost model is not ready,
        or when a sequence drafts a fixed n_draft (no chooser); a token the grammar forces counts as accepted
        (``forced_accepted``)."""
        top = max(kept.values(), default=0)
        coef = self.verify_costs.coefficients()
        if top == 0 or coef is None or any(seq.chooser is None for seq in decoding):
            return top
        wanted = []
        for seq in decoding:
            k = kept[seq]
            accept = seq.chooser.choosers[sources[seq]].accept[:k] if k else np.zeros(0)
            wanted.append((seq.seq_id, seq.pos, k, expected_tokens_by_k(forced_accepted(accept, chosen[seq].forced))))
        return best_common_cap(wanted, coef, self.ctx.n_ubatch)

    def _offers(self, seq: BatchSequence, n_max: int) -> dict[str, Draft | None]:
        """The sources that can draft for ``seq`` this round (as ``HybridDrafter.offers``): prompt lookup's proposal
        when it matches, the DSpark drafter as None (it drafts on request, in the round's one drafter decode)."""
        found: dict[str, Draft | None] = {}
        if n_max <= 0:
            return found
        if self.grammar_drafts and self.sources:
            forced = grammar_draft(seq.rules, seq.free.values(), seq.anchor, seq.pos, n_max)
            if forced is not None:
                found[GRAMMAR] = forced
        for name, source in seq.free.items():
            proposal = source.propose(seq.anchor, seq.pos, n_max, sampler=seq.request.sampler)
            if len(proposal.tokens):
                found[name] = proposal
        if self.drafter is not None:
            found[DSPARK] = None
        return found

    def _plan(self, seq: BatchSequence, offers: dict[str, Draft | None], n_max: int) -> tuple[str, int]:
        """(source, drafts to plan) for ``seq``: its cost-aware chooser's pick, or with a fixed n_draft prompt
        lookup's proposal when it matches, else the DSpark drafter's n_max."""
        available = {name: min(n_max, self.sources[name]) if offer is None else len(offer.tokens)
                     for name, offer in offers.items()}
        if seq.chooser is not None:
            return free_length(offers, *seq.chooser.choose(available, free=[name for name, offer in offers.items()
                                                                              if offer is not None]))
        if not available:
            return "", 0
        source = next((name for name in (GRAMMAR, LOOKUP, HISTORY) if name in available), DSPARK)
        return source, available[source]

    def _fit_rows(self, plans: dict) -> None:
        """Fewer drafts where the batch would exceed max_rows: the longest drafts are shortened first."""
        while sum(k + 1 for k in plans.values()) > self.max_rows:
            longest = max(plans, key=plans.get)
            if plans[longest] == 0:
                raise ValueError(f"{len(plans)} sequences do not fit a verify of {self.max_rows} rows")
            plans[longest] -= 1

    def _commit(self, seq: BatchSequence, tokens: list[int], from_draft: list[bool], events, *, rows=None,
                logits=None, logprobs=None) -> None:
        """Hand out committed tokens (cut at max_tokens, end-of-generation, a stop token or string) and end the
        sequence when one of those, or the end of its context, was reached. ``rows``/``logits``: the capture rows
        of the decoded positions and the logit rows the tokens came from, for ``on_rows`` (cut like the tokens);
        ``logprobs``: the tokens' ``TokenLogprob``s when the request asked for them."""
        request = seq.request
        reason = None
        kept = 0
        for i, (token, drafted) in enumerate(zip(tokens, from_draft)):
            seq.tokens.append(token)
            seq.stats.n_generated += 1
            kept += 1
            piece = seq.text.add(token)
            logprob = logprobs[i] if logprobs is not None else None
            if seq.logprobs is not None:
                seq.logprobs.append(logprob)
            events[seq].append(TokenEvent(token=token, text=piece, from_draft=drafted, logprob=logprob))
            if seq.text.stopped or token in request.stop_tokens:
                reason = "stop"
            elif seq.rules.ends(token, request.stop_at_eog):
                reason = "eog"
            elif len(seq.tokens) >= request.max_tokens:
                reason = "max_tokens"
            if reason:
                break
        if self.on_rows is not None:
            self.on_rows(seq, None if rows is None else rows[:kept], None if logits is None else logits[:kept])
        seq.anchor = seq.tokens[-1]
        if reason is None and seq.pos >= self.ctx.n_ctx_seq:
            reason = "n_ctx"
        if reason is not None:
            self._finish(seq, reason, events)

    def _finish(self, seq: BatchSequence, reason: str, events) -> None:
        """End a sequence: its last event carries the result; its KV and the drafter's memory of it are freed, or
        with the prompt cache kept in its slot with the ids they hold."""
        seq.stats.stop_reason = reason
        if seq._t_decode0:
            seq.stats.t_decode = time.perf_counter() - seq._t_decode0
        tail = seq.text.finish() if reason != "cancelled" else ""
        seq.result = GenerationResult(seq.text.text, list(seq.tokens), reason, seq.stats,
                                      logprobs=None if seq.logprobs is None else list(seq.logprobs))
        events[seq].append(TokenEvent(token=-1, text=tail, stop_reason=reason, result=seq.result))
        if self.history is not None and reason != "cancelled":
            self.history.add(seq.tokens, seq.request.tokens)
        if self._cache_prompts and seq.in_memory is not None:
            self._trim_unshown(seq)
        if self._cache_prompts and seq.in_memory is not None:
            self._held[seq.seq_id] = np.asarray(seq.in_memory, dtype=np.int64)
        else:
            self._forget_slot(seq.seq_id)
        self._slots[seq.seq_id] = None

    def _trim_unshown(self, seq: BatchSequence) -> None:
        """Drop accepted drafts the memory holds past the last token handed out (a generation cut inside a round), so
        the kept ids are the prompt and the output: a recurrent state is reusable only whole."""
        shown = len(seq.request.tokens) + len(seq.tokens)
        if len(seq.in_memory) > shown:
            try:
                self.ctx.seq_rm(seq.seq_id, shown, -1)
            except MemoryOpError:
                seq.in_memory = None
                return
            del seq.in_memory[shown:]

    def reset(self) -> None:
        """Drop every sequence, running or waiting, and clear the memory (after a failed step)."""
        self._waiting.clear()
        self._slots = [None] * self.n_slots
        self._held = [_NOTHING] * self.n_slots
        self._saved.clear()
        self.saved_bytes = 0
        self.ctx.clear()
        if self.drafter is not None:
            self.drafter.reset()

    def close(self) -> None:
        self._batch.close()
