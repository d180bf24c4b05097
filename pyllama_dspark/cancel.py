"""``CancelToken``: a request to stop a generation, from any thread; pure Python (the server's engine holds one
per job without importing native code). A native context that honours it (``Context.abortable``) registers a
listener that raises the flag llama.cpp's abort callback reads."""

from __future__ import annotations

import threading
from typing import Callable


class CancelToken:
    """Asks a running generation to stop, from any thread: ``cancel()``.

    A generation given the token (``LLM.stream(..., cancel=token)``) stops at the next round, and a decode
    already running (a long prompt's prefill) stops at its next graph node: ``Context.abortable`` sets a C flag
    read there by llama.cpp's abort callback once the token is cancelled, so no Python runs inside the decode.
    """

    def __init__(self):
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []

    def cancel(self) -> None:
        """Cancel, from any thread: ``cancelled`` becomes True and the listeners run now, on this thread. Idempotent."""
        with self._lock:
            self._event.set()
            listeners, self._listeners = self._listeners, []
        for listener in listeners:
            listener()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until cancelled (or the timeout passes); True if cancelled."""
        return self._event.wait(timeout)

    def on_cancel(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call ``listener()`` once, when the token is cancelled (at once if it already is, on this thread; else on
        the cancelling thread). Returns a function that takes the listener back (a no-op once it ran)."""
        with self._lock:
            if not self._event.is_set():
                self._listeners.append(listener)
                return lambda: self._forget(listener)
        listener()
        return lambda: None

    def _forget(self, listener: Callable[[], None]) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)
