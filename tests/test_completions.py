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


# --- logprobs and tool calls ------------------------------------------------------------------------------------
PIECES = {1: b"Hi", 2: b" there", 3: b"\xe2\x82", 4: b"\xac", 5: b"!"}


def lp(token, logprob, *top):
    from pyllama_dspark.logprobs import TokenLogprob

    return TokenLogprob(token, logprob, tuple(top))


def test_logprobs_in_the_chat_shape():
    entries = [lp(1, -0.5, (1, -0.5), (5, -2.0)), lp(3, -1.25)]
    assert completion(Result("Hi\ufffd", [1, 3], 2, "stop", logprobs=entries), HEAD, chat=True, speculative=False,
                      piece=PIECES.get)["choices"][0]["logprobs"] == {
        "content": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105],
                     "top_logprobs": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105]},
                                      {"token": "!", "logprob": -2.0, "bytes": [33]}]},
                    {"token": "\ufffd", "logprob": -1.25, "bytes": [226, 130], "top_logprobs": []}],
        "refusal": None}


def test_logprobs_in_the_completions_shape_with_text_offsets():
    entries = [lp(1, -0.5, (1, -0.5), (2, -3.0)), lp(2, -0.25), lp(5, -1.0)]
    result = Result("Hi there!", [1, 2, 5], 2, "stop", logprobs=entries)
    assert completion(result, HEAD, chat=False, speculative=False, piece=PIECES.get)["choices"][0]["logprobs"] == {
        "tokens": ["Hi", " there", "!"], "token_logprobs": [-0.5, -0.25, -1.0],
        "top_logprobs": [{"Hi": -0.5, " there": -3.0}, {}, {}], "text_offset": [0, 2, 8]}
    # without a piece function, or without logprobs, none
    assert completion(result, HEAD, chat=False, speculative=False)["choices"][0]["logprobs"] is None


def test_streamed_logprobs_go_with_the_chunk_their_token_released_text_in():
    events = [Event("Hi", logprob=lp(1, -0.5)), Event("", logprob=lp(3, -1.0)), Event("\u20ac", logprob=lp(4, -0.75)),
              Event("", "eog", "stop", logprob=lp(5, -0.125))]
    chunks = list(completion_chunks(events, HEAD, chat=False, piece=PIECES.get))
    assert [c["choices"][0]["text"] for c in chunks] == ["Hi", "\u20ac", "", ""]
    assert [c["choices"][0]["logprobs"] and c["choices"][0]["logprobs"]["token_logprobs"] for c in chunks] == [
        [-0.5], [-1.0, -0.75], [-0.125], None]
    assert [c["choices"][0]["logprobs"]["text_offset"] for c in chunks[:3]] == [[0], [2, 3], [4]]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "stop"]


def test_a_streamed_tool_call_is_held_back_and_sent_as_one_delta():
    from pyllama_dspark.tools import check_tools

    tools = check_tools([{"type": "function", "function": {"name": "f"}}])
    pieces = ["Let me ", "check. <tool", '_call>{"name": "f", ', '"arguments": {}}</tool_call>']
    events = [Event(p) for p in pieces] + [Event("", "eog", "stop")]
    chunks = list(completion_chunks(events, HEAD, chat=True, tools=tools))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[:3] == [{"role": "assistant"}, {"content": "Let me "}, {"content": "check. "}]
    (call,) = deltas[3]["tool_calls"]
    assert call["index"] == 0 and call["function"] == {"name": "f", "arguments": "{}"} and len(deltas) == 5
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}
    # text that only looked like the start of a call comes out at the end, whole
    events = [Event("a <tool"), Event("box> b"), Event("", "eog", "stop")]
    chunks = list(completion_chunks(events, HEAD, chat=True, tools=tools))
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "a <toolbox> b"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_a_streamed_reply_that_is_a_bare_json_call_or_starts_with_blanks():
    from pyllama_dspark.tools import check_tools

    tools = check_tools([{"type": "function", "function": {"name": "f"}}])
    events = [Event(" ", logprob=lp(1, -0.5)), Event('{"name": "f", '), Event('"arguments": {"a": 1}}'),
              Event("", "eog", "stop", logprob=lp(2, -0.25))]
    chunks = list(completion_chunks(events, HEAD, chat=True, piece=PIECES.get, tools=tools))
    assert [c["choices"][0]["delta"] for c in chunks[:1]] == [{"role": "assistant"}]
    (call_chunk,) = [c for c in chunks if "tool_calls" in c["choices"][0]["delta"]]
    assert call_chunk["choices"][0]["delta"]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert [e["logprob"] for e in call_chunk["choices"][0]["logprobs"]["content"]] == [-0.5, -0.25]
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # blanks, then text: the blanks go out with the text; JSON that is not a call comes out whole at the end
    for pieces, expected in [([" ", " Hello", " {x}"], "  Hello {x}"), (["{", '"k": 1}'], '{"k": 1}')]:
        events = [Event(p) for p in pieces] + [Event("", "max_tokens", "length")]
        chunks = list(completion_chunks(events, HEAD, chat=True, tools=tools))
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == expected
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    held = list(completion_chunks([Event(" "), Event("Hi"), Event("", "eog", "stop")], HEAD, chat=True, tools=tools))
    assert [c["choices"][0]["delta"] for c in held] == [{"role": "assistant"}, {"content": " Hi"}, {}]


