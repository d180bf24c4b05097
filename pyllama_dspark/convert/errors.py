"""Why a conversion was refused.

Every check runs before the output file is opened, so a ConversionError never
leaves a partial GGUF behind. The classes subclass ValueError: the input, not
the converter, is wrong.
"""

from __future__ import annotations


class ConversionError(ValueError):
    """Base class: the checkpoint (or the target) cannot become a loadable drafter GGUF."""


class UnsupportedModelError(ConversionError):
    """The checkpoint is not a DSpark drafter this converter (and the vendored loader) supports."""


class CheckpointError(ConversionError):
    """A checkpoint file is missing, malformed, or disagrees with its shard index."""


class InvalidConfigError(ConversionError):
    """config.json lacks a required field or holds a value out of range."""


class MissingTensorError(ConversionError):
    """A tensor the loader requires is absent from the checkpoint."""


class UnexpectedTensorError(ConversionError):
    """The checkpoint holds a tensor the loader would not consume (it refuses such files)."""


class TensorShapeError(ConversionError):
    """A tensor's shape differs from the one implied by config.json."""


class TargetMismatchError(ConversionError):
    """The target model's hidden width, vocabulary or layer count does not fit the drafter."""
