"""``pyllama-dspark train``: data -> training -> export -> evaluation, from the target GGUF alone.

Every input is checked before anything is generated (target architecture, taps, prompts with their
line numbers, the output path, the work directory's settings), and the GGUF appears at ``outfile``
only once it is complete. Each phase resumes from the work directory.

Test hook: ``PYLLAMA_DSPARK_TRAIN_KILL_AFTER=data:N`` (after N shards written in this run) or
``train:N`` (after optimizer step N) ends the process at once with status 75, as a kill would (no
clean-up, no final checkpoint); the resume tests use it to interrupt a run at a known point.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..model import Model
from .torch_import import torch  # noqa: F401  (fails early, with the install command, when torch is missing)
from . import data as data_phase
from . import trainer, vocab
from .export import export_gguf
from .model import load_frozen_target
from .settings import (TrainError, TrainSettings, WorkDir, check_target_arch, file_sha256, parse_taps,
                       target_identity, write_json_atomically)

KILL_ENV = "PYLLAMA_DSPARK_TRAIN_KILL_AFTER"
KILLED_STATUS = 75


@dataclass
class TrainOptions:
    target: Path
    prompts: Path
    outfile: Path
    work_dir: Path | None = None
    eval_prompts: Path | None = None
    block_size: int = 7
    layers: int = 1
    taps: str = "auto"
    markov_rank: int = 64
    mask_token: int | None = None
    n_predict: int = 256
    temperature: float = 0.0
    steps: int | None = None
    minutes: float | None = None
    lr: float = 1e-2
    seed: int = 0
    n_threads: int | None = None
    outtype: str = "auto"  # f16, or bf16 when the data's rows left float16's range (resolve_outtype)
    anchors: int = 16
    seqs_per_step: int = 4
    parallel: int = 8
    checkpoint_steps: int = 0
    shard_size: int = 16
    eval_n_predict: int | None = None
    progress: bool = True
    draft_vocab: int = 0
    ce_weight: float = 0.1
    tv_weight: float = 0.9
    kl_weight: float = 0.0
    gamma: float = 4.0
    warmup: float = 0.05
    noise: float = 0.0
    init_layer: int = -1
    data_dir: Path | None = None
    data_limit: int = 0
    data_only: bool = False


@dataclass
class TrainReport:
    outfile: str
    work_dir: str
    settings: dict
    data: dict = field(default_factory=dict)
    training: dict = field(default_factory=dict)
    export: dict = field(default_factory=dict)
    evaluation: dict | None = None

    def as_dict(self) -> dict:
        return {"outfile": self.outfile, "work_dir": self.work_dir, "settings": self.settings, "data": self.data,
                "training": self.training, "export": self.export, "evaluation": self.evaluation}

    def summary(self) -> str:
        d, t, e = self.data, self.training, self.export
        lines = [
            f"data         {d['sequences']} sequences, {d['tokens']} tokens ({d['generated']} generated), "
            f"{d['bytes_per_token']:.0f} bytes/token; generated {d['generated_this_run']} tokens this run at "
            f"{d['tok_s']:.1f} tok/s",
        ]
        if not t:  # --data-only
            return "\n".join(lines)
        lines.insert(0, f"drafter      {self.outfile} ({e.get('bytes', 0) / 1e6:.1f} MB, {e.get('tensors', 0)} tensors)")
        lines.append(f"training     {t['steps_done']}/{t['steps_total']} steps, {t['steps_per_s']:.2f} steps/s this "
                     f"run; loss {t['loss']:.3f}, slot-0 accuracy {t['acc0']:.3f}")
        ev = self.evaluation
        if ev:
            lines.append(f"held-out     {ev['prompts']} prompts: accept {ev['accept']:.3f}, tau {ev['tau']:.3f}, "
                         f"per position {', '.join(f'{x:.2f}' for x in ev['per_position'])}; "
                         f"token match {ev['token_match']}/{ev['prompts']}; "
                         f"plain {ev['ar_tok_s']:.1f} tok/s, speculative {ev['sp_tok_s']:.1f} tok/s "
                         f"(speedup {ev['speedup']:.3f})")
        return "\n".join(lines)


class _Progress:
    """A tqdm bar on a terminal; elsewhere (a log file, a pipe) a plain line every 15 s and at the end."""

    def __init__(self, enabled: bool, desc: str, unit: str, total: int):
        self.enabled, self.desc, self.unit, self.total = enabled, desc, unit, total
        self.n, self.postfix = 0, ""
        self._bar = None
        self._t0 = self._last = time.perf_counter()
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(file=sys.stderr, dynamic_ncols=True, desc=desc, unit=unit, total=total)

    def update(self, n: int = 1, *, to: int | None = None, **postfix) -> None:
        self.n = to if to is not None else self.n + n
        if postfix:
            self.postfix = ", ".join(f"{k} {v}" for k, v in postfix.items())
        if self._bar is not None:
            self._bar.n = self.n
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)
            self._bar.refresh()
        elif self.enabled and time.perf_counter() - self._last >= 15.0:
            self._line()

    def _line(self) -> None:
        rate = self.n / max(1e-9, time.perf_counter() - self._t0)
        tail = f", {self.postfix}" if self.postfix else ""
        print(f"{self.desc}: {self.n}/{self.total} {self.unit} ({rate:.1f} {self.unit}/s{tail})", file=sys.stderr)
        self._last = time.perf_counter()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled:
            self._line()


def _kill_point() -> tuple[str, int] | None:
    value = os.environ.get(KILL_ENV)
    if not value:
        return None
    phase, _, count = value.partition(":")
    return phase, int(count)


def _check_outfile(outfile: Path) -> None:
    if outfile.is_dir():
        raise TrainError(f"--outfile {outfile} is a directory")
    if not outfile.parent.is_dir():
        raise TrainError(f"--outfile {outfile}: folder {outfile.parent} does not exist")


def prepare(options: TrainOptions, model: Model) -> tuple[TrainSettings, list[list[int]], list[list[int]] | None]:
    """Check every input against the loaded target; return the settings and the tokenized prompts."""
    check_target_arch(model.arch)
    taps = parse_taps(options.taps, model.n_layer)
    for name in ("block_size", "layers", "n_predict", "anchors", "seqs_per_step", "parallel", "shard_size"):
        value = getattr(options, name)
        if not isinstance(value, int) or value < 1:
            raise TrainError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
    if options.markov_rank < 0:
        raise TrainError(f"--markov-rank must be >= 0, got {options.markov_rank}")
    if options.n_predict <= options.block_size:
        raise TrainError(f"--n-predict ({options.n_predict}) must exceed --block-size ({options.block_size}): "
                         f"anchors need a whole block of generated tokens after them")
    steps, minutes = options.steps, options.minutes
    if options.data_only and steps is None and minutes is None:
        steps = 0  # nothing is trained
    if (steps is None) == (minutes is None):
        raise TrainError("give exactly one of --steps N and --minutes M (or --data-only)")
    if steps is not None and steps < 0:
        raise TrainError(f"--steps must be >= 0, got {steps}")
    if minutes is not None and minutes <= 0:
        raise TrainError(f"--minutes must be > 0, got {minutes}")
    if options.temperature < 0:
        raise TrainError(f"--temperature must be >= 0, got {options.temperature}")
    mask = model.n_vocab - 1 if options.mask_token is None else options.mask_token
    if not 0 <= mask < model.n_vocab:
        raise TrainError(f"--mask-token {mask} outside the vocabulary [0, {model.n_vocab})")
    if options.draft_vocab and not 1 <= options.draft_vocab < model.n_vocab:
        raise TrainError(f"--draft-vocab must be 0 (the whole vocabulary) or in [1, {model.n_vocab - 1}], got "
                         f"{options.draft_vocab}")
    weights = {"--ce-weight": options.ce_weight, "--tv-weight": options.tv_weight, "--kl-weight": options.kl_weight}
    if any(w < 0 for w in weights.values()) or not sum(weights.values()) > 0:
        raise TrainError(f"loss weights must be >= 0 and not all 0, got {weights}")
    if options.gamma <= 0 or not 0 <= options.warmup < 1 or options.noise < 0:
        raise TrainError(f"need --gamma > 0, 0 <= --warmup < 1, --noise >= 0; got {options.gamma}, {options.warmup}, "
                         f"{options.noise}")
    if options.data_limit < 0:
        raise TrainError(f"--data-limit must be >= 0 (0 = all data), got {options.data_limit}")
    if not -1 <= options.init_layer < model.n_layer:
        raise TrainError(f"--init-layer {options.init_layer} outside [-1, {model.n_layer - 1}] (-1 = random init)")
    _check_outfile(options.outfile)
    prompts = data_phase.read_prompts(options.prompts, model)
    eval_prompts = data_phase.read_prompts(options.eval_prompts, model) if options.eval_prompts else None
    settings = TrainSettings(
        target=target_identity(options.target), prompts=file_sha256(options.prompts), taps=taps,
        n_predict=options.n_predict, temperature=float(options.temperature), block_size=options.block_size,
        n_layer=options.layers, markov_rank=options.markov_rank, mask_token=mask, steps=steps or 0,
        minutes=float(minutes or 0.0), lr=float(options.lr), seed=options.seed, anchors=options.anchors,
        seqs_per_step=options.seqs_per_step, shard_size=options.shard_size, draft_vocab=options.draft_vocab,
        ce_weight=float(options.ce_weight), tv_weight=float(options.tv_weight), kl_weight=float(options.kl_weight),
        gamma=float(options.gamma), warmup=float(options.warmup), noise=float(options.noise),
        init_layer=options.init_layer, data_limit=options.data_limit)
    return settings, prompts, eval_prompts


def run(options: TrainOptions) -> TrainReport:
    """All phases; see the module docstring."""
    if not options.target.is_file():
        raise TrainError(f"--target {options.target}: no such file")
    kill = _kill_point()
    with Model(options.target) as model:
        settings, prompts, eval_prompts = prepare(options, model)
        required = vocab.required_tokens(model) if settings.draft_vocab else set()
        placeholders = vocab.placeholder_tokens(model) if settings.draft_vocab else set()
        if settings.draft_vocab:  # checked before any data is generated
            try:
                vocab.check_size(settings.draft_vocab, required, settings.mask_token, model.n_vocab)
            except ValueError as exc:
                raise TrainError(f"--draft-vocab {settings.draft_vocab}: {exc}") from None
        work = WorkDir(options.work_dir or options.outfile.with_name(options.outfile.stem + ".work"),
                       data=options.data_dir)
        work.open(settings)
        report = TrainReport(outfile=str(options.outfile), work_dir=str(work.root), settings=settings.as_dict())

        # --- data ------------------------------------------------------------------------------
        shards_written = 0
        bar = _Progress(options.progress, "data", "tok", len(prompts) * options.n_predict)

        def on_tokens(n: int) -> None:
            bar.update(n)

        def on_shard() -> None:
            nonlocal shards_written
            shards_written += 1
            if kill and kill[0] == "data" and shards_written >= kill[1]:
                os._exit(KILLED_STATUS)

        stats = data_phase.generate_data(model, prompts, settings, work, n_threads=options.n_threads,
                                         parallel=options.parallel, progress=on_tokens, on_shard=on_shard)
        bar.close()
        report.data = {"sequences": stats.sequences, "tokens": stats.tokens, "generated": stats.generated,
                       "bytes": stats.bytes, "bytes_per_token": stats.bytes / max(1, stats.tokens),
                       "generated_this_run": stats.generated_this_run, "tok_s": stats.tok_s,
                       "seconds": stats.seconds, "shards": stats.shards_total, "parallel": options.parallel}
    if options.data_only:
        write_json_atomically(work.root / "report.json", report.as_dict())
        return report
    records = data_phase.usable(data_phase.load_sequences(work, settings.data_limit), settings.block_size)
    if not records:
        raise TrainError(f"no sequence has {settings.block_size + 1} generated tokens to anchor a block on (the "
                         f"target stopped early on every prompt); use more or longer prompts")

    outtype = resolve_outtype(options.outtype, work)

    # --- training --------------------------------------------------------------------------------
    if options.n_threads:
        torch.set_num_threads(options.n_threads)
    frozen = load_frozen_target(options.target)
    draft_ids = _draft_vocabulary(settings, work, records, required, placeholders, len(frozen.token_embd))
    module = trainer.build_module(settings, frozen, draft_ids)
    if settings.init_layer >= 0:
        trainer.init_from_target_layer(module, options.target, settings.init_layer)
    steps = _resolve_steps(settings, work, module, records)
    bar = _Progress(options.progress, "train", "step", steps)

    def on_step(log: trainer.StepLog) -> None:
        bar.update(to=log.step, loss=f"{log.loss:.3f}", acc0=f"{log.acc0:.3f}")
        if kill and kill[0] == "train" and log.step >= kill[1]:
            os._exit(KILLED_STATUS)

    tstats = trainer.train(module, records, settings, work, steps, checkpoint_steps=options.checkpoint_steps,
                           on_step=on_step)
    bar.close()
    last = tstats.last
    if draft_ids is not None:
        report.data["draft_vocab"] = {"size": len(draft_ids), "train_coverage": vocab.coverage(
            draft_ids, np.concatenate([r.tokens[r.prompt_len:] for r in records]))}
    report.training = {
        "steps_done": tstats.steps_done, "steps_total": steps, "steps_this_run": tstats.steps_this_run,
        "steps_per_s": tstats.steps_per_s, "seconds": tstats.seconds,
        "seconds_forward": tstats.time_forward, "seconds_backward": tstats.time_backward,
        "seconds_optimizer": tstats.time_optimizer,
        "loss": last.loss if last else float("nan"), "acc0": last.acc0 if last else float("nan"),
        "acc_per_slot": last.acc if last else [], "parameters": sum(p.numel() for p in module.parameters()),
    }

    # --- export ------------------------------------------------------------------------------------
    result = export_gguf(module, settings.taps, work.export, options.outfile, options.target, outtype=outtype)
    report.export = {"bytes": options.outfile.stat().st_size, "tensors": len(result.tensors),
                     "checkpoint": str(work.export), "outtype": outtype}

    # --- held-out evaluation -----------------------------------------------------------------------
    if eval_prompts:
        report.evaluation = evaluate(options.target, options.outfile, eval_prompts,
                                     n_predict=options.eval_n_predict or options.n_predict, n_threads=options.n_threads)
    write_json_atomically(work.root / "report.json", report.as_dict())
    return report


def resolve_outtype(outtype: str, work: WorkDir) -> str:
    """The drafter's storage type: ``auto`` is f16, or bf16 when some of the data's rows left float16's range.

    The drafter's ``fc`` multiplies the target's raw tap rows, and an f16 weight makes the CPU backend convert
    them to float16 first: Gemma 3's BOS row (1e5) would become infinity and poison the drafter's memory.

    Raises:
        TrainError: ``f16`` asked for such a target (before training, so the data is kept for a rerun).
    """
    wide = any("bf16" in info.get("rows", {}).values() for info in data_phase.shard_infos(work))
    if outtype == "auto":
        return "bf16" if wide else "f16"
    if outtype == "f16" and wide:
        raise TrainError("--outtype f16: the target's captured activations exceed float16's range (the data's "
                         "rows are stored as bf16), and the drafter's fc would read them as infinity; use "
                         "--outtype bf16, q8_0 or f32 (or auto)")
    return outtype


def _draft_vocabulary(settings: TrainSettings, work: WorkDir, records, required: set[int], placeholders: set[int],
                      n_vocab: int):
    """The reduced draft vocabulary's sorted target ids (None for the whole vocabulary): chosen once from the
    training data's target outputs and kept in train/draft_vocab.json, so a resumed run trains the same rows."""
    if not settings.draft_vocab:
        return None
    path = work.train / "draft_vocab.json"
    if path.exists():
        import json

        return np.asarray(json.loads(path.read_text())["ids"], dtype=np.int64)
    counts = vocab.output_counts(((r.tokens, r.prompt_len) for r in records), n_vocab)
    try:
        ids = vocab.choose_draft_vocab(counts, settings.draft_vocab, required, settings.mask_token,
                                          last=placeholders)
    except ValueError as exc:
        raise TrainError(f"--draft-vocab: {exc}") from None
    work.train.mkdir(parents=True, exist_ok=True)
    write_json_atomically(path, {"ids": ids.tolist(), "required": len(required - {settings.mask_token})})
    return ids


