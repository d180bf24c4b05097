"""Files installed beside the package: upstream tools (bin/) and data (data/).

An ordinary install puts them next to this file. An editable install keeps the
Python sources in the source tree and the built files in site-packages, so
every ``pyllama_dspark`` folder on ``sys.path`` is searched.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def _package_dirs() -> list[Path]:
    dirs = [Path(__file__).resolve().parent]
    for entry in sys.path:
        candidate = Path(entry or ".").resolve() / "pyllama_dspark"
        if candidate.is_dir() and candidate not in dirs:
            dirs.append(candidate)
    return dirs


def find_installed(relative: str) -> Path | None:
    """The first installed file at pyllama_dspark/<relative>, or None."""
    for folder in _package_dirs():
        path = folder / relative
        if path.exists():
            return path
    return None


def tool_path(name: str) -> Path | None:
    """An upstream tool built with -DPYLLAMA_DSPARK_TOOLS=... (or $PYLLAMA_DSPARK_TOOLS_DIR/name)."""
    override = os.environ.get("PYLLAMA_DSPARK_TOOLS_DIR")
    if override and (Path(override) / name).exists():
        return Path(override) / name
    return find_installed(f"bin/{name}")


def data_path(name: str) -> Path | None:
    return find_installed(f"data/{name}")
