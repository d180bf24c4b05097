"""pyllama-dspark command line: generate, info, demo, convert.

Every failure caused by the user's input (missing file, bad GGUF, prompt too
long, bad option) exits with status 1 and one line on stderr, never a
traceback or a signal.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

from . import __version__


def _add_generation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", "-n", type=int, default=128, help="most tokens to generate (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--n-threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--n-ctx", type=int, default=4096)
    p.add_argument("--n-batch", type=int, default=512)
    p.add_argument("--n-gpu-layers", type=int, default=0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pyllama-dspark", description="DSpark speculative decoding on llama.cpp")
    parser.add_argument("--version", action="version", version=f"pyllama-dspark {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="show the native llama.cpp log")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("--model", "-m", required=True, help="target model GGUF")
    gen.add_argument("--prompt", "-p", required=True)
    _add_generation_args(gen)

    info = sub.add_parser("info", help="print a GGUF model's architecture, sizes and key metadata")
    info.add_argument("model")
    info.add_argument("--json", action="store_true", help="print JSON")

    demo = sub.add_parser("demo", help="build a tiny built-in model and generate from it (no download)")
    demo.add_argument("--prompt", "-p", default="Once upon a time")
    _add_generation_args(demo)
    _add_convert_parser(sub)
    return parser


def _add_convert_parser(sub) -> None:
    from .convert.layout import OUTTYPES

    conv = sub.add_parser("convert", help="convert a Hugging Face DSpark drafter checkpoint to GGUF")
    conv.add_argument("src", help="checkpoint folder (config.json + safetensors) or hub repo id owner/name")
    conv.add_argument("--outfile", "-o", required=True, help="GGUF file to write")
    conv.add_argument("--outtype", choices=OUTTYPES, default="auto",
                      help="weight matrix type (default auto: bf16 for a bf16 checkpoint, else f16)")
    target = conv.add_mutually_exclusive_group()
    target.add_argument("--target-gguf", help="the target's GGUF: checks fit, copies its vocabulary")
    target.add_argument("--target-model-dir", help="the target's HF folder: checks fit (no vocabulary)")
    conv.add_argument("--keep-shared-tensors", action="store_true",
                      help="keep token_embd/output even when they equal the target's")


def _cmd_generate(args, model_path: Path) -> int:
    from .context import Context
    from .generate import generate
    from .model import Model

    with Model(model_path, n_gpu_layers=args.n_gpu_layers) as model:
        ctx = Context(model, n_ctx=args.n_ctx, n_batch=args.n_batch, n_threads=args.n_threads)
        events = generate(ctx, args.prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, seed=args.seed, stream=True)
        import time

        t0 = time.perf_counter()
        n = 0
        for event in events:
            sys.stdout.write(event.text)
            sys.stdout.flush()
            n += event.token >= 0
        elapsed = time.perf_counter() - t0
        sys.stdout.write("\n")
        print(f"generated {n} tokens in {elapsed:.3f} s: {n / elapsed if elapsed else 0.0:.2f} tok/s "
              "(prefill included)", file=sys.stderr)
    return 0


def _cmd_info(args) -> int:
    from .model import Model

    with Model(args.model, vocab_only=False) as model:
        info = {
            "path": str(model.path),
            "architecture": model.arch,
            "description": model.description,
            "n_layer": model.n_layer,
            "n_embd": model.n_embd,
            "n_head": model.n_head,
            "n_head_kv": model.n_head_kv,
            "n_vocab": model.n_vocab,
            "n_ctx_train": model.n_ctx_train,
            "n_params": model.n_params,
            "size_bytes": model.size,
            "recurrent": model.is_recurrent,
            "hybrid": model.is_hybrid,
            "has_vocab": model.has_vocab,
            "chat_template": model.chat_template is not None,
        }
        meta = {k: v for k, v in model.metadata().items() if not k.startswith("tokenizer.ggml.")}
    if args.json:
        print(json.dumps({**info, "metadata": meta}, indent=2))
        return 0
    for key, value in info.items():
        print(f"{key:<14} = {value}")
    print("metadata:")
    for key in sorted(meta):
        print(f"  {key} = {meta[key][:120]}")
    return 0


def _cmd_demo(args) -> int:
    from .testing import TinySpec, tiny_model

    spec = TinySpec(arch="llama", vocab="llama-spm", n_layer=2, n_embd=64, seed=0)
    path = tiny_model(spec, cache_dir=Path(tempfile.gettempdir()) / "pyllama-dspark-demo")
    print(f"demo: tiny random-weight model {path} (its text is noise; the point is the pipeline)",
          file=sys.stderr)
    return _cmd_generate(args, path)


def _cmd_convert(args) -> int:
    from .convert.converter import convert

    result = convert(args.src, args.outfile, outtype=args.outtype, target_gguf=args.target_gguf,
                     target_model_dir=args.target_model_dir, keep_shared_tensors=args.keep_shared_tensors)
    for note in result.notes:
        print(f"pyllama-dspark: {note}", file=sys.stderr)
    size = result.path.stat().st_size
    print(f"wrote {result.path}: {len(result.tensors)} tensors, {size} bytes")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.ERROR, format="%(name)s: %(message)s")
    from .errors import LlamaError

    try:
        if args.command == "generate":
            return _cmd_generate(args, Path(args.model))
        if args.command == "info":
            return _cmd_info(args)
        if args.command == "convert":
            return _cmd_convert(args)
        return _cmd_demo(args)
    except (LlamaError, ValueError, OSError, ImportError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"pyllama-dspark: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
