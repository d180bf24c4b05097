"""Every declaration in _cdef/*.h must still match the patched headers (wasmtime-py's check).

cffi's API mode makes the compiler check them at build time; this test also
catches drift without a rebuild (e.g. after refreshing the patch series).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pyllama_dspark._ffi_build import CDEF_DIR, CDEF_FILES

VENDOR = Path(__file__).resolve().parent.parent / "vendor" / "llama.cpp"
HEADERS = ["include/llama.h", "include/llama-dspark.h", "ggml/include/ggml.h", "ggml/include/ggml-cpu.h",
           "ggml/include/ggml-backend.h", "ggml/include/ggml-rpc.h"]


def normalize(text: str) -> str:
    text = re.sub(r"//[^\n]*|/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"\b(LLAMA_API|GGML_API)\b", " ", text)
    text = re.sub(r"\s+", " ", text)
    return re.sub(r"\s*([*(),;{}=\[\]])\s*", r"\1", text).strip()


def declarations(fragment: str) -> list[str]:
    """Statements of a fragment; struct and enum bodies are checked member by member (they may hold `...`);
    an integer constant (``#define NAME ...``) by its name."""
    out = [f"#define {name} " for name in re.findall(r"^#define (\w+) \.\.\.$", fragment, flags=re.M)]
    fragment = re.sub(r"^#define \w+ \.\.\.$", " ", fragment, flags=re.M)
    for stmt in normalize(fragment).split(";"):
        if not stmt or stmt == "...":
            continue
        if stmt.startswith(("struct", "typedef struct", "enum")) and "{" in stmt:
            opener, _, body = stmt.partition("{")
            out.append(opener + "{")
            if opener.startswith("enum"):
                out += [entry + "," for entry in body.rstrip("}").split(",") if entry and entry != "..."]
                continue
            stmt = body
        if stmt:
            out.append(stmt + ";")
    return out


@pytest.fixture(scope="module")
def header_text():
    if not (VENDOR / "include" / "llama-dspark.h").exists():
        pytest.skip("vendor/llama.cpp is not populated and patched (run a build from this checkout)")
    return normalize("\n".join((VENDOR / h).read_text() for h in HEADERS))


@pytest.mark.parametrize("name", CDEF_FILES)
def test_fragment_matches_patched_headers(name, header_text):
    missing = [d for d in declarations((CDEF_DIR / name).read_text()) if d not in header_text]
    assert not missing, f"{name}: declarations not in the patched headers (update the fragment): {missing}"


def test_drift_is_detected(header_text):
    changed = "int32_t llama_decode(struct llama_context * ctx, struct llama_batch * batch);"
    assert any(d not in header_text for d in declarations(changed))
