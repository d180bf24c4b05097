"""Native log -> Python logging, plus a ring buffer for exceptions.

llama.cpp and ggml log through one callback. Lines go to the logger
``pyllama_dspark.native`` (native DEBUG and INFO both as DEBUG, so loading a
model is quiet by default; WARN as WARNING; ERROR as ERROR), and the recent
INFO/WARN/ERROR lines are kept so that an exception can carry the reason
llama.cpp logged before failing.
"""

from __future__ import annotations

import collections
import contextlib
import logging

logger = logging.getLogger("pyllama_dspark.native")
# A library's loggers print nothing until the application configures logging (without a handler Python's
# last-resort handler would print every native warning, e.g. llama.cpp's vocabulary notes, at each load).
logging.getLogger("pyllama_dspark").addHandler(logging.NullHandler())

_NATIVE_DEBUG, _NATIVE_INFO, _NATIVE_CONT = 1, 2, 5
_TO_PYTHON = {_NATIVE_DEBUG: logging.DEBUG, _NATIVE_INFO: logging.DEBUG, 3: logging.WARNING, 4: logging.ERROR}

_recent: collections.deque[str] = collections.deque(maxlen=64)
_state = {"partial": "", "level": _NATIVE_INFO}
_collectors: list[list[str]] = []


def _emit(native_level: int, line: str) -> None:
    line = line.rstrip()
    if not line:
        return
    if native_level != _NATIVE_DEBUG:
        _recent.append(line)
        for lines in _collectors:
            lines.append(line)
    logger.log(_TO_PYTHON.get(native_level, logging.DEBUG), "%s", line)


def on_native_log(native_level: int, text: str) -> None:
    """Handle one callback invocation; partial lines are joined until a newline."""
    if native_level != _NATIVE_CONT:  # CONT continues the previous line at its level
        _state["level"] = native_level
    *lines, _state["partial"] = (_state["partial"] + text).split("\n")
    for line in lines:
        _emit(_state["level"], line)


@contextlib.contextmanager
def collect():
    """Every INFO/WARN/ERROR line logged inside the block (a list, filled as they arrive)."""
    lines: list[str] = []
    _collectors.append(lines)
    try:
        yield lines
    finally:
        _collectors.remove(lines)


def tail(n: int = 16) -> list[str]:
    """The last n native log lines (INFO and above), oldest first."""
    return list(_recent)[-n:]


def clear() -> None:
    """Forget the recent lines, so the next failure reports only its own."""
    _recent.clear()
