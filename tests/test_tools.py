"""Tool calls (``pyllama_dspark.tools``), pure: the checks of ``tools`` and ``tool_choice`` with their messages, the
forced-call grammar, the messages written for the template, and the parser, against literal values."""

from __future__ import annotations

import json

import pytest

from pyllama_dspark.structured import Grammar, JSON_OPTIONS
from pyllama_dspark.tools import (CLOSE, OPEN, Tool, ToolCall, ToolError, call_grammar, check_tool_choice, check_tools,
                                  parse_tool_calls, prompt_messages)

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": PARAMS}}
TIME = {"type": "function", "function": {"name": "get-time"}}


def test_tools_are_read_with_their_defaults():
    weather, clock = check_tools([WEATHER, TIME])
    assert weather == Tool("get_weather", "Weather", PARAMS)
    assert clock == Tool("get-time", "", {"type": "object", "properties": {}})
    assert clock.as_openai() == {"type": "function", "function": {"name": "get-time", "description": "",
                                                                  "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("tools, message, param", [
    (None, "tools must be a non-empty array", "tools"),
    ([], "tools must be a non-empty array", "tools"),
    ({"type": "function"}, "tools must be a non-empty array", "tools"),
    ([{"type": "retrieval"}], "tools[0] must be {\"type\": \"function\"", "tools[0]"),
    (["f"], "tools[0] must be {\"type\": \"function\"", "tools[0]"),
    ([WEATHER, {"type": "function", "function": "f"}], "tools[1].function must be an object with a name",
     "tools[1].function"),
    ([{"type": "function", "function": {"name": ""}}], "tools[0].function.name must be 1-64 letters, digits, '_' "
     "or '-', got ''", "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "a" * 65}}], "must be 1-64", "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "a.b"}}], "got 'a.b'", "tools[0].function.name"),
    ([WEATHER, WEATHER], "tools[1].function.name 'get_weather' is given twice", "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], "tools[0].function.description must be a "
     "string", "tools[0].function.description"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "tools[0].function.parameters must be a "
     "JSON schema object", "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
     "tools[0].function.parameters: invalid json schema: Invalid type: objekt", "tools[0].function.parameters"),
])
def test_malformed_tools_are_refused_naming_the_field(tools, message, param):
    with pytest.raises(ToolError) as info:
        check_tools(tools)
    assert message in str(info.value) and info.value.param == param
    assert isinstance(info.value, ValueError)


def test_tool_choice():
    tools = check_tools([WEATHER, TIME])
    assert check_tool_choice(None, tools) == "auto" and check_tool_choice(None, []) == "none"
    assert [check_tool_choice(c, tools) for c in ("none", "auto", "required")] == ["none", "auto", "required"]
    assert check_tool_choice("none", []) == "none"
    assert check_tool_choice({"type": "function", "function": {"name": "get-time"}}, tools) == "get-time"
    with pytest.raises(ToolError, match=r"tool_choice 'required' needs tools"):
        check_tool_choice("required", [])
    with pytest.raises(ToolError, match=r"tool_choice names function 'now', which is not among the tools "
                                        r"\(get_weather, get-time\)") as info:
        check_tool_choice({"type": "function", "function": {"name": "now"}}, tools)
    assert info.value.param == "tool_choice"
    for bad in ("always", {"type": "function"}, {"type": "tool", "function": {"name": "get-time"}}, 3):
        with pytest.raises(ToolError, match="tool_choice must be 'none', 'auto', 'required' or"):
            check_tool_choice(bad, tools)


def test_the_forced_call_grammar():
    tools = check_tools([WEATHER, TIME])
    assert call_grammar(tools, "auto") is None and call_grammar(tools, "none") is None
    closed = dict(PARAMS, additionalProperties=False)
    one = {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": closed},
           "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": JSON_OPTIONS}
    assert call_grammar(tools, "get_weather") == Grammar.lark(
        f'start: "{OPEN}" call "{CLOSE}"\ncall: %json {json.dumps(one, separators=(",", ":"))}\n')
    either = call_grammar(tools, "required")
    assert '"anyOf"' in either.source and "get-time" in either.source and "get_weather" in either.source
    # a schema that allows more keeps it
    opened = check_tools([{"type": "function", "function": {"name": "f", "parameters": dict(
        PARAMS, additionalProperties=True)}}])
    assert '"additionalProperties":true' in call_grammar(opened, "f").source.replace(" ", "")


def test_messages_for_a_template_without_tools():
    tools = check_tools([WEATHER])
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    out = prompt_messages(messages, tools, "auto", template_renders_tools=False)
    note = ('You can call these functions (JSON schemas of their arguments):\n'
            '{"name": "get_weather", "description": "Weather", "parameters": {"type": "object", "properties": '
            '{"city": {"type": "string"}}, "required": ["city"]}}\n'
            f'To call a function, answer with only {OPEN}{{"name": <function name>, "arguments": <the arguments as a '
            f'JSON object>}}{CLOSE}.')
    assert out == [{"role": "system", "content": note}, messages[0],
                   {"role": "assistant", "content": f'{OPEN}{{"name": "get_weather", "arguments": {{"city": "Oslo"}}}}'
                                                    f'{CLOSE}'},
                   messages[2]]
    with_system = prompt_messages([{"role": "system", "content": "Be brief."}] + messages[:1], tools, "required",
                                  template_renders_tools=False)
    assert with_system[0] == {"role": "system", "content": f"Be brief.\n\n{note}"} and len(with_system) == 2
    assert prompt_messages(messages[:1], tools, "none", template_renders_tools=False) == messages[:1]
    assert prompt_messages(messages[:1], tools, "auto", template_renders_tools=True) == messages[:1]
    assert prompt_messages(["not a message"], tools, "none", template_renders_tools=True) == ["not a message"]


