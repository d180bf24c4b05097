"""Context: a model's inference state (KV cache / recurrent state) and decode.

View lifetime: ``logits()`` returns numpy views over llama.cpp's output
buffer. A view is valid only until the next ``decode`` on the same context
(or its close); call ``.copy()`` to keep the numbers.
"""

from __future__ import annotations

import os

import numpy as np

from . import _log
from ._lib import ffi, lib
from ._owned import Owned
from .batch import Batch, EmbdBatch
from .errors import ContextInitError, InvalidBatchError, MemoryOpError, decode_error
from .model import Model


def default_threads() -> int:
    return max(1, os.cpu_count() or 1)


class Context(Owned):
    """An inference context on a Model.

    Args:
        model: the loaded model; it must stay open (closing it closes this context first).
        n_ctx: KV cache size in tokens (0 = the model's training context).
        n_batch: most tokens one ``decode`` accepts.
        n_ubatch: most tokens computed in one graph (a batch is split into ubatches).
        n_seq_max: number of sequences.
        n_threads: CPU threads for single-token decodes (default: all cores).
        n_threads_batch: CPU threads for batches (default: n_threads).
        n_rs_seq: recurrent-state snapshots per sequence, so a hybrid/recurrent model can drop
            up to that many trailing tokens with ``seq_rm`` (0 = no partial removal).
        ctx_other: a context this one reads from (a draft model's target context).

    Raises:
        ValueError: a size is not positive or n_ubatch > n_batch.
        ContextInitError: llama.cpp could not create the context.
    """

    def __init__(self, model: Model, *, n_ctx: int = 2048, n_batch: int = 512, n_ubatch: int | None = None,
                 n_seq_max: int = 1, n_threads: int | None = None, n_threads_batch: int | None = None,
                 n_rs_seq: int = 0, ctx_other: "Context | None" = None):
        n_ubatch = n_batch if n_ubatch is None else n_ubatch
        _check_sizes(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_seq_max=n_seq_max)
        if n_ubatch > n_batch:
            raise ValueError(f"n_ubatch ({n_ubatch}) must not exceed n_batch ({n_batch})")
        if n_rs_seq < 0:
            raise ValueError(f"n_rs_seq must be >= 0, got {n_rs_seq}")
        self.model = model
        params = lib.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, n_batch, n_ubatch
        params.n_seq_max, params.n_rs_seq = n_seq_max, n_rs_seq
        params.n_threads = n_threads or default_threads()
        params.n_threads_batch = n_threads_batch or params.n_threads
        params.ctx_other = ctx_other.ptr if ctx_other is not None else ffi.NULL
        _log.clear()
        ptr = lib.llama_init_from_model(model.ptr, params)
        if ptr == ffi.NULL:
            raise ContextInitError(f"could not create a context for {model.path.name}", op="llama_init_from_model",
                                   log_tail=_log.tail())
        self._set_ptr(ptr)
        model._adopt(self)  # the native context must be freed before its model
        self.ctx_other = ctx_other
        self._mem = lib.llama_get_memory(ptr)
        self._n_vocab = model.n_vocab
        self._outputs = np.zeros(0, dtype=np.int64)  # batch indices with logits in the last decode
        self._n_last = 0

    def _free(self, ptr) -> None:
        lib.llama_free(ptr)

    # --- sizes -------------------------------------------------------------------------
    @property
    def n_ctx(self) -> int:
        return lib.llama_n_ctx(self.ptr)

    @property
    def n_batch(self) -> int:
        return lib.llama_n_batch(self.ptr)

    @property
    def n_ubatch(self) -> int:
        return lib.llama_n_ubatch(self.ptr)

    @property
    def n_seq_max(self) -> int:
        return lib.llama_n_seq_max(self.ptr)

    @property
    def n_rs_seq(self) -> int:
        return lib.llama_n_rs_seq(self.ptr)

    def set_threads(self, n_threads: int, n_threads_batch: int | None = None) -> None:
        lib.llama_set_n_threads(self.ptr, n_threads, n_threads_batch or n_threads)

    # --- decode ------------------------------------------------------------------------
    def embd_batch(self, width: int | None = None) -> EmbdBatch:
        """A batch of float rows for this context (default width: the model's n_embd)."""
        return EmbdBatch(self, self.model.n_embd if width is None else width)

    def decode(self, batch: Batch | EmbdBatch) -> None:
        """Run the model on a batch; afterwards ``logits(i)`` reads the rows flagged for output.

        Raises:
            InvalidBatchError: empty or too large a batch, a token id outside the vocabulary,
                a sequence id outside [0, n_seq_max) (checked here, before native code runs).
            KvCacheFullError, DecodeAbortedError, FatalDecodeError: from llama_decode.
        """
        self._check_batch(batch)
        _log.clear()
        if isinstance(batch, Batch):
            rc = lib.llama_decode(self.ptr, batch._native())
        else:
            rc = lib.llama_process(self.ptr, lib.LLAMA_PROCESS_TYPE_DECODE, batch.ptr)
        self._outputs = np.zeros(0, dtype=np.int64)
        if rc != 0:
            raise decode_error(rc, "llama_decode", _log.tail())
        self._outputs = batch.output_indices
        self._n_last = batch.n_tokens

    def _check_batch(self, batch: Batch | EmbdBatch) -> None:
        n, n_batch = batch.n_tokens, self.n_batch
        if n == 0:
            raise InvalidBatchError("empty batch", op="decode")
        if n > n_batch:
            raise InvalidBatchError(f"batch of {n} tokens exceeds n_batch={n_batch}", op="decode")
        if isinstance(batch, Batch):
            tokens, seqs = batch.tokens, batch.seq_ids
            bad = tokens[(tokens < 0) | (tokens >= self._n_vocab)]
            if bad.size:
                raise InvalidBatchError(f"token id {int(bad[0])} out of range [0, {self._n_vocab})", op="decode")
            if seqs.min() < 0 or seqs.max() >= self.n_seq_max:
                raise InvalidBatchError(f"sequence id outside [0, {self.n_seq_max})", op="decode")
            if batch.positions.min() < 0:
                raise InvalidBatchError("negative position", op="decode")

    # --- outputs -----------------------------------------------------------------------
    def logits(self, i: int = -1) -> np.ndarray:
        """Logits [n_vocab] of batch index i of the last decode (negative counts from the end).

        The row must have been flagged for output. The view is valid until the next decode.
        """
        row = self._resolve_output(i)
        ptr = lib.llama_get_logits_ith(self.ptr, int(row))
        if ptr == ffi.NULL:
            raise IndexError(f"no logits for batch index {i}")
        return np.frombuffer(ffi.buffer(ptr, 4 * self._n_vocab), dtype=np.float32)

    def all_logits(self) -> np.ndarray:
        """Logits [n_outputs, n_vocab] of every output row of the last decode, in batch order (a view)."""
        n_out = len(self._outputs)
        if n_out == 0:
            raise IndexError("the last decode produced no logits")
        ptr = lib.llama_get_logits(self.ptr)
        return np.frombuffer(ffi.buffer(ptr, 4 * self._n_vocab * n_out), dtype=np.float32).reshape(n_out, -1)

    @property
    def output_indices(self) -> np.ndarray:
        """Batch indices of the last decode that have logits."""
        return self._outputs

    def _resolve_output(self, i: int) -> int:
        self.ptr
        idx = i + self._n_last if i < 0 else i
        if idx < 0 or idx >= self._n_last or idx not in self._outputs:
            raise IndexError(f"batch index {i} has no logits (outputs of the last decode: {self._outputs.tolist()})")
        return idx

    # --- memory ------------------------------------------------------------------------
    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> None:
        """Remove positions [p0, p1) of a sequence (p0 < 0: from 0; p1 < 0: to the end).

        Raises:
            MemoryOpError: the memory cannot remove that range (e.g. a recurrent model asked to
                drop more trailing tokens than it keeps snapshots for, see ``n_rs_seq``).
        """
        if not -1 <= seq_id < self.n_seq_max:
            raise ValueError(f"sequence id {seq_id} outside [-1, {self.n_seq_max}) (-1 = every sequence)")
        if not lib.llama_memory_seq_rm(self._memory(), seq_id, p0, p1):
            raise MemoryOpError(f"memory cannot remove positions [{p0}, {p1}) of sequence {seq_id}",
                                op="llama_memory_seq_rm", log_tail=_log.tail())

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Copy positions [p0, p1) of sequence src to dst."""
        for s in (src, dst):
            self._check_seq(s)
        lib.llama_memory_seq_cp(self._memory(), src, dst, p0, p1)

    def seq_pos_max(self, seq_id: int = 0) -> int:
        """Largest position held for the sequence, -1 when empty."""
        self._check_seq(seq_id)
        return lib.llama_memory_seq_pos_max(self._memory(), seq_id)

    def seq_pos_min(self, seq_id: int = 0) -> int:
        self._check_seq(seq_id)
        return lib.llama_memory_seq_pos_min(self._memory(), seq_id)

    def clear(self, data: bool = True) -> None:
        """Empty the memory (all sequences)."""
        lib.llama_memory_clear(self._memory(), data)

    def _memory(self):
        self.ptr
        return self._mem

    def _check_seq(self, seq_id: int) -> None:
        if not 0 <= seq_id < self.n_seq_max:
            raise ValueError(f"sequence id {seq_id} outside [0, {self.n_seq_max})")


def _check_sizes(**sizes: int) -> None:
    for name, value in sizes.items():
        if not isinstance(value, (int, np.integer)) or value < (0 if name == "n_ctx" else 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
