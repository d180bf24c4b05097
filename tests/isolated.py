"""Run code in a fresh interpreter, so that an abort or a crash fails a test instead of the test run."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import textwrap


def run_isolated(code: str, *, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run code with ``python -c``; it must exit normally (status 0), never by a signal."""
    # cwd outside the source tree: `python -c` puts cwd first on sys.path, and the uncompiled
    # source package there would shadow the installed one
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          cwd=tempfile.gettempdir(), timeout=timeout)
    how = (f"killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
           else f"status {proc.returncode}")
    assert proc.returncode == 0, f"{how}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return proc
