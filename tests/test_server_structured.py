"""Structured output, logprobs and tool calls through the server and the official client, exact under speculation:
the same requests against ``serve`` with a drafter (one slot, and four slots through the batch scheduler) and
without one give the same replies and bit-identical logprobs; sampling under a grammar keeps the masked target's
distribution through the batched scheduler too (chi-square)."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("starlette", reason="the server needs the [server] extra: pip install '.[server]'")
pytest.importorskip("uvicorn", reason="the server needs the [server] extra: pip install '.[server]'")
openai = pytest.importorskip("openai", reason="the server tests need the openai client: pip install '.[test]'")
jsonschema = pytest.importorskip("jsonschema", reason="the structured-output tests need jsonschema")

from pyllama_dspark import Batch, Context, Model  # noqa: E402
from pyllama_dspark.server import BackgroundServer  # noqa: E402
from pyllama_dspark.structured import Grammar, GrammarState  # noqa: E402
from pyllama_dspark.testing import TinySpec  # noqa: E402
from test_rejection import chi2_critical, chi_square  # noqa: E402

pytestmark = pytest.mark.timeout(600)

SPEC = TinySpec(arch="llama", n_layer=3, vocab="llama-spm", chat_template="chatml")
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string",
                                                                                   "maxLength": 12}},
                                                           "required": ["city"]}}}


def client(server) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def servers(pair):
    """A plain server, a speculative one with one slot and one with four (the batch scheduler)."""
    yield "plain", BackgroundServer(pair.target, n_ctx=512, alias="m")
    yield "dspark", BackgroundServer(pair.target, drafter=pair.drafter, n_ctx=512, alias="m",
                                     load_kwargs={"n_draft": 3})
    yield "dspark x4", BackgroundServer(pair.target, drafter=pair.drafter, n_ctx=512, alias="m", parallel=4,
                                        load_kwargs={"n_draft": 3})


def logprob_values(choice) -> list:
    return [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in choice.logprobs.content]


def test_json_schema_logprobs_and_tool_calls_are_identical_with_and_without_the_drafter(make_pair):
    pair = make_pair(SPEC)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    seen = {}
    for name, server in servers(pair):
        with server as srv:
            api = client(srv)
            reply = api.chat.completions.create(model="m", messages=MESSAGES, max_tokens=40, temperature=0,
                                                response_format=fmt, logprobs=True, top_logprobs=3)
            choice = reply.choices[0]
            # the schema bounds every field, so even this random-weight model closes the object within 40 tokens
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)
            streamed = list(api.chat.completions.create(model="m", messages=MESSAGES, max_tokens=40, temperature=0,
                                                        response_format=fmt, logprobs=True, stream=True))
            text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
            stream_logprobs = [e.logprob for c in streamed if c.choices and c.choices[0].logprobs
                               for e in c.choices[0].logprobs.content]
            assert text == choice.message.content
            assert stream_logprobs == [e.logprob for e in choice.logprobs.content]
            forced = api.chat.completions.create(model="m", messages=MESSAGES, max_tokens=40, temperature=0,
                                                 tools=[WEATHER], tool_choice="required")
            call_stream = list(api.chat.completions.create(
                model="m", messages=MESSAGES, max_tokens=40, temperature=0, tools=[WEATHER], stream=True,
                tool_choice={"type": "function", "function": {"name": "get_weather"}}))
            completion = api.completions.create(model="m", prompt="Numbers:", max_tokens=20, temperature=0,
                                                logprobs=2, extra_body={"guided_regex": "( [0-9]{1,3}){4}"})
            seen[name] = (choice.message.content, logprob_values(choice), forced.choices[0], call_stream,
                          completion.choices[0])
    reference = seen["plain"]
    for name, (content, logprobs, forced, call_stream, completion) in seen.items():
        assert content == reference[0], name
        assert logprobs == reference[1], name  # bit-identical: floats compared exactly
        # a forced call: parsed into tool_calls, arguments valid for the function, the same call everywhere
        assert forced.finish_reason == "tool_calls" and forced.message.content is None, (name, forced)
        (call,) = forced.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        assert call.function.arguments == reference[2].message.tool_calls[0].function.arguments, name
        deltas = [c.choices[0].delta for c in call_stream if c.choices and c.choices[0].delta.tool_calls]
        assert len(deltas) == 1 and deltas[0].tool_calls[0].function.arguments == call.function.arguments
        assert call_stream[-1].choices[0].finish_reason == "tool_calls"
        assert not any(c.choices[0].delta.content for c in call_stream if c.choices)  # the call is not content
        assert completion.text == reference[4].text and completion.logprobs == reference[4].logprobs, name
        assert completion.finish_reason == "stop"  # the grammar's end: four numbers, then end of generation
        assert len(completion.text.split()) == 4 and all(w.isdigit() for w in completion.text.split())
        assert completion.logprobs.tokens and len(completion.logprobs.top_logprobs[0]) == 2


def test_tool_choice_auto_parses_a_call_the_model_writes_and_leaves_text_alone(make_pair):
    """Under "auto" nothing is constrained: a reply that is a call is parsed (the tag, a bare JSON call, several
    calls), text that is not a well-formed call of a known function stays content, whole and streamed alike."""
    from pyllama_dspark.completions import completion, completion_chunks, completion_head
    from pyllama_dspark.generate import GenerationResult, TokenEvent
    from pyllama_dspark.tools import check_tools

    tools = check_tools([WEATHER])
    head = completion_head(chat=True, model_name="m")
    for text, calls in [('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>', 1),
                        ('{"name": "get_weather", "arguments": {"city": "Oslo"}}', 1),
                        ('Let me look. <tool_call>[{"name": "get_weather", "arguments": {"city": "A"}}, '
                         '{"name": "get_weather", "arguments": {"city": "B"}}]</tool_call>', 2),
                        ("It is sunny <tool_call>in Oslo.", 0),
                        ('{"name": "unknown", "arguments": {}}', 0),
                        ("Just text.", 0)]:
        result = GenerationResult(text, [1], "eog")
        message = completion(result, head, chat=True, speculative=False, tools=tools)["choices"][0]["message"]
        assert len(message.get("tool_calls", [])) == calls, text
        pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
        events = [TokenEvent(token=1, text=p) for p in pieces] + [TokenEvent(token=-1, text="", stop_reason="eog",
                                                                             result=result)]
        chunks = list(completion_chunks(iter(events), head, chat=True, tools=tools))
        streamed_calls = [c for chunk in chunks for c in chunk["choices"][0]["delta"].get("tool_calls", [])]
        streamed_text = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks)
        assert len(streamed_calls) == calls, text
        if calls:
            assert [c["function"] for c in streamed_calls] == [c["function"] for c in message["tool_calls"]]
            assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
            assert streamed_text.strip() == (message["content"] or "")
        else:
            assert streamed_text == text and message["content"] == text


@pytest.mark.statistical
def test_constrained_sampling_through_the_batched_scheduler_follows_the_masked_target(make_pair):
    """Four slots with the random-weight drafter, temperature 1, the grammar [0-9][0-9]: the second digit, drawn
    where the grammar cut the drafter's proposal (rejection sampling's residual there), over many requests with
    their own seeds, against its exact marginal sum_d1 p(d1) p(d2 | d1), p the target's softmax restricted to the
    tokens that spell a digit (this vocabulary spells each digit by a text token and by a byte token). The loop's
    rejection sampling of valid drafts under a grammar is tested in tests/test_structured.py."""
    pair = make_pair(SPEC)
    grammar = Grammar.regex("[0-9][0-9]")
    with Model(pair.target) as model:
        ids = [int(t) for t in model.tokenize(model.apply_chat_template(MESSAGES), add_special=True,
                                              parse_special=True)]
        ctx = Context(model, n_ctx=256)
        spelling = {}

        def masked(prefix, consumed):
            ctx.clear()
            batch = Batch(len(prefix))
            batch.add_tokens(prefix, 0, logits="last")
            ctx.decode(batch)
            state = GrammarState(grammar, model)
            state.advance(consumed)
            allowed = np.flatnonzero(state.allowed())
            logits = ctx.logits(-1).astype(np.float64)[allowed]
            p = np.exp(logits - logits.max())
            for t in allowed:
                spelling[int(t)] = model.token_to_piece(int(t)).decode()
            return dict(zip(allowed.tolist(), p / p.sum()))

        second: dict[str, float] = {}
        for t1, p1 in masked(ids, []).items():
            for t2, p2 in masked(ids + [t1], [t1]).items():
                second[spelling[t2]] = second.get(spelling[t2], 0.0) + p1 * p2
        ctx.close()
    digits = sorted(second)
    expected = np.array([second[d] for d in digits])
    counts = np.zeros(len(digits), int)
    with BackgroundServer(pair.target, drafter=pair.drafter, n_ctx=256, alias="m", parallel=4,
                          load_kwargs={"n_draft": 3}) as srv:
        from concurrent.futures import ThreadPoolExecutor

        api = client(srv)

        def one(seed: int) -> tuple[str, int]:
            reply = api.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4, temperature=1.0,
                                                seed=seed, extra_body={"guided_regex": "[0-9][0-9]"})
            return reply.choices[0].message.content, reply.model_extra["speculative"]["draft_invalid"]

        invalid = 0
        with ThreadPoolExecutor(8) as pool:
            for text, refused in pool.map(one, range(800)):
                counts[digits.index(text[1])] += 1
                invalid += refused
    assert invalid > 0  # the drafter's proposals were refused by the grammar and cut
    assert chi_square(counts, expected) < chi2_critical(len(digits) - 1)

