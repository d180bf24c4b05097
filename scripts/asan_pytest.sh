#!/usr/bin/env bash
# The AddressSanitizer job: build libllama, libggml* and the extension with -fsanitize=address into their
# own virtual environment (build directory build/asan, kept for incremental rebuilds), then run pytest
# under the sanitizer and fail on any report, including reports from the tests' subprocesses.
#
#   scripts/asan_pytest.sh [pytest args...]      e.g. scripts/asan_pytest.sh -q tests/test_capture.py
#
# With no test path it runs the tests that cross into native code in ways of their own (NATIVE_TESTS below:
# decode and its error codes, capture, the numerics patches, the drafter graph, rollback, the
# speculative loop, the batch scheduler, a decode aborted from another thread, state files, fuzzed model files,
# RPC), without the `statistical` and `slow` tests, which repeat paths these cover once. The rest reaches
# native code only through the same calls (the facade, the server, structured output, the CLI, the benchmark
# scripts, the README's examples) or not at all (request parsing, choosers, statistics, templates, the GGUF
# header reader). Under ASan the whole suite took 38 minutes of CI's 90 (stop 52, CI over time); this
# selection with test_attention took 17 minutes beside the Vulkan job's tests, 14 alone with the server tests
# and two slow tests more.
#
# Python itself is not instrumented: the runtime is preloaded (LD_PRELOAD) and PYTHONMALLOC=malloc sends
# Python's own allocations through malloc, so ASan also sees a native read of a freed Python object.
# Leak detection is off: the interpreter and numpy keep allocations alive at exit by design.
# The build also has the RPC backend (-DGGML_RPC=ON, opt-in elsewhere), so tests/test_rpc.py runs here, its
# rpc-server processes instrumented too; PYLLAMA_DSPARK_REQUIRE_RPC=1 makes a missing backend a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${PYLLAMA_DSPARK_ASAN_VENV:-.venv-asan}"
if [[ "${PYLLAMA_DSPARK_ASAN_REUSE:-0}" != 1 || ! -x "$venv/bin/python" ]]; then
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q -C build-dir=build/asan -C cmake.define.PYLLAMA_DSPARK_SANITIZE=address \
        -C cmake.define.GGML_RPC=ON '.[test,server]'
fi
libasan="$(gcc -print-file-name=libasan.so)"
[[ -e "$libasan" ]] || { echo "asan_pytest: libasan.so not found (gcc -print-file-name=libasan.so)" >&2; exit 2; }
# libstdc++ preloaded too: ASan resolves the real __cxa_throw when it starts, and python itself does not
# link libstdc++ (without it the first C++ exception in libllama fails an ASan CHECK)
libstdcxx="$(gcc -print-file-name=libstdc++.so)"
# not test_attention: the kernels test_numerics runs, at other shapes (GQA ratios, 3072 cells); 1.5 minutes
# alone and 4 beside the Vulkan job's tests, which CI runs side by side with this job
NATIVE_TESTS=(test_capture test_numerics test_drafter test_errors test_memory_safety test_fuzz
              test_quantize test_generate test_prefix_reuse test_cancel test_speculative test_loop_contract
              test_dspark_loop test_batching test_prompt_cache test_rpc)
paths=0
for arg in "$@"; do [[ -e ${arg%%::*} ]] && paths=1; done
if (( ! paths )); then
    set -- -m "not statistical and not slow" "$@"
    for name in "${NATIVE_TESTS[@]}"; do set -- "$@" "tests/$name.py"; done
fi
reports="$(mktemp -d)"
status=0
env LD_PRELOAD="$libasan $libstdcxx" PYTHONMALLOC=malloc PYLLAMA_DSPARK_REQUIRE_RPC=1 \
    ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:log_path=$reports/asan" \
    "$venv/bin/pytest" -p no:cacheprovider "$@" || status=$?  # not `python -m pytest`: the source tree would shadow the build
if compgen -G "$reports/asan*" > /dev/null; then
    echo "asan_pytest: AddressSanitizer reports:" >&2
    cat "$reports"/asan* >&2
    exit 1
fi
if [[ $status -ne 0 ]]; then
    echo "asan_pytest: pytest failed with status $status (no sanitizer report)" >&2
fi
exit $status