def _resolve_steps(settings: TrainSettings, work: WorkDir, module, records) -> int:
    """The step count: --steps, or --minutes divided by the time of a few timed steps (done once, on a copy of
    the module, and recorded in train/plan.json so a resumed run keeps the same schedule)."""
    if settings.minutes <= 0:
        return settings.steps
    plan = work.train / "plan.json"
    if plan.exists():
        import json

        return int(json.loads(plan.read_text())["steps"])
    import copy

    probe = copy.deepcopy(module)  # timed steps on a copy: the run itself starts from the untouched module
    optimizer = trainer.new_optimizer(probe, settings)
    # the first step pays one-time costs (allocations, the optimizer's state): untimed, or it would count about
    # twice the steps' real time and the run would stop halfway through its budget
    n = 5
    trainer.optimizer_step(probe, optimizer, records, settings, 0, n + 1, trainer.TrainStats())
    t0 = time.perf_counter()
    for step in range(1, n + 1):
        trainer.optimizer_step(probe, optimizer, records, settings, step, n + 1, trainer.TrainStats())
    per_step = (time.perf_counter() - t0) / n
    steps = max(1, int(settings.minutes * 60.0 / per_step))
    work.train.mkdir(parents=True, exist_ok=True)
    write_json_atomically(plan, {"steps": steps, "seconds_per_step": per_step, "minutes": settings.minutes})
    return steps


