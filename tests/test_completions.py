"""The OpenAI-shaped dicts (pyllama_dspark/completions.py) from made-up results and events: every field of the
whole dict and of every chunk, text and chat, with and without speculative statistics, on each finish reason.
(test_api.py checks the same shapes end to end against real generations.)"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

import pytest

from pyllama_dspark.completions import completion, completion_chunks, completion_head


class Stats:
    def __init__(self, n_reused: int = 0):
        self.n_reused = n_reused

    def as_dict(self):
        return {"rounds": 3, "tau": 1.5}


@dataclass
class Result:
    text: str
    tokens: list
    n_prompt: int
    finish_reason: str
    stats: Stats = field(default_factory=Stats)
    logprobs: list | None = None


@dataclass
class Event:
    text: str
    stop_reason: str | None = None
    finish_reason: str | None = None
    logprob: object = None


HEAD = {"id": "cmpl-x", "created": 7, "model": "m.gguf"}


@pytest.mark.parametrize("chat, prefix", [(False, "cmpl"), (True, "chatcmpl")])
def test_the_head_has_a_fresh_id_the_time_and_the_model_name(chat, prefix):
    t0 = int(time.time())
    first = completion_head(chat=chat, model_name="target.gguf")
    second = completion_head(chat=chat, model_name="target.gguf")
    t1 = int(time.time())
    assert set(first) == {"id", "created", "model"} and first["model"] == "target.gguf"
    assert re.fullmatch(prefix + r"-[0-9a-f]{32}", first["id"]) and first["id"] != second["id"]
    assert t0 <= first["created"] <= t1 and type(first["created"]) is int


@pytest.mark.parametrize("finish", ["length", "stop"])
def test_a_text_completion_dict(finish):
    result = Result("Hello there", [5, 6, 7], 4, finish)
    assert completion(result, HEAD, chat=False, speculative=False) == {
        "id": "cmpl-x", "created": 7, "model": "m.gguf", "object": "text_completion",
        "choices": [{"index": 0, "text": "Hello there", "logprobs": None, "finish_reason": finish}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7,
                  "prompt_tokens_details": {"cached_tokens": 0}}}


def test_a_chat_completion_dict_with_speculative_statistics():
    result = Result("Hi!", [9, 8], 11, "stop", Stats(n_reused=8))
    assert completion(result, HEAD, chat=True, speculative=True) == {
        "id": "cmpl-x", "created": 7, "model": "m.gguf", "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi!"}, "logprobs": None,
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 11, "completion_tokens": 2, "total_tokens": 13,
                  "prompt_tokens_details": {"cached_tokens": 8}},
        "speculative": {"rounds": 3, "tau": 1.5}}


def test_an_empty_completion_counts_no_tokens():
    out = completion(Result("", [], 6, "length"), HEAD, chat=False, speculative=False)
    assert out["usage"] == {"prompt_tokens": 6, "completion_tokens": 0, "total_tokens": 6,
                            "prompt_tokens_details": {"cached_tokens": 0}}
    assert out["choices"][0]["text"] == ""


EVENTS = [Event("Once"), Event(""), Event(" upon"), Event(" a", "stop", "stop")]


def text_chunk(text, finish=None):
    return {**HEAD, "object": "text_completion",
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


def chat_chunk(delta, finish=None):
    return {**HEAD, "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def test_text_chunks_one_per_piece_then_the_finish_reason():
    assert list(completion_chunks(EVENTS, HEAD, chat=False)) == [
        text_chunk("Once"), text_chunk(" upon"), text_chunk(" a"), text_chunk("", "stop")]


def test_chat_chunks_open_with_the_role_and_close_with_an_empty_delta():
    assert list(completion_chunks(EVENTS, HEAD, chat=True)) == [
        chat_chunk({"role": "assistant"}), chat_chunk({"content": "Once"}), chat_chunk({"content": " upon"}),
        chat_chunk({"content": " a"}), chat_chunk({}, "stop")]


@pytest.mark.parametrize("chat", [False, True])
def test_a_last_event_without_text_gives_only_the_finish_chunk(chat):
    events = [Event("x"), Event("", "max_tokens", "length")]
    chunks = list(completion_chunks(events, HEAD, chat=chat))
    if chat:
        assert chunks == [chat_chunk({"role": "assistant"}), chat_chunk({"content": "x"}), chat_chunk({}, "length")]
    else:
        assert chunks == [text_chunk("x"), text_chunk("", "length")]
