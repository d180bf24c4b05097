"""Context: a model's inference state (KV cache / recurrent state) and decode.

Threads: every native call on a context holds the context's lock, so calls
from several threads never overlap inside llama.cpp (which would corrupt its
buffers or abort the process). A generation (plain or speculative, streaming
included) also *owns* its context from its first decode until it finishes or
its iterator is closed: a second generation started meanwhile raises
ContextBusyError at once. Use one Context per thread; contexts of one Model
can run in parallel.

View lifetime: ``logits()``, ``capture()``, ``capture_row()`` and
``layer_input()`` return numpy views over llama.cpp's output buffer. A view is
valid only until the next ``decode`` on the same context (or its close, or a
change of what is captured); call ``.copy()`` to keep the numbers.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading

import numpy as np

from . import _log, checks, rpc
from ._lib import ffi, lib
from ._owned import Owned
from . import capture as _capture
from .batch import Batch, EmbdBatch
from .cancel import CancelToken
from .errors import (CaptureError, ContextBusyError, ContextInitError, InvalidBatchError, LlamaError, MemoryOpError,
                     RpcError, UnsupportedModeError, decode_error)
from .events import EXACT_UBATCH
from .model import Model


_KV_TYPES = {"f16": lib.GGML_TYPE_F16, "f32": lib.GGML_TYPE_F32, "q8_0": lib.GGML_TYPE_Q8_0}


def _serialised(method):
    """Run a Context method under the context's lock (native calls on one context must not overlap)."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return locked


# Architectures whose graphs expose every layer input (patch 0007; gemma3: patch 0025), as llama_dspark_set_
# embeddings_layer_inp checks natively: the graphs that set capture taps (capture.TAPPED_ARCHS).
_LAYER_INPUT_ARCHS = _capture.TAPPED_ARCHS


_CANCEL_REQUESTED = ffi.addressof(lib, "pyllama_cancel_requested")


def default_threads() -> int:
    return max(1, os.cpu_count() or 1)


