"""Plain vs speculative decoding on the same prompts, in one run (``pyllama-dspark bench``).

For every prompt: plain greedy (or sampled) decoding, then speculative decoding with the drafter,
same target context settings. Reports per prompt and overall: rounds, drafted, accepted, accept
rate, tau, decode tok/s of both, speedup (sp / ar), and whether the token ids match (at
temperature 0 anything but all-match is a bug).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from .context import Context
from .drafter import Drafter, DSparkDrafter, HistoryDrafter, PromptLookupDrafter
from .generate import generate, prompt_tokens
from .history import DEFAULT_HISTORY_TOKENS, HISTORY_BLOCK, HistoryStore
from .hybrid import HybridDrafter
from .model import Model
from .sampling import Sampler, SamplingParams
from .speculative import Speculator
from .stats import SpecStats


def load_prompts(path: str | Path) -> list[dict]:
    """Read a JSONL file of {"prompt": str} or {"messages": [{"role", "content"}, ...]} lines.

    Raises:
        ValueError: a line that is not JSON or has neither key (with its line number).
    """
    prompts = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from None
        if not isinstance(item, dict) or not (isinstance(item.get("prompt"), str) or
                                              isinstance(item.get("messages"), list)):
            raise ValueError(f'{path}:{number}: expected {{"prompt": ...}} or {{"messages": [...]}}')
        prompts.append(item)
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


@dataclass
class PromptResult:
    index: int
    n_prompt: int
    ar_tokens: list[int]
    sp_tokens: list[int]
    ar_t_decode: float
    stats: SpecStats
    ar_t_prefill: float = 0.0

    @property
    def match(self) -> bool:
        return self.ar_tokens == self.sp_tokens

    @property
    def first_mismatch(self) -> int | None:
        return first_mismatch(self.ar_tokens, self.sp_tokens)


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (the shorter one's length if one is a prefix), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass
class BenchSummary:
    results: list[PromptResult] = field(default_factory=list)

    def as_dict(self) -> dict:
        rs = self.results
        ar_tokens = sum(len(r.ar_tokens) for r in rs)
        ar_time = sum(r.ar_t_decode for r in rs)
        sp_tokens = sum(r.stats.n_generated for r in rs)
        sp_time = sum(r.stats.t_decode for r in rs)
        rounds = sum(r.stats.rounds for r in rs)
        plain_steps = sum(r.stats.plain_steps for r in rs)
        drafted = sum(r.stats.drafted for r in rs)
        accepted = sum(r.stats.accepted for r in rs)
        ar_tok_s = ar_tokens / ar_time if ar_time else 0.0
        sp_tok_s = sp_tokens / sp_time if sp_time else 0.0
        return {
            "prompts": len(rs), "n_predicted": sp_tokens, "rounds": rounds, "plain_steps": plain_steps,
            "drafted": drafted, "accepted": accepted,
            "accept": accepted / drafted if drafted else 0.0, "tau": accepted / rounds + 1 if rounds else 0.0,
            "ar_tok_s": ar_tok_s, "sp_tok_s": sp_tok_s, "speedup": sp_tok_s / ar_tok_s if ar_tok_s else 0.0,
            "token_match": sum(r.match for r in rs), "token_match_of": len(rs),
            "per_prompt": [{"index": r.index, "n_prompt": r.n_prompt, "match": r.match,
                            "first_mismatch": r.first_mismatch, **r.stats.as_dict(),
                            "ar_tok_s": len(r.ar_tokens) / r.ar_t_decode if r.ar_t_decode else 0.0} for r in rs],
        }

    def per_position_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """(accepted, reached) by draft position over every prompt; a prompt whose drafts were shorter reached
        fewer positions."""
        width = max((len(r.stats.reached_per_pos) for r in self.results), default=0)
        accepted, reached = np.zeros(width, dtype=np.int64), np.zeros(width, dtype=np.int64)
        for r in self.results:  # as int arrays: a prompt that never drafted has empty lists (numpy reads as float)
            accepted[: len(r.stats.accepted_per_pos)] += np.asarray(r.stats.accepted_per_pos, dtype=np.int64)
            reached[: len(r.stats.reached_per_pos)] += np.asarray(r.stats.reached_per_pos, dtype=np.int64)
        return accepted, reached

    def overall_line(self) -> str:
        d = self.as_dict()
        return (f"=== OVERALL: prompts={d['prompts']} n_predicted={d['n_predicted']} rounds={d['rounds']} "
                f"plain_steps={d['plain_steps']} "
                f"drafted={d['drafted']} accepted={d['accepted']} accept={d['accept']:.3f} tau={d['tau']:.3f} "
                f"ar_tok_s={d['ar_tok_s']:.2f} sp_tok_s={d['sp_tok_s']:.2f} speedup={d['speedup']:.3f} "
                f"token_match={d['token_match']}/{d['token_match_of']} ===")


def run_bench(model: Model, drafter: str | Path | Callable[[Context], Drafter], prompts: list[dict], *,
              n_predict: int, n_draft: int | None = None, n_draft_min: int = 0, p_min: float = 0.0,
              prompt_lookup: bool | None = None, history_tokens: int = DEFAULT_HISTORY_TOKENS,
              n_threads: int | None = None, n_ctx: int = 4096, n_batch: int = 512,
              n_gpu_layers: int = 0, consistent_numerics: bool = True,
              temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
              seed: int | None = 0) -> Iterator[PromptResult]:
    """Yield one PromptResult per prompt: plain, then speculative decoding, in two contexts of the same settings
    (the plain one has no capture, so it pays nothing for the drafter).

    Args:
        drafter: a DSpark drafter GGUF, or a function that makes a Drafter for the speculative context.
        n_draft: fixed draft length; None = cost-aware (the Speculator's default).
        n_draft_min, p_min: as ``Speculator`` and ``DSparkDrafter`` take them.
        prompt_lookup: wrap the drafter in a ``HybridDrafter`` (prompt lookup first, then the drafter); None (the
            default configuration, as ``load``): for a drafter given as a path.
        history_tokens: with prompt lookup, the hybrid's history of earlier replies (as ``load``; 0: none),
            shared by the run's prompts in order.
        consistent_numerics: the mode of both contexts (``Context``). False measures a GPU's verify without it:
            faster there, and the output may then differ from plain decoding (``PromptResult.match``).
        temperature, top_k, top_p, seed: the sampling of both runs (one seed for both).

    Raises:
        ValueError: chat prompts for a model without a chat template (checked before any decoding).
    """
    if any("messages" in item for item in prompts) and model.chat_template is None:
        raise ValueError(f"{model.path.name} has no chat template: chat ({{\"messages\"}}) prompts cannot be formatted")
    if prompt_lookup is None:
        prompt_lookup = not callable(drafter)
    if callable(drafter):
        make_drafter, k_rs = drafter, n_draft or 16  # the block size is known once the drafter exists
    else:
        path = drafter
        block = int(DSparkDrafter.peek_block_size(path))
        make_drafter = lambda ctx: DSparkDrafter(path, ctx, n_threads=n_threads,  # noqa: E731
                                                 n_gpu_layers=n_gpu_layers, p_min=p_min)
        if prompt_lookup:  # the hybrid's block is the largest of its sources'
            block = max(block, PromptLookupDrafter().block_size, HISTORY_BLOCK if history_tokens else 0)
        k_rs = block if n_draft is None else min(n_draft, block)
    if prompt_lookup:
        make_model_drafter = make_drafter
        store = HistoryStore(history_tokens) if history_tokens else None
        make_drafter = lambda ctx: HybridDrafter(  # noqa: E731
            make_model_drafter(ctx), history=None if store is None else HistoryDrafter(store))
    hybrid = model.is_hybrid or model.is_recurrent
    ctx = Context(model, n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads,
                  n_rs_seq=Speculator.target_rs_seq(k_rs) if hybrid else 0, consistent_numerics=consistent_numerics)
    plain_ctx = Context(model, n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads,
                        consistent_numerics=consistent_numerics)
    spec_drafter = make_drafter(ctx)
    try:
        spec = Speculator(ctx, spec_drafter, n_draft=n_draft, n_draft_min=n_draft_min)
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        for index, item in enumerate(prompts):
            # token ids (the training evaluation), a text, or chat messages
            text = (item["tokens"] if "tokens" in item else item["prompt"] if "prompt" in item
                    else model.apply_chat_template(item["messages"]))
            plain = generate(plain_ctx, text, max_tokens=n_predict, temperature=temperature, top_k=top_k,
                             top_p=top_p, seed=seed)
            tokens = prompt_tokens(ctx, text)
            stats = SpecStats()
            sampler = Sampler(params)
            sp_tokens = [t for step in spec.run(tokens, max_tokens=n_predict, sampler=sampler, stats=stats)
                         for t in step.tokens]
            yield PromptResult(index=index, n_prompt=len(tokens), ar_tokens=plain.tokens, sp_tokens=sp_tokens,
                               ar_t_decode=plain.t_decode, stats=stats, ar_t_prefill=plain.t_prefill)
    finally:
        close = getattr(spec_drafter, "close", None)
        if close is not None:
            close()
        ctx.close()
        plain_ctx.close()
