"""The data phase: the target continues the prompts itself, and its hidden states are kept.

For every prompt the target generates up to ``n_predict`` tokens (greedy, or sampled with a seed per
prompt) while the context captures, densely, the tap layers and the target's last layer for every
position. A shard stores, per sequence, the token ids (prompt + continuation), the prompt length and
the rows for positions 0..L-2 (the last token's row is never needed: it would predict a token that
does not exist), with the target's 32 most likely next tokens at every generated position. The last layer
is stored too: without the top-k the trainer recomputes the teacher's distribution through the frozen final
norm and output head. A token costs ``(n_taps + 1) * n_embd * 2`` bytes of rows rather than ``n_vocab * 4``.

Rows are float16 where they fit, else bfloat16 (as uint16 bits; ``decode_rows`` reads both): some targets'
activations leave float16's range. Gemma 3 270M's layers 6-15 reach 4e4-1e5 at the BOS position, which
float16 would store as infinity. The choice is made per shard and per array (``taps``, ``last``) from the
rows themselves, so data of targets that fit keeps float16's precision.

Several prompts are generated at once, one sequence each, so a decode carries one token of every
active sequence (``parallel``; a target context's KV is split between its sequences).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import numpy as np

from ..bench import load_prompts
from ..context import Context
from ..model import Model
from ..sampling import Sampler, SamplingParams
from .settings import TrainError, TrainSettings, WorkDir, write_json_atomically

MANIFEST = "manifest.json"


@dataclass
class Record:
    tokens: np.ndarray      # [L] int32
    prompt_len: int
    taps: np.ndarray        # [L-1, n_taps * n_embd] f16, or bf16 bits as uint16 (decode_rows)
    last: np.ndarray        # [L-1, n_embd] f16 or bf16 bits (decode_rows)
    # the target's top-k next-token ids and probabilities at positions prompt_len-1 .. L-2 (the rows whose next
    # token the target generated), [L - prompt_len, k]; None in shards written without them (the trainer then
    # recomputes the teacher from ``last``)
    top_ids: np.ndarray | None = None   # int32
    top_p: np.ndarray | None = None     # f16


class Continuation(NamedTuple):
    """One sequence continued by ``continue_side_by_side``."""

    tokens: list[int]               # prompt + continuation
    rows: np.ndarray | None         # f32 capture rows of positions 0..L-2 (with capture)
    top_ids: np.ndarray | None      # int32 [L - prompt_len, k]: the target's top-k ids at positions prompt_len-1..L-2
    top_p: np.ndarray | None        # f16, their probabilities (softmax of the whole vocabulary)


@dataclass
class DataStats:
    sequences: int = 0
    tokens: int = 0               # prompt + generated tokens stored
    generated: int = 0
    seconds: float = 0.0          # time spent generating in this run
    shards_done: int = 0
    shards_total: int = 0
    bytes: int = 0
    generated_this_run: int = 0

    @property
    def tok_s(self) -> float:
        return self.generated_this_run / self.seconds if self.seconds else 0.0


def read_prompts(path: Path, model: Model) -> list[list[int]]:
    """Token ids of every prompt of a JSONL file, chat prompts through the target's template.

    Raises:
        TrainError: missing, empty or malformed file (with the line number), chat prompts without a template,
            or a prompt that tokenizes to nothing.
    """
    if not path.is_file():
        raise TrainError(f"--prompts {path}: no such file")
    try:
        items = load_prompts(path)
    except ValueError as exc:
        raise TrainError(f"--prompts {exc}") from None
    if any("messages" in item for item in items) and model.chat_template is None:
        raise TrainError(f"--prompts {path}: chat prompts ({{\"messages\"}}), but {model.path.name} has no chat "
                         f"template")
    out = []
    for number, item in enumerate(items, 1):
        if "messages" in item:
            bad = [m for m in item["messages"] if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                                                        and isinstance(m.get("content"), str))]
            if bad:
                raise TrainError(f"--prompts {path}: prompt {number}: every message needs string 'role' and "
                                 f"'content'")
            text = model.apply_chat_template(item["messages"])
        else:
            text = item["prompt"]
        ids = model.tokenize(text, parse_special=True) if model.has_vocab else np.zeros(0, np.int32)
        if len(ids) == 0:
            raise TrainError(f"--prompts {path}: prompt {number} is empty after tokenization")
        out.append([int(t) for t in ids])
    return out


def shard_path(work: WorkDir, index: int) -> Path:
    return work.data / f"shard-{index:05d}.npz"


def _manifest(work: WorkDir) -> dict:
    path = work.data / MANIFEST
    return json.loads(path.read_text()) if path.exists() else {"shards": {}}


def generate_data(model: Model, prompts: list[list[int]], settings: TrainSettings, work: WorkDir, *,
                  n_threads: int | None = None, parallel: int = 8,
                  progress: Callable[[int], None] | None = None,
                  on_shard: Callable[[], None] | None = None) -> DataStats:
    """Generate every missing shard (resumable: finished shards are kept, an interrupted one is redone).

    ``progress(n)`` is called with the number of tokens generated since the last call, ``on_shard()`` after
    each shard this run writes.
    """
    work.data.mkdir(parents=True, exist_ok=True)
    manifest = _manifest(work)
    key = settings.data_key()
    if manifest.setdefault("key", key) != key:
        have = manifest["key"]
        diff = ", ".join(f"{k}: {have.get(k)!r} there, {key.get(k)!r} now" for k in sorted(key) if have.get(k) != key.get(k))
        raise TrainError(f"data directory {work.data} holds data of other settings ({diff}); use another --data-dir")
    capture = list(settings.taps) + [model.n_layer - 1]
    n_shards = (len(prompts) + settings.shard_size - 1) // settings.shard_size
    stats = DataStats(shards_total=n_shards)
    longest = max(len(p) for p in prompts) + settings.n_predict + 1
    parallel = max(1, min(parallel, settings.shard_size))
    ctx = None
    lock = None
    try:
        for index in range(n_shards):
            if settings.data_limit and stats.generated >= settings.data_limit:
                break  # enough for --data-limit: training reads no further
            name = shard_path(work, index).name
            if name in manifest["shards"] and shard_path(work, index).exists():
                _count(stats, manifest["shards"][name])
                continue
            if lock is None:  # a shared --data-dir: one writer at a time (readers of finished shards need none)
                lock = _lock_for_writing(work)
                manifest = _manifest(work)  # what another writer finished before the lock was ours
                manifest.setdefault("key", key)  # a first writer's manifest may not exist yet: it gets the key
                if name in manifest["shards"] and shard_path(work, index).exists():
                    _count(stats, manifest["shards"][name])
                    continue
            if ctx is None:
                # one sequence per parallel prompt; llama.cpp splits n_ctx between the sequences' streams
                ctx = Context(model, n_ctx=parallel * longest, n_batch=max(512, parallel), n_seq_max=parallel,
                              n_threads=n_threads)
                ctx.set_capture_layers(capture, masked=False)
            chunk = range(index * settings.shard_size, min(len(prompts), (index + 1) * settings.shard_size))
            t0 = time.perf_counter()
            seqs: list[Record] = []
            for start in range(chunk.start, chunk.stop, parallel):
                group = list(range(start, min(chunk.stop, start + parallel)))
                seqs += _generate_group(ctx, [prompts[i] for i in group], group, settings, len(settings.taps),
                                        progress, stats)
            stats.seconds += time.perf_counter() - t0
            info = _write_shard(shard_path(work, index), seqs, chunk)
            manifest["shards"][name] = info
            write_json_atomically(work.data / MANIFEST, manifest)
            _count(stats, info)
            if on_shard is not None:
                on_shard()
    finally:
        if ctx is not None:
            ctx.close()
        if lock is not None:
            lock.close()  # releases the lock
    return stats


def _lock_for_writing(work: WorkDir):
    """An exclusive lock on the data directory (``.lock``, held while the returned file stays open).

    Raises:
        TrainError: another run is writing shards there now (two writers would redo each other's shards and
            overwrite each other's manifest).
    """
    import fcntl

    handle = open(work.data / ".lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise TrainError(f"data directory {work.data} is being written by another run; wait for it to finish, or "
                         f"give --data-limit within the shards it has finished") from None
    return handle


def _count(stats: DataStats, info: dict) -> None:
    stats.shards_done += 1
    stats.sequences += info["sequences"]
    stats.tokens += info["tokens"]
    stats.generated += info["generated"]
    stats.bytes += info["bytes"]


def _generate_group(ctx: Context, prompts: list[list[int]], indices: list[int], settings: TrainSettings, n_taps: int,
                    progress, stats: DataStats) -> list[Record]:
    """Continue ``prompts`` side by side, sequence i in the context's sequence i; capture every row."""
    n_embd = ctx.model.n_embd
    samplers = [Sampler(SamplingParams(temperature=settings.temperature, seed=settings.seed * 1_000_003 + i))
                for i in indices]

    def count(n: int) -> None:
        stats.generated_this_run += n
        if progress is not None:
            progress(n)

    out = []
    for prompt, c in zip(prompts, continue_side_by_side(ctx, prompts, samplers, settings.n_predict, capture=True,
                                                        teacher_top_k=TEACHER_TOP_K, progress=count)):
        # rows for positions 0..L-2: the last token was sampled but never decoded
        assert c.rows.shape[0] == len(c.tokens) - 1, (c.rows.shape, len(c.tokens))
        out.append(Record(tokens=np.asarray(c.tokens, dtype=np.int32), prompt_len=len(prompt),
                          taps=c.rows[:, : n_taps * n_embd], last=c.rows[:, n_taps * n_embd:], top_ids=c.top_ids,
                          top_p=c.top_p))
    return out


TEACHER_TOP_K = 32  # the target's most likely next tokens stored per generated position (~200 bytes)


def top_k_probabilities(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k most likely ids of a logit row (most likely first, ties to the lower id) and their softmax
    probabilities over the whole vocabulary.

    Only the ids at or above the k-th largest of the row's 256-wide chunk maxima are sorted: k chunks reach that
    value, so at least k ids do, and each of the k largest does. On Gemma 3's 262,144 logits a row takes 0.3 ms
    against 7 ms for a partition of the whole row."""
    logits = np.asarray(logits, dtype=np.float32)
    n = len(logits)
    n_chunks = -(-n // TOP_K_CHUNK)
    if k < n_chunks:
        padded = logits if n % TOP_K_CHUNK == 0 else np.concatenate(
            [logits, np.full(n_chunks * TOP_K_CHUNK - n, -np.inf, np.float32)])
        chunk_max = padded.reshape(n_chunks, TOP_K_CHUNK).max(axis=1)
        floor = np.partition(chunk_max, n_chunks - k)[n_chunks - k]
        candidates = np.flatnonzero(logits >= floor)
    else:
        candidates = np.arange(n)
    ids = candidates[np.argsort(-logits[candidates], kind="stable")[:k]]
    top = logits[ids].astype(np.float64)
    peak = logits[ids[0]]
    log_z = float(peak) + np.log(np.exp(logits - peak).sum(dtype=np.float64))
    return ids.astype(np.int32), np.exp(top - log_z).astype(np.float16)


TOP_K_CHUNK = 256


def continue_side_by_side(ctx: Context, prompts: Sequence[Sequence[int]], samplers: Sequence[Sampler],
                          n_predict: int, *, capture: bool = False, teacher_top_k: int = 0,
                          stop_tokens: Sequence[int] = (),
                          progress: Callable[[int], None] | None = None) -> list[Continuation]:
    """Continue each prompt with its own sampler in one context of at least ``len(prompts)`` sequences (at most
    64), through the continuous-batching scheduler: every decode carries one token of each generating sequence,
    and each continuation is exactly what the prompt alone would give.

    A sequence ends after ``n_predict`` tokens, at an end-of-generation token or at one of ``stop_tokens``
    (the ending token is kept). With ``capture`` the context's f32 capture rows of positions 0..L-2 come back
    (its capture layers must be set, dense); with ``teacher_top_k`` the target's top-k next-token ids and
    probabilities at every position whose next token it generated. ``progress(n)`` is told the tokens each
    decode round added.
    """
    from ..batching import BatchRequest, BatchScheduler

    rows: dict = {}
    tops: dict = {}

    def on_rows(seq, captured, logits) -> None:
        if capture and captured is not None and len(captured):
            rows.setdefault(seq, []).append(np.array(captured, dtype=np.float32))  # a copy: the view is reused
        if teacher_top_k and logits is not None:
            tops.setdefault(seq, []).extend(top_k_probabilities(row, teacher_top_k) for row in logits)

    scheduler = BatchScheduler(ctx, on_rows=on_rows)
    stops = frozenset(int(t) for t in stop_tokens)
    try:
        handles = [scheduler.submit(BatchRequest(np.asarray(prompt, dtype=np.int64), n_predict, sampler,
                                                 stop_tokens=stops))
                   for prompt, sampler in zip(prompts, samplers)]
        while not scheduler.idle:
            events = scheduler.step()
            if progress is not None:
                progress(sum(1 for batch in events.values() for event in batch if event.token >= 0))
    finally:
        scheduler.close()
    out = []
    for prompt, handle in zip(prompts, handles):
        seq_tops = tops.get(handle, [])
        top_ids = np.stack([t[0] for t in seq_tops]) if teacher_top_k else None
        top_p = np.stack([t[1] for t in seq_tops]) if teacher_top_k else None
        out.append(Continuation(list(prompt) + handle.result.tokens,
                                np.concatenate(rows[handle]) if capture else None, top_ids, top_p))
    return out


def _write_shard(path: Path, seqs: list[Record], chunk: range) -> dict:
    offsets = np.cumsum([0] + [len(s.tokens) for s in seqs]).astype(np.int64)
    tmp = path.with_name(path.name + ".tmp.npz")
    top = {}
    if all(s.top_ids is not None for s in seqs):
        top = {"top_ids": np.concatenate([s.top_ids for s in seqs]), "top_p": np.concatenate([s.top_p for s in seqs])}
    taps = encode_rows(np.concatenate([s.taps for s in seqs]), path)
    last = encode_rows(np.concatenate([s.last for s in seqs]), path)
    np.savez(tmp, tokens=np.concatenate([s.tokens for s in seqs]), offsets=offsets,
             prompt_lens=np.asarray([s.prompt_len for s in seqs], dtype=np.int32),
             prompt_index=np.asarray(list(chunk), dtype=np.int32), taps=taps, last=last, **top)
    os.replace(tmp, path)
    return {"sequences": len(seqs), "tokens": int(offsets[-1]),
            "generated": int(sum(len(s.tokens) - s.prompt_len for s in seqs)), "bytes": path.stat().st_size,
            "rows": {"taps": rows_format(taps), "last": rows_format(last)}}


F16_MAX = float(np.finfo(np.float16).max)


def encode_rows(rows: np.ndarray, where: Path | str = "") -> np.ndarray:
    """float32 capture rows as stored: float16 when every value fits, else bfloat16 bits (uint16, rounded to
    nearest even).

    Raises:
        TrainError: a row holds NaN or infinity (the target's own output: nothing can be learnt from it).
    """
    rows = np.asarray(rows, dtype=np.float32)
    if not np.isfinite(rows).all():
        raise TrainError(f"{where}: the target's captured rows hold NaN or infinity")
    if rows.size == 0 or float(np.abs(rows).max()) <= F16_MAX:
        return rows.astype(np.float16)
    bits = rows.view(np.uint32).astype(np.uint64)  # room for the rounding carry
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def decode_rows(rows: np.ndarray) -> np.ndarray:
    """Stored rows (float16, or bfloat16 bits as uint16) as float32."""
    if rows.dtype == np.uint16:
        return (rows.astype(np.uint32) << 16).view(np.float32)
    return rows.astype(np.float32)


def rows_format(rows: np.ndarray) -> str:
    return "bf16" if rows.dtype == np.uint16 else "f16"


def shard_infos(work: WorkDir) -> list[dict]:
    """The manifest's record of every finished shard (sequences, tokens, bytes, row formats)."""
    return list(_manifest(work)["shards"].values())


def load_sequences(work: WorkDir, generated_limit: int = 0) -> list[Record]:
    """Every sequence of every finished shard, in shard order; with ``generated_limit`` > 0 only the first ones,
    until they hold that many generated tokens."""
    manifest = _manifest(work)
    out = []
    generated = 0
    for name in sorted(manifest["shards"]):
        if generated_limit and generated >= generated_limit:
            break
        with np.load(work.data / name) as z:
            tokens, offsets, plens = z["tokens"], z["offsets"], z["prompt_lens"]
            taps, last = z["taps"], z["last"]
            top_ids, top_p = (z["top_ids"], z["top_p"]) if "top_ids" in z.files else (None, None)
        row = top_row = 0
        for i in range(len(plens)):
            seq_tokens = tokens[offsets[i]:offsets[i + 1]]
            n_rows = len(seq_tokens) - 1
            if generated_limit and generated >= generated_limit:
                break
            n_top = len(seq_tokens) - int(plens[i])
            out.append(Record(tokens=seq_tokens, prompt_len=int(plens[i]), taps=taps[row:row + n_rows],
                              last=last[row:row + n_rows],
                              top_ids=None if top_ids is None else top_ids[top_row:top_row + n_top],
                              top_p=None if top_p is None else top_p[top_row:top_row + n_top]))
            generated += n_top
            row += n_rows
            top_row += n_top
    return out


def anchor_range(seq: Record, block_size: int) -> tuple[int, int]:
    """Anchors a with every slot target a+1..a+B inside the continuation the target generated:
    a in [prompt_len, L - 1 - B] (empty when lo > hi)."""
    return seq.prompt_len, len(seq.tokens) - 1 - block_size


def usable(seqs: Sequence[Record], block_size: int) -> list[Record]:
    return [s for s in seqs if anchor_range(s, block_size)[0] <= anchor_range(s, block_size)[1]]