@pytest.mark.parametrize("text, content, calls", [
    (f'{OPEN}{{"name": "get_weather", "arguments": {{"city": "Oslo"}}}}{CLOSE}', None,
     [("get_weather", '{"city": "Oslo"}')]),
    (f'Sure. {OPEN}{{"name": "get_weather", "arguments": "{{\\"city\\": \\"Rome\\"}}"}}{CLOSE} Done.', "Sure.  Done.",
     [("get_weather", '{"city": "Rome"}')]),
    (f'{OPEN}[{{"name": "get_weather", "arguments": {{}}}}, {{"name": "get_weather", "parameters": {{"city": "A"}}}}]'
     f'{CLOSE}', None, [("get_weather", "{}"), ("get_weather", '{"city": "A"}')]),
    (f'{OPEN}{{"name": "get_weather", "arguments": {{"city": "B"}}}}', None, [("get_weather", '{"city": "B"}')]),
    ('  {"name": "get_weather", "arguments": {"city": "Å"}}', None, [("get_weather", '{"city": "Å"}')]),
    ('{"name": "get_weather"}', None, [("get_weather", "{}")]),
    # not calls: the reply stays content, whole
    (f'{OPEN}{{"name": "other", "arguments": {{}}}}{CLOSE}', ..., []),
    (f'{OPEN}{{"name": "get_weather", "arguments": [1]}}{CLOSE}', ..., []),
    (f'{OPEN}{{"name": "get_weather", "arguments": "not json"}}{CLOSE}', ..., []),
    ("[]", ..., []),
    ("plain text", ..., []),
])
def test_calls_are_parsed_out_of_a_reply(text, content, calls):
    got_content, got_calls = parse_tool_calls(text, check_tools([WEATHER]))
    assert [(c.name, c.arguments) for c in got_calls] == calls
    assert got_content == (text if content is ... else content)


def test_a_call_in_openai_shape():
    call = ToolCall("f", "{}")
    assert call.id.startswith("call_") and len(call.id) == 29 and ToolCall("f", "{}").id != call.id
    assert call.as_openai() == {"id": call.id, "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert call.as_openai(2) == {"index": 2, **call.as_openai()}


def test_earlier_calls_and_tools_are_written_whole():
    """Several calls in one assistant message (with its own text), arguments given as objects, missing names and
    arguments, non-ASCII text kept as is, two tools described one per line, no messages at all."""
    tools = check_tools([dict(WEATHER, function=dict(WEATHER["function"], description="Wetter in Zürich")), TIME])
    calls = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
             {"type": "function", "function": {"name": "get-time"}},
             {"type": "function", "function": {"arguments": "not json"}},
             {"type": "function"},
             "not a call"]
    out = prompt_messages([{"role": "assistant", "content": "Let me check.", "tool_calls": calls}], tools, "none",
                          template_renders_tools=False)
    assert out == [{"role": "assistant", "content": (
        f'Let me check.{OPEN}{{"name": "get_weather", "arguments": {{"city": "Zürich"}}}}{CLOSE}'
        f'{OPEN}{{"name": "get-time", "arguments": {{}}}}{CLOSE}'
        f'{OPEN}{{"name": "", "arguments": "not json"}}{CLOSE}'
        f'{OPEN}{{"name": "", "arguments": {{}}}}{CLOSE}'
        f'{OPEN}{{"name": "", "arguments": {{}}}}{CLOSE}')}]
    (system,) = prompt_messages([], tools, "required", template_renders_tools=False)
    lines = system["content"].split("\n")
    assert lines[1] == ('{"name": "get_weather", "description": "Wetter in Zürich", "parameters": {"type": "object", '
                        '"properties": {"city": {"type": "string"}}, "required": ["city"]}}')
    assert lines[2] == '{"name": "get-time", "description": "", "parameters": {"type": "object", "properties": {}}}'


def test_the_refusals_say_exactly_what_is_wrong():
    with pytest.raises(ToolError) as info:
        check_tools([])
    assert str(info.value) == 'tools must be a non-empty array of {"type": "function", "function": {...}}'
    with pytest.raises(ToolError) as info:
        check_tool_choice("sometimes", [])
    assert str(info.value) == ("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                               "\"function\": {\"name\": ...}}")
    with pytest.raises(ToolError) as info:
        check_tool_choice({"type": "function", "function": {"name": "f"}}, [])
    assert str(info.value) == "tool_choice names function 'f', which is not among the tools (none given)"


def test_the_parser_reads_calls_across_lines_and_past_a_malformed_one():
    tools = check_tools([WEATHER])
    text = (f'{OPEN}not json{CLOSE}\n{OPEN}\n{{"name": "get_weather",\n "arguments": {{"city": "Zürich"}}}}\n{CLOSE}')
    content, calls = parse_tool_calls(text, tools)
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Zürich"}')]
    assert content == f"{OPEN}not json{CLOSE}"
