#!/usr/bin/env python3
"""The ceiling the speculative loop allows on this machine: plain greedy vs speculative decoding with an
always-right drafter (it proposes the target's own greedy continuation), side by side in one run.

Every draft is accepted, so the speedup is what batching k + 1 tokens into one verify decode buys
minus the loop's overhead; a real drafter can only do worse.

Usage: bench_ceiling.py [--arch qwen3] [--n-layer 8] [--n-embd 512] [--n-predict 128]
                        [--n-draft 4 7] [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from pyllama_dspark import Context, Model, generate
from pyllama_dspark.speculative import Speculator
from pyllama_dspark.stats import SpecStats
from pyllama_dspark.testing import AlwaysRightDrafter as AlwaysRight, TinySpec, tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen3")
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--n-predict", type=int, default=128)
    parser.add_argument("--n-draft", type=int, nargs="+", default=[4, 7])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--n-threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    spec = TinySpec(arch=args.arch, n_layer=args.n_layer, n_embd=args.n_embd, n_head=8, n_head_kv=2,
                    n_ff=4 * args.n_embd, vocab="llama-spm", dtype="f16")
    path = tiny_model(spec, cache_dir=Path(tempfile.gettempdir()) / "pyllama-dspark-bench")
    prompt = "The quick brown fox jumps over the lazy dog because"
    result = {"model": str(path), "n_predict": args.n_predict, "runs": {}}
    with Model(path) as model:
        hybrid = model.is_hybrid or model.is_recurrent
        ctx = Context(model, n_ctx=1024, n_batch=256, n_threads=args.n_threads,
                      n_rs_seq=max(args.n_draft) if hybrid else 0)
        tokens = model.tokenize(prompt, parse_special=True)
        plain = generate(ctx, tokens, max_tokens=args.n_predict, stop_at_eog=False)
        sequence = list(tokens) + plain.tokens
        rates = {"plain": []}
        for k in args.n_draft:
            rates[f"spec_k{k}"] = []
        for _ in range(args.repeats):  # interleaved so noise hits all alike
            rates["plain"].append(generate(ctx, tokens, max_tokens=args.n_predict, stop_at_eog=False).decode_tok_s)
            for k in args.n_draft:
                stats = SpecStats()
                run = Speculator(ctx, AlwaysRight(sequence, k), n_draft=k).run(
                    tokens, max_tokens=args.n_predict, stop_at_eog=False, stats=stats)
                out = [t for step in run for t in step.tokens]
                assert out == plain.tokens, "always-right drafter changed the output"
                rates[f"spec_k{k}"].append(stats.decode_tok_s)
    med = {name: statistics.median(r) for name, r in rates.items()}
    result["tok_s"] = med
    result["speedup"] = {name: med[name] / med["plain"] for name in med if name != "plain"}
    print(f"plain          {med['plain']:8.1f} tok/s")
    for k in args.n_draft:
        name = f"spec_k{k}"
        print(f"always-right k={k} {med[name]:8.1f} tok/s  speedup {result['speedup'][name]:.3f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
