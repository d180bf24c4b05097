#!/usr/bin/env python3
"""Populate vendor/llama.cpp/ with the pinned upstream llama.cpp tree.

The tree comes from the llama-cpp-python sdist named in ``llama-cpp-pin.json``
(its ``vendor/llama.cpp/`` folder is upstream at a known commit). The sdist is
downloaded once into a cache (``$PYLLAMA_DSPARK_CACHE`` or
``~/.cache/pyllama-dspark``), checked against the pinned sha256 and extracted,
leaving out bulk we never build (docs, most vocab files, the web UI). Later
builds are offline.

``LLAMA_CPP_SOURCE_DIR=/path/to/llama.cpp`` replaces the sdist with a local
checkout. That checkout is copied, never modified: patches are applied to the
copy.

Usage: vendor_llama_cpp.py [--dest DIR] [--force]
"""

from __future__ import annotations

import argparse
import hashlib
import html.parser
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PIN_FILE = ROOT / "llama-cpp-pin.json"
MARKER = ".pyllama-dspark-source"

# Top-level entries of the upstream tree we never need for building or testing. The sdist
# ships a submodule ``.git`` pointer file that would confuse git apply; it goes too.
SKIP_TOP = {".git", "docs", "media", "benches", "pocs", "app", "tests", ".devops", ".github", "ci", "skills"}
SKIP_PATHS = {"tools/ui", "tools/server/public", "tools/server/webui", "examples/llama.android",
              "examples/llama.swiftui"}
# The vocab-only GGUFs the test kit borrows tokenizers from.
KEEP_MODELS = {"ggml-vocab-llama-spm.gguf", "ggml-vocab-gpt-2.gguf"}


def load_pin() -> dict:
    return json.loads(PIN_FILE.read_text())


def cache_dir() -> Path:
    path = Path(os.environ.get("PYLLAMA_DSPARK_CACHE", Path.home() / ".cache" / "pyllama-dspark"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class _LinkParser(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self.links.extend(v for k, v in attrs if k == "href" and v)


def _index_urls() -> list[str]:
    urls = []
    for var in ("PIP_INDEX_URL", "UV_INDEX_URL"):
        if os.environ.get(var):
            urls.append(os.environ[var])
    urls.append("https://pypi.org/simple")
    return list(dict.fromkeys(u.rstrip("/") for u in urls if u.startswith("http")))


def _download_from_index(pin: dict, dest: Path) -> bool:
    """Fetch the sdist through a PEP 503 simple index (what pip itself reads)."""
    for index in _index_urls():
        page_url = f"{index}/{pin['sdist_project']}/"
        try:
            with urllib.request.urlopen(page_url, timeout=60) as resp:
                parser = _LinkParser()
                parser.feed(resp.read().decode("utf-8", "replace"))
        except OSError as exc:
            print(f"vendor: index {index} unreachable: {exc}", file=sys.stderr)
            continue
        for link in parser.links:
            url = urllib.parse.urljoin(page_url, link)
            if urllib.parse.urlparse(url).path.endswith("/" + pin["sdist_filename"]):
                print(f"vendor: downloading {url.split('#')[0]}", file=sys.stderr)
                tmp = dest.with_suffix(".part")
                with urllib.request.urlopen(url, timeout=600) as resp, open(tmp, "wb") as out:
                    shutil.copyfileobj(resp, out)
                tmp.replace(dest)
                return True
    return False


def _download_with_pip(pin: dict, folder: Path) -> bool:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--no-build-isolation", f"{pin['sdist_project']}=={pin['sdist_version']}", "-d", str(folder)]
    print("vendor: " + " ".join(cmd), file=sys.stderr)
    return subprocess.run(cmd).returncode == 0


def fetch_sdist(pin: dict) -> Path:
    """Return the cached, hash-verified sdist, downloading it if needed."""
    path = cache_dir() / pin["sdist_filename"]
    if path.exists() and sha256_of(path) == pin["sdist_sha256"]:
        return path
    if path.exists():
        path.unlink()
    if not _download_from_index(pin, path):
        _download_with_pip(pin, path.parent)
    if not path.exists():
        sys.exit(f"vendor: could not download {pin['sdist_filename']} "
                 f"(set LLAMA_CPP_SOURCE_DIR to build from a local llama.cpp checkout)")
    got = sha256_of(path)
    if got != pin["sdist_sha256"]:
        path.unlink()
        sys.exit(f"vendor: sha256 mismatch for {pin['sdist_filename']}: "
                 f"expected {pin['sdist_sha256']}, got {got}")
    return path


def _keep(rel: str) -> bool:
    parts = rel.split("/")
    if parts[0] in SKIP_TOP:
        return False
    if parts[0] == "models":
        return len(parts) == 1 or parts[1] in KEEP_MODELS
    return not any(rel == p or rel.startswith(p + "/") for p in SKIP_PATHS)


def extract_sdist(sdist: Path, dest: Path, keep: Callable[[str], bool] = _keep) -> None:
    """The sdist's llama.cpp tree into ``dest``: the files and folders whose path under it ``keep`` accepts (by
    default what the package's build needs)."""
    prefix = sdist.name[: -len(".tar.gz")] + "/vendor/llama.cpp/"
    with tarfile.open(sdist, "r:gz") as tar:
        members = []
        for member in tar.getmembers():
            if not member.name.startswith(prefix):
                continue
            rel = member.name[len(prefix):]
            if rel and keep(rel) and (member.isfile() or member.isdir()):
                member.name = rel
                members.append(member)
        tar.extractall(dest, members=members, filter="data")


def copy_checkout(src: Path, dest: Path) -> None:
    def ignore(folder, names):
        rel = os.path.relpath(folder, src).replace(os.sep, "/")
        rel = "" if rel == "." else rel + "/"
        return [n for n in names if n in (".git", "build") or not _keep(rel + n)]

    shutil.copytree(src, dest, ignore=ignore, symlinks=False)


def source_identity(pin: dict) -> str:
    override = os.environ.get("LLAMA_CPP_SOURCE_DIR")
    if override:
        return f"local:{Path(override).resolve()}"
    return f"sdist:{pin['sdist_filename']}:{pin['sdist_sha256']}"


def ensure_vendor(dest: Path, force: bool = False) -> Path:
    """Make ``dest`` a pristine copy of the pinned (or overriding) llama.cpp tree."""
    pin = load_pin()
    identity = source_identity(pin)
    marker = dest / MARKER
    if not force and marker.exists() and marker.read_text().strip() == identity:
        return dest
    staging = Path(tempfile.mkdtemp(prefix=".llama.cpp-", dir=dest.parent if dest.parent.exists() else None))
    try:
        tree = staging / "tree"
        override = os.environ.get("LLAMA_CPP_SOURCE_DIR")
        if override:
            copy_checkout(Path(override), tree)
        else:
            tree.mkdir()
            extract_sdist(fetch_sdist(pin), tree)
        (tree / MARKER).write_text(identity + "\n")
        if dest.exists():
            shutil.rmtree(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tree.rename(dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"vendor: {dest} populated from {identity}", file=sys.stderr)
    return dest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=ROOT / "vendor" / "llama.cpp")
    parser.add_argument("--force", action="store_true", help="re-extract even if up to date")
    args = parser.parse_args()
    ensure_vendor(args.dest.resolve(), force=args.force)


if __name__ == "__main__":
    main()
