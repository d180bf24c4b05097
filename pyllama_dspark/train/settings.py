"""What a training run is made of, and the work directory that remembers it.

A work directory belongs to one target and one set of settings: ``settings.json`` records them on
the first run, and a later run with another target or other settings is refused (a drafter trained
on mixed data, or resumed under another schedule, would be neither run's drafter). Re-running the
same command continues where the last run stopped.

Layout::

    WORK/settings.json          the settings (written once)
    WORK/data/manifest.json     finished shards (each shard-NNNNN.npz is written whole, then listed) and the
                                settings they depend on (``--data-dir`` puts this folder elsewhere, to share it)
    WORK/train/plan.json        the step count (--minutes resolves it once, from timed steps)
    WORK/train/checkpoint.pt    model + optimizer + step (replaced atomically)
    WORK/export/                config.json + model.safetensors (DeepSpec layout), then the GGUF
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..capture import TAPPED_ARCHS


class TrainError(ValueError):
    """Bad input to ``pyllama-dspark train`` (the message names what and where)."""


@dataclass(frozen=True)
class TrainSettings:
    """Everything that decides the drafter a run produces (all but the thread count)."""

    target: str                 # identity of the target GGUF (see target_identity)
    prompts: str                # sha256 of the prompts file
    taps: tuple[int, ...]       # HF layer-output ids the drafter reads (never the last layer)
    n_predict: int              # tokens generated per prompt
    temperature: float          # 0 = greedy continuations
    block_size: int
    n_layer: int                # drafter layers
    markov_rank: int
    mask_token: int
    steps: int                  # optimizer steps; 0 with minutes > 0: resolved when training starts (train/plan.json)
    minutes: float              # training budget in minutes instead of steps (0 = steps decide)
    lr: float
    seed: int
    anchors: int = 16           # anchors drawn per sequence per step
    seqs_per_step: int = 4
    gamma: float = 4.0          # slot weight exp(-k / gamma)
    warmup: float = 0.05        # fraction of steps of linear warm-up
    weight_decay: float = 0.01
    clip: float = 1.0
    shard_size: int = 16        # prompts per data shard
    draft_vocab: int = 0        # reduced draft vocabulary size (0 = the target's whole vocabulary)
    ce_weight: float = 0.1      # loss = ce_weight * CE + tv_weight * TVD + kl_weight * KL(p || q) (+ confidence BCE)
    tv_weight: float = 0.9
    kl_weight: float = 0.0
    noise: float = 0.0          # std of Gaussian noise added to the feature rows in training, relative to their RMS
    init_layer: int = -1        # target layer whose attention/MLP weights initialise the drafter's layers (-1 = random)
    data_limit: int = 0         # train on the first sequences holding this many generated tokens (0 = all)

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["taps"] = list(self.taps)
        return d

    def data_key(self) -> dict[str, Any]:
        """The settings the data shards depend on."""
        d = self.as_dict()
        return {k: d[k] for k in ("target", "prompts", "taps", "n_predict", "temperature", "seed", "shard_size")}


def target_identity(path: Path) -> str:
    """``name:size:sha256`` of a GGUF (the hash covers the first and last 4 MiB: fast on multi-GB files, and a
    different model or quantization changes the header and tensor data there)."""
    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        digest.update(fh.read(4 << 20))
        if size > 8 << 20:
            fh.seek(size - (4 << 20))
            digest.update(fh.read())
    return f"{path.name}:{size}:{digest.hexdigest()[:16]}"


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def auto_taps(n_layer: int) -> tuple[int, ...]:
    """Taps like DeepSpec's (Qwen3-8B, 36 layers: 1, 9, 17, 25, 33): up to five layer outputs evenly spaced
    from layer 1 to layer n_layer - 3, never the last layer; small targets tap what they have."""
    if n_layer < 2:
        raise TrainError(f"a target needs at least 2 layers to be tapped (the last layer cannot be), has {n_layer}")
    if n_layer < 5:
        return tuple(range(0, n_layer - 1))[:5]
    lo, hi = 1, n_layer - 3
    count = min(5, hi - lo + 1)
    if count == 1:
        return (lo,)
    return tuple(sorted({round(lo + i * (hi - lo) / (count - 1)) for i in range(count)}))


def parse_taps(text: str, n_layer: int) -> tuple[int, ...]:
    """``auto`` or comma-separated HF layer-output ids, each in [0, n_layer - 2] (the last layer's output is the
    teacher's input, not a feature)."""
    if text.strip() == "auto":
        return auto_taps(n_layer)
    try:
        taps = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise TrainError(f"--taps must be 'auto' or comma-separated layer ids, got {text!r}") from None
    bad = [t for t in taps if not 0 <= t <= n_layer - 2]
    if bad:
        raise TrainError(f"--taps {bad} outside [0, {n_layer - 2}]: the target has {n_layer} layers and its last "
                         f"layer ({n_layer - 1}) cannot be tapped")
    if len(set(taps)) != len(taps) or not taps:
        raise TrainError(f"--taps must list distinct layer ids, got {text!r}")
    return taps


def check_target_arch(arch: str) -> None:
    if arch not in TAPPED_ARCHS:
        raise TrainError(f"target architecture {arch!r}: train captures the target's last layer on every row, "
                         f"which needs a graph with capture taps (supported: {', '.join(TAPPED_ARCHS)})")


class WorkDir:
    """The work directory of one run (see the module docstring)."""

    def __init__(self, root: Path, data: Path | None = None):
        self.root = Path(root)
        # shared data: several runs (other recipes on the same data) may read one data directory
        self.data = Path(data) if data is not None else self.root / "data"
        self.train = self.root / "train"
        self.export = self.root / "export"

    @property
    def settings_file(self) -> Path:
        return self.root / "settings.json"

    def open(self, settings: TrainSettings) -> None:
        """Create the directory for ``settings``, or check that it was made for exactly them.

        Raises:
            TrainError: the directory belongs to another target or other settings.
        """
        if self.root.exists() and not self.root.is_dir():
            raise TrainError(f"--work-dir {self.root} exists and is not a directory")
        wanted = settings.as_dict()
        if self.settings_file.exists():
            try:
                have = json.loads(self.settings_file.read_text())
            except json.JSONDecodeError:
                raise TrainError(f"{self.settings_file} is not valid JSON; remove the work directory") from None
            diff = sorted(k for k in set(wanted) | set(have) if wanted.get(k) != have.get(k))
            if diff:
                detail = ", ".join(f"{k}: {have.get(k)!r} there, {wanted.get(k)!r} now" for k in diff[:4])
                raise TrainError(f"work directory {self.root} was made for another target or other settings "
                                 f"({detail}); use another --work-dir or the same settings")
            return
        if self.root.exists() and any(self.root.iterdir()):
            raise TrainError(f"--work-dir {self.root} is not empty and holds no settings.json; use an empty or "
                             f"new directory")
        self.root.mkdir(parents=True, exist_ok=True)
        write_json_atomically(self.settings_file, wanted)

def write_json_atomically(path: Path, value: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2, sort_keys=True))
    os.replace(tmp, path)
