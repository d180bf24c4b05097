"""pyllama-dspark: DSpark speculative decoding on a patched llama.cpp, from Python.

Quick use::

    from pyllama_dspark import Model, Context, generate
    with Model("target.gguf") as model:
        ctx = Context(model, n_ctx=4096)
        print(generate(ctx, "Hello", max_tokens=32).text)
"""

__version__ = "0.1.0"

from ._lib import build_info  # noqa: E402  (loads and checks the native library)
from .batch import Batch, EmbdBatch  # noqa: E402
from .context import Context  # noqa: E402
from .errors import (  # noqa: E402
    CaptureError,
    ClosedHandleError,
    ContextInitError,
    DecodeAbortedError,
    DecodeError,
    FatalDecodeError,
    InvalidBatchError,
    KvCacheFullError,
    LibraryMismatchError,
    LlamaError,
    MemoryOpError,
    ModelLoadError,
)
from .generate import GenerationResult, TokenEvent, generate  # noqa: E402
from .model import Model  # noqa: E402
from .sampling import Sampler, SamplingParams  # noqa: E402

__all__ = [
    "Batch", "EmbdBatch", "Context", "Model", "generate", "GenerationResult", "TokenEvent",
    "Sampler", "SamplingParams", "build_info",
    "LlamaError", "ModelLoadError", "ContextInitError", "DecodeError", "KvCacheFullError",
    "DecodeAbortedError", "InvalidBatchError", "FatalDecodeError", "MemoryOpError", "CaptureError",
    "ClosedHandleError", "LibraryMismatchError",
]
