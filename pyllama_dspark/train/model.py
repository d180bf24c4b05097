"""The DSpark drafter as a PyTorch module, computing what the ``dflash`` GGUF graph computes.

Semantics (llama.cpp ``src/models/dflash.cpp``, as tests/dspark_reference.py models them):

- context: feature rows ``f`` (the concatenated tap outputs) become ``g = rms(fc f) * hidden_norm``;
  every layer projects ``g`` with its own ``k_proj``/``v_proj`` (k: per-head k_norm, then NEOX RoPE at
  the row's absolute position; v as is). Context rows issue no queries and skip ``input_layernorm``.
- block: ids ``[anchor, mask, ..., mask]`` at positions ``a .. a+B-1``, the target's frozen token
  embeddings; per layer: ``input_layernorm``, q/k/v with per-head q_norm/k_norm and RoPE, attention of
  the block's queries over [context rows before a ; the block], NON-causal, GQA; ``o_proj``; residual;
  ``post_attention_layernorm``; SwiGLU MLP; residual.
- head: ``h = rms(x) * norm``; ``base = h @ output^T`` with the target's frozen output matrix, or with a
  reduced draft vocabulary (``draft_ids``, the GGUF's ``d2t``) the drafter's own head of those rows only
  (copied from the target's rows and kept frozen); the runtime scatters them to the target's ids, -inf
  elsewhere.
- Markov head (rank R): ``logits_k = base_k + markov_w2 @ markov_w1[prev_k]``, prev_0 = the anchor; in
  training prev_k is the true previous token (teacher forcing), when drafting the argmax of slot k-1.
- confidence: ``sigmoid(conf_proj [h_k ; markov_w1[prev_k]] + b)``.

Only this module imports torch (with the rest of ``pyllama_dspark.train``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .torch_import import torch

nn = torch.nn
F = torch.nn.functional


IGNORE = -100  # draft column of a target id outside a reduced draft vocabulary (torch's ignore_index default)


@dataclass(frozen=True)
class DraftConfig:
    n_embd: int           # = the target's width (the drafter reads the target's token embeddings)
    n_taps: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    markov_rank: int
    block_size: int
    mask_token: int
    eps: float
    rope_theta: float
    confidence: bool = True
    n_ctx_train: int = 4096


@dataclass
class FrozenTarget:
    """The target's tensors a drafter borrows (float32, numpy order [rows, cols])."""

    token_embd: np.ndarray   # [n_vocab, n_embd]
    output: np.ndarray       # [n_vocab, n_embd] (token_embd when the target ties them)
    output_norm: np.ndarray  # [n_embd] the target's final norm (teacher only)
    eps: float
    n_head: int
    n_head_kv: int
    n_ff: int
    rope_theta: float
    n_ctx_train: int


