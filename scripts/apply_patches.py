#!/usr/bin/env python3
"""Apply the patches/ series to vendor/llama.cpp, idempotently.

A stamp file in the vendored tree records the hash of (base commit, series,
patch bytes) and the source. When it matches, nothing happens. Otherwise the
pristine base is extracted into a staging folder, every patch is checked with
``git apply --check`` and applied there, and only files whose bytes differ are
copied into vendor/llama.cpp, so an incremental build recompiles only what the
series changed. A patch that no longer applies leaves vendor/ untouched and
names itself.

Works outside a git checkout (sdists have none): ``git apply`` is run with
discovery of an enclosing repository disabled.

Usage: apply_patches.py [--vendor DIR] [--print-hash]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
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
    """Make ``vendor`` the pinned base with the series applied; returns the series hash.

    The patched tree is built in a staging folder and only files whose bytes differ are written
    into ``vendor``, so a changed series rebuilds only what it touches.
    """
    wanted = series_hash()
    stamp = vendor / STAMP
    identity = vendor_llama_cpp.source_identity(vendor_llama_cpp.load_pin())
    if stamp.exists() and stamp.read_text().split() == [wanted, identity]:
        return wanted
    vendor.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".llama.cpp-patching-", dir=vendor.parent))
    try:
        tree = vendor_llama_cpp.ensure_vendor(staging / "tree", force=True)
        for patch in series():
            check = _git_apply(tree, patch, "--check")
            if check.returncode != 0:
                sys.exit(_recovery_text(patch, check.stderr + check.stdout))
            result = _git_apply(tree, patch)
            if result.returncode != 0:
                sys.exit(_recovery_text(patch, result.stderr + result.stdout))
        n_changed = _sync(tree, vendor)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    stamp.write_text(f"{wanted}\n{identity}\n")
    print(f"apply_patches: series {wanted} applied ({len(series())} patches, {n_changed} files written)",
          file=sys.stderr)
    return wanted


def _sync(src: Path, dst: Path) -> int:
    """Mirror src into dst, writing only files whose content differs (their mtimes drive rebuilds)."""
    changed = 0
    wanted = set()
    for path in src.rglob("*"):
        rel = path.relative_to(src)
        wanted.add(rel)
        target = dst / rel
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif not target.is_file() or target.read_bytes() != path.read_bytes():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
            changed += 1
    for path in sorted(dst.rglob("*"), reverse=True):  # children before their folders
        rel = path.relative_to(dst)
        if rel not in wanted and rel.name != STAMP:
            path.unlink() if path.is_file() or path.is_symlink() else shutil.rmtree(path, ignore_errors=True)
    return changed


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
