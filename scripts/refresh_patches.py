#!/usr/bin/env python3
"""Inverse of apply_patches.py: regenerate patches/ from a git working branch.

    refresh_patches.py --workdir ../llama-work --init
        makes WORKDIR a git repository holding the pristine pinned base as its
        first commit and each patch of the series as one commit on top.

    refresh_patches.py --workdir ../llama-work
        rewrites patches/*.patch and patches/series from the commits after the
        base (git format-patch --zero-commit --no-signature --no-numbered, so an
        unchanged commit gives a byte-identical file).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import apply_patches  # noqa: E402
import vendor_llama_cpp  # noqa: E402

IDENTITY = ["-c", "user.name=pyllama-dspark", "-c", "user.email=dev@pyllama-dspark.invalid"]


def git(workdir: Path, *args: str) -> str:
    return subprocess.run(["git", *IDENTITY, *args], cwd=workdir, check=True,
                          capture_output=True, text=True).stdout


def init(workdir: Path) -> None:
    if workdir.exists():
        sys.exit(f"refresh_patches: {workdir} exists; remove it first")
    vendor_llama_cpp.ensure_vendor(workdir, force=True)
    (workdir / vendor_llama_cpp.MARKER).unlink()
    git(workdir, "init", "-q")
    git(workdir, "add", "-A")
    commit = vendor_llama_cpp.load_pin()["upstream_commit"]
    git(workdir, "commit", "-qm", f"base: llama.cpp {commit}")
    git(workdir, "tag", "pyllama-dspark-base")
    for patch in apply_patches.series():
        git(workdir, "am", "-q", "--keep-cr", str(patch))
    print(f"refresh_patches: {workdir} ready; base tagged pyllama-dspark-base", file=sys.stderr)


def refresh(workdir: Path) -> None:
    base = "pyllama-dspark-base"
    if not git(workdir, "tag", "-l", base).strip():
        base = git(workdir, "rev-list", "--max-parents=0", "HEAD").split()[0]
    out = apply_patches.PATCH_DIR
    for old in out.glob("*.patch"):
        old.unlink()
    names = git(workdir, "format-patch", "--zero-commit", "--no-signature", "--no-numbered",
                "-o", str(out), f"{base}..HEAD").split()
    series = "# Applied in this order by scripts/apply_patches.py. Regenerate with scripts/refresh_patches.py.\n"
    series += "".join(Path(n).name + "\n" for n in names)
    (out / "series").write_text(series)
    print(f"refresh_patches: wrote {len(names)} patches; series hash {apply_patches.series_hash()}",
          file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--init", action="store_true")
    args = parser.parse_args()
    (init if args.init else refresh)(args.workdir.resolve())


if __name__ == "__main__":
    main()
