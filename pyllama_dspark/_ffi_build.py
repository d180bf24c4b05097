"""Out-of-line, API-mode cffi builder.

Run by our CMake as ``python _ffi_build.py OUT.c``: it concatenates the header
fragments in ``_cdef/`` (order below matters: types first) and emits the C
source of the ``pyllama_dspark._native`` extension. CMake compiles that source
against the patched headers, so the C compiler checks every declaration and
struct layout, and links it to libllama.
"""

from __future__ import annotations

import sys
from pathlib import Path

from cffi import FFI

CDEF_DIR = Path(__file__).resolve().parent / "_cdef"

# Order matters: types.h declares what the others use.
CDEF_FILES = ["types.h", "backend.h", "model.h", "vocab.h", "context.h", "memory.h", "batch.h", "threadpool.h",
              "dspark.h"]

# Declared here, not in a fragment: these are ours, not llama.cpp's.
EXTRA_CDEF = """
extern "Python" void _pyllama_log_callback(enum ggml_log_level level, const char * text, void * user_data);
const char * pyllama_expected_build_info(void);
bool pyllama_cancel_requested(void * flag);
"""

PREAMBLE = """
#include "ggml-cpu.h"
#include "ggml-rpc.h"
#include "llama.h"
#include "llama-dspark.h"

#ifndef PYLLAMA_DSPARK_EXPECTED_BUILD_INFO
#error "PYLLAMA_DSPARK_EXPECTED_BUILD_INFO must be defined by the build"
#endif

/* The identity of the libllama this extension was compiled against; compared at import with what the
   loaded library reports, so a stale library never runs under these declarations. */
static const char * pyllama_expected_build_info(void) {
    return PYLLAMA_DSPARK_EXPECTED_BUILD_INFO;
}

/* llama.cpp's abort callback for a CancelToken: it runs between graph nodes on a compute thread, so it is C
   reading the token's flag (a Python callback there would take the GIL at every check). */
static bool pyllama_cancel_requested(void * flag) {
    return *(volatile int32_t *) flag != 0;
}
"""


def cdef_source() -> str:
    return "\n".join((CDEF_DIR / name).read_text() for name in CDEF_FILES) + EXTRA_CDEF


def make_ffi() -> FFI:
    ffi = FFI()
    ffi.cdef(cdef_source())
    ffi.set_source("pyllama_dspark._native", PREAMBLE)
    return ffi


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: _ffi_build.py OUT.c")
    make_ffi().emit_c_code(sys.argv[1])


if __name__ == "__main__":
    main()
