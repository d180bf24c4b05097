"""Convert a Hugging Face DSpark drafter checkpoint to GGUF, with numpy and gguf only.

Quick use::

    from pyllama_dspark.convert import convert
    result = convert("path/to/Qwen3-8B-DSpark", "drafter.gguf", target_gguf="Qwen3-8B-Q4_K_M.gguf")
    print(result.notes)

or ``pyllama-dspark convert SRC --outfile F [--target-gguf T.gguf]``. The file
matches what the vendored ``convert_hf_to_gguf.py`` writes (architecture
``dflash``, DSpark detected by ``markov_w1.weight``), see ``metadata`` and
``tensors`` for the exact keys and tensors and ``shared`` for when the token
embedding and LM head are left out.
"""

from .config import SUPPORTED_ARCHITECTURES, DraftConfig, parse_config
from .converter import ConversionResult, convert
from .errors import (
    CheckpointError,
    ConversionError,
    InvalidConfigError,
    MissingTensorError,
    TargetMismatchError,
    TensorShapeError,
    UnexpectedTensorError,
    UnsupportedModelError,
)
from .layout import OUTTYPES

__all__ = [
    "convert", "ConversionResult", "parse_config", "DraftConfig", "SUPPORTED_ARCHITECTURES", "OUTTYPES",
    "ConversionError", "CheckpointError", "InvalidConfigError", "MissingTensorError", "UnexpectedTensorError",
    "TensorShapeError", "TargetMismatchError", "UnsupportedModelError",
]
