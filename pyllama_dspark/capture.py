"""Multi-layer hidden-state capture: which layers, and the checks made before native code.

A captured row is the concatenation, in the order given, of the *output* of
each listed decoder layer (post-residual, before the final norm; HF
``hidden_states[id + 1]``), width ``len(layer_ids) * n_embd``.

- ``masked=True``: rows only for batch tokens whose logits flag is set, in the
  same order as the logits (``capture_row(i)`` takes the batch index).
- ``masked=False`` (dense): one row for every batch token, whatever its logits
  flag: a prefill can keep logits off on context rows and still get every row.

View lifetime: ``Context.capture()`` and ``Context.capture_row(i)`` return
numpy views over llama.cpp's output buffer, valid until the next ``decode``
(or ``set_capture_layers``) on that context; ``.copy()`` what you keep.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .errors import CaptureError

# Architectures whose graphs set every layer output as a tap and keep their last layer dense when a dense
# capture asks for it (patches 0002 and, for gemma3, 0025): capture in any form, and `train`, which captures
# its taps and the last layer densely. Any other graph is probed by llama_set_capture_layers (patch 0027): a
# layer output named "l_out" (upstream's convention, most architectures) is captured, except the last layer
# densely where the graph runs it on the output rows only (ERR_DENSE_LAST). Tested beyond these: qwen2.
TAPPED_ARCHS = ("llama", "qwen3", "qwen35", "gemma3")
MAX_CAPTURE_LAYERS = 64

# llama_dspark_capture_status (include/llama-dspark.h)
ERR_LAYER_RANGE, ERR_DUPLICATE, ERR_TOO_MANY, ERR_ARCH, ERR_NULL, ERR_CONTEXT_TYPE = -1, -2, -3, -4, -5, -6
ERR_DENSE_LAST = -7
_MEANINGS = {
    ERR_LAYER_RANGE: "layer id out of range",
    ERR_DUPLICATE: "duplicate layer id",
    ERR_TOO_MANY: "too many layers",
    ERR_ARCH: "the model's graph marks no output of a listed layer (no capture tap, no \"l_out\" name)",
    ERR_NULL: "no layer ids",
    ERR_CONTEXT_TYPE: "not a decoder context",
    ERR_DENSE_LAST: "dense capture of the last layer, which this architecture's graph runs on the output rows "
                    "only (capture it with masked=True, or capture an earlier layer)",
}


def check_layer_ids(layer_ids: Sequence[int], *, n_layer: int) -> list[int]:
    """Validate capture layer ids (HF output convention: 0 .. n_layer-1); raise CaptureError with the code
    the native call would return. Whether the graph has the taps is the native call's probe."""
    if any(isinstance(i, bool) or not isinstance(i, (int, np.integer)) for i in layer_ids):
        raise CaptureError(f"layer ids must be integers, got {list(layer_ids)!r}", op="set_capture_layers",
                           code=ERR_LAYER_RANGE)
    ids = [int(i) for i in layer_ids]
    if len(ids) > min(n_layer, MAX_CAPTURE_LAYERS):
        raise CaptureError(f"cannot capture {len(ids)} layers: the model has {n_layer} (at most "
                           f"{MAX_CAPTURE_LAYERS})", op="set_capture_layers", code=ERR_TOO_MANY)
    for pos, layer in enumerate(ids):
        if not 0 <= layer < n_layer:
            raise CaptureError(f"layer id {layer} outside [0, {n_layer}) (ids are layer outputs, HF "
                               "hidden_states[id + 1])", op="set_capture_layers", code=ERR_LAYER_RANGE)
        if layer in ids[:pos]:
            raise CaptureError(f"layer id {layer} listed twice", op="set_capture_layers", code=ERR_DUPLICATE)
    return ids


def status_error(code: int, layer_ids: Sequence[int], log_tail: Sequence[str]) -> CaptureError:
    meaning = _MEANINGS.get(code, "unknown status")
    return CaptureError(f"llama_set_capture_layers({list(layer_ids)}) returned {code}: {meaning}",
                        op="llama_set_capture_layers", code=code, log_tail=log_tail)