def evaluate(target: Path, drafter: Path, prompts: list[list[int]], *, n_predict: int,
             n_threads: int | None = None) -> dict:
    """Plain vs speculative greedy decoding of held-out prompts with the exported drafter (``bench``'s loop).

    Drafts a whole block every round (a fixed draft length) from the drafter alone (no prompt lookup, which
    ``run_bench`` adds by default for a drafter path): the figures describe the drafter, not the cost-aware
    loop's choices, which depend on the machine's timings.
    """
    from ..bench import BenchSummary, run_bench
    from ..drafter import DSparkDrafter

    with Model(target) as model:
        items = [{"tokens": p} for p in prompts]
        summary = BenchSummary(list(run_bench(model, drafter, items, n_predict=n_predict, n_threads=n_threads,
                                              n_draft=DSparkDrafter.peek_block_size(drafter), prompt_lookup=False,
                                              n_ctx=max(len(p) for p in prompts) + n_predict + 16)))
    d = summary.as_dict()
    accepted, reached = summary.per_position_counts()
    per_position = [float(a / r) if r else 0.0 for a, r in zip(accepted, reached)]
    # the draft sources that drafted: the drafter's name alone (a report that also lists "lookup" measured the
    # hybrid, as this evaluation did by mistake for a while)
    sources = sorted({name for r in summary.results for name in r.stats.by_source})
    return {k: d[k] for k in ("prompts", "n_predicted", "rounds", "drafted", "accepted", "accept", "tau", "ar_tok_s",
                              "sp_tok_s", "speedup", "token_match")} | {"per_position": per_position,
                                                                         "sources": sources}
