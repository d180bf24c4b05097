"""PyTorch, or an ImportError that says how to install it (it is the optional extra ``[train]``)."""

from __future__ import annotations

INSTALL_HINT = ("pyllama-dspark train needs PyTorch: pip install torch==2.13.0 (the CPU build; or a build for your "
                "GPU), then pip install 'pyllama-dspark[train]'")

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised in a subprocess without torch
    raise ImportError(f"{INSTALL_HINT} ({exc})") from None

__all__ = ["torch", "INSTALL_HINT"]
