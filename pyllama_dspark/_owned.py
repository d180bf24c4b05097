"""Owned: the base of every wrapper that owns a native pointer.

``close()`` is idempotent, use after close raises ClosedHandleError, ``with``
closes, and ``__del__`` is only a backstop. Children (a model's contexts, a
context's batches) are closed before their parent frees its pointer.
"""

from __future__ import annotations

import weakref

from .errors import ClosedHandleError


class Owned:
    _ptr = None
    _children: "weakref.WeakSet[Owned]"

    def _set_ptr(self, ptr) -> None:
        if self._ptr is not None:
            raise RuntimeError(f"{type(self).__name__}: pointer set twice")
        self._ptr = ptr
        self._children = weakref.WeakSet()

    @property
    def ptr(self):
        """The native pointer; raises ClosedHandleError once closed."""
        if self._ptr is None:
            raise ClosedHandleError(f"{type(self).__name__} is closed (or was never opened)")
        return self._ptr

    @property
    def closed(self) -> bool:
        """True once ``close()`` has freed the native object (using it then raises ClosedHandleError)."""
        return self._ptr is None

    def _adopt(self, child: "Owned") -> None:
        """Register a child so that closing self closes it first."""
        self.ptr  # raises if closed
        self._children.add(child)

    def close(self) -> None:
        """Free the native object (children first). Safe to call more than once."""
        if self._ptr is None:
            return
        for child in list(self._children):
            child.close()
        ptr, self._ptr = self._ptr, None
        self._free(ptr)

    def _free(self, ptr) -> None:  # pragma: no cover - every subclass defines it
        raise TypeError(f"{type(self).__name__} does not define _free")

    def __enter__(self):
        self.ptr
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