def test_tools_and_logprobs_without_a_piece_function_change_nothing_for_text_completions():
    from pyllama_dspark.tools import check_tools

    tools = check_tools([{"type": "function", "function": {"name": "f"}}])
    text = '{"name": "f", "arguments": {}}'
    result = Result(text, [1], 2, "stop", logprobs=[lp(1, -0.5)])
    out = completion(result, HEAD, chat=False, speculative=False, tools=tools)
    assert out["choices"][0] == {"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}
    chat = completion(Result("no call", [1], 2, "stop"), HEAD, chat=True, speculative=False, tools=tools)
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "no call"}
    assert chat["choices"][0]["finish_reason"] == "stop"
    events = [Event("x", logprob=lp(1, -0.5)), Event("", "eog", "stop")]
    assert [c["choices"][0]["logprobs"] for c in completion_chunks(events, HEAD, chat=False)] == [None, None]


def test_where_a_call_may_begin_is_held_back_exactly():
    from pyllama_dspark.tools import check_tools

    tools = check_tools([{"type": "function", "function": {"name": "f"}}])

    def contents(pieces, finish=("eog", "stop")):
        events = [Event(p) for p in pieces] + [Event("", *finish)]
        return [c["choices"][0]["delta"].get("content") for c in completion_chunks(events, HEAD, chat=True,
                                                                                    tools=tools)][1:]

    # a prefix of the tag at the end is held (one character, ten), the rest goes out at once
    assert contents(["a <", "b"]) == ["a ", "<b", None]
    assert contents(["a <tool_call", "x"]) == ["a ", "<tool_callx", None]
    # after text went out, a later "{" is text, not a bare call
    assert contents(["Hi ", "{x}", " more"]) == ["Hi ", "{x}", " more", None]
    # two calls and text around them in one piece: the text before the first goes out, the rest after the calls
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    events = [Event(f"Look: {call} and {call} Done."), Event("", "eog", "stop")]
    chunks = list(completion_chunks(events, HEAD, chat=True, tools=tools))
    deltas = [c["choices"][0]["delta"] for c in chunks[1:]]
    assert deltas[0] == {"content": "Look: "} and deltas[1] == {"content": "and  Done."}
    assert [c["function"]["name"] for c in deltas[2]["tool_calls"]] == ["f", "f"] and deltas[3] == {}
    # a bare JSON list of calls
    listed = [Event('[{"name": "f", "arguments": {}}]'), Event("", "eog", "stop")]
    (delta,) = [c["choices"][0]["delta"] for c in completion_chunks(listed, HEAD, chat=True, tools=tools)
                if "tool_calls" in c["choices"][0]["delta"]]
    assert len(delta["tool_calls"]) == 1


def test_a_chat_logprob_left_at_the_end_goes_in_an_empty_content_delta():
    events = [Event("Hi", logprob=lp(1, -0.5)), Event("", "eog", "stop", logprob=lp(2, -0.25))]
    chunks = list(completion_chunks(events, HEAD, chat=True, piece=PIECES.get))
    assert chunks[2]["choices"][0]["delta"] == {"content": ""}
    assert [e["logprob"] for e in chunks[2]["choices"][0]["logprobs"]["content"]] == [-0.25]


def test_split_utf8_among_the_alternatives_is_replaced_not_an_error():
    entries = [lp(3, -1.0, (3, -1.0), (4, -2.0))]
    out = completion(Result("\ufffd", [3], 2, "stop", logprobs=entries), HEAD, chat=False, speculative=False,
                     piece=PIECES.get)["choices"][0]["logprobs"]
    assert out["top_logprobs"] == [{"\ufffd": -2.0}]  # both alternatives decode to U+FFFD; the later one stays
