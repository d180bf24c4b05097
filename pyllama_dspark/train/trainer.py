"""The training phase: the DeepSpec objective on the target's own continuations, resumable.

Per step: ``seqs_per_step`` sequences drawn from the data, ``anchors`` random anchors in each (the
anchor is a generated token; slot k predicts the token at anchor + k + 1), the block forward of
``DSparkDraft.blocks`` and, per slot, with the Markov bias teacher-forced by the true previous token:

    loss_k = ce * CE(logits_k, token) + tv * TVD(softmax(logits_k), p_k) + kl * KL(p_k || q_k)
             + BCE(conf_k, 1 - TVD_k / 2)

(default ce 0.1, tv 0.9, kl 0; ``LossMix``) where p_k is the target's distribution at that position: its
top-k ids and probabilities stored by the data phase, or (older shards) its last layer's row through the
frozen final norm and head; TVD = sum |p - q|. With a reduced draft vocabulary q is 0 outside it, CE skips
tokens outside it, and the teacher's mass there counts fully in TVD. Slots are weighted exp(-k / gamma);
optional Gaussian noise on the feature rows. AdamW, linear warm-up then cosine decay, gradient clipping.

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

from .data import Record, anchor_range, decode_rows
from .model import IGNORE, DraftConfig, DSparkDraft, FrozenTarget
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


def build_module(settings: TrainSettings, frozen: FrozenTarget, draft_ids: np.ndarray | None = None) -> DSparkDraft:
    n_vocab, n_embd = frozen.token_embd.shape
    config = DraftConfig(
        n_embd=n_embd, n_taps=len(settings.taps), n_layer=settings.n_layer, n_head=frozen.n_head,
        n_head_kv=frozen.n_head_kv, head_dim=n_embd // frozen.n_head, n_ff=frozen.n_ff, n_vocab=n_vocab,
        markov_rank=settings.markov_rank, block_size=settings.block_size, mask_token=settings.mask_token,
        eps=frozen.eps, rope_theta=frozen.rope_theta, n_ctx_train=frozen.n_ctx_train)
    torch.manual_seed(settings.seed)
    return DSparkDraft(config, frozen, draft_ids)


def learning_rate(settings: TrainSettings, steps: int, step: int) -> float:
    warm = max(1, int(round(settings.warmup * steps)))
    if step < warm:
        return settings.lr * (step + 1) / warm
    progress = (step - warm) / max(1, steps - warm)
    return settings.lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


@dataclass(frozen=True)
class LossMix:
    """loss_k = ce * CE + tv * TVD + kl * KL(p || q), plus the confidence BCE; slot k weighted exp(-k / gamma)."""

    ce: float = 0.1
    tv: float = 0.9
    kl: float = 0.0
    gamma: float = 4.0

    @classmethod
    def of(cls, settings: TrainSettings) -> "LossMix":
        return cls(ce=settings.ce_weight, tv=settings.tv_weight, kl=settings.kl_weight, gamma=settings.gamma)


def sequence_loss(module: DSparkDraft, record: Record, anchors: np.ndarray, mix: LossMix | float,
                  noise: float = 0.0, rng: np.random.Generator | None = None):
    """(loss, metrics) of the blocks anchored at ``anchors`` in one sequence. ``mix`` may be a bare gamma (the
    default loss mix). ``noise`` > 0 adds Gaussian noise of that size relative to each feature row's RMS, drawn
    from ``rng`` (the step's generator, so a resumed run draws the same noise)."""
    mix = mix if isinstance(mix, LossMix) else LossMix(gamma=float(mix))
    B = module.c.block_size
    tokens = torch.from_numpy(record.tokens.astype(np.int64))
    a = torch.from_numpy(anchors.astype(np.int64))
    raw = decode_rows(record.taps[: int(anchors.max())])
    if noise > 0.0:
        rms = np.sqrt(np.mean(raw * raw, axis=1, keepdims=True))
        raw = raw + (noise * rms * (rng or np.random.default_rng()).standard_normal(raw.shape)).astype(np.float32)
    features = torch.from_numpy(raw)
    hidden = module.blocks(features, a, tokens[a])                               # [n_a, B, n_embd]
    slot = torch.arange(B)
    prev = tokens[a[:, None] + slot[None, :]]                                    # prev_0 = anchor, prev_k = truth
    target = tokens[a[:, None] + slot[None, :] + 1]                              # slot k -> token at a + k + 1
    logits, conf = module.slot_logits(hidden.reshape(-1, hidden.shape[-1]), prev.reshape(-1))
    column = target.reshape(-1)
    if module.draft_ids is not None:
        column = module.draft_index[column]  # IGNORE where the token is outside the draft vocabulary: no CE term
    log_q = torch.log_softmax(logits, dim=-1)
    ce = torch.nn.functional.nll_loss(log_q, column, reduction="none", ignore_index=IGNORE)
    positions = (a[:, None] + slot[None, :]).reshape(-1)  # the row whose next token slot k predicts
    if record.top_ids is not None:
        tvd, kl = _sparse_teacher_terms(module, record, positions, log_q)
    else:
        tvd, kl = _dense_teacher_terms(module, record, positions, log_q)
    per_slot = mix.ce * ce + mix.tv * tvd
    if mix.kl > 0.0:
        per_slot = per_slot + mix.kl * kl
    if conf is not None:
        want = (1.0 - tvd.detach() / 2.0).clamp(0.0, 1.0)
        per_slot = per_slot + torch.nn.functional.binary_cross_entropy(conf.clamp(1e-6, 1 - 1e-6), want,
                                                                       reduction="none")
    weights = torch.exp(-slot.to(torch.float32) / mix.gamma).repeat(len(anchors))
    loss = (per_slot * weights).sum() / weights.sum()
    drafted = logits.argmax(-1) if module.draft_ids is None else module.draft_ids[logits.argmax(-1)]
    hits = (drafted == target.reshape(-1)).view(-1, B).float()
    return loss, {"ce": float(ce.detach().mean()), "tvd": float(tvd.detach().mean()), "acc": hits.mean(0).tolist()}


def _dense_teacher_terms(module: DSparkDraft, record: Record, positions, log_q):
    """(TVD, KL) per row against the target's whole distribution, recomputed from its stored last-layer rows
    through the frozen final norm and head. With a reduced draft vocabulary the teacher's mass outside it counts
    fully in TVD (q = 0 there), and KL runs over the draft vocabulary only (outside, q = 0 would make it
    infinite)."""
    with torch.no_grad():
        last = torch.from_numpy(decode_rows(record.last))[positions]
        p = torch.softmax(module.teacher_logits(last), dim=-1)
        outside = 0.0
        if module.draft_ids is not None:
            p = p[:, module.draft_ids]
            outside = (1.0 - p.sum(-1)).clamp(min=0.0)
    tvd = (p - log_q.exp()).abs().sum(-1) + outside
    kl = (p * (torch.log(p.clamp(min=1e-30)) - log_q)).sum(-1)
    return tvd, kl


def _sparse_teacher_terms(module: DSparkDraft, record: Record, positions, log_q):
    """(TVD, KL) per row against the target's top-k ids and probabilities stored by the data phase (no head
    matmul: the teacher costs nothing here). Outside the top k the target's remaining mass r and the draft's
    remaining mass s are not matched token by token: TVD counts r + s (an upper bound, which also pushes the
    draft's mass into the target's top k); KL runs over the top k ids inside the draft vocabulary."""
    index = positions.numpy() - (record.prompt_len - 1)
    ids = torch.from_numpy(record.top_ids[index].astype(np.int64))          # [R, k]
    p = torch.from_numpy(record.top_p[index].astype(np.float32))            # [R, k]
    columns = ids if module.draft_ids is None else module.draft_index[ids]
    inside = columns != IGNORE
    log_q_k = log_q.gather(1, columns.clamp(min=0))
    q_k = torch.where(inside, log_q_k.exp(), torch.zeros_like(log_q_k))
    rest_p = (1.0 - p.sum(-1)).clamp(min=0.0)
    rest_q = (1.0 - q_k.sum(-1)).clamp(min=0.0)
    tvd = (p - q_k).abs().sum(-1) + rest_p + rest_q
    kl = torch.where(inside, p * (torch.log(p.clamp(min=1e-30)) - log_q_k), torch.zeros_like(p)).sum(-1)
    return tvd, kl


def draw(rng: np.random.Generator, records: list[Record], settings: TrainSettings) -> list[tuple[int, np.ndarray]]:
    """A step's sequences and their sorted anchors, drawn from the step's generator (seeded by (seed, step), so a
    function of those only; the same generator then draws the step's feature noise)."""
    picks = rng.choice(len(records), size=min(settings.seqs_per_step, len(records)), replace=False)
    out = []
    for i in picks:
        lo, hi = anchor_range(records[i], settings.block_size)
        n = min(settings.anchors, hi - lo + 1)
        out.append((int(i), np.sort(rng.choice(np.arange(lo, hi + 1), size=n, replace=False))))
    return out


def init_from_target_layer(module: DSparkDraft, target: Path, layer: int) -> None:
    """Copy target layer ``layer``'s attention, MLP and norm weights into every drafter layer (the drafter has the
    target's widths). A llama-arch GGUF stores q/k rows permuted for llama.cpp's interleaved RoPE; the drafter
    rotates halves (NEOX), so those rows are put back in Hugging Face order first."""
    from ..gguf_header import GGUFHeader

    header = GGUFHeader(target)
    arch = header.value("general.architecture")
    c = module.c

    def weight(name):
        full = f"blk.{layer}.{name}.weight"
        return None if full not in header.tensors else header.dequantized(full).astype(np.float32)

    def unpermute(w, n_head):
        if arch not in ("llama",):
            return w
        rows, cols = w.shape
        return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)

    pairs = {"q_proj": ("attn_q", c.n_head), "k_proj": ("attn_k", c.n_head_kv), "v_proj": ("attn_v", None),
             "o_proj": ("attn_output", None), "gate_proj": ("ffn_gate", None), "up_proj": ("ffn_up", None),
             "down_proj": ("ffn_down", None)}
    norms = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "q_norm": "attn_q_norm",
             "k_norm": "attn_k_norm"}
    with torch.no_grad():
        for draft_layer in module.layers:
            for ours, (theirs, heads) in pairs.items():
                w = weight(theirs)
                target_param = getattr(draft_layer, ours).weight
                if w is None or tuple(w.shape) != tuple(target_param.shape):
                    raise ValueError(f"target layer {layer} has no {theirs} of shape {list(target_param.shape)}")
                target_param.copy_(torch.from_numpy(unpermute(w, heads) if heads else w))
            for ours, theirs in norms.items():
                w = weight(theirs)
                if w is not None and w.shape == getattr(draft_layer, ours).shape:
                    getattr(draft_layer, ours).copy_(torch.from_numpy(w))


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
    rng = np.random.default_rng([settings.seed, step])
    batch = draw(rng, records, settings)
    mix = LossMix.of(settings)
    total, metrics = 0.0, []
    for index, anchors in batch:
        tf = time.perf_counter()
        loss, m = sequence_loss(module, records[index], anchors, mix, settings.noise, rng)
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
