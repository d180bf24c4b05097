"""The training phase: the DeepSpec objective on the target's own continuations, resumable.

Per step: ``seqs_per_step`` sequences drawn from the data, ``anchors`` random anchors in each (the
anchor is a generated token; slot k predicts the token at anchor + k + 1), the block forward of
``DSparkDraft.blocks`` and, per slot, with the Markov bias teacher-forced by the true previous token:

    loss_k = 0.1 * CE(logits_k, token) + 0.9 * TVD(softmax(logits_k), p_k) + BCE(conf_k, 1 - TVD_k / 2)

where p_k is the target's distribution at that position (its last layer's row through the frozen
final norm and head) and TVD = sum |p - q|; slots are weighted exp(-k / gamma). AdamW, linear
warm-up then cosine decay, gradient clipping.

Determinism: the module is initialised from ``seed``; step s draws its sequences and anchors from
``numpy.random.default_rng([seed, s])``; a checkpoint holds the module, the optimizer and the step. A run
resumed from a checkpoint therefore takes exactly the steps an uninterrupted run takes, and ends with
the same weights bit for bit (on the same machine with the same thread count: the float summation
order of PyTorch's CPU kernels depends on the number of threads).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from .data import Record, anchor_range
from .model import DraftConfig, DSparkDraft, FrozenTarget
from .settings import TrainSettings, WorkDir
from .torch_import import torch

CHECKPOINT = "checkpoint.pt"


@dataclass
class StepLog:
    step: int
    loss: float
    ce: float
    tvd: float
    acc0: float        # slot-0 argmax accuracy against the target's token
    acc: list[float]   # per-slot accuracy (teacher-forced chain)
    lr: float
    seconds: float


@dataclass
class TrainStats:
    steps_done: int = 0
    steps_total: int = 0
    seconds: float = 0.0        # this run
    steps_this_run: int = 0
    last: StepLog | None = None
    time_forward: float = 0.0
    time_backward: float = 0.0
    time_optimizer: float = 0.0
    history: list[dict] = field(default_factory=list)

    @property
    def steps_per_s(self) -> float:
        return self.steps_this_run / self.seconds if self.seconds else 0.0


def build_module(settings: TrainSettings, frozen: FrozenTarget) -> DSparkDraft:
    n_vocab, n_embd = frozen.token_embd.shape
    config = DraftConfig(
        n_embd=n_embd, n_taps=len(settings.taps), n_layer=settings.n_layer, n_head=frozen.n_head,
        n_head_kv=frozen.n_head_kv, head_dim=n_embd // frozen.n_head, n_ff=frozen.n_ff, n_vocab=n_vocab,
        markov_rank=settings.markov_rank, block_size=settings.block_size, mask_token=settings.mask_token,
        eps=frozen.eps, rope_theta=frozen.rope_theta, n_ctx_train=frozen.n_ctx_train)
    torch.manual_seed(settings.seed)
    return DSparkDraft(config, frozen)


def learning_rate(settings: TrainSettings, steps: int, step: int) -> float:
    warm = max(1, int(round(settings.warmup * steps)))
    if step < warm:
        return settings.lr * (step + 1) / warm
    progress = (step - warm) / max(1, steps - warm)
    return settings.lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def sequence_loss(module: DSparkDraft, record: Record, anchors: np.ndarray, gamma: float):
    """(loss, metrics) of the blocks anchored at ``anchors`` in one sequence."""
    B = module.c.block_size
    tokens = torch.from_numpy(record.tokens.astype(np.int64))
    a = torch.from_numpy(anchors.astype(np.int64))
    features = torch.from_numpy(record.taps[: int(anchors.max())].astype(np.float32))
    hidden = module.blocks(features, a, tokens[a])                               # [n_a, B, n_embd]
    slot = torch.arange(B)
    prev = tokens[a[:, None] + slot[None, :]]                                    # prev_0 = anchor, prev_k = truth
    target = tokens[a[:, None] + slot[None, :] + 1]                              # slot k -> token at a + k + 1
    logits, conf = module.slot_logits(hidden.reshape(-1, hidden.shape[-1]), prev.reshape(-1))
    with torch.no_grad():
        last = torch.from_numpy(record.last.astype(np.float32))[(a[:, None] + slot[None, :]).reshape(-1)]
        p = torch.softmax(module.teacher_logits(last), dim=-1)
    log_q = torch.log_softmax(logits, dim=-1)
    ce = torch.nn.functional.nll_loss(log_q, target.reshape(-1), reduction="none")
    tvd = (p - log_q.exp()).abs().sum(-1)
    per_slot = 0.1 * ce + 0.9 * tvd
    if conf is not None:
        want = (1.0 - tvd.detach() / 2.0).clamp(0.0, 1.0)
        per_slot = per_slot + torch.nn.functional.binary_cross_entropy(conf.clamp(1e-6, 1 - 1e-6), want,
                                                                       reduction="none")
    weights = torch.exp(-slot.to(torch.float32) / gamma).repeat(len(anchors))
    loss = (per_slot * weights).sum() / weights.sum()
    hits = (logits.argmax(-1) == target.reshape(-1)).view(-1, B).float()
    return loss, {"ce": float(ce.detach().mean()), "tvd": float(tvd.detach().mean()), "acc": hits.mean(0).tolist()}


def draw(records: list[Record], settings: TrainSettings, step: int) -> list[tuple[int, np.ndarray]]:
    """Step ``step``'s sequences and anchors, a function of (seed, step) only."""
    rng = np.random.default_rng([settings.seed, step])
    picks = rng.choice(len(records), size=min(settings.seqs_per_step, len(records)), replace=False)
    out = []
    for i in picks:
        lo, hi = anchor_range(records[i], settings.block_size)
        n = min(settings.anchors, hi - lo + 1)
        out.append((int(i), np.sort(rng.choice(np.arange(lo, hi + 1), size=n, replace=False))))
    return out


