#!/usr/bin/env python3
"""What a reduced draft vocabulary buys and costs, side by side in one run.

For each size N (the N most frequent tokens of the target's outputs in a training data folder, plus every
control, end-of-generation and chat-template token, as ``train --draft-vocab N`` chooses them):

- coverage: the share of the target's greedy output tokens on held-out prompts inside the vocabulary (what
  bounds acceptance);
- the drafter's ``propose`` time per draft length k, full vocabulary against reduced;
- acceptance at equal training: the given full-vocabulary drafter restricted to the N ids (its own output rows
  are the target's head rows of those ids, ``markov_w2`` the same rows, a ``d2t`` table added; every kept
  logit is the full drafter's), at a fixed draft length on the held-out prompts, against the full drafter.

    python scripts/bench_draft_vocab.py --target SmolLM2.gguf --drafter drafter.gguf --data-dir work/data \\
        --eval-prompts prompts/held_out.jsonl --sizes 4096 8192 16384 32768 --json benchmarks/draft-vocab.json
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
import numpy as np

from pyllama_dspark import Context, Model, generate
from pyllama_dspark.bench import BenchSummary, load_prompts, run_bench
from pyllama_dspark.drafter import DSparkDrafter
from pyllama_dspark.gguf_header import GGUFHeader
from pyllama_dspark.train.vocab import choose_draft_vocab, coverage, output_counts, required_tokens


def data_counts(data_dir: Path, n_vocab: int) -> np.ndarray:
    """Output-token counts of every finished shard (token arrays only; the feature rows are not read)."""
    manifest = json.loads((data_dir / "manifest.json").read_text())

    def sequences():
        for name in sorted(manifest["shards"]):
            with np.load(data_dir / name) as z:
                tokens, offsets, plens = z["tokens"], z["offsets"], z["prompt_lens"]
            for i, plen in enumerate(plens):
                yield tokens[offsets[i]:offsets[i + 1]], int(plen)

    return output_counts(sequences(), n_vocab)


def restrict(full: Path, target: Path, ids: np.ndarray, out: Path) -> Path:
    """A copy of the full-vocabulary drafter ``full`` whose head covers ``ids`` only: output.weight = the
    target's head rows of ids (f32), markov_w2 = its rows of ids, plus d2t."""
    reader = gguf.GGUFReader(full)
    head_reader = gguf.GGUFReader(target)
    tensors = {t.name: t for t in head_reader.tensors}
    head = tensors.get("output.weight", tensors["token_embd.weight"])
    head_rows = np.asarray(gguf.quants.dequantize(head.data, head.tensor_type), dtype=np.float32)[ids]
    writer = gguf.GGUFWriter(out, arch=reader.get_field("general.architecture").contents(), use_temp_file=False)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.alignment"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        if t.name in ("output.weight", "d2t"):
            continue
        if t.name == "markov_w2.weight":
            w2 = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
            writer.add_tensor(t.name, np.ascontiguousarray(w2[ids]))
            continue
        data = np.asarray(t.data)
        # block and bf16 types come as bytes per row, from which the writer infers the element shape
        writer.add_tensor(t.name, data, raw_dtype=t.tensor_type if data.dtype == np.uint8 else None)
    writer.add_tensor("output.weight", np.ascontiguousarray(head_rows))
    writer.add_tensor("d2t", ids.astype(np.int64))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def propose_ms(ctx: Context, drafter_path: Path, prompt: np.ndarray, ks: list[int], repeats: int) -> dict[int, float]:
    """Median milliseconds of one ``propose`` of k slots after ``prompt`` (its features observed)."""
    drafter = DSparkDrafter(drafter_path, ctx)
    try:
        ctx.clear()
        ctx.set_capture_layers(drafter.capture_layers, masked=False)
        from pyllama_dspark import Batch

        batch = Batch(len(prompt))
        batch.add_tokens(prompt, 0, logits="last")
        ctx.decode(batch)
        drafter.observe(prompt, ctx.capture().copy(), 0)
        anchor = int(np.argmax(ctx.logits(-1)))
        out = {}
        for k in ks:
            drafter.propose(anchor, len(prompt), k)  # warm-up (graph allocation)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                drafter.propose(anchor, len(prompt), k)
                times.append(time.perf_counter() - t0)
            out[k] = 1e3 * statistics.median(times)
        return out
    finally:
        drafter.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--drafter", type=Path, required=True, help="a full-vocabulary DSpark drafter GGUF")
    parser.add_argument("--data-dir", type=Path, required=True, help="a train data folder (manifest.json + shards)")
    parser.add_argument("--eval-prompts", type=Path, required=True)
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--n-predict", type=int, default=128)
    parser.add_argument("--n-draft", type=int, default=4, help="fixed draft length of the acceptance runs")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--n-threads", type=int, default=2)
    parser.add_argument("--no-acceptance", action="store_true", help="coverage and cost only")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    items = load_prompts(args.eval_prompts)
    result: dict = {"target": args.target.name, "drafter": args.drafter.name, "eval_prompts": str(args.eval_prompts),
                    "n_predict": args.n_predict, "sizes": {}}
    with Model(args.target) as model, tempfile.TemporaryDirectory() as tmp:
        counts = data_counts(args.data_dir, model.n_vocab)
        required = required_tokens(model)
        mask = int(GGUFHeader(args.drafter).value("tokenizer.ggml.mask_token_id"))
        prompts = [model.tokenize(model.apply_chat_template(it["messages"]) if "messages" in it else it["prompt"],
                                  parse_special=True) for it in items]
        ctx = Context(model, n_ctx=max(len(p) for p in prompts) + args.n_predict + 16, n_threads=args.n_threads)
        greedy = np.concatenate([generate(ctx, p, max_tokens=args.n_predict).tokens for p in prompts])
        result["held_out_tokens"] = int(greedy.size)
        result["train_output_tokens"] = int(counts.sum())
        result["full"] = {"propose_ms": propose_ms(ctx, args.drafter, prompts[0], args.ks, args.repeats)}
        if not args.no_acceptance:
            result["full"] |= acceptance(model, args.drafter, items, args)
        print(f"full vocabulary ({model.n_vocab}): propose ms {fmt(result['full']['propose_ms'])}"
              + accept_text(result["full"]), flush=True)
        for size in args.sizes:
            ids = choose_draft_vocab(counts, size, required, mask)
            entry = {"coverage": coverage(ids, greedy), "train_coverage": coverage(ids, np.repeat(
                np.arange(len(counts)), counts)), "required": len(required - {mask})}
            path = restrict(args.drafter, args.target, ids, Path(tmp) / f"reduced-{size}.gguf")
            entry["propose_ms"] = propose_ms(ctx, path, prompts[0], args.ks, args.repeats)
            if not args.no_acceptance:
                entry |= acceptance(model, path, items, args)
            result["sizes"][size] = entry
            print(f"N = {size}: coverage {entry['coverage']:.4f} (training outputs {entry['train_coverage']:.4f}); "
                  f"propose ms {fmt(entry['propose_ms'])}" + accept_text(entry), flush=True)
        ctx.close()
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


def acceptance(model: Model, drafter: Path, items: list[dict], args) -> dict:
    summary = BenchSummary(list(run_bench(model, drafter, items, n_predict=args.n_predict, n_threads=args.n_threads,
                                          n_draft=args.n_draft)))
    d = summary.as_dict()
    accepted, reached = summary.per_position_counts()
    return {"accept": d["accept"], "tau": d["tau"], "token_match": d["token_match"], "prompts": d["prompts"],
            "per_position": [float(a / r) if r else 0.0 for a, r in zip(accepted, reached)]}


def fmt(ms: dict[int, float]) -> str:
    return " ".join(f"k={k}: {v:.2f}" for k, v in ms.items())


def accept_text(entry: dict) -> str:
    if "tau" not in entry:
        return ""
    return (f"; fixed k: tau {entry['tau']:.3f}, per position {' '.join(f'{x:.2f}' for x in entry['per_position'])}, "
            f"token match {entry['token_match']}/{entry['prompts']}")


if __name__ == "__main__":
    sys.exit(main())