class Context(Owned):
    """An inference context on a Model.

    Args:
        model: the loaded model; it must stay open (closing it closes this context first).
        n_ctx: KV cache size in tokens (0 = the model's training context). llama.cpp rounds it up to a
            multiple of 256 (logged at INFO on the ``pyllama_dspark`` logger); ``ctx.n_ctx`` is the size in effect.
        n_batch: most tokens one ``decode`` accepts.
        n_ubatch: most tokens computed in one graph (a batch is split into ubatches). Default: n_batch, and with
            consistent numerics at most 64 (``EXACT_UBATCH``), so a prompt's tokens are computed by the same
            kernels as single tokens too.
        n_seq_max: number of sequences.
        n_threads: CPU threads for single-token decodes (default: all cores).
        n_threads_batch: CPU threads for batches (default: n_threads).
        n_rs_seq: recurrent-state snapshots per sequence, so a hybrid/recurrent model can drop
            up to that many trailing tokens with ``seq_rm`` (0 = no partial removal); at most
            n_ubatch - 2 for such models.
        ctx_other: a context this one reads from (a draft model's target context).
        kv_type: "f16" (llama.cpp's default), "f32" or "q8_0" KV cache; f32 costs twice the memory and makes
            attention match a float reference more closely, q8_0 about half (it needs flash attention, which
            llama.cpp then turns on unless ``flash_attn=False``, which it refuses).
        flash_attn: None lets llama.cpp decide (its default), True/False forces flash attention on/off.
        consistent_numerics: decode small batches (<= 64 tokens) with the same kernels as single tokens, so
            a batched verify reproduces token-by-token greedy decoding bit for bit (CPU: patches 0005, 0012;
            Vulkan: patch 0018, which needs flash attention). On by default. With ubatches of at most 64 tokens (the
            default n_ubatch) a prompt's memory is then bit for bit what decoding it token by token would leave,
            so a kept prefix (``reuse_prefix``, the server's prompt cache) gives the cold output: SmolLM2 Q4_1 on 2
            CPU cores prefilled 700 tokens about 5 % slower than in ubatches of 512, whose batch-width-dependent
            kernels moved the logits by up to 0.48.
        swa_full: a model with sliding-window attention layers (``model.n_swa`` > 0, Gemma 3) keeps every position
            in those layers' cache too (llama.cpp's default), so a rollback (the speculative loop, prefix reuse,
            ``seq_rm``) never needs a cell the cache has given away. False keeps n_swa + n_ubatch cells (rounded up
            to 256) for them instead of n_ctx, and reuses cells that fell out of every window: a ``seq_rm`` after
            which the next position's window is no longer held raises ``MemoryOpError``, and ``reuse_prefix``
            keeps a prefix only when its window is held (else the prompt is decoded whole).

    Raises:
        ValueError: a size is not positive, n_ubatch > n_batch or n_seq_max > n_batch.
        ContextInitError: llama.cpp could not create the context.
        UnsupportedModeError: consistent numerics asked for where it cannot be promised (a model loaded with
            ``use_extra_bufts=True``, a BLAS backend, a GPU backend other than Vulkan, ``flash_attn=False``
            with layers on a GPU, a gated-delta-net model without its fused op).
    """

    def __init__(self, model: Model, *, n_ctx: int = 2048, n_batch: int = 512, n_ubatch: int | None = None,
                 n_seq_max: int = 1, n_threads: int | None = None, n_threads_batch: int | None = None,
                 n_rs_seq: int = 0, ctx_other: "Context | None" = None, kv_type: str = "f16",
                 flash_attn: bool | None = None, consistent_numerics: bool = True, swa_full: bool = True):
        self._lock = threading.RLock()
        self._claim_lock = threading.Lock()
        self._owner: str | None = None  # what owns the context: a running generation, or None
        if n_ubatch is None:
            n_ubatch = min(n_batch, EXACT_UBATCH) if consistent_numerics else n_batch
        _check_sizes(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_seq_max=n_seq_max)
        if n_ubatch > n_batch:
            raise ValueError(f"n_ubatch ({n_ubatch}) must not exceed n_batch ({n_batch})")
        if n_seq_max > n_batch:  # llama.cpp reserves an output row per sequence within n_batch (and asserts on it)
            raise ValueError(f"n_batch ({n_batch}) must be at least n_seq_max ({n_seq_max})")
        if n_rs_seq < 0:
            raise ValueError(f"n_rs_seq must be >= 0, got {n_rs_seq}")
        if n_rs_seq and (model.is_recurrent or model.is_hybrid) and n_rs_seq + 1 >= n_ubatch:
            # llama.cpp keeps the last n_rs_seq + 1 tokens of a sequence in one ubatch (and asserts on it)
            raise ValueError(f"n_rs_seq ({n_rs_seq}) must be at most n_ubatch - 2 ({n_ubatch - 2})")
        if kv_type not in _KV_TYPES:
            raise ValueError(f"kv_type must be one of {sorted(_KV_TYPES)}, got {kv_type!r}")
        if consistent_numerics:
            _check_consistent_model(model)
        self.model = model
        self.swa_full = bool(swa_full)
        self.ctx_other = ctx_other
        self._threadpools: tuple = ()
        self._owns_threadpools = True
        self._threadpool_counts: tuple[int, int] = (0, 0)
        params = lib.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, n_batch, n_ubatch
        params.n_seq_max, params.n_rs_seq = n_seq_max, n_rs_seq
        params.swa_full = bool(swa_full)
        params.n_threads = n_threads or default_threads()
        params.n_threads_batch = n_threads_batch or params.n_threads
        params.ctx_other = ctx_other.ptr if ctx_other is not None else ffi.NULL
        params.type_k = params.type_v = _KV_TYPES[kv_type]
        params.flash_attn_type = {None: lib.LLAMA_FLASH_ATTN_TYPE_AUTO, True: lib.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                                  False: lib.LLAMA_FLASH_ATTN_TYPE_DISABLED}[flash_attn]
        _log.clear()
        ptr = lib.llama_init_from_model(model.ptr, params)
        if ptr == ffi.NULL:
            raise ContextInitError(f"could not create a context for {model.path.name}", op="llama_init_from_model",
                                   log_tail=_log.tail())
        self._set_ptr(ptr)
        model._adopt(self)  # the native context must be freed before its model
        # A threadpool of our own: without one ggml starts and joins fresh threads on every decode. A context
        # that reads another (a drafter's) borrows that one's pools when the thread counts agree: the two decode
        # in turn, never at once, and one set of threads leaves no idle pool polling for cores beside the busy one
        # (measured: SmolLM2 speculative decoding alone on 2 cores, 99 -> 109-117 tok/s).
        counts = (params.n_threads, params.n_threads_batch)
        if ctx_other is not None and ctx_other._threadpool_counts == counts:
            self._threadpools, self._owns_threadpools = ctx_other._threadpools, False
        else:
            self._threadpools, self._owns_threadpools = _threadpools(*counts), True
        self._threadpool_counts = counts
        lib.llama_attach_threadpool(ptr, *self._threadpools)
        try:
            _set_consistent_numerics(ptr, consistent_numerics)
        except UnsupportedModeError:
            self.close()
            raise
        self.consistent_numerics = bool(consistent_numerics)
        if n_ctx and self.n_ctx != n_ctx:
            logging.getLogger("pyllama_dspark").info("n_ctx %d rounded up to %d by llama.cpp", n_ctx, self.n_ctx)
        self._mem = lib.llama_get_memory(ptr)
        self._n_vocab = model.n_vocab
        self._outputs = np.zeros(0, dtype=np.int64)  # batch indices with logits in the last decode
        self._n_last = 0
        self._capture_ids: list[int] = []
        self._capture_masked = False
        self._layer_inputs: set[int] = set()
        self._causal = True
        # Prefix reuse between generations: every memory change bumps the epoch; a generation that ends
        # cleanly records (owner, the tokens its memory holds, the epoch), and the next one may keep the
        # common prefix only if nothing touched the memory since.
        self._memory_epoch = 0
        self._memory_record: tuple[object, np.ndarray, int] | None = None

    def close(self) -> None:
        """Free the context (its children first). Waits for a native call running in another thread."""
        lock = getattr(self, "_lock", None)  # absent when __init__ failed before creating it
        with lock if lock is not None else contextlib.nullcontext():
            super().close()

    def _free(self, ptr) -> None:
        # A model (or a ctx_other) closes its contexts before itself, but a garbage-collection cycle clears the
        # weak references that order relies on: if what this context reads is already freed, freeing the context
        # would read freed memory in its destructor. Leak it instead (this happens only to unreachable cycles).
        if not (self.model.closed or (self.ctx_other is not None and self.ctx_other.closed)):
            lib.llama_free(ptr)
        if self._owns_threadpools:  # borrowed pools belong to the context lent them (closed after this one)
            for pool in dict.fromkeys(self._threadpools):  # the context is gone: its pools can go
                lib.ggml_threadpool_free(pool)

    # --- ownership by a generation ----------------------------------------------------------
    @contextlib.contextmanager
    def generation(self, what: str = "generation"):
        """Own the context for one generation (plain or speculative); released on exit.

        Raises:
            ContextBusyError: another generation owns it (in this or another thread).
            ClosedHandleError: the context is closed.
        """
        self.ptr
        with self._claim_lock:
            if self._owner is not None:
                raise ContextBusyError(
                    f"Context is busy: a {self._owner} is still running on it. Use one Context per thread "
                    f"(contexts of one Model can run in parallel), or finish or close the other generation "
                    f"first.", op=what)
            self._owner = f"{what} (started in thread {threading.current_thread().name!r})"
        try:
            yield self
        finally:
            with self._claim_lock:
                self._owner = None

    @property
    def busy(self) -> bool:
        """True while a generation owns the context."""
        return self._owner is not None

    # --- sizes -------------------------------------------------------------------------
    @property
    def n_ctx(self) -> int:
        """The KV cache size in tokens as llama.cpp made it (``n_ctx`` rounded up; ``n_ctx=0``: the training size)."""
        return lib.llama_n_ctx(self.ptr)

    @property
    def n_ctx_seq(self) -> int:
        """Cells one sequence may use: n_ctx, or with n_seq_max > 1 its share (each sequence has a KV stream of
        its own, so one sequence's cells never sit among another's)."""
        return lib.llama_n_ctx_seq(self.ptr)

    @property
    def n_batch(self) -> int:
        """The most tokens one ``decode`` accepts."""
        return lib.llama_n_batch(self.ptr)

    @property
    def n_ubatch(self) -> int:
        """The most tokens computed in one graph (a batch is split into ubatches of this size)."""
        return lib.llama_n_ubatch(self.ptr)

    @property
    def n_seq_max(self) -> int:
        """The number of sequences (sequence ids 0 .. n_seq_max - 1)."""
        return lib.llama_n_seq_max(self.ptr)

    @property
    def n_rs_seq(self) -> int:
        """Recurrent-state snapshots per sequence: the most trailing tokens a hybrid/recurrent model can drop."""
        return lib.llama_n_rs_seq(self.ptr)

    @_serialised
    def set_threads(self, n_threads: int, n_threads_batch: int | None = None) -> None:
        """Set the CPU threads of the following decodes: single tokens, and batches (default: ``n_threads``)."""
        lib.llama_set_n_threads(self.ptr, n_threads, n_threads_batch or n_threads)

    @_serialised
    def set_consistent_numerics(self, enabled: bool) -> None:
        """Switch the consistent-numerics mode (see the class docstring) for the following decodes.

        Raises:
            UnsupportedModeError: turning it on where it cannot be promised (see the class docstring).
        """
        if enabled:
            _check_consistent_model(self.model)
        _set_consistent_numerics(self.ptr, enabled)
        self.consistent_numerics = bool(enabled)

    @property
    def offloaded(self) -> bool:
        """True when the model's layers may run off this process's CPU: on RPC servers, or offloaded with a GPU
        device present. (llama_supports_gpu_offload() says yes in every RPC build, GPU or not: not used here.)"""
        if self.model.n_gpu_layers == 0:
            return False
        return bool(self.model.rpc_servers) or bool(rpc.local_gpu_devices())

    @contextlib.contextmanager
    def abortable(self, token: CancelToken):
        """While inside, a ``decode`` stops early (``DecodeAbortedError``) once ``token`` is cancelled; the
        ubatches it processed stay in the memory, which the next generation clears or trims."""
        checks.instance("token", token, CancelToken)
        flag = ffi.new("int32_t *")  # kept alive by the listener's closure: a late cancel writes valid memory

        def raise_flag() -> None:
            flag[0] = 1

        forget = token.on_cancel(raise_flag)  # raised at once when the token is already cancelled
        with self._lock:
            lib.llama_set_abort_callback(self.ptr, _CANCEL_REQUESTED, flag)
            self._abort_flag = flag  # the flag's memory must outlive the callback's use of it
        try:
            yield token
        finally:
            forget()
            with self._lock:
                if not self.closed:
                    lib.llama_set_abort_callback(self._ptr, ffi.NULL, ffi.NULL)
                self._abort_flag = None

    # --- decode ------------------------------------------------------------------------
    def embd_batch(self, width: int | None = None) -> EmbdBatch:
        """A batch of float rows for this context (default width: the model's n_embd)."""
        return EmbdBatch(self, self.model.n_embd if width is None else width)

    @_serialised
    def decode(self, batch: Batch | EmbdBatch) -> None:
        """Run the model on a batch; afterwards ``logits(i)`` reads the rows flagged for output.

        Raises:
            InvalidBatchError: empty or too large a batch, a token id outside the vocabulary,
                a sequence id outside [0, n_seq_max) (checked here, before native code runs).
            KvCacheFullError, DecodeAbortedError, FatalDecodeError: from llama_decode.
        """
        self._check_batch(batch)
        _log.clear()
        self._memory_epoch += 1
        if isinstance(batch, Batch):
            rc = lib.llama_decode(self.ptr, batch._native())
        else:
            rc = lib.llama_process(self.ptr, lib.LLAMA_PROCESS_TYPE_DECODE, batch.ptr)
        self._outputs = np.zeros(0, dtype=np.int64)
        self._n_last = 0
        if self.model.rpc_servers and lib.llama_dspark_remote_failed(self.ptr) == 1:
            # the outputs of this decode are not valid (the native side completes lost commands unsent)
            raise RpcError(f"lost the connection to an RPC server of {self.model.path.name} "
                           f"({', '.join(self.model.rpc_servers)}); close the model and load it again once the "
                           "servers run", op="llama_decode", code=rc, log_tail=_log.tail())
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
        if not self._causal and n > self.n_ubatch:  # llama.cpp asserts: a non-causal batch is one ubatch
            raise InvalidBatchError(f"non-causal batch of {n} tokens exceeds n_ubatch={self.n_ubatch}", op="decode")
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
    @_serialised
    def logits(self, i: int = -1) -> np.ndarray:
        """Logits [n_vocab] of batch index i of the last decode.

        i >= 0 is a batch index whose logits flag was set; i < 0 counts output rows from the end
        (-1: the last row with logits), as llama_get_logits_ith does. Valid until the next decode.

        Args:
            i: a batch index with the logits flag, or a negative index counting output rows from the end.

        Returns:
            A float32 [n_vocab] view over llama.cpp's buffer (``.copy()`` it to keep it).

        Raises:
            IndexError: that index has no logits in the last decode.
        """
        row = self._resolve_output(i)
        ptr = lib.llama_get_logits_ith(self.ptr, int(row))
        if ptr == ffi.NULL:
            raise IndexError(f"no logits for batch index {i}")
        return np.frombuffer(ffi.buffer(ptr, 4 * self._n_vocab), dtype=np.float32)

    @_serialised
    def all_logits(self) -> np.ndarray:
        """Logits [n_outputs, n_vocab] of every output row of the last decode, in batch order (a view).

        Returns:
            A float32 [n_outputs, n_vocab] view, row k for ``output_indices[k]``, valid until the next decode.

        Raises:
            IndexError: the last decode produced no logits.
        """
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
        """Batch index of i, resolved like llama_get_logits_ith: i >= 0 is a batch index that must have
        logits; i < 0 counts output rows from the end."""
        self.ptr
        outputs = self._outputs
        if i < 0:
            if -i > len(outputs):
                raise IndexError(f"output index {i} out of range: the last decode has {len(outputs)} outputs")
            return int(outputs[i])
        if i >= self._n_last or i not in outputs:
            raise IndexError(f"batch index {i} has no logits (outputs of the last decode: {outputs.tolist()})")
        return i

    # --- hidden-state capture (see capture.py) ---------------------------------------------
    @_serialised
    def set_capture_layers(self, layer_ids, *, masked: bool = False) -> None:
        """Capture the outputs of these layers (HF ``hidden_states[id + 1]``) on every following decode.

        Args:
            layer_ids: layer ids in row order, each in [0, n_layer); ``[]`` turns capture off.
            masked: rows only for tokens with the logits flag (True) or for every token (False).

        Raises:
            CaptureError: (a ValueError) out-of-range or duplicate ids, too many layers, a graph that marks
                no output of a listed layer, dense capture of a last layer the graph narrows to the output rows
                (architectures outside capture.TAPPED_ARCHS); ``code`` is the native llama_dspark_capture_status.
        """
        if self.model.vocab_only and len(layer_ids):
            raise CaptureError("a vocab-only model's context has no memory: its decode runs encode, which captures "
                               "nothing", op="set_capture_layers", code=_capture.ERR_CONTEXT_TYPE)
        ids = _capture.check_layer_ids(layer_ids, n_layer=self.model.n_layer)
        arr = ffi.new("int32_t[]", ids or [0])
        _log.clear()
        rc = lib.llama_set_capture_layers(self.ptr, arr, len(ids), bool(masked))
        if rc != 0:
            raise _capture.status_error(rc, ids, _log.tail())
        self._capture_ids, self._capture_masked = ids, bool(masked)

    @property
    def capture_layers(self) -> list[int]:
        """The layer ids captured on every decode (``set_capture_layers``); [] when capture is off."""
        return list(self._capture_ids)

    @property
    def capture_width(self) -> int:
        """Width of a captured row: ``len(capture_layers) * model.n_embd`` (0 when capture is off)."""
        return len(self._capture_ids) * self.model.n_embd

    @_serialised
    def capture(self) -> np.ndarray:
        """Captured rows of the last decode, [n_rows, n_capture * n_embd] (a view; see module doc).

        Returns:
            A float32 [n_rows, capture_width] view, valid until the next decode: per row, the captured layers'
                outputs side by side in ``capture_layers`` order; one row per token (dense) or per token with the
                logits flag (masked).

        Raises:
            CaptureError: capture is off, or the last decode produced no rows (it failed, or masked
                capture with no logits flag set).
        """
        n_rows = self._capture_rows()
        ptr = lib.llama_get_embeddings_capture(self.ptr)
        return np.frombuffer(ffi.buffer(ptr, 4 * n_rows * self.capture_width), dtype=np.float32).reshape(n_rows, -1)

    @_serialised
    def capture_row(self, i: int) -> np.ndarray:
        """The captured row of batch index i of the last decode (negative i counts from the end).

        Args:
            i: a batch index (with masked capture, one with the logits flag); negative counts from the end.

        Returns:
            A float32 [capture_width] view, valid until the next decode.

        Raises:
            CaptureError: capture is off, or the last decode captured no rows.
            IndexError: no row for that index (out of range, or masked capture and logits off there).
        """
        n_rows = self._capture_rows()
        if self._capture_masked:
            i = self._resolve_output(i)
        elif not -n_rows <= i < n_rows:
            raise IndexError(f"batch index {i} outside the {n_rows} captured rows")
        ptr = lib.llama_get_embeddings_capture_ith(self.ptr, int(i))
        if ptr == ffi.NULL:
            raise IndexError(f"no captured row for batch index {i}")
        return np.frombuffer(ffi.buffer(ptr, 4 * self.capture_width), dtype=np.float32)

    def _capture_rows(self) -> int:
        if not self._capture_ids:
            raise CaptureError("capture is off: call set_capture_layers first", op="capture")
        n_rows = lib.llama_get_capture_n_rows(self.ptr)
        if n_rows <= 0:
            raise CaptureError("the last decode captured no rows", op="capture")
        return n_rows

    @_serialised
    def set_narrowing(self, enabled: bool) -> None:
        """Run the last layer's tail on output rows only (default). False restores upstream's dense
        qwen35 path; for benchmarks."""
        _check_status(lib.llama_dspark_set_narrowing(self.ptr, bool(enabled)), "llama_dspark_set_narrowing")

    @_serialised
    def set_layer_input(self, layer: int, enabled: bool = True) -> None:
        """Upstream's per-layer extraction of the *input* of layer ``layer`` (0..n_layer), dense."""
        if not 0 <= layer <= self.model.n_layer:
            raise ValueError(f"layer {layer} outside [0, {self.model.n_layer}]")
        if enabled and self.model.arch not in _LAYER_INPUT_ARCHS:
            raise CaptureError(f"architecture {self.model.arch!r} does not expose layer inputs (supported: "
                               f"{', '.join(_LAYER_INPUT_ARCHS)})", op="set_layer_input", code=-2)
        _log.clear()
        rc = lib.llama_dspark_set_embeddings_layer_inp(self.ptr, layer, bool(enabled))
        if rc != 0:
            raise CaptureError(f"llama.cpp refused extraction of layer input {layer}", op="set_layer_input",
                               code=rc, log_tail=_log.tail())
        (self._layer_inputs.add if enabled else self._layer_inputs.discard)(layer)

    @_serialised
    def layer_input(self, layer: int) -> np.ndarray:
        """Rows [n_tokens of the last decode, n_embd] of the input of ``layer`` (a view)."""
        if layer not in self._layer_inputs:
            raise ValueError(f"extraction of layer {layer} is not enabled (set_layer_input)")
        ptr = lib.llama_dspark_get_embeddings_layer_inp(self.ptr, layer)
        if ptr == ffi.NULL or self._n_last == 0:
            raise CaptureError(f"no extracted input for layer {layer}", op="layer_input", log_tail=_log.tail())
        n_embd = self.model.n_embd
        return np.frombuffer(ffi.buffer(ptr, 4 * self._n_last * n_embd), dtype=np.float32).reshape(-1, n_embd)

    # --- draft-model switches ---------------------------------------------------------------
    @_serialised
    def set_causal_attn(self, causal: bool) -> None:
        """Causal (default) or non-causal attention inside a batch (a DFlash/DSpark block is non-causal)."""
        lib.llama_set_causal_attn(self.ptr, bool(causal))
        self._causal = bool(causal)

    @_serialised
    def set_nextn(self, enabled: bool, *, masked: bool = True) -> None:
        """Extraction of the "nextn" rows (a DSpark draft's per-slot confidence)."""
        _check_status(lib.llama_dspark_set_embeddings_nextn(self.ptr, bool(enabled), bool(masked)),
                      "llama_dspark_set_embeddings_nextn")

    @_serialised
    def nextn_row(self, i: int) -> np.ndarray:
        """The nextn row [n_embd] of batch index i of the last decode (a view)."""
        row = self._resolve_output(i)
        ptr = lib.llama_dspark_get_embeddings_nextn_ith(self.ptr, int(row))
        if ptr == ffi.NULL:
            raise IndexError(f"no nextn row for batch index {i} (is extraction on, and does the architecture "
                             f"produce nextn rows?)")
        return np.frombuffer(ffi.buffer(ptr, 4 * self.model.n_embd), dtype=np.float32)

    # --- memory ------------------------------------------------------------------------
    @_serialised
    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> None:
        """Remove positions [p0, p1) of a sequence (p0 < 0: from 0; p1 < 0: to the end).

        Raises:
            MemoryOpError: the memory cannot remove that range (e.g. a recurrent model asked to
                drop more trailing tokens than it keeps snapshots for, see ``n_rs_seq``).
        """
        if not -1 <= seq_id < self.n_seq_max:
            raise ValueError(f"sequence id {seq_id} outside [-1, {self.n_seq_max}) (-1 = every sequence)")
        self._memory_epoch += 1
        if not lib.llama_memory_seq_rm(self._memory(), seq_id, p0, p1):
            raise MemoryOpError(f"memory cannot remove positions [{p0}, {p1}) of sequence {seq_id}",
                                op="llama_memory_seq_rm", log_tail=_log.tail())
        if seq_id >= 0 and p0 > 0 and p1 < 0:
            self._check_tail_removed(seq_id, p0)

    def _check_tail_removed(self, seq_id: int, p0: int) -> None:
        """After dropping a sequence's positions from p0 on: nothing at p0 or later is left, and the cells the next
        position attends to are still held (a window-sized sliding-window cache may have given them to newer
        positions). A memory that says it removed the tail but did not would let positions restart or repeat
        (upstream llama.cpp #29045)."""
        memory = self._memory()
        pos_max = lib.llama_memory_seq_pos_max(memory, seq_id)
        if pos_max >= p0:
            raise MemoryOpError(f"removing positions from {p0} on left position {pos_max} in sequence {seq_id}",
                                op="llama_memory_seq_rm", log_tail=_log.tail())
        n_swa = self.model.n_swa
        if n_swa and not self.swa_full and pos_max >= 0:
            pos_min = lib.llama_memory_seq_pos_min(memory, seq_id)
            needed = max(0, p0 - n_swa + 1)  # position p0 attends to positions p0 - n_swa + 1 .. p0
            if pos_min > needed:
                raise MemoryOpError(
                    f"the sliding-window cache of sequence {seq_id} holds positions from {pos_min} on, but position "
                    f"{p0} attends to {needed}..{p0 - 1}: the cells were given to newer positions; create the "
                    f"Context with swa_full=True (the default) to roll back this far", op="llama_memory_seq_rm")

    @_serialised
    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Copy positions [p0, p1) of sequence src to dst."""
        for s in (src, dst):
            self._check_seq(s)
        self._memory_epoch += 1
        lib.llama_memory_seq_cp(self._memory(), src, dst, p0, p1)

    @_serialised
    def seq_state(self, seq_id: int) -> bytearray:
        """A copy of one sequence's memory (its KV cells and, for a hybrid or recurrent target, its state), for
        ``set_seq_state`` on this context.

        Args:
            seq_id: the sequence, in [0, n_seq_max).

        Returns:
            The sequence's state as llama.cpp serialises it.

        Raises:
            ValueError: ``seq_id`` outside [0, n_seq_max).
            MemoryOpError: llama.cpp could not copy it.
        """
        self._check_seq(seq_id)
        size = lib.llama_state_seq_get_size(self.ptr, seq_id)
        data = bytearray(size)
        if lib.llama_state_seq_get_data(self.ptr, ffi.from_buffer("uint8_t[]", data), size, seq_id) != size:
            raise MemoryOpError(f"could not copy the memory of sequence {seq_id}", op="llama_state_seq_get_data",
                                log_tail=_log.tail())
        return data

    @_serialised
    def set_seq_state(self, seq_id: int, data: bytes | bytearray) -> None:
        """Replace a sequence's memory by what ``seq_state`` copied (of any sequence of this context).

        Raises:
            MemoryOpError: the data does not fit this context (the sequence is left empty).
        """
        self._check_seq(seq_id)
        self._memory_epoch += 1
        if not lib.llama_state_seq_set_data(self.ptr, ffi.from_buffer("uint8_t[]", data), len(data), seq_id):
            raise MemoryOpError(f"could not restore the memory of sequence {seq_id}", op="llama_state_seq_set_data",
                                log_tail=_log.tail())

    @_serialised
    def seq_pos_max(self, seq_id: int = 0) -> int:
        """Largest position held for the sequence, -1 when empty."""
        self._check_seq(seq_id)
        return lib.llama_memory_seq_pos_max(self._memory(), seq_id)

    @_serialised
    def seq_pos_min(self, seq_id: int = 0) -> int:
        """Smallest position held for the sequence, -1 when empty."""
        self._check_seq(seq_id)
        return lib.llama_memory_seq_pos_min(self._memory(), seq_id)

    @_serialised
    def clear(self, data: bool = True) -> None:
        """Empty the memory (all sequences)."""
        self._memory_epoch += 1
        lib.llama_memory_clear(self._memory(), data)

    def _remember(self, owner: object, tokens: np.ndarray) -> None:
        """A generation ended cleanly with ``tokens`` (positions 0..) in sequence 0's memory."""
        self._memory_record = (owner, np.array(tokens, dtype=np.int64), self._memory_epoch)

    def _forget(self) -> None:
        self._memory_record = None

    def _reusable_prefix(self, owner: object, tokens: np.ndarray, *, any_owner: bool = False) -> int:
        """How many leading ``tokens`` the memory already holds from the last generation and may keep:
        0 unless that generation was ``owner``'s (or ``any_owner``) and nothing touched the memory since.
        At least the last token is always decoded again (its logits are needed). A recurrent or hybrid
        memory cannot drop trailing cells beyond its snapshots, so it keeps all of the old tokens or none."""
        record = self._memory_record
        if record is None or record[2] != self._memory_epoch or not (any_owner or record[0] is owner):
            return 0
        held = record[1]
        n = min(len(held), len(tokens) - 1)
        if n <= 0:
            return 0
        differs = np.flatnonzero(held[:n] != np.asarray(tokens[:n]))
        keep = int(differs[0]) if differs.size else n
        if (self.model.is_recurrent or self.model.is_hybrid) and keep != len(held):
            return 0
        n_swa = self.model.n_swa
        if keep and n_swa and not self.swa_full:
            # a window-sized sliding-window cache may no longer hold the window of the first position decoded again
            if lib.llama_memory_seq_pos_min(self._memory(), 0) > max(0, keep - n_swa + 1):
                return 0
        return keep

    def _memory(self):
        self.ptr
        return self._mem

    def _check_seq(self, seq_id: int) -> None:
        if not 0 <= seq_id < self.n_seq_max:
            raise ValueError(f"sequence id {seq_id} outside [0, {self.n_seq_max})")


