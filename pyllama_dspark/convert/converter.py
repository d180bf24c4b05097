"""HF DSpark checkpoint -> drafter GGUF, checks first and the file last.

Order of work: read config.json and index the tensors (lazily), check them,
read and check the target, decide which shared tensors to leave out, build
the metadata, and only then open the output. Any refusal therefore happens
before a byte is written.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from . import keys
from .config import parse_config
from .errors import ConversionError
from .hf import index_checkpoint, load_config, resolve_source
from .layout import OUTTYPES, output_tensors, resolve_outtype
from .metadata import build_metadata
from .shared import decide_shared
from .target import TargetInfo, check_target, target_from_gguf, target_from_hf
from .tensors import plan_tensors
from .writer import write_gguf

__all__ = ["ConversionResult", "convert"]

logger = logging.getLogger("pyllama_dspark.convert")


@dataclass(frozen=True)
class ConversionResult:
    """What ``convert`` wrote.

    ``tensors`` lists ``(gguf name, numpy shape, ggml type name)`` in file
    order; ``omitted`` the shared tensors left out; ``notes`` one line per
    decision the user should know about (also logged at INFO).
    """

    path: Path
    tensors: tuple[tuple[str, tuple[int, ...], str], ...]
    omitted: frozenset[str]
    notes: tuple[str, ...]


def _check_outfile(outfile: Path) -> None:
    if outfile.is_dir():
        raise ConversionError(f"output {outfile} is a folder; give a file name")
    if not outfile.parent.is_dir():
        raise ConversionError(f"output folder {outfile.parent} does not exist")


def _load_target(target_gguf: str | os.PathLike[str] | None,
                 target_model_dir: str | os.PathLike[str] | None) -> TargetInfo | None:
    if target_gguf is not None and target_model_dir is not None:
        raise ConversionError("give the target either as a GGUF or as a model folder, not both")
    if target_gguf is not None:
        return target_from_gguf(target_gguf)
    return target_from_hf(target_model_dir) if target_model_dir is not None else None


def _vocab_note(target: TargetInfo | None) -> tuple[str, ...]:
    if target is not None and target.tokenizer_kvs:
        return ()
    return ("no target GGUF given: wrote a 'no_vocab' tokenizer with dflash.vocab_size; pass --target-gguf "
            "to copy the target's vocabulary (tokenizer.* keys)",)


def convert(src: str | os.PathLike[str], outfile: str | os.PathLike[str], *, outtype: str = "auto",
            target_gguf: str | os.PathLike[str] | None = None,
            target_model_dir: str | os.PathLike[str] | None = None,
            keep_shared_tensors: bool = False) -> ConversionResult:
    """Convert a Hugging Face DSpark drafter checkpoint to a GGUF the vendored llama.cpp loads.

    Args:
        src: checkpoint folder (config.json + safetensors, single or sharded),
            or a hub repo id ``owner/name`` (needs huggingface_hub; honours
            HF_HUB_OFFLINE).
        outfile: the GGUF to write; written to a temporary file in the same
            folder and renamed at the end, removed on any error.
        outtype: ``auto`` (default: bf16 for a bf16 checkpoint, else f16),
            ``f32``, ``f16``, ``bf16`` or ``q8_0`` for the weight matrices;
            norms and biases are always f32.
        target_gguf: the target's GGUF: checks the taps, width and vocabulary,
            copies its ``tokenizer.*`` keys, and lets shared tensors equal to
            its own be left out.
        target_model_dir: the target's HF folder instead (sizes and shared
            tensors, no tokenizer).
        keep_shared_tensors: keep ``token_embd``/``output`` even when they
            equal the target's.

    Returns:
        A ConversionResult.

    Raises:
        ConversionError: (a subclass naming what was expected and what was
            found) for any input the loader would refuse; nothing is written then.
    """
    if outtype not in OUTTYPES:
        raise ConversionError(f"outtype must be one of {', '.join(OUTTYPES)}, got {outtype!r}")
    outfile = Path(outfile)
    _check_outfile(outfile)
    folder = resolve_source(src)
    cfg = parse_config(load_config(folder))
    refs = index_checkpoint(folder)
    plan = plan_tensors(cfg, refs)
    target = _load_target(target_gguf, target_model_dir)
    if target is not None:
        check_target(cfg, target)
    shared = decide_shared(plan, target, keep=keep_shared_tensors)
    resolved = resolve_outtype(outtype, refs.values())
    tensors = output_tensors(cfg, plan, shared.omitted, resolved)
    name = str(src) if not Path(src).is_dir() else folder.resolve().name
    kvs = build_metadata(cfg, plan, target, file_type=keys.FILE_TYPES[resolved], name=name)
    notes = shared.notes + _vocab_note(target)
    for note in notes:
        logger.info(note)
    write_gguf(outfile, kvs, tensors)
    return ConversionResult(
        path=outfile, tensors=tuple((t.name, t.shape, t.qtype.name) for t in tensors),
        omitted=shared.omitted, notes=notes,
    )
