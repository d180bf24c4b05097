"""Reading a Hugging Face checkpoint folder: config.json and its safetensors.

A checkpoint is a folder holding ``config.json`` and either one or more
``model*.safetensors`` files, or shards listed by
``model.safetensors.index.json``. A hub repo id (``owner/name``) is fetched
with ``huggingface_hub.snapshot_download``, imported only then, so the
converter itself needs neither the hub client nor the network.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from .errors import CheckpointError
from .safetensors import TensorRef, read_safetensors

__all__ = ["resolve_source", "load_config", "index_checkpoint"]

INDEX_FILE = "model.safetensors.index.json"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HUB_PATTERNS = ["*.json", "*.safetensors"]


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() not in ("", "0", "false", "no", "off")


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise CheckpointError(
            f"{repo_id!r} is not a local folder; fetching it from the hub needs huggingface_hub "
            "(pip install 'pyllama-dspark[hub]')") from None
    offline = _hub_offline()
    try:
        # local_files_only mirrors HF_HUB_OFFLINE explicitly, so an offline run
        # fails fast on a cache miss instead of trying the network
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS, local_files_only=offline))
    except Exception as exc:  # the hub client raises many unrelated types
        where = "the local hub cache (HF_HUB_OFFLINE is set)" if offline else "the hub"
        raise CheckpointError(f"could not fetch {repo_id!r} from {where}: {exc}") from exc


def resolve_source(src: str | os.PathLike[str]) -> Path:
    """The local folder holding checkpoint ``src``: ``src`` itself, or a hub download.

    Raises:
        CheckpointError: ``src`` is neither a folder nor a repo id, or the download failed.
    """
    path = Path(src)
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{path} is a file; expected a checkpoint folder holding config.json")
    if not _REPO_ID.match(str(src)):
        raise CheckpointError(f"{src}: no such folder, and not a hub repo id of the form 'owner/name'")
    return _download(str(src))


def load_config(folder: Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a checkpoint folder.

    Raises:
        CheckpointError: the file is missing or is not a JSON object.
    """
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{folder}: no config.json") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def _weight_map(folder: Path) -> dict[str, str]:
    path = folder / INDEX_FILE
    try:
        weight_map = json.loads(path.read_text(encoding="utf-8")).get("weight_map")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
        raise CheckpointError(f"{path}: not a shard index: {exc}") from None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{path}: no 'weight_map' object")
    return weight_map


def _part_names(folder: Path) -> list[str]:
    # convert_hf_to_gguf reads model*.safetensors; accept any name when none match
    names = sorted(p.name for p in folder.glob("model*.safetensors"))
    names = names or sorted(p.name for p in folder.glob("*.safetensors"))
    if not names:
        raise CheckpointError(f"{folder}: no *.safetensors files (PyTorch .bin checkpoints are not supported)")
    return names


def _read_parts(folder: Path, parts: list[str]) -> dict[str, TensorRef]:
    tensors: dict[str, TensorRef] = {}
    for part in parts:
        if not (folder / part).is_file():
            raise CheckpointError(f"{folder}: shard {part} listed in {INDEX_FILE} is missing")
        for name, ref in read_safetensors(folder / part).items():
            if name in tensors:
                raise CheckpointError(f"tensor {name!r} is in both {tensors[name].path.name} and {part}")
            tensors[name] = ref
    return tensors


def _check_against_index(tensors: dict[str, TensorRef], weight_map: dict[str, str]) -> None:
    missing = sorted(set(weight_map) - set(tensors))
    extra = sorted(set(tensors) - set(weight_map))
    misplaced = sorted(n for n in weight_map if n in tensors and tensors[n].path.name != weight_map[n])
    if missing or extra or misplaced:
        raise CheckpointError(
            f"{INDEX_FILE} disagrees with the shards: missing tensors {missing}, "
            f"unlisted tensors {extra}, tensors in another shard than listed {misplaced}")


def index_checkpoint(folder: Path) -> dict[str, TensorRef]:
    """Every tensor of the checkpoint in ``folder``, by its HF name, read lazily.

    Sharded checkpoints are read through ``model.safetensors.index.json``, and
    the shards must hold exactly the tensors the index lists.

    Raises:
        CheckpointError: no safetensors, a missing shard, a malformed file, or
            shards that disagree with the index.
    """
    if (folder / INDEX_FILE).is_file():
        weight_map = _weight_map(folder)
        tensors = _read_parts(folder, sorted(set(weight_map.values())))
        _check_against_index(tensors, weight_map)
        return tensors
    return _read_parts(folder, _part_names(folder))
