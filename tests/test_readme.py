"""The README's Python examples and its CLI examples run as written, on tiny models saved as target.gguf and
drafter.gguf (so the examples cannot drift from the API or the command line)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pyllama_dspark.testing import TinySpec

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.M | re.S)
CLI_SECTION = README.read_text().split("\n## CLI\n", 1)[1].split("\n## ", 1)[0]
COMMANDS = [line for block in re.findall(r"^```sh\n(.*?)^```", CLI_SECTION, flags=re.M | re.S)
            for line in block.splitlines() if "pyllama-dspark " in line]


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
