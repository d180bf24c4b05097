"""OpenAI-shaped completion dicts and stream chunks from a generation's result or events, pure (no model, no
context): what ``LLM.create_completion`` / ``create_chat_completion`` return, in llama-cpp-python's shape.

    head = completion_head(chat=True, model_name="target.gguf")
    reply = completion(result, head, chat=True, speculative=True)
    for chunk in completion_chunks(events, head, chat=True): ...

The server (``server/protocol.py``) builds its responses from the same functions and adds llama-server's
``timings``. Its opening chat delta is OpenAI's ``{"role": "assistant", "content": ""}``; the facade's is
llama-cpp-python's ``{"role": "assistant"}``.
"""

from __future__ import annotations

import time
import uuid
from typing import Iterable, Iterator


def completion_head(*, chat: bool, model_name: str) -> dict:
    """The fields every dict and chunk of one completion shares: a fresh ``id`` (``chatcmpl-``/``cmpl-`` and 32 hex
    digits), ``created`` (Unix seconds) and ``model``."""
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": model_name}


def usage(result) -> dict:
    """``usage`` of a finished generation: prompt, completion and total token counts, and (OpenAI's
    ``prompt_tokens_details.cached_tokens``) the prompt tokens whose memory a previous generation left."""
    n_prompt, n_completion = result.n_prompt, len(result.tokens)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion,
            "prompt_tokens_details": {"cached_tokens": result.stats.n_reused}}


def completion(result, head: dict, *, chat: bool, speculative: bool) -> dict:
    """A ``chat.completion`` (``message``) or ``text_completion`` (``text``) dict of a finished generation
    (``text``, ``tokens``, ``n_prompt``, ``finish_reason``; ``stats`` when ``speculative``: its ``as_dict()`` goes
    under ``speculative``)."""
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": result.text}, "logprobs": None,
                  "finish_reason": result.finish_reason}
    else:
        choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": result.finish_reason}
    out = {**head, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
           "usage": usage(result)}
    if speculative:
        out["speculative"] = result.stats.as_dict()
    return out


def chunk_object(chat: bool) -> str:
    return "chat.completion.chunk" if chat else "text_completion"


def completion_chunk(head: dict, text: str | None, finish_reason: str | None = None, *, chat: bool,
                     opening: dict | None = None) -> dict:
    """One stream chunk: a piece of ``text`` (None: none, as in the chunk with the finish reason), or for chat the
    ``opening`` delta (the role) that comes first."""
    if chat:
        delta = dict(opening) if opening is not None else ({} if text is None else {"content": text})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    return {**head, "object": chunk_object(chat), "choices": [choice]}


def completion_chunks(events: Iterable, head: dict, *, chat: bool) -> Iterator[dict]:
    """Stream chunks of a generation's events (``text``; the last one has ``stop_reason`` and ``finish_reason``):
    for chat a first ``{"role": "assistant"}`` delta, then one chunk per non-empty piece of text, then an empty
    one with the finish reason."""
    if chat:
        yield completion_chunk(head, None, chat=True, opening={"role": "assistant"})
    for event in events:
        if event.stop_reason is not None:  # the last event
            if event.text:
                yield completion_chunk(head, event.text, chat=chat)
            yield completion_chunk(head, None, event.finish_reason, chat=chat)
        elif event.text:
            yield completion_chunk(head, event.text, chat=chat)
