"""Drafters: the Drafter protocol and DSparkDrafter over the vendored dflash/DSpark graph.

A drafter proposes a block of tokens after the last committed one and is told
what the target committed. DSparkDrafter keeps the target's tapped hidden
states for every committed position in its own KV cache (injected at their
absolute positions) and drafts a whole block in one decode:

    propose(anchor, pos, n_max): decode [anchor, mask x (B-1)] at positions pos..pos+B-1
        (non-causal), read the first n_max slot logits (the Markov bias is applied
        in-graph with the greedy chain prev_0 = anchor, prev_k = argmax of slot
        k-1; the output head runs on those n_max rows only), then drop the
        block's own cells so only committed features remain.
    observe(rows, pos0): inject the target's capture rows of newly committed
        positions pos0.. (width n_taps * n_embd_target).

Index conventions: the GGUF stores ``dflash.target_layers`` as layer *inputs*
(HF id + 1); the capture API takes layer *outputs* (HF id). ``capture_layers``
is the list to pass to ``Context.set_capture_layers`` on the target.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from .batch import Batch
from .context import Context
from .errors import ClosedHandleError, LlamaError
from .history import HISTORY_BLOCK, HistoryStore
from .model import Model


class DrafterError(LlamaError, ValueError):
    """The drafter GGUF cannot serve this target (incompatible sizes, taps, vocabulary)."""


@dataclass
class Draft:
    """A proposed block.

    Attributes:
        tokens: draft token ids, slot order (slot k predicts the token after slot k-1's).
        logits: [len(tokens), n_vocab] post-Markov slot logits (a copy), or None.
        confidence: [len(tokens)] per-slot acceptance estimate, or None without a confidence head.
        probs: [len(tokens), n_vocab] the draft distributions q the tokens were drawn from (sampling
            only); None for a greedy draft (the loop then treats q as one-hot).
        source: which source drafted it, for a drafter with several ("lookup", "dspark": see
            ``HybridDrafter``); "" from a single-source drafter (the loop names its rounds by the drafter).
        forced: for a grammar's draft ("grammar"), which tokens the grammar forced (the others continue it from
            a free source where the grammar was free); None otherwise.
    """

    tokens: np.ndarray
    logits: np.ndarray | None = None
    confidence: np.ndarray | None = None
    probs: np.ndarray | None = None
    source: str = ""
    forced: np.ndarray | None = None  # [len(tokens)] bool: the tokens a grammar forced (source "grammar"), else None


class Drafter(Protocol):
    """What the speculative loop needs from a drafter.

    ``capture_layers``: target layer outputs whose concatenated rows ``observe`` receives
    (empty for drafters that only need token ids).

    Any object with these attributes and methods drafts for ``Speculator`` and ``load`` (no base class needed);
    ``DSparkDrafter``, ``PromptLookupDrafter`` and ``HybridDrafter`` are the built-in ones.

    Attributes:
        capture_layers: the target layer outputs (HF ids) ``observe`` receives, concatenated per row; [] for none.
        block_size: the most tokens ``propose`` returns.
    """

    capture_layers: list[int]
    block_size: int

    def observe(self, tokens: np.ndarray, rows: np.ndarray | None, pos0: int) -> None:
        """Committed tokens at positions pos0.. and, if capture_layers, their target capture rows."""

    def propose(self, anchor: int, pos: int, n_max: int, sampler=None) -> Draft:
        """Up to n_max draft tokens following ``anchor`` (the last committed token, at position pos).

        With a non-greedy ``sampler`` the tokens are drawn and ``Draft.probs`` holds q."""

    def reset(self) -> None:
        """Forget everything observed (a new generation)."""


@dataclass(frozen=True)
class DrafterInfo:
    """What DSparkDrafter reads from the GGUF and checks against the target."""

    block_size: int
    target_layers: list[int]  # GGUF convention: layer inputs (HF id + 1)
    mask_token: int
    has_confidence: bool
    sample_from_anchor: bool
    markov_rank: int = 0  # 0: no Markov head (the "DFlash ablation"), slots are independent
    n_vocab_draft: int = 0  # rows of the drafter's output head: the target's n_vocab, or fewer with a d2t table

    @property
    def capture_layers(self) -> list[int]:
        """The same taps in the capture API's convention: layer outputs (HF id)."""
        return [layer - 1 for layer in self.target_layers]


