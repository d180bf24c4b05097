"""OpenAI-shaped completion dicts and stream chunks from a generation's result or events, pure (no model, no
context): what ``LLM.create_completion`` / ``create_chat_completion`` return, in llama-cpp-python's shape.

    head = completion_head(chat=True, model_name="target.gguf")
    reply = completion(result, head, chat=True, speculative=True)
    for chunk in completion_chunks(events, head, chat=True): ...
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


def completion(result, head: dict, *, chat: bool, speculative: bool) -> dict:
    """A ``chat.completion`` (``message``) or ``text_completion`` (``text``) dict of a finished generation
    (``text``, ``tokens``, ``n_prompt``, ``finish_reason``; ``stats`` when ``speculative``: its ``as_dict()`` goes
    under ``speculative``)."""
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": result.text}, "logprobs": None,
                  "finish_reason": result.finish_reason}
    else:
        choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": result.finish_reason}
    n_completion = len(result.tokens)
    out = {**head, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
           "usage": {"prompt_tokens": result.n_prompt, "completion_tokens": n_completion,
                     "total_tokens": result.n_prompt + n_completion}}
    if speculative:
        out["speculative"] = result.stats.as_dict()
    return out


def completion_chunks(events: Iterable, head: dict, *, chat: bool) -> Iterator[dict]:
    """Stream chunks of a generation's events (``text``; the last one has ``stop_reason`` and ``finish_reason``):
    for chat a first ``{"role": "assistant"}`` delta, then one chunk per non-empty piece of text, then an empty
    one with the finish reason."""
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(piece: str | None, finish: str | None, role: bool = False) -> dict:
        if chat:
            delta = {"role": "assistant"} if role else ({} if piece is None else {"content": piece})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish}
        return {**head, "object": obj, "choices": [choice]}

    if chat:
        yield chunk(None, None, role=True)
    for event in events:
        if event.stop_reason is not None:  # the last event
            if event.text:
                yield chunk(event.text, None)
            yield chunk(None, event.finish_reason)
        elif event.text:
            yield chunk(event.text, None)
