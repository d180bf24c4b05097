"""The installed package: imports outside the source tree, names its base and series."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import pyllama_dspark
from pyllama_dspark import LibraryMismatchError, build_info
from pyllama_dspark._lib import expected_build_info, verify_build

ROOT = Path(__file__).resolve().parent.parent


def test_import_outside_source_tree(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = "import pyllama_dspark, sys; print(pyllama_dspark.build_info()); print(pyllama_dspark.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out[0] == build_info()


def test_build_info_names_base_commit_and_series_hash():
    info = build_info()
    assert f"pyllama-dspark {pyllama_dspark.__version__} " in info
    assert "llama.cpp 0c1e57098" in info
    series = subprocess.run([sys.executable, str(ROOT / "scripts" / "apply_patches.py"), "--print-hash"],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert info.endswith(f"series {series}"), "library built from another patch series: rebuild"
    assert info == expected_build_info()


def test_mismatched_library_raises_import_error():
    good = build_info()
    with pytest.raises(LibraryMismatchError, match="does not match"):
        verify_build(good.replace("series ", "series 0"), good, pyllama_dspark.__version__)
    with pytest.raises(ImportError):
        verify_build(good, good, "9.9.9")


def test_native_log_reaches_python_logging(make_model, caplog):
    with caplog.at_level("DEBUG", logger="pyllama_dspark.native"):
        pyllama_dspark.Model(make_model(arch="llama", n_layer=1)).close()
    assert any(r.name == "pyllama_dspark.native" and "llama_model_loader" in r.getMessage() for r in caplog.records)