def inspect_drafter(drafter: Model, target: Model) -> DrafterInfo:
    """Read the drafter's DSpark parameters and check it fits the target.

    Raises:
        DrafterError: not a dflash/DSpark GGUF, taps outside the target's layers, feature width or
            vocabulary that does not match the target, mask token outside the vocabulary.
    """
    fail = _failer(drafter)
    if drafter.arch != "dflash":
        fail(f"architecture {drafter.arch!r} is not a DFlash/DSpark drafter (expected 'dflash')")
    tensors = _tensor_shapes(drafter)
    anchor_first = bool(drafter.gguf_value("dflash.sample_from_anchor", "markov_w1.weight" in tensors))
    if not anchor_first:
        fail("a bonus-anchor (DFlash-style, dflash.sample_from_anchor = false) drafter; only anchor-first DSpark "
             "drafters are supported")
    taps = drafter.target_layers
    if not taps:
        fail("no dflash.target_layers")
    bad = [t for t in taps if not 1 <= t <= target.n_layer]
    if bad:
        fail(f"target layers {bad} (GGUF layer-input ids) outside the target's 1..{target.n_layer} "
             f"({target.n_layer} layers)")
    fc_in = tensors.get("fc.weight", (0,))[0]
    if fc_in != len(taps) * target.n_embd:
        fail(f"fc expects feature rows of {fc_in}, the target gives {len(taps)} taps x n_embd {target.n_embd} "
             f"= {len(taps) * target.n_embd}")
    if drafter.n_vocab != target.n_vocab:
        fail(f"vocabulary size {drafter.n_vocab} differs from the target's {target.n_vocab}")
    mask = drafter.special_tokens["mask"]
    if mask < 0:  # a vocabulary without tokenizer (no_vocab) ignores its special-token keys
        mask = int(drafter.gguf_value("tokenizer.ggml.mask_token_id", -1))
    if not 0 <= mask < target.n_vocab:
        fail(f"mask token {mask} is not in the vocabulary (tokenizer.ggml.mask_token_id)")
    block = int(drafter.gguf_value("dflash.block_size", 0))
    if block < 1:
        fail("dflash.block_size missing or < 1")
    n_vocab_draft = target.n_vocab
    if "d2t" in tensors:
        n_vocab_draft = len(draft_vocabulary(drafter, target.n_vocab, mask, fail))
    return DrafterInfo(
        block_size=block,
        target_layers=taps,
        mask_token=mask,
        has_confidence="conf_proj.weight" in tensors,
        sample_from_anchor=anchor_first,
        markov_rank=int(tensors["markov_w1.weight"][0]) if "markov_w1.weight" in tensors else 0,
        n_vocab_draft=n_vocab_draft,
    )


def draft_vocabulary(drafter: Model, n_vocab: int, mask: int, fail) -> np.ndarray:
    """The target ids of a reduced draft vocabulary (the GGUF's ``d2t``: I64, one absolute target id per
    row of the drafter's own output head and of ``markov_w2``), checked the way llama.cpp's graph needs it:
    llama.cpp scatters draft row i to target id d2t[i] and leaves every other id at -inf, so an id out of
    range would write outside the logits, a repeated id would drop a row, and the mask token must never be
    drafted. Calls ``fail(message)`` on any violation."""
    import gguf

    header = drafter.gguf_header
    info = header.tensors["d2t"]
    type_name = gguf.GGMLQuantizationType(info.ggml_type).name
    if type_name != "I64" or len(info.shape) != 1:
        fail(f"d2t must be a 1-D I64 tensor of target token ids, got {type_name} of shape {list(info.shape)}")
    ids = np.asarray(header.tensor_data("d2t"), dtype=np.int64).reshape(-1)
    if not 1 <= len(ids) <= n_vocab:
        fail(f"d2t has {len(ids)} entries; a draft vocabulary needs 1..{n_vocab}")
    if ids.min() < 0 or ids.max() >= n_vocab:
        fail(f"d2t maps to target ids outside [0, {n_vocab})")
    if np.unique(ids).size != ids.size:
        fail("d2t maps two draft tokens to the same target id")
    if mask in set(ids.tolist()):
        fail(f"d2t contains the mask token {mask}, which must never be drafted")
    shapes = {name: t.shape for name, t in header.tensors.items()}
    output = shapes.get("output.weight")
    if output is None or output[-1] != len(ids):
        fail(f"a reduced draft vocabulary of {len(ids)} tokens needs its own output.weight with {len(ids)} rows, "
             f"got {None if output is None else list(output)}")
    w2 = shapes.get("markov_w2.weight")
    if w2 is not None and w2[-1] != len(ids):
        fail(f"markov_w2 has {w2[-1]} rows, the draft vocabulary {len(ids)}")
    return ids


