"""Batch (token ids) and EmbdBatch (rows of floats) for Context.decode.

Batch owns a fixed-capacity ``llama_batch``; its token/pos/logits arrays are
exposed as numpy views so that filling a batch is a few vectorised writes.
EmbdBatch owns a ``llama_batch_ext`` bound to a context and carries embedding
or feature rows of the width that context's graph takes as input.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ._lib import ffi, lib
from ._owned import Owned
from .errors import InvalidBatchError


class Batch(Owned):
    """A batch of token ids at positions, for ``Context.decode``.

    Args:
        capacity: the most tokens it can hold (a decode also needs capacity <= n_batch).
        n_seq_max: sequence ids per token (1 is enough unless tokens are shared across sequences).
    """

    def __init__(self, capacity: int, *, n_seq_max: int = 1):
        if capacity < 1:
            raise ValueError(f"batch capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        raw = lib.llama_batch_init(self.capacity, 0, int(n_seq_max))
        self._set_ptr(ffi.new("struct llama_batch *", raw))
        n = self.capacity
        self._tokens = np.frombuffer(ffi.buffer(raw.token, 4 * n), dtype=np.int32)
        self._pos = np.frombuffer(ffi.buffer(raw.pos, 4 * n), dtype=np.int32)
        self._n_seq_id = np.frombuffer(ffi.buffer(raw.n_seq_id, 4 * n), dtype=np.int32)
        self._logits = np.frombuffer(ffi.buffer(raw.logits, n), dtype=np.int8)
        self._seq = np.zeros(n, dtype=np.int32)  # mirror of seq_id[i][0], written lazily
        self._n_seq_id[:] = 1
        for i in range(n):
            raw.seq_id[i][0] = 0
        self.n_tokens = 0

    def _free(self, ptr) -> None:
        lib.llama_batch_free(ptr[0])

    def clear(self) -> None:
        """Empty the batch for reuse (capacity unchanged); raises ClosedHandleError once closed."""
        self.ptr
        self.n_tokens = 0

    def add(self, token: int, pos: int, *, seq_id: int = 0, logits: bool = False) -> int:
        """Append one token; returns its batch index."""
        return self.add_tokens([token], pos, seq_id=seq_id, logits=[logits])

    def add_tokens(self, tokens: Sequence[int] | np.ndarray, pos0: int, *, seq_id: int = 0,
                   logits: str | Sequence[bool] = "last") -> int:
        """Append tokens at positions pos0, pos0+1, ...; returns the batch index of the first.

        ``logits`` is "last", "all", "none" or one flag per token.
        """
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        n = len(ids)
        start = self.n_tokens
        if start + n > self.capacity:
            raise InvalidBatchError(f"batch capacity {self.capacity} exceeded: {start} + {n} tokens", op="Batch.add")
        if n and (ids.min() < 0 or ids.max() >= 2**31):
            raise InvalidBatchError(f"negative or oversized token id {int(ids.min())}", op="Batch.add")
        self.ptr
        end = start + n
        self._tokens[start:end] = ids
        self._pos[start:end] = np.arange(pos0, pos0 + n, dtype=np.int64)
        self._logits[start:end] = _logit_flags(logits, n)
        if seq_id != 0 or self._seq[start:end].any():
            self._set_seq(start, end, seq_id)
        self.n_tokens = end
        return start

    def _set_seq(self, start: int, end: int, seq_id: int) -> None:
        raw = self.ptr[0]
        for i in range(start, end):
            raw.seq_id[i][0] = seq_id
        self._seq[start:end] = seq_id

    # Read access for Context.decode and tests.
    @property
    def tokens(self) -> np.ndarray:
        return self._tokens[: self.n_tokens]

    @property
    def positions(self) -> np.ndarray:
        return self._pos[: self.n_tokens]

    @property
    def seq_ids(self) -> np.ndarray:
        return self._seq[: self.n_tokens]

    @property
    def output_indices(self) -> np.ndarray:
        """Batch indices whose logits flag is set."""
        return np.flatnonzero(self._logits[: self.n_tokens])

    def _native(self):
        """The llama_batch struct to pass by value, with n_tokens set."""
        raw = self.ptr
        raw.n_tokens = self.n_tokens
        return raw[0]


class EmbdBatch(Owned):
    """Rows of floats (token embeddings, or feature rows for a draft model) for ``Context.decode``.

    Created by ``Context.embd_batch()``; the row width must be one the context's graph takes
    (the model's n_embd, or a draft model's feature width). Rows are copied on ``add_rows``.
    """

    def __init__(self, ctx, width: int):
        self.width = int(width)
        self.capacity = ctx.n_batch
        ptr = lib.llama_batch_ext_init(ctx.ptr)
        if ptr == ffi.NULL:
            raise InvalidBatchError("llama_batch_ext_init failed", op="llama_batch_ext_init")
        self._set_ptr(ptr)
        ctx._adopt(self)
        self.n_tokens = 0
        self._outputs: list[int] = []

    def _free(self, ptr) -> None:
        lib.llama_batch_ext_free(ptr)

    def clear(self) -> None:
        """Empty the batch for reuse; raises ClosedHandleError once closed."""
        lib.llama_batch_ext_clear(self.ptr)
        self.n_tokens = 0
        self._outputs = []

    def add_rows(self, rows: np.ndarray, pos0: int, *, seq_id: int = 0,
                 logits: str | Sequence[bool] = "none") -> int:
        """Append rows[n, width] at positions pos0.. ; returns the batch index of the first."""
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        if rows.ndim != 2 or rows.shape[1] != self.width:
            raise InvalidBatchError(f"rows must have shape [n, {self.width}], got {list(rows.shape)}",
                                    op="EmbdBatch.add_rows")
        n = rows.shape[0]
        if self.n_tokens + n > self.capacity:
            raise InvalidBatchError(f"batch capacity {self.capacity} exceeded: {self.n_tokens} + {n} rows",
                                    op="EmbdBatch.add_rows")
        flags = _logit_flags(logits, n)
        start = self.n_tokens
        pos = ffi.new("llama_pos[4]")
        for k in range(n):
            row = rows[k]
            embd = ffi.new("struct llama_embd *", {"data": ffi.from_buffer("float[]", row),
                                                    "n_rows": 1, "n_embd": self.width})
            idx = lib.llama_batch_ext_add_embd(self.ptr, seq_id, embd[0])
            if idx < 0:
                raise InvalidBatchError(f"llama_batch_ext_add_embd returned {idx}", op="llama_batch_ext_add_embd",
                                        code=idx)
            pos[0] = pos0 + k
            lib.llama_batch_ext_set_pos(self.ptr, idx, pos)
            if flags[k]:
                lib.llama_batch_ext_set_output_logits(self.ptr, idx, True)
                self._outputs.append(idx)
        self.n_tokens = start + n
        return start

    @property
    def output_indices(self) -> np.ndarray:
        return np.asarray(self._outputs, dtype=np.int64)


def _logit_flags(logits: str | Sequence[bool], n: int) -> np.ndarray:
    if isinstance(logits, str):
        flags = np.zeros(n, dtype=np.int8)
        if logits == "all":
            flags[:] = 1
        elif logits == "last":
            if n:
                flags[-1] = 1
        elif logits != "none":
            raise ValueError(f"logits must be 'last', 'all', 'none' or a list of flags, got {logits!r}")
        return flags
    flags = np.asarray(logits, dtype=bool).astype(np.int8)
    if flags.shape != (n,):
        raise ValueError(f"expected {n} logits flags, got shape {flags.shape}")
    return flags
