#!/usr/bin/env python3
"""Apply the patches/ series to vendor/llama.cpp, idempotently.

A stamp file in the vendored tree records the hash of (base commit, series,
patch bytes). When it matches, nothing happens. When the tree carries another
stamp (an older series), it is re-extracted pristine first. Each patch is
checked with ``git apply --check`` before anything is written, so a patch that
no longer applies leaves the tree untouched and names itself.

Works outside a git checkout (sdists have none): ``git apply`` is run with
discovery of an enclosing repository disabled.

Usage: apply_patches.py [--vendor DIR] [--print-hash]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATCH_DIR = ROOT / "patches"
STAMP = ".pyllama-dspark-patched"

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vendor_llama_cpp  # noqa: E402


def series() -> list[Path]:
    names = []
    for line in (PATCH_DIR / "series").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(PATCH_DIR / line)
    missing = [p.name for p in names if not p.exists()]
    if missing:
        sys.exit(f"apply_patches: patches/series names missing files: {', '.join(missing)}")
    return names


def series_hash() -> str:
    """Short hash over the base commit, the series order and every patch's bytes."""
    digest = hashlib.sha256()
    digest.update(json.loads(vendor_llama_cpp.PIN_FILE.read_text())["upstream_commit"].encode())
    for patch in series():
        digest.update(patch.name.encode() + b"\0" + patch.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _git_apply(vendor: Path, patch: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(vendor.parent), GIT_DIR=os.devnull)
    env.pop("GIT_WORK_TREE", None)
    return subprocess.run(["git", "apply", "--whitespace=nowarn", *extra, str(patch)],
                          cwd=vendor, env=env, capture_output=True, text=True)


def _recovery_text(patch: Path, output: str) -> str:
    return f"""apply_patches: {patch.name} no longer applies to vendor/llama.cpp.
{output.strip()}

To refresh the series against the pinned base:
  1. python scripts/refresh_patches.py --workdir ../llama-work --init   (pristine base + series as commits)
  2. cd ../llama-work && fix the commit for {patch.name} (git rebase -i), rebuild, run the tests
  3. python scripts/refresh_patches.py --workdir ../llama-work          (rewrites patches/ from the commits)"""


def apply_series(vendor: Path) -> str:
    wanted = series_hash()
    stamp = vendor / STAMP
    if stamp.exists():
        if stamp.read_text().strip() == wanted:
            return wanted
        vendor_llama_cpp.ensure_vendor(vendor, force=True)
    vendor_llama_cpp.ensure_vendor(vendor)
    # Check every patch on top of its predecessors before touching the tree: apply as we go,
    # and undo what we applied if a later one fails.
    applied: list[Path] = []
    for patch in series():
        check = _git_apply(vendor, patch, "--check")
        if check.returncode != 0:
            for done in reversed(applied):
                _git_apply(vendor, done, "-R")
            sys.exit(_recovery_text(patch, check.stderr + check.stdout))
        result = _git_apply(vendor, patch)
        if result.returncode != 0:
            sys.exit(_recovery_text(patch, result.stderr + result.stdout))
        applied.append(patch)
    stamp.write_text(wanted + "\n")
    print(f"apply_patches: applied {len(applied)} patches (series {wanted})", file=sys.stderr)
    return wanted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vendor", type=Path, default=ROOT / "vendor" / "llama.cpp")
    parser.add_argument("--print-hash", action="store_true", help="print the series hash and exit")
    args = parser.parse_args()
    if args.print_hash:
        print(series_hash())
        return
    print(apply_series(args.vendor.resolve()))


if __name__ == "__main__":
    main()
