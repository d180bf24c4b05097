"""No other llama.cpp in the process can stand in for ours (issue 51): decoy libllama.so / libggml*.so, built here,
export every symbol our libraries export and abort when called. Found first through LD_LIBRARY_PATH, or loaded
before us with RTLD_GLOBAL, they must not be called: the generation runs, and its tokens are a clean process's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pyllama_dspark import _lib
from pyllama_dspark.testing import TinySpec

pytestmark = pytest.mark.skipif("libasan" in os.environ.get("LD_PRELOAD", ""),
                                reason="the decoys are plain builds; under AddressSanitizer the import runs without "
                                       "RTLD_DEEPBIND, which the sanitizer's runtime refuses")

# upstream's names, in the order a program that uses llama.cpp loads them (each needs the ones before)
UPSTREAM_NAMES = ["libggml-base.so", "libggml-cpu.so", "libggml.so", "libllama.so"]

GENERATE = """
import json, sys
import pyllama_dspark
with pyllama_dspark.load(sys.argv[1], n_ctx=256) as llm:
    result = llm.generate("Once upon a time", max_tokens=12, stop_at_eog=False)
print(json.dumps({"tokens": result.tokens, "loaded": pyllama_dspark._lib.loaded_native_files()}))
"""

PRELOAD_GLOBAL = """
import ctypes, os, sys
for name in {names!r}:
    ctypes.CDLL(os.path.join(sys.argv[2], name), mode=os.RTLD_NOW | ctypes.RTLD_GLOBAL)
"""


def exported_functions(library: Path) -> list[str]:
    proc = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True, check=True)
    rows = [line.split() for line in proc.stdout.splitlines()]  # address, kind, name
    return sorted({name for _, kind, name in (row for row in rows if len(row) == 3)
                   if kind in "TW" and not name.startswith("_")})


@pytest.fixture(scope="module")
def decoys(tmp_path_factory) -> Path:
    """A folder of upstream-named libraries exporting every function of ours (llama_*, ggml_*, gguf_*, ...), each
    writing "decoy called" and aborting."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None or shutil.which("nm") is None:
        pytest.skip("building the decoys needs a C compiler and nm")
    folder = tmp_path_factory.mktemp("decoys")
    ours = {path.name: path for path in _lib.native_dir().glob(f"{_lib.OWN_PREFIX}*.so")}
    previous: list[Path] = []
    for name in UPSTREAM_NAMES:
        own = ours[name.replace("lib", _lib.OWN_PREFIX, 1)]
        lines = ["#include <stdio.h>", "#include <stdlib.h>",
                 'static void decoy(const char *name) { fprintf(stderr, "decoy called: %s\\n", name); abort(); }']
        lines += [f'void {symbol}(void) {{ decoy("{symbol}"); }}' for symbol in exported_functions(own)]
        source = folder / f"{name}.c"
        source.write_text("\n".join(lines) + "\n")
        target = folder / name
        subprocess.run([compiler, "-shared", "-fPIC", "-o", str(target), str(source),
                        *[str(p) for p in previous], f"-Wl,-rpath,{folder}"], check=True, capture_output=True)
        previous.append(target)
    return folder


@pytest.fixture(scope="module")
def target(make_pair, tmp_path_factory) -> Path:
    return make_pair(TinySpec(arch="llama", n_layer=2, vocab="llama-spm")).target


def run(code: str, target: Path, decoys: Path, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-c", code, str(target), str(decoys)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=decoys)


@pytest.fixture(scope="module")
def clean_tokens(target, decoys) -> list[int]:
    proc = run(GENERATE, target, decoys)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)["tokens"]


def test_the_decoys_abort_when_called(decoys):
    """The decoys are real stand-ins: loaded, their llama_backend_init aborts the process."""
    code = (f"import ctypes, os\nlib = ctypes.CDLL(os.path.join({str(decoys)!r}, 'libllama.so'))\n"
            "lib.llama_backend_init()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "decoy called: llama_backend_init" in proc.stderr


def test_our_libraries_have_names_of_their_own():
    names = {path.name for path in _lib.native_dir().glob("*.so")}
    assert {f"{_lib.OWN_PREFIX}llama.so", f"{_lib.OWN_PREFIX}ggml.so", f"{_lib.OWN_PREFIX}ggml-base.so"} <= names
    assert not names & set(UPSTREAM_NAMES)


def test_decoys_on_ld_library_path_are_not_loaded(target, decoys, clean_tokens):
    proc = run(GENERATE, target, decoys, {"LD_LIBRARY_PATH": str(decoys)})
    assert proc.returncode == 0 and "decoy called" not in proc.stderr, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["tokens"] == clean_tokens
    assert not any(str(decoys) in path for path in out["loaded"])


def test_decoys_loaded_first_with_rtld_global_do_not_bind_our_calls(target, decoys, clean_tokens):
    proc = run(PRELOAD_GLOBAL.format(names=UPSTREAM_NAMES) + GENERATE, target, decoys)
    assert proc.returncode == 0 and "decoy called" not in proc.stderr, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["tokens"] == clean_tokens
    assert sum(str(decoys) in path for path in out["loaded"]) == len(UPSTREAM_NAMES)  # they were there


def test_llama_cpp_python_in_the_same_process_in_both_orders(target, decoys, clean_tokens):
    """Optional: with llama-cpp-python installed, it generates on the same file in the same process before ours,
    then after ours, and ours gives a clean process's tokens both times."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (an optional check)")
    theirs = ("import llama_cpp, sys\n"
              "out = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=256, verbose=False)('Once upon a time', "
              "max_tokens=4, temperature=0)\n"
              "assert out['usage']['completion_tokens'] >= 1, out\n")
    for code in (theirs + GENERATE, GENERATE + theirs):  # llama-cpp-python generates before ours, then after
        proc = run(code, target, decoys)
        assert proc.returncode == 0, proc.stderr[-3000:]
        line = next(line for line in proc.stdout.splitlines() if line.startswith("{"))
        assert json.loads(line)["tokens"] == clean_tokens


def test_a_failed_load_names_what_was_found_not_reinstall(monkeypatch):
    """The message for an extension that does not load says where our libraries are and which environment
    variable may have put another copy first; "reinstall" only when the compiled part is missing."""
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/llama.cpp/build/bin")
    advice = _lib._load_failure_advice()
    assert str(_lib.native_dir()) in advice and "LD_LIBRARY_PATH=/opt/llama.cpp/build/bin" in advice
    assert "Reinstall" not in advice
    monkeypatch.setattr(_lib, "native_dir", lambda: None)
    monkeypatch.setattr(_lib, "_source_tree", lambda: None)
    assert "Reinstall" in _lib._load_failure_advice()


def test_importing_the_source_tree_says_so(tmp_path):
    """From the repository root Python finds the source tree, which has no compiled part: the error says that, not
    "reinstall"."""
    import pyllama_dspark

    root = Path(__file__).resolve().parent.parent
    if not (root / "pyproject.toml").is_file():
        pytest.skip("not run from a source checkout")
    if Path(pyllama_dspark.__file__).resolve().parent == root / "pyllama_dspark":
        pytest.skip("an editable install: its import hook finds the compiled part from the source tree too")
    proc = subprocess.run([sys.executable, "-c", "import pyllama_dspark"], cwd=root, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode != 0 and "LibraryMismatchError" in proc.stderr
    assert "imported the source tree" in proc.stderr and "Reinstall" not in proc.stderr
