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

from .tools import OPEN, parse_tool_calls


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


def completion(result, head: dict, *, chat: bool, speculative: bool, piece=None, tools=None) -> dict:
    """A ``chat.completion`` (``message``) or ``text_completion`` (``text``) dict of a finished generation
    (``text``, ``tokens``, ``n_prompt``, ``finish_reason``; ``stats`` when ``speculative``: its ``as_dict()`` goes
    under ``speculative``). ``piece`` (token id -> bytes) writes ``result.logprobs`` in OpenAI's shape; ``tools``
    (chat, the offered ``Tool``s) parses a tool call out of the reply (``message.tool_calls``, finish reason
    "tool_calls")."""
    logprobs = None
    if result.logprobs is not None and piece is not None:
        logprobs = logprobs_object(result.logprobs, piece, chat=chat)
    if chat:
        message = {"role": "assistant", "content": result.text}
        finish = result.finish_reason
        if tools:
            content, calls = parse_tool_calls(result.text, tools)
            if calls:
                message = {"role": "assistant", "content": content,
                           "tool_calls": [call.as_openai() for call in calls]}
                finish = "tool_calls"
        choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": result.text, "logprobs": logprobs, "finish_reason": result.finish_reason}
    out = {**head, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
           "usage": usage(result)}
    if speculative:
        out["speculative"] = result.stats.as_dict()
    return out


def logprobs_object(entries, piece, *, chat: bool, text_offset: int = 0) -> dict:
    """OpenAI's ``logprobs`` of a choice or chunk from ``TokenLogprob``s: chat's ``{"content": [{token, logprob,
    bytes, top_logprobs}], "refusal": None}``, or the completions API's ``{tokens, token_logprobs, top_logprobs,
    text_offset}`` (offsets counted from ``text_offset``). A token's text is its bytes decoded, U+FFFD where a
    UTF-8 sequence is split between tokens; ``bytes`` are exact."""
    if chat:
        def one(token: int, logprob: float) -> dict:
            data = piece(token)
            return {"token": data.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(data)}

        return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                            for e in entries], "refusal": None}
    tokens, offsets = [], []
    for e in entries:
        offsets.append(text_offset)
        text = piece(e.token).decode("utf-8", "replace")
        tokens.append(text)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{piece(t).decode("utf-8", "replace"): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets}


def chunk_object(chat: bool) -> str:
    return "chat.completion.chunk" if chat else "text_completion"


def completion_chunk(head: dict, text: str | None, finish_reason: str | None = None, *, chat: bool,
                     opening: dict | None = None, logprobs: dict | None = None,
                     tool_calls: list[dict] | None = None) -> dict:
    """One stream chunk: a piece of ``text`` (None: none, as in the chunk with the finish reason), or for chat the
    ``opening`` delta (the role) that comes first; ``logprobs`` of the tokens in it; chat ``tool_calls`` deltas."""
    if chat:
        delta = dict(opening) if opening is not None else ({} if text is None else {"content": text})
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
    return {**head, "object": chunk_object(chat), "choices": [choice]}


class ChunkWriter:
    """A generation's events -> the stream's text chunks (``completion_chunk`` dicts): one per non-empty piece of
    text, with the ``logprobs`` of every token since the last chunk (``piece``: token id -> bytes; a token that
    released no text yet goes with the next chunk). With ``tools`` (chat), text from where a ``<tool_call>`` may
    begin is held back; at the end the calls go out as one ``tool_calls`` delta (``finish_reason`` then says
    "tool_calls"), and what was not a call as content."""

    def __init__(self, head: dict, *, chat: bool, piece=None, tools=None):
        self.head, self.chat, self.piece, self.tools = head, chat, piece, tools or []
        self._logprobs: list = []
        self._offset = 0
        self._held = ""  # tool mode: text that may still be (part of) a call
        self._calling = False  # what is held is a call (or may be one) until the end
        self._emitted = False  # tool mode: some content went out already
        self.finish_reason: str | None = None

    def feed(self, event) -> list[dict]:
        """The chunks one event releases (the last event: everything left; then ``finish_reason`` is set)."""
        if event.logprob is not None and self.piece is not None:
            self._logprobs.append(event.logprob)
        text = event.text
        if not self.tools:
            out = [self._text_chunk(text)] if text else []
        else:
            out = self._tool_text(text, last=event.stop_reason is not None)
        if event.stop_reason is not None:
            if self._logprobs:  # tokens that released no text (an end of generation): their own chunk
                out.append(self._text_chunk(""))
            if self.finish_reason is None:
                self.finish_reason = event.finish_reason
        return out

    def _tool_text(self, text: str, *, last: bool) -> list[dict]:
        self._held += text
        out = []
        if not self._calling:
            head = self._held.lstrip()
            if not self._emitted and head[:1] in ("{", "["):  # the reply may be a bare JSON call: hold it all
                self._calling = True
            elif self._emitted or head:
                at = _possible_call_start(self._held)
                cut = len(self._held) if at < 0 else at
                if cut:
                    out.append(self._text_chunk(self._held[:cut]))
                    self._held, self._emitted = self._held[cut:], True
                self._calling = self._held.startswith(OPEN)
        if last:
            content, calls = parse_tool_calls(self._held, self.tools) if self._held else (None, [])
            if calls:
                if content:
                    out.append(self._text_chunk(content))
                out.append(completion_chunk(self.head, None, chat=True, logprobs=self._take_logprobs(),
                                            tool_calls=[c.as_openai(i) for i, c in enumerate(calls)]))
                self.finish_reason = "tool_calls"
            elif self._held:
                out.append(self._text_chunk(self._held))
            self._held = ""
        return out

    def _text_chunk(self, text: str) -> dict:
        return completion_chunk(self.head, text, chat=self.chat, logprobs=self._take_logprobs())

    def _take_logprobs(self) -> dict | None:
        if not self._logprobs or self.piece is None:
            return None
        out = logprobs_object(self._logprobs, self.piece, chat=self.chat, text_offset=self._offset)
        if not self.chat:
            self._offset = out["text_offset"][-1] + len(out["tokens"][-1])
        self._logprobs = []
        return out


def _possible_call_start(text: str) -> int:
    """Where in ``text`` a ``<tool_call>`` tag begins or may begin (a prefix of it at the end); -1 if nowhere."""
    at = text.find(OPEN)
    if at >= 0:
        return at
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:k]):
            return len(text) - k
    return -1


def completion_chunks(events: Iterable, head: dict, *, chat: bool, piece=None, tools=None) -> Iterator[dict]:
    """Stream chunks of a generation's events (``text``; the last one has ``stop_reason`` and ``finish_reason``):
    for chat a first ``{"role": "assistant"}`` delta, then one chunk per non-empty piece of text (``ChunkWriter``:
    with logprobs and tool calls), then an empty one with the finish reason."""
    if chat:
        yield completion_chunk(head, None, chat=True, opening={"role": "assistant"})
    writer = ChunkWriter(head, chat=chat, piece=piece, tools=tools)
    for event in events:
        yield from writer.feed(event)
        if event.stop_reason is not None:
            yield completion_chunk(head, None, writer.finish_reason, chat=chat)
