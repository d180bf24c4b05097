"""Peer: our loop's tokens equal upstream llama-speculative-simple's on the same target + DSpark drafter."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pyllama_dspark.resources import tool_path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_parity.py"


@pytest.mark.peer
@pytest.mark.parametrize("draft_vocab", [None, 20000], ids=["full-vocabulary", "reduced-vocabulary"])
def test_tokens_equal_llama_speculative_simple(tmp_path, draft_vocab):
    """Also with a reduced draft vocabulary (d2t): upstream's graph scatters the draft rows the same way."""
    if tool_path("llama-speculative-simple") is None:
        pytest.skip("llama-speculative-simple not built (-C cmake.define.PYLLAMA_DSPARK_TOOLS=...)")
    out = tmp_path / "parity.json"
    extra = ["--tiny-draft-vocab", str(draft_vocab)] if draft_vocab else []
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", *extra, "--n-predict", "48", "--repeats", "1",
                           "--json", str(out)], capture_output=True, text=True, cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["tokens_equal"] and result["n_predict"] == 48
    assert all(row["tokens_equal"] for row in result["prompts"]) and result["ours_over_cpp"] > 0


def test_parity_compares_whole_outputs_token_by_token():
    """Upstream's output must be exactly our first m >= n_predict tokens (not merely start like ours)."""
    spec = importlib.util.spec_from_file_location("bench_parity", SCRIPT)
    parity = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(parity)
    ours = [b"a", b"b", b"", b"cd", b"e"]
    assert parity.tokens_spelled(b"abcd", ours) == 4  # a, b, the empty piece, cd
    assert parity.tokens_spelled(b"abc", ours) is None  # ends inside a token
    assert parity.tokens_spelled(b"abX", ours) is None
    assert parity.same_tokens(b"abcde", ours, False, 5) and parity.same_tokens(b"abcd", ours, False, 4)
    assert not parity.same_tokens(b"ab", ours, False, 3)  # upstream stopped short of n_predict
    assert not parity.same_tokens(b"abcdeX", ours, False, 3)  # upstream went on where we did not
    assert parity.same_tokens(b"abcde", ours, True, 9)  # both met the end of generation after 5 tokens
