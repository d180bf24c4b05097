#!/usr/bin/env python3
"""Prefill cost of hidden-state capture and of qwen35 output-row narrowing, side by side.

On one qwen35 (hybrid) model built by the tiny kit, one prompt, in one run:
  (a) plain prefill, logits on the last row only (narrowed last layer)
  (b) dense capture of several layers, logits on the last row only
  (c) capture with logits on every row (what a masked-only capture would force)
  (d) plain prefill with narrowing off (upstream's qwen35 path)
Prints the median times and the ratios b/a, c/b, a/d; ``--json OUT`` writes them with the keys
dense_over_plain (b/a), all_logits_over_dense (c/b), narrowed_over_unnarrowed (a/d).

Usage: bench_prefill.py [--n-layer 8] [--n-embd 512] [--n-prompt 512] [--repeats 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from pyllama_dspark import Batch, Context, Model
from pyllama_dspark.testing import TinySpec, tiny_model


def timed_prefill(ctx: Context, batch: Batch, tokens: np.ndarray, logits: str) -> float:
    ctx.clear()
    t0 = time.perf_counter()
    for start in range(0, len(tokens), ctx.n_batch):
        batch.clear()
        chunk = tokens[start:start + ctx.n_batch]
        is_last = start + ctx.n_batch >= len(tokens)
        batch.add_tokens(chunk, start, logits=logits if logits == "all" else ("last" if is_last else "none"))
        ctx.decode(batch)
    ctx.logits(-1)  # waits for the compute to finish
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--n-prompt", type=int, default=512)
    parser.add_argument("--n-batch", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--n-threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    spec = TinySpec(arch="qwen35", n_layer=args.n_layer, n_embd=args.n_embd, n_head=8, n_head_kv=2,
                    n_ff=4 * args.n_embd, vocab="llama-spm", dtype="f16")
    path = tiny_model(spec, cache_dir=Path(tempfile.gettempdir()) / "pyllama-dspark-bench")
    n_taps = min(5, args.n_layer - 1)
    taps = sorted({int(round(i)) for i in np.linspace(1, max(1, args.n_layer - 2), n_taps)})
    tokens = (np.arange(args.n_prompt) * 7919 % 31000 + 100).astype(np.int32)

    with Model(path) as model:
        configs = {
            "a_plain": dict(capture=None, logits="last", narrowing=True),
            "b_dense_capture": dict(capture=taps, logits="last", narrowing=True),
            "c_capture_all_logits": dict(capture=taps, logits="all", narrowing=True),
            "d_plain_unnarrowed": dict(capture=None, logits="last", narrowing=False),
        }
        contexts = {}
        for name, cfg in configs.items():
            ctx = Context(model, n_ctx=args.n_prompt + 64, n_batch=args.n_batch, n_threads=args.n_threads)
            ctx.set_narrowing(cfg["narrowing"])
            if cfg["capture"]:
                ctx.set_capture_layers(cfg["capture"], masked=False)
            contexts[name] = (ctx, cfg)
        batch = Batch(args.n_batch)
        times = {name: [] for name in configs}
        for name, (ctx, cfg) in contexts.items():  # warm-up: graph reservation, first-touch of weights
            timed_prefill(ctx, batch, tokens, cfg["logits"])
        for _ in range(args.repeats):  # interleaved so machine noise hits every configuration alike
            for name, (ctx, cfg) in contexts.items():
                times[name].append(timed_prefill(ctx, batch, tokens, cfg["logits"]))

    med = {name: statistics.median(t) for name, t in times.items()}
    result = {
        "model": str(path), "n_layer": args.n_layer, "n_embd": args.n_embd, "n_prompt": args.n_prompt,
        "capture_layers": taps, "seconds": med,
        "dense_over_plain": med["b_dense_capture"] / med["a_plain"],
        "all_logits_over_dense": med["c_capture_all_logits"] / med["b_dense_capture"],
        "narrowed_over_unnarrowed": med["a_plain"] / med["d_plain_unnarrowed"],
    }
    for name, seconds in med.items():
        print(f"{name:<22} {seconds * 1e3:9.1f} ms  ({args.n_prompt / seconds:8.1f} tok/s)")
    print(f"b/a dense_over_plain         = {result['dense_over_plain']:.3f}")
    print(f"c/b all_logits_over_dense    = {result['all_logits_over_dense']:.3f}")
    print(f"a/d narrowed_over_unnarrowed = {result['narrowed_over_unnarrowed']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
