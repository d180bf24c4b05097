#!/usr/bin/env bash
# The Vulkan job: Debian's Vulkan headers, glslc and Mesa's lavapipe (a Vulkan device that runs on the CPU),
# the package built with -DGGML_VULKAN=on into its own virtual environment (build directory build/vulkan,
# kept for incremental rebuilds), then the Vulkan tests on that device.
#
#   scripts/vulkan_pytest.sh [pytest args...]      tests/test_vulkan.py unless a test path is given
#
# Only that file: the rest of the suite assumes a CPU-only build (run under this build, some of its
# numerics tests fail, see the closing note of issue 15).
#
# ggml skips CPU-type Vulkan devices unless GGML_VK_VISIBLE_DEVICES names them; on a machine whose only
# Vulkan device is lavapipe it is device 0 (set GGML_VK_VISIBLE_DEVICES yourself to pick another).
# PYLLAMA_DSPARK_REQUIRE_GPU=1 makes the tests fail, not skip, when no device shows up.
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
    CMAKE_ARGS="-DGGML_VULKAN=on" "$venv/bin/pip" install -q -C build-dir=build/vulkan '.[test]'
fi
export GGML_VK_VISIBLE_DEVICES="${GGML_VK_VISIBLE_DEVICES:-0}" PYLLAMA_DSPARK_REQUIRE_GPU=1
# tests/test_vulkan.py unless an existing test path is given (options alone, such as -q or -k X, keep it)
paths=0
for arg in "$@"; do [[ -e ${arg%%::*} ]] && paths=1; done
(( paths )) || set -- "$@" tests/test_vulkan.py
exec "$venv/bin/pytest" -p no:cacheprovider -rs "$@"  # not `python -m pytest`: the source tree would shadow the build
