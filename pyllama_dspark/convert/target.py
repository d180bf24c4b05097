"""What the converter needs to know about the target model.

A target is given either as its GGUF (``--target-gguf``: sizes, vocabulary and
the shared tensors all come from the file, read with ``gguf.GGUFReader``) or
as its HF folder (``--target-model-dir``: sizes from config.json, shared
tensors from its safetensors; no tokenizer, since reading HF tokenizers needs
transformers). ``check_target`` refuses a drafter whose taps, width or
vocabulary do not fit.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from . import keys
from .config import DraftConfig, find_hparam
from .errors import CheckpointError, TargetMismatchError
from .hf import index_checkpoint, load_config
from .safetensors import TensorRef

__all__ = ["RowSource", "TargetInfo", "target_from_gguf", "target_from_hf", "check_target"]

_EXACT_TYPES = (QT.F32, QT.F16, QT.BF16)
_HF_EMBD_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
                  "language_model.model.embed_tokens.weight", "embed_tokens.weight")
_HF_HEAD_NAMES = ("lm_head.weight", "model.lm_head.weight", "language_model.lm_head.weight")


@dataclass(frozen=True)
class RowSource:
    """A 2-D tensor read in row chunks as float32.

    ``exact`` is False for a quantized tensor, whose values only approximate
    the checkpoint it was made from.
    """

    shape: tuple[int, ...]
    read: Callable[[int, int], np.ndarray]
    exact: bool


@dataclass(frozen=True)
class TargetInfo:
    """Sizes, vocabulary and shared tensors of the target.

    ``n_layer`` counts the decoder layers a tap can address (MTP layers
    excluded). ``output`` is None when the target ties its head to
    ``token_embd``. ``tokenizer_kvs`` is empty for an HF folder.
    """

    description: str
    n_embd: int
    n_layer: int
    n_vocab: int
    uses_mrope: bool
    tokenizer_kvs: tuple[keys.KV, ...]
    token_embd: RowSource | None
    output: RowSource | None


def _gguf_rows(t: Any) -> RowSource:
    data, qtype = t.data, t.tensor_type
    return RowSource(
        shape=tuple(int(n) for n in reversed(t.shape)),
        read=lambda a, b: np.asarray(gguf.quants.dequantize(data[a:b], qtype), dtype=np.float32),
        exact=qtype in _EXACT_TYPES,
    )


def _scalar(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _kv(key: str, field: Any) -> keys.KV:
    """A field as written by GGUFWriter, strings kept as raw bytes (token text need not be UTF-8)."""
    main = VT(field.types[0])
    if main == VT.STRING:
        return key, bytes(field.parts[-1]), main, None
    if main == VT.ARRAY and VT(field.types[-1]) == VT.STRING:
        return key, [bytes(field.parts[i]) for i in field.data], main, VT.STRING
    if main == VT.ARRAY:
        return key, field.contents(), main, VT(field.types[-1])
    return key, field.contents(), main, None


def _gguf_n_vocab(reader: gguf.GGUFReader, arch: str, tensors: dict[str, Any]) -> int:
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens.data)
    size = _scalar(reader, f"{arch}.vocab_size")
    if size is None and "token_embd.weight" in tensors:
        size = int(tensors["token_embd.weight"].shape[-1])
    if size is None:
        raise CheckpointError("target GGUF has neither tokenizer.ggml.tokens, a vocab_size nor token_embd")
    return int(size)


def target_from_gguf(path: str | os.PathLike[str]) -> TargetInfo:
    """Read the target's sizes, vocabulary keys and shared tensors from its GGUF.

    Raises:
        CheckpointError: the file is not a readable GGUF or lacks the size keys.
    """
    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read target GGUF {path}: {exc}") from None
    arch = _scalar(reader, "general.architecture")
    n_embd, n_block = _scalar(reader, f"{arch}.embedding_length"), _scalar(reader, f"{arch}.block_count")
    if n_embd is None or n_block is None:
        raise CheckpointError(f"target GGUF {path} lacks {arch}.embedding_length or {arch}.block_count")
    tensors = {t.name: t for t in reader.tensors}
    return TargetInfo(
        description=f"target GGUF {path}",
        n_embd=int(n_embd),
        n_layer=int(n_block) - int(_scalar(reader, f"{arch}.nextn_predict_layers") or 0),
        n_vocab=_gguf_n_vocab(reader, arch, tensors),
        # M-RoPE targets store sections; upstream then writes degenerate ones for the draft
        uses_mrope=f"{arch}.rope.dimension_sections" in reader.fields,
        tokenizer_kvs=tuple(_kv(k, f) for k, f in reader.fields.items() if k.startswith(keys.TOKENIZER_PREFIX)),
        token_embd=_gguf_rows(tensors["token_embd.weight"]) if "token_embd.weight" in tensors else None,
        output=_gguf_rows(tensors["output.weight"]) if "output.weight" in tensors else None,
    )


def _ref_rows(ref: TensorRef) -> RowSource:
    return RowSource(shape=ref.shape, read=ref.rows, exact=True)


def _hf_shared(folder: Path, tied: bool) -> tuple[RowSource | None, RowSource | None]:
    try:
        refs = index_checkpoint(folder)
    except CheckpointError:
        return None, None  # a config/tokenizer-only folder: nothing to compare with
    embd = next((refs[n] for n in _HF_EMBD_NAMES if n in refs), None)
    head = None if tied else next((refs[n] for n in _HF_HEAD_NAMES if n in refs), None)
    return (_ref_rows(embd) if embd else None), (_ref_rows(head) if head else None)


def target_from_hf(folder: str | os.PathLike[str]) -> TargetInfo:
    """Read the target's sizes from its HF config.json and its shared tensors from its safetensors.

    Raises:
        CheckpointError: no config.json, or it lacks the size fields.
    """
    folder = Path(folder)
    config = load_config(folder)
    config = {**config, **config.get("text_config", {})}
    sizes = [find_hparam(config, names) for names in
             (("hidden_size", "n_embd", "dim"), ("num_hidden_layers", "n_layers", "n_layer"), ("vocab_size",))]
    if any(not isinstance(s, int) for s in sizes):
        raise CheckpointError(f"{folder}/config.json lacks hidden_size, num_hidden_layers or vocab_size")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    tied = bool(config.get("tie_word_embeddings", False))
    embd, head = _hf_shared(folder, tied)
    return TargetInfo(
        description=f"target model folder {folder}", n_embd=sizes[0], n_layer=sizes[1], n_vocab=sizes[2],
        uses_mrope="mrope_section" in rope, tokenizer_kvs=(), token_embd=embd, output=head,
    )


def check_target(cfg: DraftConfig, target: TargetInfo) -> None:
    """Refuse a drafter that does not fit ``target``.

    Raises:
        TargetMismatchError: different hidden width or vocabulary, or a tap
            outside the target's layers or on its last layer.
    """
    if target.n_embd != cfg.n_embd:
        raise TargetMismatchError(
            f"{target.description}: hidden width {target.n_embd}, but the drafter's fc expects "
            f"{cfg.n_taps} taps x hidden_size {cfg.n_embd} (the loader sizes fc as n_taps * n_embd)")
    if target.n_vocab != cfg.n_vocab:
        raise TargetMismatchError(
            f"{target.description}: vocabulary of {target.n_vocab} tokens, drafter vocab_size is {cfg.n_vocab}")
    last = target.n_layer - 1
    for i in cfg.target_layer_ids:
        if i > last:
            raise TargetMismatchError(
                f"target_layer_ids {list(cfg.target_layer_ids)}: layer {i} does not exist, "
                f"the target has {target.n_layer} layers (usable taps 0..{last - 1})")
        if i == last:
            raise TargetMismatchError(
                f"target_layer_ids {list(cfg.target_layer_ids)}: layer {i} is the target's last layer; "
                f"upstream llama.cpp aborts the process when a drafter taps it (its output is not a "
                f"layer input the graph exposes); usable taps are 0..{last - 1}")
