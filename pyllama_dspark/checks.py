"""Argument checks for the public API: a wrong type fails at once with a TypeError that names the
argument, before any native call and before any work is done (rather than deep inside, as an
AttributeError about an internal attribute, or silently, as a truncated float token id)."""

from __future__ import annotations

import numbers
from typing import Any, Mapping, Sequence

import numpy as np


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def integer(name: str, value: Any, *, minimum: int | None = None) -> int:
    """An int (numpy integers too; not bool, not float, not str)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {_show(value)}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def optional_integer(name: str, value: Any, *, minimum: int | None = None) -> int | None:
    return None if value is None else integer(name, value, minimum=minimum)


def number(name: str, value: Any) -> float:
    """A real number (ints and numpy scalars too; not bool, not str)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {_show(value)}")
    return float(value)


def stop_strings(stop: Any) -> list[str]:
    """``stop`` as a list: None or () -> [], one string -> [it], a sequence of strings -> a list of them."""
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, (bytes, bytearray)) or not isinstance(stop, Sequence) or \
            not all(isinstance(s, str) for s in stop):
        raise TypeError(f"stop must be a string or a list of strings, got {_show(stop)}")
    return [s for s in stop if s]


def prompt(value: Any) -> str | np.ndarray:
    """Text, or token ids as an int array (a list/tuple of ints or an integer numpy array)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray)):
        raise TypeError("prompt must be text (str) or token ids, got bytes: decode it first, "
                        "e.g. prompt.decode('utf-8')")
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or not (np.issubdtype(value.dtype, np.integer) or value.size == 0):
            raise TypeError(f"prompt token ids must be a 1-D integer array, got {value.ndim}-D {value.dtype}")
        return value.astype(np.int64)
    if isinstance(value, Sequence):
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in value):
            bad = next(t for t in value if not isinstance(t, numbers.Integral) or isinstance(t, bool))
            raise TypeError(f"prompt token ids must be ints, got {_show(bad)}")
        return np.asarray(value, dtype=np.int64)
    raise TypeError(f"prompt must be text (str) or a sequence of token ids, got {_show(value)}")


def messages(value: Any) -> list[dict[str, str]]:
    """Chat messages: a list of {"role": str, "content": str} mappings."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got {_show(value)}; "
                        "for one user turn: [{'role': 'user', 'content': text}]")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise TypeError(f"messages[{i}] must be a dict with string 'role' and 'content', got {_show(m)}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def instance(name: str, value: Any, cls: type, hint: str = "") -> Any:
    if not isinstance(value, cls):
        raise TypeError(f"{name} must be a {cls.__name__}, got {_show(value)}{'; ' + hint if hint else ''}")
    return value