def _check_consistent_model(model: Model) -> None:
    if model.use_extra_bufts:
        raise UnsupportedModeError(
            f"consistent numerics needs {model.path.name} loaded with use_extra_bufts=False: repacked weights go "
            "through kernels whose results depend on the batch width (or pass consistent_numerics=False)",
            op="llama_dspark_set_consistent_numerics")


def _set_consistent_numerics(ptr, enabled: bool) -> None:
    rc = lib.llama_dspark_set_consistent_numerics(ptr, bool(enabled))
    if rc == -2:
        raise UnsupportedModeError(
            "consistent numerics cannot be promised here: a BLAS backend takes over small batches, a GPU backend "
            "other than Vulkan holds layers, flash attention is off on a GPU backend, an RPC server lacks "
            "pyllama-dspark's patch (run `pyllama-dspark rpc-server`) or serves a device other than its CPU, or "
            "this gated-delta-net model runs without its fused op; pass consistent_numerics=False",
            op="llama_dspark_set_consistent_numerics", code=rc, log_tail=_log.tail())
    _check_status(rc, "llama_dspark_set_consistent_numerics")


def _check_status(rc: int, op: str) -> None:
    """Our C setters return 0, or -1 for bad arguments (which the wrappers never pass)."""
    if rc != 0:
        raise LlamaError(f"{op} returned {rc}", op=op, code=rc, log_tail=_log.tail())


def _threadpools(n_threads: int, n_threads_batch: int) -> tuple:
    """(pool for single tokens, pool for batches); one pool when the thread counts agree."""
    def new(n):
        params = ffi.new("struct ggml_threadpool_params *", lib.ggml_threadpool_params_default(n))
        pool = lib.ggml_threadpool_new(params)
        if pool == ffi.NULL:
            raise ContextInitError(f"could not start a threadpool of {n} threads", op="ggml_threadpool_new")
        return pool
    single = new(n_threads)
    return (single, single if n_threads_batch == n_threads else new(n_threads_batch))


def _check_sizes(**sizes: int) -> None:
    for name, value in sizes.items():
        if not isinstance(value, (int, np.integer)) or value < (0 if name == "n_ctx" else 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