class DSparkDrafter:
    """A DSpark drafter running in its own context next to the target's.

    Args:
        path: drafter GGUF (architecture ``dflash`` with the DSpark Markov head).
        target: the target's Context; its model lends token_embd/output when the drafter omits them.
        n_ctx: drafter KV size (default: the target's n_ctx + block size - 1, the least that lets it draft a
            whole block at the target's last position; smaller values are refused).
        n_batch: rows per injection decode (default: the target's n_batch); also its n_ubatch,
            because a non-causal graph must see a whole batch in one ubatch.
        n_threads: CPU threads (default: all cores).
        n_gpu_layers: drafter layers to offload.
        p_min: cut the draft at the first slot whose confidence is below p_min (0 = off).
        kv_type, flash_attn: the drafter context's KV cache type and flash attention (see Context); "f32" and
            False bring its logits within ~1e-6 of a float reference.
        n_seq_max: sequences (default: the target's n_seq_max): sequence i drafts for the target's sequence i,
            and ``propose_many`` drafts for several in one decode. ``n_ctx`` is then per sequence.
        header: the drafter file's ``read_header(path)``, when the caller has read it (not read again).

    Raises:
        DrafterError: see ``inspect_drafter``; ValueError: p_min with no confidence head, or n_ctx too small.
        ClosedHandleError: the target context is closed.

    The drafter's context reads the target's (``ctx_other``), so it is closed with the target's Context (or
    Model); afterwards ``propose``/``observe``/``reset`` raise ClosedHandleError.
    """

    def __init__(self, path, target: Context, *, n_ctx: int | None = None, n_batch: int | None = None,
                 n_threads: int | None = None, n_gpu_layers: int = 0, p_min: float = 0.0, kv_type: str = "f16",
                 flash_attn: bool | None = None, n_seq_max: int | None = None, header=None):
        target.ptr  # a closed target raises ClosedHandleError before anything is loaded
        # A target on RPC servers: the drafter's model gets the same devices (its own layers stay local unless
        # n_gpu_layers says otherwise), so its context can run the target tensors it borrows (the token
        # embeddings, a full-vocabulary drafter's output head) where they live.
        self.model = Model(path, n_gpu_layers=n_gpu_layers, rpc_servers=target.model.rpc_servers, header=header)
        try:
            self.info = inspect_drafter(self.model, target.model)
            if p_min > 0.0 and not self.info.has_confidence:
                raise DrafterError("p_min > 0 needs a confidence head; this drafter has none", op="DSparkDrafter")
            # A block is drafted at positions pos..pos+B-1 after pos committed cells; pos reaches n_ctx - 1.
            n_ctx_min = target.n_ctx_seq + self.info.block_size - 1
            if n_ctx is not None and n_ctx < n_ctx_min:
                raise ValueError(f"drafter n_ctx={n_ctx} is too small: drafting a block of {self.info.block_size} "
                                 f"at the target's last position needs n_ctx >= {n_ctx_min} (the target's "
                                 f"{target.n_ctx_seq} + block size - 1)")
            self.n_seq_max = target.n_seq_max if n_seq_max is None else int(n_seq_max)
            n_batch = max(n_batch or target.n_batch, self.info.block_size * self.n_seq_max)
            self.ctx = Context(self.model, n_ctx=(n_ctx or n_ctx_min) * self.n_seq_max, n_batch=n_batch,
                               n_ubatch=n_batch, n_seq_max=self.n_seq_max, n_threads=n_threads, ctx_other=target,
                               kv_type=kv_type, flash_attn=flash_attn,
                               # drafts are verified, so their last bits never reach the output: the drafter
                               # follows the target (a GPU backend without the mode would refuse it)
                               consistent_numerics=target.consistent_numerics)
            # the native drafter context holds a pointer to the target's: it must be freed first
            target._adopt(self.ctx)
        except BaseException:
            self.model.close()
            raise
        self.target = target
        self.p_min = float(p_min)
        self.ctx.set_causal_attn(False)
        if self.info.has_confidence:
            self.ctx.set_nextn(True, masked=True)
        self.width = len(self.info.target_layers) * target.model.n_embd
        self._rows = self.ctx.embd_batch(self.width)
        self._block = Batch(self.info.block_size * self.n_seq_max, n_seq_max=self.n_seq_max)
        # per sequence: observed rows not injected yet (a list of arrays, in position order) and the position of
        # the first. A list, not one array grown by concatenation: while another source drafts (prompt lookup),
        # a long prompt's rows wait here for many rounds, and copying them every round cost more than a decode.
        self._pending: dict[int, tuple[list[np.ndarray], int]] = {}
        self._bias = None  # Markov bias function, loaded on the first sampled draft

    @property
    def block_size(self) -> int:
        return self.info.block_size

    @staticmethod
    def peek_block_size(path) -> int:
        """dflash.block_size of a drafter GGUF, read without loading it (0 if absent)."""
        from .gguf_header import GGUFHeader

        return int(GGUFHeader(path).value("dflash.block_size", 0))

    @property
    def capture_layers(self) -> list[int]:
        return self.info.capture_layers

    def close(self) -> None:
        """Close the drafter's model and its context (the target's stay open). Safe to call more than once."""
        self.model.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def reset(self, seq_id: int | None = None) -> None:
        """Forget what was observed: for one sequence, or (None) for all."""
        self._check_open()
        if seq_id is None:
            self.ctx.clear()
            self._pending.clear()
        else:
            self.ctx.seq_rm(self._seq(seq_id))
            self._pending.pop(seq_id, None)

    def saved(self, seq_id: int) -> tuple:
        """A copy of what the drafter holds for sequence ``seq_id`` (its KV of injected rows and the rows still
        pending), for ``restore`` into any of its sequences."""
        self._check_open()
        self._seq(seq_id)
        chunks, pos0 = self._pending.get(seq_id, ([], 0))
        return self.ctx.seq_state(seq_id), (list(chunks), pos0)

    def restore(self, seq_id: int, saved: tuple) -> None:
        """Replace what the drafter holds for ``seq_id`` by what ``saved`` copied."""
        self._check_open()
        self._seq(seq_id)
        state, (chunks, pos0) = saved
        self.ctx.set_seq_state(seq_id, state)
        self._pending.pop(seq_id, None)
        if chunks:
            self._pending[seq_id] = (list(chunks), pos0)

    def _check_open(self) -> None:
        if self.target.closed:
            raise ClosedHandleError("the drafter's target Context is closed (the drafter reads the target's "
                                    "context and closes with it); create a new DSparkDrafter for a new target")
        if self.ctx.closed:
            raise ClosedHandleError("DSparkDrafter is closed")

    def _seq(self, seq_id: int) -> int:
        if not 0 <= seq_id < self.n_seq_max:
            raise ValueError(f"seq_id {seq_id} outside [0, {self.n_seq_max})")
        return int(seq_id)

    def observe(self, tokens: np.ndarray, rows: np.ndarray | None, pos0: int, seq_id: int = 0) -> None:
        """Take the capture rows of committed positions pos0.. of sequence ``seq_id`` (anything observed there at
        or after pos0 before is stale: rejected or re-fed).

        The rows are injected into the drafter's KV cache lazily, in one decode before the next ``propose``:
        rounds that do not draft (a cost-aware loop's plain steps) then cost one batched injection later
        instead of one decode each.
        """
        self._check_open()
        self._seq(seq_id)
        if rows is None or len(rows) == 0:
            return
        rows = np.array(rows, dtype=np.float32)  # a copy: the caller's buffer may be the target's, reused
        if rows.ndim != 2 or rows.shape[1] != self.width:
            raise ValueError(f"feature rows must be [n, {self.width}], got {list(rows.shape)}")
        if seq_id in self._pending:
            chunks, start = self._pending[seq_id]
            end = start + sum(len(chunk) for chunk in chunks)
            if start <= pos0 <= end:
                while end > pos0:  # drop what was observed at pos0 and after (stale)
                    last = chunks.pop()
                    end -= len(last)
                    if end < pos0:
                        chunks.append(last[: pos0 - end])
                        end = pos0
                chunks.append(rows)
                return
            if pos0 > end:
                self._flush([seq_id])
        self._pending[seq_id] = ([rows], pos0)

    def _flush(self, seq_ids) -> None:
        """Inject the pending rows of these sequences (dropping their cells at and after the first position), all
        sequences' rows in the same decodes."""
        chunks = []
        for seq_id in seq_ids:
            if seq_id in self._pending:
                pending, pos0 = self._pending.pop(seq_id)
                rows = pending[0] if len(pending) == 1 else np.concatenate(pending)
                self.ctx.seq_rm(seq_id, pos0, -1)
                chunks += [(seq_id, rows[i:i + self.ctx.n_batch], pos0 + i) for i in range(0, len(rows),
                                                                                           self.ctx.n_batch)]
        self._rows.clear()
        for seq_id, rows, pos0 in chunks:
            if self._rows.n_tokens + len(rows) > self.ctx.n_batch:
                self.ctx.decode(self._rows)
                self._rows.clear()
            self._rows.add_rows(rows, pos0, seq_id=seq_id)
        if self._rows.n_tokens:
            self.ctx.decode(self._rows)

    def propose(self, anchor: int, pos: int, n_max: int | None = None, sampler=None, seq_id: int = 0) -> Draft:
        """Draft up to n_max (default: the block size) tokens after ``anchor`` at position ``pos``.

        Greedy (no sampler, or temperature 0): slot k's token is the argmax of its post-Markov logits,
        the same chain the graph used. Sampling: tokens are drawn slot by slot and the Markov bias is
        recomputed with the token actually drawn at the previous slot (the graph's chain is greedy),
        so ``Draft.probs`` is the q each token came from. The confidence cut (p_min) reads the
        graph's confidence, which follows the greedy chain.
        """
        return self.propose_many([(seq_id, anchor, pos, n_max, sampler)])[0]

    def propose_many(self, requests) -> list[Draft]:
        """Drafts for several sequences in one decode: ``requests`` is a list of (seq_id, anchor, pos, n_max,
        sampler) with distinct seq_ids; the Drafts come in the same order."""
        self._check_open()
        block = self.info.block_size
        wanted = []
        for seq_id, anchor, pos, n_max, sampler in requests:
            n_max = block if n_max is None else min(int(n_max), block)
            if n_max < 1:
                raise ValueError(f"n_max must be >= 1, got {n_max}")
            wanted.append((self._seq(seq_id), int(anchor), int(pos), n_max, sampler))
        if len({w[0] for w in wanted}) != len(wanted):
            raise ValueError("propose_many: one request per sequence")
        self._flush([w[0] for w in wanted])
        self._block.clear()
        # The whole block is decoded (its slots attend to each other), but only its first slots are flagged:
        # patch 0009 runs the output head, the Markov chain and the confidence head on those alone. The graph
        # chains the Markov head only when every block flags as many slots, so all flag the most asked for.
        n_flag = max(w[3] for w in wanted)
        for seq_id, anchor, pos, _, _ in wanted:
            self._block.add_tokens([anchor] + [self.info.mask_token] * (block - 1), pos, seq_id=seq_id,
                                   logits=[True] * n_flag + [False] * (block - n_flag))
        try:
            self.ctx.decode(self._block)
            logits = self.ctx.all_logits().copy()
            confidence = (np.array([self.ctx.nextn_row(i)[0] for i in self._block.output_indices],
                                   dtype=np.float32) if self.info.has_confidence else None)
        finally:
            for seq_id, _, pos, _, _ in wanted:
                self.ctx.seq_rm(seq_id, pos, -1)  # the block's own cells are not context
        drafts = []
        for i, (seq_id, anchor, pos, n_max, sampler) in enumerate(wanted):
            rows = logits[i * n_flag:i * n_flag + n_max]
            conf = None if confidence is None else confidence[i * n_flag:i * n_flag + n_max]
            drafts.append(self._draft(anchor, rows, conf, sampler))
        return drafts

    def _draft(self, anchor: int, logits: np.ndarray, confidence: np.ndarray | None, sampler) -> Draft:
        n = len(logits)
        if self.p_min > 0.0 and confidence is not None:
            below = np.flatnonzero(confidence[:n] < self.p_min)
            n = int(below[0]) if below.size else n
        conf = None if confidence is None else confidence[:n]
        if sampler is None or sampler.params.greedy:
            tokens = np.argmax(logits[:n], axis=1).astype(np.int32)
            return Draft(tokens=tokens, logits=logits[:n], confidence=conf)
        tokens, probs, chained = self._sample_chain(anchor, logits[:n], sampler)
        return Draft(tokens=tokens, logits=chained, confidence=conf, probs=probs)

    def _sample_chain(self, anchor: int, logits: np.ndarray, sampler):
        """Redo the Markov chain with drawn tokens: base_k = logits_k - bias(greedy prev_k), then
        logits_k' = base_k + bias(drawn prev_k)."""
        from .sampling import probabilities

        bias = self._markov_bias()
        greedy_prev = np.concatenate([[anchor], np.argmax(logits[:-1], axis=1)]).astype(np.int64)
        base = logits.astype(np.float64) - bias(greedy_prev)
        tokens, probs, chained = [], [], []
        prev = anchor
        for k in range(len(logits)):
            row = base[k] + bias(np.array([prev]))[0]
            q = probabilities(row, sampler.params)
            prev = sampler.draw(q)
            tokens.append(prev)
            probs.append(q)
            chained.append(row)
        return np.asarray(tokens, dtype=np.int32), np.stack(probs), np.stack(chained).astype(np.float32)

    def _markov_bias(self):
        """bias(prev) = markov_w2 @ markov_w1[prev] (x markov_w2.scale), rows [len(prev), n_vocab]."""
        if self._bias is None and self.info.markov_rank == 0:
            n_vocab = self.model.n_vocab
            self._bias = lambda prev: np.zeros((len(prev), n_vocab))
        if self._bias is None:
            header = self.model.gguf_header
            w1 = header.dequantized("markov_w1.weight")  # [n_vocab, R]
            w2 = header.dequantized("markov_w2.weight")  # [n_vocab_draft, R]
            scale = float(header.dequantized("markov_w2.scale").ravel()[0]) if "markov_w2.scale" in header.tensors \
                else 1.0
            if "d2t" in header.tensors:
                # as in the graph: the reduced rows scattered to their target ids, zero bias elsewhere (those ids'
                # logits are -inf, so they keep probability 0 and are never drafted)
                ids = np.asarray(header.tensor_data("d2t"), dtype=np.int64).reshape(-1)
                n_vocab = self.model.n_vocab

                def bias(prev):
                    out = np.zeros((len(prev), n_vocab))
                    out[:, ids] = (w1[prev] @ w2.T) * scale
                    return out

                self._bias = bias
            else:
                self._bias = lambda prev: (w1[prev] @ w2.T) * scale
        return self._bias