def load_frozen_target(path) -> FrozenTarget:
    """Dequantize the token embeddings, output head and final norm of a target GGUF (gguf-py, numpy)."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = reader.get_field("general.architecture").contents()

    def value(key, default=None):
        field = reader.get_field(f"{arch}.{key}")
        return default if field is None else field.contents()

    tensors = {t.name: t for t in reader.tensors}

    def matrix(name):
        t = tensors[name]
        shape = tuple(reversed([int(d) for d in t.shape]))
        data = np.asarray(t.data)
        if t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            data = gguf.quants.dequantize(data, t.tensor_type)
        return np.array(data, dtype=np.float32).reshape(shape)  # a writable copy (the reader's data is a memmap)

    token_embd = matrix("token_embd.weight")
    output = matrix("output.weight") if "output.weight" in tensors else token_embd
    n_head = value("attention.head_count")
    n_head_kv = value("attention.head_count_kv", n_head)
    n_ff = value("feed_forward_length")
    # per-layer arrays (qwen35 and friends): the first layer's value
    first = lambda v: int(v[0]) if isinstance(v, (list, tuple)) else int(v)  # noqa: E731
    return FrozenTarget(token_embd=token_embd, output=output, output_norm=matrix("output_norm.weight"),
                        eps=float(value("attention.layer_norm_rms_epsilon", 1e-6)), n_head=first(n_head),
                        n_head_kv=first(n_head_kv), n_ff=first(n_ff), rope_theta=float(value("rope.freq_base", 1e4)),
                        n_ctx_train=int(value("context_length", 4096)))


def rms_norm(x, weight, eps: float):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_neox(x, pos, theta: float):
    """NEOX RoPE of x [..., T, H, D] at positions pos [T]: rotates the pairs (i, i + D/2)."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.to(torch.float64)[:, None] * inv[None, :]
    cos, sin = ang.cos().to(x.dtype)[:, None, :], ang.sin().to(x.dtype)[:, None, :]
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class DraftLayer(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.c = c
        q, kv = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
        self.q_proj = nn.Linear(c.n_embd, q, bias=False)
        self.k_proj = nn.Linear(c.n_embd, kv, bias=False)
        self.v_proj = nn.Linear(c.n_embd, kv, bias=False)
        self.o_proj = nn.Linear(q, c.n_embd, bias=False)
        self.q_norm = nn.Parameter(torch.ones(c.head_dim))
        self.k_norm = nn.Parameter(torch.ones(c.head_dim))
        self.input_layernorm = nn.Parameter(torch.ones(c.n_embd))
        self.post_attention_layernorm = nn.Parameter(torch.ones(c.n_embd))
        self.gate_proj = nn.Linear(c.n_embd, c.n_ff, bias=False)
        self.up_proj = nn.Linear(c.n_embd, c.n_ff, bias=False)
        self.down_proj = nn.Linear(c.n_ff, c.n_embd, bias=False)

    def kv(self, x, pos):
        """K (normed, roped) and V [T, Hkv, D] of input rows x [T, n_embd]."""
        c = self.c
        k = self.k_proj(x).view(-1, c.n_head_kv, c.head_dim)
        k = rope_neox(rms_norm(k, self.k_norm, c.eps), pos, c.rope_theta)
        return k, self.v_proj(x).view(-1, c.n_head_kv, c.head_dim)

    def forward(self, x, pos, k_ctx, v_ctx, mask):
        """x [Q, n_embd] block rows at pos [Q]; k_ctx/v_ctx [S, Hkv, D]; mask [Q, S + Q] (True = attend)."""
        c = self.c
        n = rms_norm(x, self.input_layernorm, c.eps)
        q = self.q_proj(n).view(-1, c.n_head, c.head_dim)
        q = rope_neox(rms_norm(q, self.q_norm, c.eps), pos, c.rope_theta)
        k_blk, v_blk = self.kv(n, pos)
        k = torch.cat([k_ctx, k_blk]).repeat_interleave(c.n_head // c.n_head_kv, dim=1)
        v = torch.cat([v_ctx, v_blk]).repeat_interleave(c.n_head // c.n_head_kv, dim=1)
        att = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             attn_mask=mask, scale=1.0 / math.sqrt(c.head_dim))
        h = self.o_proj(att.transpose(0, 1).reshape(x.shape[0], -1)) + x
        n = rms_norm(h, self.post_attention_layernorm, c.eps)
        return self.down_proj(F.silu(self.gate_proj(n)) * self.up_proj(n)) + h


class DSparkDraft(nn.Module):
    """The trainable drafter; the target's embeddings, head and final norm are frozen buffers.

    ``draft_ids`` (sorted target ids, never the mask token) gives a reduced draft vocabulary: slot logits then
    cover those ids only (``markov_w2`` has one row per id, the head the target's rows of them)."""

    def __init__(self, c: DraftConfig, frozen: FrozenTarget, draft_ids: np.ndarray | None = None):
        super().__init__()
        self.c = c
        n_out = c.n_vocab if draft_ids is None else len(draft_ids)
        self.fc = nn.Linear(c.n_taps * c.n_embd, c.n_embd, bias=False)
        self.hidden_norm = nn.Parameter(torch.ones(c.n_embd))
        self.layers = nn.ModuleList([DraftLayer(c) for _ in range(c.n_layer)])
        self.norm = nn.Parameter(torch.ones(c.n_embd))
        self.markov_w1 = nn.Parameter(torch.empty(c.n_vocab, c.markov_rank)) if c.markov_rank else None
        self.markov_w2 = nn.Parameter(torch.empty(n_out, c.markov_rank)) if c.markov_rank else None
        width = c.n_embd + c.markov_rank
        self.conf_proj = nn.Linear(width, 1) if c.confidence else None
        self.register_buffer("token_embd", torch.from_numpy(frozen.token_embd), persistent=False)
        # the teacher always reads the target's whole head; the drafter its rows of the draft vocabulary
        self.register_buffer("target_output", torch.from_numpy(frozen.output), persistent=False)
        if draft_ids is None:
            self.draft_ids = None
            self.output = self.target_output
        else:
            ids = np.asarray(draft_ids, dtype=np.int64)
            if ids.ndim != 1 or not 0 < len(ids) <= c.n_vocab or np.unique(ids).size != len(ids) \
                    or ids.min() < 0 or ids.max() >= c.n_vocab or c.mask_token in set(ids.tolist()):
                raise ValueError("draft_ids must be distinct target ids in [0, n_vocab), without the mask token")
            self.register_buffer("draft_ids", torch.from_numpy(ids), persistent=False)
            index = torch.full((c.n_vocab,), IGNORE, dtype=torch.long)  # target id -> draft column, or IGNORE
            index[self.draft_ids] = torch.arange(len(ids))
            self.register_buffer("draft_index", index, persistent=False)
            self.register_buffer("output", torch.from_numpy(np.ascontiguousarray(frozen.output[ids])),
                                 persistent=False)
        self.register_buffer("target_norm", torch.from_numpy(frozen.output_norm), persistent=False)
        self.target_eps = frozen.eps
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Qwen-style init: N(0, 0.02) matrices, unit norms; a small Markov head and a neutral confidence."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        if self.markov_w1 is not None:
            nn.init.normal_(self.markov_w1, std=0.02)
            nn.init.normal_(self.markov_w2, std=0.02)

    # --- pieces ---------------------------------------------------------------------------------
    def context(self, features):
        """``g = rms(fc f) * hidden_norm`` for feature rows [P, n_taps * n_embd]."""
        return rms_norm(self.fc(features), self.hidden_norm, self.c.eps)

    def markov_bias(self, prev):
        """[N, n_vocab] bias for previous tokens prev [N] (zeros without a Markov head)."""
        if self.markov_w1 is None:
            return None
        return self.markov_w1[prev] @ self.markov_w2.T

    def confidence(self, hidden, prev):
        if self.conf_proj is None:
            return None
        parts = [hidden] + ([self.markov_w1[prev]] if self.markov_w1 is not None else [])
        return torch.sigmoid(self.conf_proj(torch.cat(parts, dim=-1))).squeeze(-1)

    def teacher_logits(self, last_rows):
        """The target's logits from its last layer's output rows (frozen final norm and head)."""
        return rms_norm(last_rows, self.target_norm, self.target_eps) @ self.target_output.T

    # --- forward over many blocks of one sequence ------------------------------------------------
    def blocks(self, features, anchors, anchor_tokens):
        """Final-norm hidden [n_a, B, n_embd] of the blocks anchored at ``anchors`` [n_a] (tokens
        ``anchor_tokens`` [n_a]) over context rows ``features`` [P, ...] (row j at position j).

        Block i attends to context rows < anchors[i] and to its own B rows, non-causally.
        """
        c = self.c
        B, n_a = c.block_size, anchors.shape[0]
        P = features.shape[0]
        g = self.context(features)
        ctx_pos = torch.arange(P)
        offsets = torch.arange(B)
        pos = (anchors[:, None] + offsets[None, :]).reshape(-1)
        ids = torch.full((n_a, B), c.mask_token, dtype=torch.long)
        ids[:, 0] = anchor_tokens
        x = self.token_embd[ids.reshape(-1)]
        block_of = torch.arange(n_a).repeat_interleave(B)
        mask = torch.cat([ctx_pos[None, :] < anchors.repeat_interleave(B)[:, None],   # context rows before a
                          block_of[:, None] == block_of[None, :]], dim=1)             # the own block, non-causal
        for layer in self.layers:
            k_ctx, v_ctx = layer.kv(g, ctx_pos)
            x = layer(x, pos, k_ctx, v_ctx, mask)
        return rms_norm(x, self.norm, c.eps).view(n_a, B, -1)

    def slot_logits(self, hidden, prev):
        """Post-Markov logits [N, n_vocab] (or [N, len(draft_ids)]: one column per draft-vocabulary id) and
        confidence [N] of slot rows ``hidden`` [N, n_embd] with previous tokens ``prev`` [N]."""
        logits = hidden @ self.output.T
        bias = self.markov_bias(prev)
        if bias is not None:
            logits = logits + bias
        return logits, self.confidence(hidden, prev)

    def to_target_vocab(self, logits):
        """Slot logits over the target's vocabulary: a reduced vocabulary's columns at their target ids and -inf
        everywhere else, as llama.cpp's graph scatters them (full-vocabulary logits pass through)."""
        if self.draft_ids is None:
            return logits
        full = torch.full((logits.shape[0], self.c.n_vocab), float("-inf"), dtype=logits.dtype)
        full[:, self.draft_ids] = logits
        return full

    @torch.no_grad()
    def propose(self, features, anchor: int):
        """What the runtime drafts after context rows ``features`` [P, ...] at anchor position P: slot logits
        [B, n_vocab] with the greedy Markov chain, and confidence [B] (or None)."""
        hidden = self.blocks(features, torch.tensor([features.shape[0]]), torch.tensor([anchor]))[0]
        logits, conf, prev = [], [], int(anchor)
        for k in range(self.c.block_size):
            row, cf = self.slot_logits(hidden[k:k + 1], torch.tensor([prev]))
            row = self.to_target_vocab(row)
            logits.append(row[0])
            conf.append(None if cf is None else cf[0])
            prev = int(row[0].argmax())
        return torch.stack(logits), (None if conf[0] is None else torch.stack(conf))
