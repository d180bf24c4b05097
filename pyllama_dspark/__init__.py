"""pyllama-dspark: DSpark speculative decoding on a patched llama.cpp, from Python.

Quick use::

    import pyllama_dspark
    with pyllama_dspark.load("target.gguf", drafter="drafter.gguf") as llm:
        print(llm.generate("Hello", max_tokens=32).text)

Finer control: Model, Context, DSparkDrafter, HybridDrafter and Speculator (``load`` builds them).
"""

__version__ = "0.1.0"

from ._lib import build_info  # noqa: E402  (loads and checks the native library)
from .api import LLM, load  # noqa: E402
from .batch import Batch, EmbdBatch  # noqa: E402
from .context import CancelToken, Context  # noqa: E402
from .errors import (  # noqa: E402
    CaptureError,
    ClosedHandleError,
    ContextBusyError,
    ContextInitError,
    DecodeAbortedError,
    DecodeError,
    FatalDecodeError,
    GrammarError,
    InvalidBatchError,
    KvCacheFullError,
    LibraryMismatchError,
    LlamaError,
    MemoryOpError,
    ModelLoadError,
    RpcError,
    UnsupportedModeError,
)
from .draft_length import DraftLengthChooser  # noqa: E402
from .drafter import Draft, Drafter, DrafterError, DSparkDrafter, PromptLookupDrafter  # noqa: E402
from .generate import GenerationResult, TokenEvent, generate  # noqa: E402
from .hybrid import HybridDrafter  # noqa: E402
from .logprobs import TokenLogprob  # noqa: E402
from .model import Model, quantize  # noqa: E402
from .sampling import Sampler, SamplingParams  # noqa: E402
from .speculative import SpecResult, Speculator, Step  # noqa: E402
from .stats import SpecStats  # noqa: E402
from .structured import Grammar  # noqa: E402
from .tools import ToolError  # noqa: E402

__all__ = [
    "load", "LLM",
    "Batch", "EmbdBatch", "Context", "CancelToken", "Model", "quantize", "generate", "GenerationResult", "TokenEvent",
    "Speculator", "Step", "SpecResult", "SpecStats", "DraftLengthChooser",
    "DSparkDrafter", "PromptLookupDrafter", "HybridDrafter", "Drafter", "Draft", "DrafterError",
    "Sampler", "SamplingParams", "build_info", "Grammar", "TokenLogprob",
    "LlamaError", "ModelLoadError", "ContextInitError", "DecodeError", "KvCacheFullError",
    "DecodeAbortedError", "InvalidBatchError", "FatalDecodeError", "MemoryOpError", "CaptureError",
    "ContextBusyError", "ClosedHandleError", "LibraryMismatchError", "UnsupportedModeError", "RpcError",
    "GrammarError", "ToolError",
]
