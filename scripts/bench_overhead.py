#!/usr/bin/env python3
"""Python overhead per decoded token: our plain greedy loop vs upstream llama-simple.

On a tiny model the per-token compute is small, so the difference in
microseconds per token between the two loops is what our Python layer costs.
Both run in this one process run, on the same GGUF and prompt, same threads.

Usage: bench_overhead.py [--model M.gguf] [--n-predict N] [--repeats R] [--json OUT]
(default model: the tiny llama kit model with a real tokenizer)
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from pyllama_dspark import Context, Model, generate
from pyllama_dspark.resources import tool_path
from pyllama_dspark.testing import TinySpec, tiny_model

PROMPT = "The quick brown fox jumps over the lazy dog because"


def cpp_us_per_token(exe: Path, model: Path, n_predict: int) -> tuple[float, int]:
    proc = subprocess.run([str(exe), "-m", str(model), "-n", str(n_predict), PROMPT],
                          capture_output=True, check=True)  # bytes: a random model's pieces need not be UTF-8
    match = re.search(r"decoded (\d+) tokens in ([\d.]+) s", proc.stderr.decode("utf-8", "replace"))
    n, seconds = int(match.group(1)), float(match.group(2))
    return 1e6 * seconds / n, n


def ours_us_per_token(model_path: Path, n_predict: int) -> tuple[float, int]:
    with Model(model_path) as model:
        ctx = Context(model, n_ctx=n_predict + 64, n_threads=4)  # llama-simple uses llama.cpp's default, 4
        result = generate(ctx, PROMPT, max_tokens=n_predict)
        # llama-simple times from the prompt decode on; its count excludes the first sampled token
        n = len(result.tokens) - 1
        return 1e6 * (result.t_prefill + result.t_decode) / n, n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--n-predict", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    model = args.model or tiny_model(TinySpec(arch="llama", vocab="llama-spm"),
                                     cache_dir=Path(tempfile.gettempdir()) / "pyllama-dspark-bench")
    exe = tool_path("llama-simple")
    if exe is None:
        sys.exit("llama-simple is not built: pip install -C cmake.define.PYLLAMA_DSPARK_TOOLS=llama-simple .")
    cpp, ours = [], []
    for _ in range(args.repeats):  # interleaved, so drift in machine load hits both alike
        cpp.append(cpp_us_per_token(exe, model, args.n_predict)[0])
        ours.append(ours_us_per_token(model, args.n_predict)[0])
    result = {
        "model": str(model),
        "n_predict": args.n_predict,
        "cpp_us_per_token": statistics.median(cpp),
        "ours_us_per_token": statistics.median(ours),
    }
    result["overhead_us_per_token"] = result["ours_us_per_token"] - result["cpp_us_per_token"]
    result["ours_over_cpp"] = result["ours_us_per_token"] / result["cpp_us_per_token"]
    print(f"llama-simple   {result['cpp_us_per_token']:9.1f} us/token")
    print(f"pyllama-dspark {result['ours_us_per_token']:9.1f} us/token")
    print(f"overhead       {result['overhead_us_per_token']:9.1f} us/token  (ratio {result['ours_over_cpp']:.3f})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
