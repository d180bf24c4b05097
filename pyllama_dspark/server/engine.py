"""The engine: one thread owns the model, its context and the drafter, and runs the queued jobs in turn.

Requests never call native code on the event loop. Each one becomes a ``Job`` with its own mailbox (an
``asyncio.Queue`` of the event loop that submitted it); the engine thread posts every token event there with
``call_soon_threadsafe`` and goes on at once, so a slow reader only lets its own mailbox grow (by at most
``max_tokens`` events) and never holds up the engine. A job's ``CancelToken`` stops its generation at the next
round, or inside a long prefill through llama.cpp's abort callback; the HTTP layer cancels it when the client goes.

With ``parallel`` > 1 the engine keeps that many jobs in the LLM's batch scheduler (continuous batching): jobs
join and leave between steps, and every step is one batched decode for all of them, each job's output still
exactly what it would be alone.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .. import checks
from ..cancel import CancelToken
from ..events import MAX_EXACT_ROWS, BatchRequest, OutputRules, TokenEvent, output_options, sampling_params
from ..sampling import Sampler


class QueueFullError(Exception):
    """More jobs wait than ``max_queue`` allows."""


class EngineUnavailableError(Exception):
    """The engine is loading, failed to load, or is shutting down."""


@dataclass
class Job:
    """One generation asked for by one request.

    Attributes:
        prompt: token ids (already checked against the context size).
        sampling: keyword arguments of ``LLM.stream`` (max_tokens, temperature, top_p, top_k, stop, seed,
            grammar, logprobs).
        cancel: cancelled by the HTTP layer when the client disconnects, and by shutdown.
    """

    prompt: list[int]
    sampling: dict[str, Any]
    loop: asyncio.AbstractEventLoop
    mailbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: CancelToken = field(default_factory=CancelToken)
    t_submitted: float = field(default_factory=time.perf_counter)

    def post(self, item: TokenEvent | BaseException) -> None:
        """From the engine thread: hand an event (or the error that ended the job) to the request's task."""
        try:
            self.loop.call_soon_threadsafe(self.mailbox.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is left to read
            self.cancel.cancel()


@dataclass
class Counters:
    """What ``/metrics`` reports; written by the engine thread only, read by anyone (plain ints and floats)."""

    prompt_tokens: int = 0  # evaluated: the prompt cache's tokens are not
    prompt_tokens_cached: int = 0
    prompt_seconds: float = 0.0
    generated_tokens: int = 0
    generation_seconds: float = 0.0
    requests_processing: int = 0
    requests_deferred: int = 0
    requests_finished: int = 0
    requests_cancelled: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    by_source: dict[str, list[int]] = field(default_factory=dict)  # source -> [rounds, drafted, accepted]

    def add(self, stats) -> None:
        """Add a finished (or cancelled) generation's ``SpecStats``."""
        self.prompt_tokens += stats.n_prompt - stats.n_reused
        self.prompt_tokens_cached += stats.n_reused
        self.prompt_seconds += stats.t_prefill
        self.generated_tokens += stats.n_generated
        self.generation_seconds += stats.t_decode
        self.drafts += stats.rounds
        self.draft_tokens += stats.drafted
        self.accepted_tokens += stats.accepted
        for i, n in enumerate(stats.accepted_per_pos):
            if i == len(self.accepted_per_pos):
                self.accepted_per_pos.append(0)
            self.accepted_per_pos[i] += n
        for name, share in stats.by_source.items():
            counts = self.by_source.setdefault(name, [0, 0, 0])
            counts[0] += share.rounds
            counts[1] += share.drafted
            counts[2] += share.accepted


class Engine:
    """Loads the model on its own thread (``state`` "loading", then "ready" or "failed") and serves jobs.

    Args:
        open_llm: called on the engine thread; returns the ``LLM`` (facade) the engine owns and closes.
        max_queue: most jobs waiting for a free slot; more are refused with QueueFullError.
        parallel: slots: 1 runs one job at a time through ``LLM.stream``; more run that many at once, every
            step one batched decode for all of them (``LLM.batch_scheduler``, continuous batching).
        cache_prompt: each slot keeps the memory of its last generation and a new job reuses the longest prefix
            it shares with it (``reuse_prefix`` with one slot; the scheduler's ``cache_prompts`` with several, a job
            going to the free slot that shares the most).
        cache_ram_bytes: with several slots, host memory for copies of slot memories that requests cut or replace
            (the scheduler's ``cache_ram_bytes``).
    """

    def __init__(self, open_llm: Callable[[], Any], *, max_queue: int = 64, parallel: int = 1,
                 cache_prompt: bool = True, cache_ram_bytes: int = 0):
        if not 1 <= parallel <= MAX_EXACT_ROWS:
            raise ValueError(f"parallel must be in [1, {MAX_EXACT_ROWS}], got {parallel}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.max_queue, self.parallel, self.cache_prompt = max_queue, parallel, bool(cache_prompt)
        self.cache_ram_bytes = cache_ram_bytes
        self.counters = Counters()
        self.state = "loading"
        self.load_error: BaseException | None = None
        self.llm = None
        self._open_llm = open_llm
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: list[Job] = []
        self._wake = threading.Condition()
        self._stopping = False
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="pyllama-dspark-engine", daemon=True)
        self._thread.start()

    # --- called from the event loop ------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Queue a job.

        Raises:
            EngineUnavailableError: not ready (loading, failed, stopping).
            QueueFullError: ``max_queue`` jobs already wait.
        """
        with self._wake:
            if self._stopping or self.state != "ready":
                raise EngineUnavailableError(self.unavailable_reason())
            free_slots = max(0, self.parallel - len(self._running) - len(self._waiting))
            if len(self._waiting) + 1 - free_slots > self.max_queue:
                raise QueueFullError(f"{len(self._waiting)} requests are waiting (--max-queue {self.max_queue})")
            self._waiting.append(job)
            self.counters.requests_deferred = len(self._waiting)
            self._wake.notify()

    @property
    def n_waiting(self) -> int:
        """Jobs queued, not yet running."""
        return len(self._waiting)

    def unavailable_reason(self) -> str:
        if self._stopping:
            return "the server is shutting down"
        if self.state == "failed":
            return f"the model failed to load: {self.load_error}"
        return "the model is loading"

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the model is loaded (or failed to); True when it is ready."""
        self._ready.wait(timeout)
        return self.state == "ready"

    def stop(self, timeout: float | None = 30.0) -> None:
        """Refuse new jobs, cancel the waiting and the running ones, let the engine close the model; idempotent."""
        with self._wake:
            self._stopping = True
            for job in [*self._waiting, *self._running]:
                job.cancel.cancel()
            self._wake.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # --- the engine thread ----------------------------------------------------------------------
    def _main(self) -> None:
        try:
            self.llm = self._open_llm()
        except BaseException as exc:  # reported by /health and to every request; the server keeps answering
            self.load_error, self.state = exc, "failed"
            self._ready.set()
            return
        self.state = "ready"
        self._ready.set()
        try:
            self._serve() if self.parallel == 1 else self._serve_batched()
        finally:
            self.state = "stopped"
            self.llm.close()

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not self._waiting and not self._stopping:
                    self._wake.wait()
                if self._stopping:
                    for job in self._waiting:
                        job.post(EngineUnavailableError("the server is shutting down"))
                    self._waiting.clear()
                    return
                job = self._waiting.popleft()
                self._running.append(job)
                self.counters.requests_deferred = len(self._waiting)
                self.counters.requests_processing = len(self._running)
            try:
                self._run(job)
            finally:
                with self._wake:
                    self._running.remove(job)
                    self.counters.requests_processing = len(self._running)

    def _run(self, job: Job) -> None:
        if job.cancel.cancelled:  # its client left while it waited
            self.counters.requests_cancelled += 1
            return
        try:
            for event in self.llm.stream(job.prompt, cancel=job.cancel, reuse_prefix=self.cache_prompt,
                                         **job.sampling):
                job.post(event)
                if event.result is not None:
                    self._count_finished(event.result)
        except Exception as exc:  # noqa: BLE001 - the request gets it (an error event), the engine goes on
            job.post(exc)

    def _serve_batched(self) -> None:
        """Up to ``parallel`` jobs at once in the LLM's batch scheduler: admitted between steps, each step one
        batched decode for all of them, every job's new events posted after it."""
        scheduler = self.llm.batch_scheduler(self.parallel)
        scheduler.cache_prompts = self.cache_prompt
        scheduler.cache_ram_bytes = self.cache_ram_bytes if self.cache_prompt else 0
        jobs: dict[Any, Job] = {}
        while True:
            with self._wake:
                while not self._waiting and scheduler.idle and not self._stopping:
                    self._wake.wait()
                if self._stopping:
                    for job in self._waiting:
                        job.post(EngineUnavailableError("the server is shutting down"))
                    self._waiting.clear()
                    if scheduler.idle:
                        return
                while self._waiting and len(jobs) < self.parallel:
                    job = self._waiting.popleft()
                    if job.cancel.cancelled:  # its client left while it waited
                        self.counters.requests_cancelled += 1
                        continue
                    try:
                        jobs[scheduler.submit(_batch_request(job, self.llm.model))] = job
                    except (TypeError, ValueError) as exc:
                        job.post(exc)
                        continue
                    self._running.append(job)
                self.counters.requests_deferred = len(self._waiting)
                self.counters.requests_processing = len(self._running)
            if scheduler.idle:
                continue
            try:
                events = scheduler.step()
            except Exception as exc:  # noqa: BLE001 - a failed decode ends every job in it; the engine goes on
                for seq, job in list(jobs.items()):
                    job.post(exc)
                self._reset_batched(scheduler, jobs)
                continue
            for seq, batch in events.items():
                job = jobs[seq]
                for event in batch:
                    job.post(event)
                if seq.finished:
                    self._count_finished(seq.result)
                    del jobs[seq]
                    with self._wake:
                        self._running.remove(job)
                        self.counters.requests_processing = len(self._running)

    def _count_finished(self, result) -> None:
        self.counters.add(result.stats)
        if result.stop_reason == "cancelled":
            self.counters.requests_cancelled += 1
        else:
            self.counters.requests_finished += 1

    def _reset_batched(self, scheduler, jobs: dict) -> None:
        """After a failed step: forget every job and start the scheduler afresh (memory cleared)."""
        for job in jobs.values():
            job.cancel.cancel()
        jobs.clear()
        with self._wake:
            self._running.clear()
            self.counters.requests_processing = 0
        scheduler.reset()


def _batch_request(job: Job, model) -> BatchRequest:
    knobs = job.sampling
    params = sampling_params(knobs["temperature"], knobs["top_k"], knobs["top_p"], knobs["seed"])
    grammar, logprobs = output_options(knobs.get("grammar"), knobs.get("logprobs"))
    return BatchRequest(np.asarray(job.prompt, dtype=np.int64), checks.integer("max_tokens", knobs["max_tokens"]),
                        Sampler(params), checks.stop_strings(knobs["stop"]), cancel=job.cancel,
                        rules=OutputRules(model, grammar, logprobs))
