"""Load the extension, check it matches this package, initialise the backend once.

Only this module, ``errors``, ``_owned`` and the thin wrappers (model, context,
batch, capture) touch ``ffi``/``lib``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from . import __version__, _log
from .errors import LibraryMismatchError

# Our native libraries are installed in lib/ beside the extension, under names no other llama.cpp uses
# (CMakeLists.txt): libpyllama_dspark_llama.so, libpyllama_dspark_ggml-base.so, ...
OWN_PREFIX = "libpyllama_dspark_"


def extension_path() -> Path | None:
    """Where the compiled extension is (an editable install keeps it outside the source tree), or None."""
    try:
        spec = importlib.util.find_spec(f"{__package__}._native")
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec is not None and spec.origin else None


def native_dir() -> Path | None:
    """The folder of our native libraries, or None without an extension."""
    extension = extension_path()
    return None if extension is None else extension.parent / "lib"


def _sanitizer_loaded() -> bool:
    """AddressSanitizer's runtime refuses RTLD_DEEPBIND (it aborts the dlopen); its job imports without it."""
    return "libasan" in os.environ.get("LD_PRELOAD", "")


def loaded_native_files() -> list[str]:
    """The llama.cpp / ggml libraries mapped into this process (ours and any other copy), from /proc/self/maps."""
    found = []
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return found
    for line in maps.splitlines():
        fields = line.split(None, 5)  # address, permissions, offset, device, inode, path
        path = fields[5] if len(fields) == 6 else ""
        name = os.path.basename(path)
        if (name.startswith((OWN_PREFIX, "libllama", "libggml")) or "_native." in name) and path not in found:
            found.append(path)
    return found


def _source_tree() -> Path | None:
    """This package's folder when it sits in a source checkout (beside pyproject.toml and patches/), else None."""
    package = Path(__file__).resolve().parent
    checkout = package.parent
    return package if (checkout / "pyproject.toml").is_file() and (checkout / "patches").is_dir() else None


def _load_failure_advice() -> str:
    """Why the extension did not load, by what is on disk and in the environment: "reinstall" only where a
    reinstall can help."""
    folder = native_dir()
    ours = sorted(p.name for p in folder.glob(f"{OWN_PREFIX}*")) if folder is not None and folder.is_dir() else []
    package = _source_tree()
    if not ours and package is not None:
        return (f"Python imported the source tree ({package}), which has no compiled part: run from another "
                "folder (or with the `pytest` script, not `python -m pytest`), after `pip install .`.")
    if not ours:
        return ("The package is installed without its compiled part (no pyllama_dspark._native extension, or no "
                f"{OWN_PREFIX}*.so beside it in lib/). Reinstall with `pip install .` from the source tree, or "
                "install the wheel.")
    hints = [f"Our libraries are in {folder}: {', '.join(ours)}."]
    for variable in ("LD_LIBRARY_PATH", "LD_PRELOAD"):
        if os.environ.get(variable):
            hints.append(f"{variable}={os.environ[variable]} is set: a library there may have been loaded in "
                         "place of ours; try without it.")
    others = [path for path in loaded_native_files() if OWN_PREFIX not in path and "_native." not in path]
    if others:
        hints.append("Another llama.cpp is loaded in this process: " + ", ".join(others) + ".")
    return " ".join(hints)


def _import_native():
    """Import the extension with RTLD_DEEPBIND: it and its libraries resolve llama_*/ggml_* symbols among
    themselves first, so another copy of llama.cpp loaded earlier with RTLD_GLOBAL cannot bind our calls (ours are
    in a local scope the global one would otherwise precede)."""
    flags = sys.getdlopenflags()
    deep = 0 if _sanitizer_loaded() else getattr(os, "RTLD_DEEPBIND", 0)
    sys.setdlopenflags(flags | deep)
    try:
        from . import _native
    finally:
        sys.setdlopenflags(flags)
    return _native.ffi, _native.lib


try:
    ffi, lib = _import_native()
except ImportError as exc:  # pragma: no cover - depends on the install
    raise LibraryMismatchError(
        f"pyllama_dspark could not load its native extension (pyllama_dspark._native): {exc}\n"
        + _load_failure_advice()
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
            f"  files loaded:       {', '.join(loaded_native_files()) or '(unknown)'}\n"
            "Two builds are mixed: the files above show which library was loaded. An older build of this "
            "package found first on the path (an editable install's build directory, LD_LIBRARY_PATH), or the "
            "patch series changed without a rebuild: rebuild or reinstall (`pip install .`)."
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