class PromptLookupDrafter:
    """Prompt lookup (n-gram) drafting: find the text's last few tokens earlier in the prompt or the output
    and propose what followed them there. No model, no features; a baseline for trained drafters, and useful
    on its own where outputs repeat their input (extraction, editing, code).

    Args:
        ngram_max, ngram_min: longest and shortest suffix to look up (the longest that occurs wins; among
            its occurrences, the most recent).
        block_size: most tokens proposed per round (default 8: where text is copied, a match runs on for many
            tokens, and since patch 0024 a verify of 9 rows costs about twice one row; the cost-aware loop
            verifies fewer where matches go wrong sooner).
    """

    capture_layers: list[int] = []
    source = "lookup"  # what its rounds are called in Step.source and SpecStats.by_source

    def __init__(self, *, ngram_max: int = 3, ngram_min: int = 1, block_size: int = 8):
        if not 1 <= ngram_min <= ngram_max or block_size < 1:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max and block_size >= 1, got {ngram_min}, "
                             f"{ngram_max}, {block_size}")
        self.ngram_max, self.ngram_min, self.block_size = ngram_max, ngram_min, block_size
        # committed tokens by position: _text[:_n] (grown by doubling). The hybrid asks for a proposal every round,
        # so a proposal must not rebuild the text from a list (that and three sliding windows cost ~0.2 ms a
        # round on a 2k-token context, 3 % of a decode of SmolLM2-135M)
        self._text = np.zeros(256, np.int64)
        self._n = 0

    @property
    def tokens(self) -> list[int]:
        """The committed tokens observed so far, by position."""
        return self._text[:self._n].tolist()

    def reset(self) -> None:
        """Forget the observed tokens (a new generation)."""
        self._n = 0

    def observe(self, tokens: np.ndarray, rows: np.ndarray | None, pos0: int) -> None:
        """Committed tokens at positions pos0.. (what was observed from pos0 on is replaced; ``rows`` is unused).

        Raises:
            ValueError: ``pos0`` past the tokens observed so far (a gap).
        """
        if self._n < pos0:
            raise ValueError(f"observed position {pos0} after only {self._n} tokens")
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        end = pos0 + len(tokens)
        if end > len(self._text):
            grown = np.zeros(max(end, 2 * len(self._text)), np.int64)
            grown[:pos0] = self._text[:pos0]
            self._text = grown
        self._text[pos0:end] = tokens
        self._n = end

    def propose(self, anchor: int, pos: int, n_max: int | None = None, sampler=None) -> Draft:
        """Up to n_max (default and most: the block size) tokens that followed the latest earlier occurrence of the
        longest n-gram (ngram_max down to ngram_min tokens) ending with ``anchor`` at ``pos``; an empty Draft when
        none occurs. ``sampler`` is unused (a deterministic proposal)."""
        n_max = self.block_size if n_max is None else min(int(n_max), self.block_size)
        # the text is the committed tokens before pos, then the anchor at index last (not appended: that copies the
        # whole text every round). The ends e < last of earlier occurrences of the anchor; an n-gram match ends at
        # one of them with the n - 1 tokens before it equal too. The longest n that matches wins, then its latest
        # occurrence.
        last = min(pos, self._n)
        text = self._text
        ends = np.flatnonzero(text[:last] == anchor)
        for n in range(min(self.ngram_max, last), self.ngram_min - 1, -1):
            hits = ends[ends >= n - 1]
            for back in range(1, n):
                hits = hits[text[hits - back] == text[last - back]]
            if hits.size:
                start = int(hits[-1]) + 1  # <= last; what follows the match, the anchor included where reached
                proposal = text[start:min(start + n_max, last)].astype(np.int32)
                if start + n_max > last:
                    proposal = np.append(proposal, np.int32(anchor))
                return Draft(tokens=proposal)
        return Draft(tokens=np.zeros(0, np.int32))

    def propose_after(self, anchor: int, pos: int, ahead: Sequence[int], n_max: int, sampler=None) -> Draft:
        """``propose`` as if ``ahead`` (tokens not committed yet, e.g. what a grammar forces) followed the anchor:
        up to n_max tokens after the last of them. The text observed so far is unchanged afterwards."""
        ahead = [int(t) for t in ahead]
        if not ahead:
            return self.propose(anchor, pos, n_max, sampler=sampler)
        observed = self._n
        if observed != pos:  # the anchor sits at pos: every position before it is observed, none after
            return Draft(tokens=np.zeros(0, np.int32))
        self.observe(np.asarray([anchor] + ahead[:-1], np.int64), None, pos)
        try:
            return self.propose(ahead[-1], pos + len(ahead), n_max, sampler=sampler)
        finally:
            self._n = observed  # the positions written past it are overwritten by the next observe


