"""Load the extension, check it matches this package, initialise the backend once.

Only this module, ``errors``, ``_owned`` and the thin wrappers (model, context,
batch, capture) touch ``ffi``/``lib``.
"""

from __future__ import annotations

from . import __version__, _log
from .errors import LibraryMismatchError

try:
    from ._native import ffi, lib
except ImportError as exc:  # pragma: no cover - depends on the install
    raise LibraryMismatchError(
        "pyllama_dspark could not load its native extension (pyllama_dspark._native). "
        "The package is installed without its compiled part, or libllama/libggml next to it "
        "are missing. Reinstall with `pip install .` from the source tree.\n"
        f"Cause: {exc}"
    ) from exc


def build_info() -> str:
    """Identity of the loaded libllama: package version, llama.cpp base commit, patch series hash.

    Returns:
        One line, e.g. ``"pyllama-dspark 0.1.0 llama.cpp 0c1e57098 series fe49b6fd9fbfe406"``.

    Example:
        >>> pyllama_dspark.build_info()
        'pyllama-dspark 0.1.0 llama.cpp 0c1e57098 series fe49b6fd9fbfe406'
    """
    return ffi.string(lib.llama_dspark_build_info()).decode()


def expected_build_info() -> str:
    """What the extension was compiled against."""
    return ffi.string(lib.pyllama_expected_build_info()).decode()


def verify_build(actual: str, expected: str, version: str) -> None:
    """Raise LibraryMismatchError unless the loaded library is the one this package was built with."""
    if actual != expected or not actual.startswith(f"pyllama-dspark {version} "):
        raise LibraryMismatchError(
            "The native llama.cpp library loaded by pyllama_dspark does not match the package.\n"
            f"  loaded library:     {actual}\n"
            f"  extension expects:  {expected}\n"
            f"  python package:     pyllama-dspark {version}\n"
            "This usually means two installs are mixed on the path (an old build directory or a "
            "stale libllama.so found first through LD_LIBRARY_PATH), or the patch series changed "
            "without a rebuild. Reinstall the package (`pip install .`) and unset LD_LIBRARY_PATH."
        )


@ffi.def_extern()
def _pyllama_log_callback(level, text, user_data):  # noqa: ARG001 - fixed C signature
    try:
        _log.on_native_log(int(level), ffi.string(text).decode("utf-8", "replace"))
    except Exception:  # a Python exception must never unwind into C
        pass


verify_build(build_info(), expected_build_info(), __version__)
lib.llama_log_set(lib._pyllama_log_callback, ffi.NULL)
lib.llama_backend_init()
