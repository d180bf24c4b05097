"""The exception tree, and the one place native return codes become exceptions.

llama.cpp reports *why* something failed through its log, not its return
value, so every native failure carries ``log_tail``: the last native log lines
seen before the failing call (see ``_log``).

    LlamaError(RuntimeError)             op, code, log_tail
      ModelLoadError                     llama_model_load_from_file returned NULL
      ContextInitError                   llama_init_from_model returned NULL
      DecodeError                        llama_decode returned non-zero
        KvCacheFullError                 rc 1: no KV slot (shrink the batch or grow n_ctx)
        DecodeAbortedError               rc 2: aborted by the abort callback
        InvalidBatchError(ValueError)    rc -1, or rejected in Python before the call
        FatalDecodeError                 rc < -1
      MemoryOpError                      a memory operation the cache cannot honour (seq_rm)
      CaptureError(ValueError)           hidden-state capture misuse (code: llama_dspark_capture_status)
      ContextBusyError                   a generation started on a Context another generation is using
      RpcError                           an RPC server unreachable, of another protocol, or lost mid-run
    ClosedHandleError(ValueError)        use of a closed Model / Context / Batch
    GrammarError(ValueError)             a grammar / JSON schema / regex that cannot be compiled
    LibraryMismatchError(ImportError)    the loaded libllama is not the one this package was built with
"""

from __future__ import annotations

from typing import Sequence


class LlamaError(RuntimeError):
    """A native llama.cpp operation failed.

    Attributes:
        op: the operation, e.g. ``"llama_decode"``.
        code: the native return code, or None where the call returns a pointer.
        log_tail: recent native log lines (WARN/ERROR and INFO), oldest first.
    """

    def __init__(self, message: str, *, op: str, code: int | None = None, log_tail: Sequence[str] = ()):
        self.op = op
        self.code = code
        self.log_tail = list(log_tail)
        detail = "\n".join(f"  | {line}" for line in self.log_tail[-8:])
        super().__init__(f"{message}\n  native log:\n{detail}" if detail else message)


class ModelLoadError(LlamaError):
    """The model file could not be loaded (missing, truncated, corrupt or unsupported)."""


class ContextInitError(LlamaError):
    """A context could not be created for the model."""


class UnsupportedModeError(LlamaError, ValueError):
    """A mode the caller asked for (consistent numerics) cannot be promised by this build, model or backend."""


# what the CLI and the server say, in one line, when they run without the mode because the backend has none
INEXACT_BACKEND = ("this backend has no consistent-numerics mode, so speculative output may differ from plain "
                   "decoding in the last bits (running without it; --no-consistent-numerics says so up front)")


class DecodeError(LlamaError):
    """llama_decode failed."""


class KvCacheFullError(DecodeError):
    """No room in the KV cache for the batch (rc 1): reduce the batch or increase n_ctx."""


class DecodeAbortedError(DecodeError):
    """The decode was aborted (rc 2); processed ubatches remain in the memory."""


class InvalidBatchError(DecodeError, ValueError):
    """The batch is invalid (rc -1, or rejected in Python before reaching native code)."""


class FatalDecodeError(DecodeError):
    """A fatal decode error (rc < -1); processed ubatches remain in the memory."""


class MemoryOpError(LlamaError):
    """The context memory cannot perform the requested operation (e.g. a partial seq_rm
    on a recurrent model without rollback snapshots)."""


class CaptureError(LlamaError, ValueError):
    """Hidden-state capture was misconfigured (``code`` is the llama_dspark_capture_status) or read
    without data."""


class ContextBusyError(LlamaError):
    """A generation (plain or speculative) was started on a Context that another generation still owns.

    A generation owns its context from its first decode until it finishes or its iterator is closed. Use one
    Context per thread (contexts of one Model may run in parallel), or finish the other generation first.
    """


class RpcError(LlamaError):
    """An RPC server (``rpc_servers=``) cannot be used: unreachable, not answering, of another protocol version,
    not in this build, or its connection was lost mid-run (the context's decodes then no longer compute)."""


class ClosedHandleError(ValueError):
    """A native handle was used after close()."""


class GrammarError(ValueError):
    """A structured-output grammar (JSON schema, regex, Lark/GBNF) that cannot be compiled, or a token it refuses;
    the message names the problem."""


class LibraryMismatchError(ImportError):
    """The native library does not match this Python package."""


# From the comment above llama_decode in llama.h.
_DECODE_CODES: dict[int, tuple[type[DecodeError], str]] = {
    1: (KvCacheFullError, "could not find a KV slot for the batch (reduce the batch or increase n_ctx)"),
    2: (DecodeAbortedError, "aborted (processed ubatches remain in the memory)"),
    -1: (InvalidBatchError, "invalid input batch"),
}


def decode_error(code: int, op: str, log_tail: Sequence[str] = ()) -> DecodeError:
    """The exception for a non-zero llama_decode return code."""
    cls, meaning = _DECODE_CODES.get(code, (FatalDecodeError, "fatal error (processed ubatches remain in the memory)"))
    return cls(f"{op} returned {code}: {meaning}", op=op, code=code, log_tail=log_tail)