class HistoryDrafter(PromptLookupDrafter):
    """The draft source over a ``HistoryStore``: it observes the request's committed tokens (as prompt lookup
    does) and proposes the store's continuation of their longest suffix (``HistoryStore.propose``). It only
    reads the store; the loop that ran the generation adds the finished reply (``remember``).

    Args:
        store: the shared store.
        block_size: most tokens proposed per round (``HISTORY_BLOCK``).
    """

    source = "history"

    def __init__(self, store: HistoryStore, *, block_size: int = HISTORY_BLOCK, max_depth: int = 24):
        if not isinstance(store, HistoryStore):
            raise TypeError(f"store must be a HistoryStore, got {type(store).__name__}")
        super().__init__(block_size=block_size)
        self.store, self.max_depth = store, max_depth

    def propose(self, anchor: int, pos: int, n_max: int | None = None, sampler=None) -> Draft:
        n_max = self.block_size if n_max is None else min(int(n_max), self.block_size)
        last = min(pos, self._n)
        tail = self._text[max(0, last - self.max_depth + 1):last].tolist() + [int(anchor)]
        tokens, _ = self.store.propose(tail, n_max, max_depth=self.max_depth)
        return Draft(tokens=np.asarray(tokens, dtype=np.int32))

    def remember(self, prompt: Sequence[int], reply: Sequence[int]) -> None:
        """Add a finished generation's reply to the store, after its prompt's last tokens."""
        self.store.add(reply, prompt)


def _failer(drafter: Model):
    def fail(message: str):
        raise DrafterError(f"drafter {drafter.path.name}: {message}", op="DSparkDrafter")
    return fail


def _tensor_shapes(model: Model) -> dict[str, tuple[int, ...]]:
    """Tensor name -> ggml shape (ne order) from the GGUF file's header."""
    return {name: info.shape for name, info in model.gguf_header.tensors.items()}
