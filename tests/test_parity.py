"""Peer: our loop's tokens equal upstream llama-speculative-simple's on the same target + DSpark drafter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pyllama_dspark.resources import tool_path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_parity.py"


@pytest.mark.peer
def test_tokens_equal_llama_speculative_simple(tmp_path):
    if tool_path("llama-speculative-simple") is None:
        pytest.skip("llama-speculative-simple not built (-C cmake.define.PYLLAMA_DSPARK_TOOLS=...)")
    out = tmp_path / "parity.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--n-predict", "48", "--repeats", "1",
                           "--json", str(out)], capture_output=True, text=True, cwd=tmp_path, timeout=900)
    result = json.loads(out.read_text())
    assert proc.returncode == 0 and result["tokens_equal"], proc.stdout + proc.stderr[-2000:]
    assert result["ours_over_cpp"] > 0
