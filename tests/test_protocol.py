"""The server's wire format (pyllama_dspark/server/protocol.py) without a server: every request field checked into a
``CompletionRequest`` or refused with the 400 a client sees (message and param), the error body, every field of the
responses and chunks, llama-server's ``timings`` against literal values, and the server-sent event bytes.
(test_server.py runs the same through HTTP and the official client.)"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import pytest

from pyllama_dspark.server.protocol import (APIError, CompletionRequest, ResponseShape, bad_request, parse_completion,
                                            parse_json, sse, timings)
from pyllama_dspark.stats import DraftCounts

MESSAGES = [{"role": "user", "content": "Hi"}]


def refusal(body: dict, *, chat: bool) -> APIError:
    with pytest.raises(APIError) as caught:
        parse_completion(body, chat=chat)
    assert caught.value.status == 400 and caught.value.type == "invalid_request_error" and caught.value.code is None
    assert str(caught.value) == caught.value.message
    return caught.value


def chat_body(**fields) -> dict:
    return {"messages": MESSAGES, **fields}


def text_body(**fields) -> dict:
    return {"prompt": "Hi", **fields}


# --- errors ---------------------------------------------------------------------------------------------------
def test_an_api_error_has_openai_s_nested_body_and_its_own_headers():
    headers = {"Retry-After": "1"}
    error = APIError(429, "busy", type="server_busy", param="p", code="c", headers=headers)
    assert (error.status, error.message, error.type, error.param, error.code) == (429, "busy", "server_busy", "p", "c")
    assert error.body() == {"error": {"message": "busy", "type": "server_busy", "param": "p", "code": "c"}}
    headers["Retry-After"] = "9"  # a copy: the caller's dict is not kept
    assert error.headers == {"Retry-After": "1"} and str(error) == "busy"
    plain = APIError(500, "boom")
    assert plain.headers == {} and plain.body() == {"error": {"message": "boom", "type": "invalid_request_error",
                                                              "param": None, "code": None}}
    bad = bad_request("no", "field", "c")
    assert (bad.status, bad.message, bad.param, bad.code, bad.type) == (400, "no", "field", "c",
                                                                          "invalid_request_error")
    assert bad_request("no").param is None and bad_request("no").code is None


def test_parse_json_returns_an_object_and_refuses_the_rest():
    assert parse_json(b'{"a": [1, 2]}') == {"a": [1, 2]}
    for raw in (b"{", b"\xff\xfe", b""):
        with pytest.raises(APIError) as caught:
            parse_json(raw)
        assert caught.value.status == 400 and caught.value.message.startswith("the request body is not valid JSON: ")
    for raw, kind in ((b"[1]", "list"), (b"3", "int"), (b'"x"', "str"), (b"null", "NoneType")):
        with pytest.raises(APIError) as caught:
            parse_json(raw)
        assert caught.value.message == f"the request body must be a JSON object, got {kind}"


# --- requests -------------------------------------------------------------------------------------------------
def test_defaults_of_a_minimal_chat_and_text_request():
    assert parse_completion(chat_body(), chat=True) == CompletionRequest(
        chat=True, model=None, messages=MESSAGES, prompt=None, max_tokens=None, temperature=1.0, top_p=1.0, top_k=0,
        stop=[], seed=None, stream=False, include_usage=False)
    # OpenAI's legacy completions default to 16 tokens
    assert parse_completion(text_body(), chat=False) == CompletionRequest(
        chat=False, model=None, messages=None, prompt="Hi", max_tokens=16, temperature=1.0, top_p=1.0, top_k=0,
        stop=[], seed=None, stream=False, include_usage=False)


def test_every_knob_is_taken_as_given():
    req = parse_completion(chat_body(model="m", max_tokens=7, temperature=0.5, top_p=0.25, top_k=3, stop="END",
                                     seed=11, stream=True, stream_options={"include_usage": True}), chat=True)
    assert (req.model, req.max_tokens, req.temperature, req.top_p, req.top_k, req.stop, req.seed, req.stream,
            req.include_usage) == ("m", 7, 0.5, 0.25, 3, ["END"], 11, True, True)
    assert type(req.temperature) is float and type(req.top_p) is float
    assert req.sampling(5) == {"max_tokens": 5, "temperature": 0.5, "top_p": 0.25, "top_k": 3, "stop": ["END"],
                               "seed": 11, "grammar": None, "logprobs": None}
    integral = parse_completion(text_body(temperature=1, top_p=1, seed=3.0, max_tokens=2.0), chat=False)
    assert (integral.temperature, integral.top_p, integral.seed, integral.max_tokens) == (1.0, 1.0, 3, 2)
    assert type(integral.temperature) is float and type(integral.seed) is int and type(integral.max_tokens) is int


def test_max_completion_tokens_wins_over_max_tokens_and_zero_is_allowed():
    assert parse_completion(chat_body(max_completion_tokens=3, max_tokens=9), chat=True).max_tokens == 3
    assert parse_completion(chat_body(max_tokens=9), chat=True).max_tokens == 9
    assert parse_completion(chat_body(max_completion_tokens=0, max_tokens=9), chat=True).max_tokens == 0
    assert parse_completion(text_body(max_tokens=0), chat=False).max_tokens == 0
    assert parse_completion(text_body(max_tokens=None), chat=False).max_tokens == 16
    for name in ("max_tokens", "max_completion_tokens"):
        error = refusal(chat_body(**{name: -1}), chat=True)
        assert (error.message, error.param) == (f"{name} must be >= 0, got -1", name)


@pytest.mark.parametrize("name, low, high", [("temperature", 0, 2), ("top_p", 0, 1)])
def test_number_ranges_are_inclusive_and_refusals_name_the_field(name, low, high):
    if name == "temperature":
        assert parse_completion(chat_body(**{name: low}), chat=True).temperature == 0.0
    assert getattr(parse_completion(chat_body(**{name: high}), chat=True), name) == high
    for value in (low - 0.5, high + 0.5):
        error = refusal(chat_body(**{name: value}), chat=True)
        assert (error.message, error.param) == (f"{name} must be in [{low}, {high}], got {value}", name)
    for value, kind in (("1", "a string"), (True, "a boolean"), (float("nan"), "a number"),
                        (float("inf"), "a number"), ([1], "an array"), ({}, "an object")):
        error = refusal(chat_body(**{name: value}), chat=True)
        assert (error.message, error.param) == (f"{name} must be a number, got {kind}", name)


def test_top_p_zero_is_refused_with_the_reason():
    error = refusal(chat_body(top_p=0), chat=True)
    assert error.message == "top_p must be in (0, 1] (0 would keep no token; use temperature 0 for greedy)"
    assert error.param == "top_p"


def test_integer_fields_refuse_fractions_booleans_and_strings():
    assert parse_completion(chat_body(top_k=0), chat=True).top_k == 0
    assert parse_completion(chat_body(top_k=None), chat=True).top_k == 0
    assert parse_completion(chat_body(seed=-5), chat=True).seed == -5  # no minimum
    error = refusal(chat_body(top_k=-1), chat=True)
    assert (error.message, error.param) == ("top_k must be >= 0, got -1", "top_k")
    for value, kind in ((1.5, "a number"), (True, "a boolean"), ("3", "a string"), ([3], "an array")):
        error = refusal(chat_body(seed=value), chat=True)
        assert (error.message, error.param) == (f"seed must be an integer, got {kind}", "seed")


def test_typed_fields_name_the_type_they_got():
    cases = [("model", 5, "model must be a string, got an integer"),
             ("model", [], "model must be a string, got an array"),
             ("stream", "yes", "stream must be a boolean, got a string"),
             ("stream", 1, "stream must be a boolean, got an integer"),
             ("stream_options", [], "stream_options must be an object, got an array"),
             ("stream_options", 1.5, "stream_options must be an object, got a number"),
             ("stream_options", True, "stream_options must be an object, got a boolean")]
    for name, value, message in cases:
        error = refusal(chat_body(stream=True, **{name: value}) if name != "stream" else chat_body(stream=value),
                        chat=True)
        assert (error.message, error.param) == (message, name)


def test_a_direct_caller_s_python_types_are_named_too():
    # parse_completion also takes bodies built in Python, not parsed from JSON: a tuple is named as what it is
    error = refusal(chat_body(model=("m",)), chat=True)
    assert (error.message, error.param) == ("model must be a string, got tuple", "model")
    error = refusal(chat_body(seed=b"1"), chat=True)
    assert error.message == "seed must be an integer, got bytes"


def test_stream_options():
    assert parse_completion(chat_body(stream=True, stream_options={}), chat=True).include_usage is False
    assert parse_completion(chat_body(stream=True, stream_options={"include_usage": False}),
                            chat=True).include_usage is False
    assert parse_completion(chat_body(stream=False), chat=True).stream is False
    error = refusal(chat_body(stream_options={"include_usage": True}), chat=True)
    assert (error.message, error.param) == ("stream_options is only allowed with stream: true", "stream_options")
    error = refusal(chat_body(stream=False, stream_options={}), chat=True)
    assert error.param == "stream_options"
    error = refusal(chat_body(stream=True, stream_options={"include_usage": 1}), chat=True)
    assert (error.message, error.param) == ("stream_options.include_usage must be a boolean",
                                            "stream_options.include_usage")


def test_stop_strings_drop_empty_ones():
    assert parse_completion(chat_body(stop=None), chat=True).stop == []
    assert parse_completion(chat_body(stop=""), chat=True).stop == []
    assert parse_completion(chat_body(stop=["a", "", "b"]), chat=True).stop == ["a", "b"]
    assert parse_completion(chat_body(stop=[]), chat=True).stop == []
    for value in (["a", 1], 5, {"a": 1}):
        error = refusal(chat_body(stop=value), chat=True)
        assert (error.message, error.param) == ("stop must be a string or an array of strings", "stop")


UNSUPPORTED = [  # (chat, field, value, message, param)
    (True, "n", 2, "n = 2 is not supported: this server returns one choice per request", "n"),
    (False, "n", 3, "n = 3 is not supported: this server returns one choice per request", "n"),
    (True, "n", 0, "n must be >= 1, got 0", "n"),
    (False, "functions", [{"name": "f"}], "the legacy functions / function_call are not supported: use tools and "
     "tool_choice", "functions"),
    (True, "function_call", "auto", "the legacy functions / function_call are not supported: use tools and "
     "tool_choice", "function_call"),
    (False, "tools", [{"type": "function", "function": {"name": "f"}}], "tools are for /v1/chat/completions",
     "tools"),
    (True, "presence_penalty", 0.5, "presence_penalty is not supported (only 0)", "presence_penalty"),
    (False, "frequency_penalty", -2, "frequency_penalty is not supported (only 0)", "frequency_penalty"),
    (True, "frequency_penalty", 2.5, "frequency_penalty must be in [-2, 2], got 2.5", "frequency_penalty"),
    (True, "logit_bias", {"1": 5}, "logit_bias is not supported", "logit_bias"),
    (False, "echo", True, "echo is not supported", "echo"),
    (False, "best_of", 2, "best_of > 1 is not supported", "best_of"),
    (False, "best_of", 0, "best_of must be >= 1, got 0", "best_of"),
    (False, "suffix", "end", "suffix is not supported", "suffix"),
]


@pytest.mark.parametrize("chat, name, value, message, param", UNSUPPORTED,
                         ids=[f"{'chat' if c[0] else 'text'}-{c[1]}={c[2]}" for c in UNSUPPORTED])
def test_fields_it_cannot_honour_are_refused_by_name(chat, name, value, message, param):
    error = refusal((chat_body if chat else text_body)(**{name: value}), chat=chat)
    assert (error.message, error.param) == (message, param)


BAD_OUTPUT_FIELDS = [  # (chat, body fields, message fragment, param)
    (True, dict(logprobs=True, top_logprobs=21), "top_logprobs must be at most 20, got 21", "top_logprobs"),
    (True, dict(top_logprobs=0), "top_logprobs needs logprobs: true", "top_logprobs"),
    (True, dict(logprobs=1), "logprobs must be a boolean, got an integer", "logprobs"),
    (False, dict(logprobs=21), "logprobs must be at most 20, got 21", "logprobs"),
    (False, dict(logprobs=True), "logprobs must be an integer, got a boolean", "logprobs"),
    (True, dict(tools=[{"type": "function"}]), "tools[0].function must be an object with a name",
     "tools[0].function"),
    (True, dict(tools=[{"type": "function", "function": {"name": "a b"}}]), "tools[0].function.name must be",
     "tools[0].function.name"),
    (True, dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]),
     "Invalid type: strin", "tools[0].function.parameters"),
    (True, dict(tool_choice="auto"), "tool_choice 'auto' needs tools", "tool_choice"),
    (True, dict(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="sometimes"),
     "tool_choice must be", "tool_choice"),
    (True, dict(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required",
                response_format={"type": "json_object"}), "cannot be combined", "tool_choice"),
    (True, dict(response_format={"type": "json_object", "json_schema": 5}, grammar="start: /a/"),
     "give one of response_format, grammar", "grammar"),
    (True, dict(response_format={"type": "json_schema", "json_schema": {"schema": {"if": {}}}}),
     "Unimplemented keys", "response_format"),
    (False, dict(guided_json={"type": "objekt"}), "Invalid type: objekt", "guided_json"),
    (False, dict(guided_regex=5), "guided_regex must be a string, got an integer", "guided_regex"),
]


@pytest.mark.parametrize("chat, fields, message, param", BAD_OUTPUT_FIELDS)
def test_bad_structured_output_logprobs_and_tools_are_refused_by_name(chat, fields, message, param):
    error = refusal((chat_body if chat else text_body)(**fields), chat=chat)
    assert message in error.message and error.param == param


def test_structured_output_logprobs_and_tools_are_parsed():
    from pyllama_dspark.structured import Grammar

    req = parse_completion(chat_body(logprobs=True, top_logprobs=3, response_format={"type": "json_object"}),
                           chat=True)
    assert (req.logprobs, req.grammar) == (3, Grammar.json_object())
    assert parse_completion(chat_body(logprobs=True), chat=True).logprobs == 0
    assert parse_completion(text_body(logprobs=2, guided_regex="[ab]+"), chat=False).grammar == Grammar.regex("[ab]+")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    auto = parse_completion(chat_body(tools=[tool]), chat=True)
    assert (auto.tool_choice, [t.name for t in auto.tools], auto.grammar) == ("auto", ["f"], None)
    forced = parse_completion(chat_body(tools=[tool], tool_choice={"type": "function", "function": {"name": "f"}}),
                              chat=True)
    assert forced.tool_choice == "f" and forced.grammar is not None and forced.grammar.kind == "lark"
    off = parse_completion(chat_body(tools=[tool], tool_choice="none"), chat=True)
    assert off.tools == [] and off.grammar is None
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    req = parse_completion(chat_body(messages=[{"role": "user", "content": "x"},
                                               {"role": "assistant", "content": None, "tool_calls": calls},
                                               {"role": "tool", "content": "42", "tool_call_id": "c1"}]), chat=True)
    assert req.messages[1] == {"role": "assistant", "content": "", "tool_calls": calls}


def test_the_neutral_values_of_unsupported_fields_are_accepted():
    neutral = dict(n=1, tools=[], functions=None, tool_choice="none", response_format={"type": "text"},
                   presence_penalty=0, frequency_penalty=0.0, logit_bias={})
    assert parse_completion(chat_body(logprobs=False, top_logprobs=None, **neutral), chat=True).messages == MESSAGES
    assert parse_completion(text_body(logprobs=None, echo=False, best_of=1, suffix="", **neutral),
                            chat=False).prompt == "Hi"
    # text-only fields mean nothing to chat: ignored there, like any unknown field
    assert parse_completion(chat_body(echo=True, best_of=3, suffix="x", unknown=1), chat=True).messages == MESSAGES


def test_messages_are_checked_and_text_parts_joined():
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
             {"role": "user", "content": "Hi", "name": "ann"}]
    assert parse_completion({"messages": parts}, chat=True).messages == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]  # other keys dropped
    assert parse_completion({"messages": [{"role": "user", "content": []}]}, chat=True).messages == [
        {"role": "user", "content": ""}]
    whole = "messages must be a non-empty array of {role, content} objects"
    cases = [({}, whole, "messages"), ({"messages": []}, whole, "messages"), ({"messages": "Hi"}, whole, "messages"),
             ({"messages": [MESSAGES[0], "Hi"]}, "messages[1] must be an object with a string role", "messages[1]"),
             ({"messages": [{"content": "Hi"}]}, "messages[0] must be an object with a string role", "messages[0]"),
             ({"messages": [{"role": 1, "content": "Hi"}]}, "messages[0] must be an object with a string role",
              "messages[0]"),
             ({"messages": [{"role": "user"}]}, "messages[0].content must be a string or an array of text parts",
              "messages[0].content"),
             ({"messages": [{"role": "user", "content": 3}]},
              "messages[0].content must be a string or an array of text parts", "messages[0].content")]
    for body, message, param in cases:
        error = refusal(body, chat=True)
        assert (error.message, error.param) == (message, param)
    image = {"type": "image_url", "image_url": {"url": "x"}}
    for bad_part in (image, "text", {"type": "text"}, {"type": "text", "text": 5}):
        error = refusal({"messages": [MESSAGES[0], {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                 bad_part]}]}, chat=True)
        assert error.message == ('messages[1].content[1] must be a text part ({"type": "text", "text": ...}); images '
                                 "and audio are not supported")
        assert error.param == "messages[1].content"


def test_prompts_strings_token_ids_and_batches_of_one():
    assert parse_completion({"prompt": "Hello"}, chat=False).prompt == "Hello"
    assert parse_completion({"prompt": ["Hello"]}, chat=False).prompt == "Hello"
    assert parse_completion({"prompt": [1, 2, 3]}, chat=False).prompt == [1, 2, 3]
    assert parse_completion({"prompt": [[4, 5]]}, chat=False).prompt == [4, 5]
    assert parse_completion({"prompt": [7]}, chat=False).prompt == [7]
    error = refusal({"prompt": ""}, chat=False)
    assert (error.message, error.param) == ("prompt must not be empty", "prompt")
    error = refusal({"prompt": [""]}, chat=False)
    assert error.message == "prompt must not be empty"
    error = refusal({"prompt": ["a", "b"]}, chat=False)
    assert (error.message, error.param) == ("a batch of several prompts is not supported: send one request per "
                                            "prompt", "prompt")
    other = "prompt must be a non-empty string or an array of token ids"
    for prompt in (None, [], [[]], [1, True], [1.5], ["a", 1], [[1], [2]], 5, {"text": "x"}, [["a"]]):
        error = refusal({"prompt": prompt}, chat=False)
        assert (error.message, error.param) == (other, "prompt"), prompt


# --- responses ------------------------------------------------------------------------------------------------
@dataclass
class Stats:
    n_prompt: int = 10
    n_reused: int = 5
    t_prefill: float = 0.25
    t_decode: float = 0.5
    n_generated: int = 8
    drafted: int = 12
    accepted: int = 7
    by_source: dict = None

    def __post_init__(self):
        if self.by_source is None:
            self.by_source = {"grammar": DraftCounts(rounds=2, drafted=9, accepted=6),
                              "lookup": DraftCounts(rounds=1, drafted=3, accepted=1)}

    def as_dict(self):
        return {"drafted": self.drafted, "accepted": self.accepted}


@dataclass
class Result:
    text: str = "Hello"
    tokens: tuple = (4, 5, 6)
    n_prompt: int = 10
    finish_reason: str = "stop"
    stats: Stats = None
    logprobs: list | None = None


TIMINGS = {"cache_n": 5, "prompt_n": 5, "prompt_ms": 250.0, "prompt_per_token_ms": 50.0, "prompt_per_second": 20.0,
           "predicted_n": 8, "predicted_ms": 500.0, "predicted_per_token_ms": 62.5, "predicted_per_second": 16.0,
           "draft_n": 12, "draft_n_accepted": 7,
           "draft_by_source": {"grammar": {"draft_n": 9, "draft_n_accepted": 6},
                               "lookup": {"draft_n": 3, "draft_n_accepted": 1}}}


def test_timings_against_literal_values():
    assert timings(Stats()) == TIMINGS
    nothing = timings(Stats(n_prompt=6, n_reused=6, t_prefill=0.0, t_decode=0.0, n_generated=0, drafted=0,
                            accepted=0, by_source={}))
    assert nothing == {"cache_n": 6, "prompt_n": 0, "prompt_ms": 0.0, "prompt_per_token_ms": 0.0, "prompt_per_second": 0.0,
                       "predicted_n": 0, "predicted_ms": 0.0, "predicted_per_token_ms": 0.0,
                       "predicted_per_second": 0.0, "draft_n": 0, "draft_n_accepted": 0, "draft_by_source": {}}
    # tokens without time (a clock too coarse) and time without tokens give 0, not a division error
    odd = timings(Stats(t_prefill=0.0, t_decode=0.0, n_reused=10, n_prompt=10))
    assert (odd["prompt_per_token_ms"], odd["prompt_per_second"], odd["predicted_per_second"]) == (0.0, 0.0, 0.0)
    assert odd["predicted_per_token_ms"] == 0.0
    time_only = timings(Stats(n_reused=10, n_generated=0))
    assert (time_only["prompt_per_token_ms"], time_only["prompt_per_second"]) == (0.0, 0.0)
    assert (time_only["predicted_per_token_ms"], time_only["predicted_per_second"]) == (0.0, 0.0)


def shape(chat: bool, speculative: bool) -> ResponseShape:
    return ResponseShape(CompletionRequest(chat=chat, model=None), "target.gguf", speculative=speculative)


@pytest.mark.parametrize("chat, prefix", [(True, "chatcmpl"), (False, "cmpl")])
def test_one_id_and_creation_time_for_every_dict_of_a_request(chat, prefix):
    t0 = int(time.time())
    first, second = shape(chat, False), shape(chat, False)
    assert re.fullmatch(prefix + r"-[0-9a-f]{32}", first.head["id"]) and first.head["id"] != second.head["id"]
    assert t0 <= first.head["created"] <= int(time.time()) and first.head["model"] == "target.gguf"
    result = Result(stats=Stats())
    dicts = [first.completion(result), first.chunk("a"), first.chunk(None, role=True), first.final_chunk(result),
             first.usage_chunk(result)]
    assert {(d["id"], d["created"], d["model"]) for d in dicts} == {(first.head["id"], first.head["created"],
                                                                      "target.gguf")}


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("finish", ["length", "stop"])
def test_every_field_of_a_chat_response_and_its_chunks(finish, speculative):
    out = shape(True, speculative)
    head = out.head
    result = Result(finish_reason=finish, stats=Stats())
    extra = {"timings": TIMINGS, **({"speculative": {"drafted": 12, "accepted": 7}} if speculative else {})}
    assert out.completion(result) == {
        **head, "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello"}, "logprobs": None,
                     "finish_reason": finish}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                  "prompt_tokens_details": {"cached_tokens": 5}}, **extra}

    def chunk(delta, reason=None):
        return {**head, "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}

    assert out.chunk(None, role=True) == chunk({"role": "assistant", "content": ""})  # OpenAI's opening delta
    assert out.chunk("Hel") == chunk({"content": "Hel"})
    assert out.chunk("") == chunk({"content": ""})
    assert out.final_chunk(result) == {**chunk({}, finish), **extra}
    assert out.usage_chunk(result) == {**head, "object": "chat.completion.chunk", "choices": [],
                                       "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                  "prompt_tokens_details": {"cached_tokens": 5}}}


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("finish", ["length", "stop"])
def test_every_field_of_a_text_response_and_its_chunks(finish, speculative):
    out = shape(False, speculative)
    head = out.head
    result = Result(text="", tokens=(), n_prompt=4, finish_reason=finish, stats=Stats())
    extra = {"timings": TIMINGS, **({"speculative": {"drafted": 12, "accepted": 7}} if speculative else {})}
    assert out.completion(result) == {
        **head, "object": "text_completion",
        "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": finish}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 0, "total_tokens": 4,
                  "prompt_tokens_details": {"cached_tokens": 5}}, **extra}

    def chunk(text, reason=None):
        return {**head, "object": "text_completion",
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}]}

    assert out.chunk("Hel") == chunk("Hel")
    assert out.chunk(None) == chunk("")
    assert out.final_chunk(result) == {**chunk("", finish), **extra}
    assert out.usage_chunk(result) == {**head, "object": "text_completion", "choices": [],
                                       "usage": {"prompt_tokens": 4, "completion_tokens": 0, "total_tokens": 4,
                  "prompt_tokens_details": {"cached_tokens": 5}}}


def test_server_sent_events_are_compact_utf8_json():
    assert sse({"a": 1, "b": ["é", None]}) == 'data: {"a":1,"b":["é",null]}\n\n'.encode()
    assert sse("[DONE]") == b"data: [DONE]\n\n"
    assert sse({"error": {"message": "x"}}, event="error") == b'event: error\ndata: {"error":{"message":"x"}}\n\n'


def test_logprob_bounds_and_refusals_exactly():
    assert parse_completion(text_body(logprobs=0), chat=False).logprobs == 0
    assert parse_completion(text_body(logprobs=20), chat=False).logprobs == 20
    assert parse_completion(chat_body(logprobs=True, top_logprobs=20), chat=True).logprobs == 20
    assert parse_completion(chat_body(logprobs=True, top_logprobs=0), chat=True).logprobs == 0
    assert parse_completion(chat_body(logprobs=False), chat=True).logprobs is None
    for body, chat, message, param in [
            (text_body(logprobs=-1), False, "logprobs must be >= 0, got -1", "logprobs"),
            (chat_body(logprobs=True, top_logprobs=-1), True, "top_logprobs must be >= 0, got -1", "top_logprobs"),
            (chat_body(top_logprobs=3), True, "top_logprobs needs logprobs: true", "top_logprobs"),
            (chat_body(logprobs=False, top_logprobs=3), True, "top_logprobs needs logprobs: true", "top_logprobs")]:
        error = refusal(body, chat=chat)
        assert (error.message, error.param) == (message, param)


def test_grammar_fields_and_what_goes_to_the_engine():
    from pyllama_dspark.structured import Grammar

    req = parse_completion(chat_body(guided_grammar='start: "a" | "b"', logprobs=True, top_logprobs=2), chat=True)
    assert req.grammar == Grammar.lark('start: "a" | "b"')
    assert req.sampling(7)["grammar"] == req.grammar and req.sampling(7)["logprobs"] == 2
    assert parse_completion(chat_body(grammar='root ::= "x"'), chat=True).grammar.kind == "lark"
    assert parse_completion(text_body(guided_json={"type": "object"}), chat=False).grammar == Grammar.json_schema(
        {"type": "object"})
    error = refusal(chat_body(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required",
                              grammar="start: /a/"), chat=True)
    assert (error.message, error.param) == ("tool_choice 'required' constrains the reply to a tool call: it cannot be "
                                            "combined with a response_format or grammar", "tool_choice")
    error = refusal(text_body(tool_choice="auto"), chat=False)
    assert (error.message, error.param) == ("tools are for /v1/chat/completions", "tools")
    assert parse_completion(text_body(tool_choice="none"), chat=False).tools == []


def test_tool_calls_only_on_assistant_messages():
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    for message in ({"role": "user", "content": "x", "tool_calls": calls},
                    {"role": "assistant", "content": None, "tool_calls": {"id": "c"}}):
        error = refusal(chat_body(messages=[message]), chat=True)
        assert (error.message, error.param) == ("messages[0].tool_calls must be an array, on an assistant message",
                                                "messages[0].tool_calls")


def test_responses_carry_logprobs_and_tool_calls():
    from pyllama_dspark.logprobs import TokenLogprob
    from pyllama_dspark.tools import check_tools

    tools = [{"type": "function", "function": {"name": "f"}}]
    req = parse_completion(chat_body(tools=tools, logprobs=True), chat=True)
    out = ResponseShape(req, "target.gguf", speculative=False, piece={4: b"<", 5: b"x"}.get)
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    result = Result(text=call, tokens=(4, 5), stats=Stats(), logprobs=[TokenLogprob(4, -0.5), TokenLogprob(5, -1.0)])
    choice = out.completion(result)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["role"] == "assistant"
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [{"name": "f", "arguments": "{}"}]
    assert choice["logprobs"]["content"] == [{"token": "<", "logprob": -0.5, "bytes": [60], "top_logprobs": []},
                                             {"token": "x", "logprob": -1.0, "bytes": [120], "top_logprobs": []}]
    writer = out.writer()
    assert writer.tools == check_tools(tools) and writer.piece is out.piece
    assert writer.head is out.head and writer.chat is True