def save_checkpoint(path: Path, module: DSparkDraft, optimizer, step: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"step": step, "module": module.state_dict(), "optimizer": optimizer.state_dict()}, tmp)
    os.replace(tmp, path)


def optimizer_step(module: DSparkDraft, optimizer, records: list[Record], settings: TrainSettings, step: int,
                   steps: int, stats: TrainStats) -> StepLog:
    """Step ``step`` of a ``steps``-step schedule: its sequences, forward, backward, clipping, AdamW. Adds its
    phase times to ``stats``."""
    t0 = time.perf_counter()
    lr = learning_rate(settings, steps, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    batch = draw(records, settings, step)
    total, metrics = 0.0, []
    for index, anchors in batch:
        tf = time.perf_counter()
        loss, m = sequence_loss(module, records[index], anchors, settings.gamma)
        tb = time.perf_counter()
        (loss / len(batch)).backward()
        stats.time_forward += tb - tf
        stats.time_backward += time.perf_counter() - tb
        total += float(loss.detach()) / len(batch)
        metrics.append(m)
    to = time.perf_counter()
    torch.nn.utils.clip_grad_norm_(module.parameters(), settings.clip)
    optimizer.step()
    stats.time_optimizer += time.perf_counter() - to
    acc = np.mean([m["acc"] for m in metrics], axis=0).tolist()
    return StepLog(step=step + 1, loss=total, ce=float(np.mean([m["ce"] for m in metrics])),
                   tvd=float(np.mean([m["tvd"] for m in metrics])), acc0=acc[0], acc=acc, lr=lr,
                   seconds=time.perf_counter() - t0)


def new_optimizer(module: DSparkDraft, settings: TrainSettings):
    return torch.optim.AdamW(module.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)


def train(module: DSparkDraft, records: list[Record], settings: TrainSettings, work: WorkDir, steps: int, *,
          checkpoint_seconds: float = 60.0, checkpoint_steps: int = 0,
          on_step: Callable[[StepLog], None] | None = None) -> TrainStats:
    """Train ``module`` to ``steps`` steps, resuming from the work directory's checkpoint.

    A checkpoint is written every ``checkpoint_steps`` steps (when > 0), else every ``checkpoint_seconds``,
    and at the end; an interrupted run loses at most the steps since the last one.
    """
    work.train.mkdir(parents=True, exist_ok=True)
    optimizer = new_optimizer(module, settings)
    start = 0
    ck = work.train / CHECKPOINT
    if ck.exists():
        state = torch.load(ck, weights_only=True)
        module.load_state_dict(state["module"])  # the frozen target's buffers are not part of the state
        optimizer.load_state_dict(state["optimizer"])
        start = int(state["step"])
    stats = TrainStats(steps_done=start, steps_total=steps)
    last_save = time.perf_counter()
    t_run = time.perf_counter()
    for step in range(start, steps):
        log = optimizer_step(module, optimizer, records, settings, step, steps, stats)
        stats.steps_done, stats.steps_this_run, stats.last = step + 1, stats.steps_this_run + 1, log
        stats.history.append({"step": log.step, "loss": log.loss, "acc0": log.acc0})
        due = ((step + 1) % checkpoint_steps == 0 if checkpoint_steps > 0
               else time.perf_counter() - last_save >= checkpoint_seconds)
        if due:
            save_checkpoint(ck, module, optimizer, step + 1)
            last_save = time.perf_counter()
        if on_step is not None:
            on_step(log)
    stats.seconds = time.perf_counter() - t_run
    save_checkpoint(ck, module, optimizer, stats.steps_done)
    return stats
