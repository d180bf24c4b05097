"""Tool calls (OpenAI's function calling), pure Python: the tools checked, put into the prompt, a call parsed out of
the reply, and the grammar that forces one when ``tool_choice`` asks for it.

The format is one every template can carry: the model calls a function by answering

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

(SmolLM2's and Hermes/Qwen's tag; a list of calls inside one tag, several tags, and a bare ``{"name", "arguments"}``
object as the whole reply are parsed too). A chat template that renders ``tools`` itself gets them; for one that
does not (SmolLM2-135M's), the tools and the format are described in the system message. Earlier assistant tool
calls are written back in the same format, and ``tool`` messages keep their role.

``tool_choice``: "none" (tools left out of the prompt, nothing parsed), "auto" (offered; a reply that is a call is
parsed), "required" (the output is constrained to a call of one of the tools, whose arguments object takes only the
declared parameters unless its schema sets ``additionalProperties``) or ``{"type": "function",
"function": {"name": ...}}`` (constrained to a call of that one).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from .structured import JSON_OPTIONS, Grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names


class ToolError(ValueError):
    """A malformed ``tools`` list or ``tool_choice``; ``param`` names the field (``tools[1].function.name``)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def as_openai(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": dict(self.parameters)}}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def check_tools(value: Any) -> list[Tool]:
    """OpenAI's ``tools``: ``[{"type": "function", "function": {"name", "description"?, "parameters"?}}]``; each
    function's parameters must compile as a JSON schema.

    Raises:
        ToolError: naming the malformed entry.
    """
    if not isinstance(value, list) or not value:
        raise ToolError("tools must be a non-empty array of {\"type\": \"function\", \"function\": {...}}", "tools")
    tools, seen = [], set()
    for i, entry in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(entry, Mapping) or entry.get("type") != "function":
            raise ToolError(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}", where)
        function = entry.get("function")
        if not isinstance(function, Mapping):
            raise ToolError(f"{where}.function must be an object with a name", f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolError(f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}",
                            f"{where}.function.name")
        if name in seen:
            raise ToolError(f"{where}.function.name {name!r} is given twice", f"{where}.function.name")
        seen.add(name)
        description = function.get("description", "")
        if not isinstance(description, str):
            raise ToolError(f"{where}.function.description must be a string", f"{where}.function.description")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, Mapping):
            raise ToolError(f"{where}.function.parameters must be a JSON schema object",
                            f"{where}.function.parameters")
        try:
            Grammar.json_schema(parameters)
        except ValueError as exc:
            raise ToolError(f"{where}.function.parameters: {exc}", f"{where}.function.parameters") from None
        tools.append(Tool(name, description, dict(parameters)))
    return tools


def check_tool_choice(value: Any, tools: Sequence[Tool]) -> str:
    """``tool_choice``: "none", "auto" (the default with tools), "required", or a function's name (from
    ``{"type": "function", "function": {"name": ...}}``).

    Raises:
        ToolError: an unknown value, or a function the tools do not have.
    """
    if value is None:
        return "auto" if tools else "none"
    if value in ("none", "auto", "required"):
        if value != "none" and not tools:
            raise ToolError(f"tool_choice {value!r} needs tools", "tool_choice")
        return value
    if isinstance(value, Mapping) and value.get("type") == "function" and isinstance(value.get("function"), Mapping):
        name = value["function"].get("name")
        if name not in {tool.name for tool in tools}:
            raise ToolError(f"tool_choice names function {name!r}, which is not among the tools "
                            f"({', '.join(t.name for t in tools) or 'none given'})", "tool_choice")
        return name
    raise ToolError("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": "
                    "{\"name\": ...}}", "tool_choice")


def call_grammar(tools: Sequence[Tool], choice: str) -> Grammar | None:
    """The grammar that forces one call under "required" (any of the tools) or a named function; None otherwise."""
    if choice in ("none", "auto"):
        return None
    chosen = [t for t in tools if choice == "required" or t.name == choice]
    calls = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": _closed(t.parameters)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in chosen]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema["x-guidance"] = JSON_OPTIONS  # compact, as Grammar.json_schema writes JSON
    return Grammar.lark(f"start: {json.dumps(OPEN)} call {json.dumps(CLOSE)}\n"
                        f"call: %json {json.dumps(schema, separators=(',', ':'))}\n")


def _closed(parameters: Mapping[str, Any]) -> dict:
    """A function's parameters schema whose object takes only the declared parameters unless it says otherwise
    (``additionalProperties``): a forced call then carries arguments the function has (as OpenAI's strict mode)."""
    schema = dict(parameters)
    if schema.get("type") == "object" and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    return schema


def prompt_messages(messages: Sequence[Mapping[str, Any]], tools: Sequence[Tool], choice: str, *,
                    template_renders_tools: bool) -> list[dict]:
    """The messages to render: assistant tool calls written as ``<tool_call>`` text, and, when the template does
    not render ``tools`` itself and the tools are offered, their description in the system message."""
    out = []
    for message in messages:
        if not isinstance(message, Mapping) or not message.get("tool_calls") and message.get("content") is not None:
            out.append(message)  # as given (checks.messages judges it)
            continue
        content = message.get("content") or ""
        calls = message.get("tool_calls") or []
        if calls:
            written = "".join(f"{OPEN}{json.dumps(_call_object(call), ensure_ascii=False)}{CLOSE}" for call in calls)
            content = f"{content}{written}" if content else written
        out.append({"role": message.get("role"), "content": content})
    if tools and choice != "none" and not template_renders_tools:
        described = "\n".join(json.dumps(t.as_openai()["function"], ensure_ascii=False) for t in tools)
        note = (f"You can call these functions (JSON schemas of their arguments):\n{described}\n"
                f"To call a function, answer with only {OPEN}{{\"name\": <function name>, \"arguments\": "
                f"<the arguments as a JSON object>}}{CLOSE}.")
        first = out[0] if out else None
        if isinstance(first, Mapping) and first.get("role") == "system" and isinstance(first.get("content"), str):
            out[0] = {"role": "system", "content": f"{first['content']}\n\n{note}"}
        else:
            out.insert(0, {"role": "system", "content": note})
    return out


def _call_object(call: Mapping[str, Any]) -> dict:
    function = call.get("function", {}) if isinstance(call, Mapping) else {}
    arguments = function.get("arguments", "{}")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        pass
    return {"name": function.get("name", ""), "arguments": arguments}


def parse_tool_calls(text: str, tools: Sequence[Tool]) -> tuple[str | None, list[ToolCall]]:
    """(the text left as content, the calls) of a reply. A call names one of ``tools`` and has an arguments
    object; text that is not a well-formed call stays content, and a reply without calls is all content."""
    names = {tool.name for tool in tools}
    calls: list[ToolCall] = []
    rest: list[str] = []
    at = 0
    for match in re.finditer(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", text, re.S):
        found = _calls_in(match.group(1), names)
        if found is None:
            continue
        rest.append(text[at:match.start()])
        calls.extend(found)
        at = match.end()
    if not calls:  # the common JSON shape: the whole reply is one call (or a list of them)
        found = _calls_in(text, names)
        if found:
            return None, found
        return text, []
    rest.append(text[at:])
    content = "".join(rest).strip()
    return content or None, calls


def _calls_in(text: str, names: set[str]) -> list[ToolCall] | None:
    try:
        value = json.loads(text.strip())
    except json.JSONDecodeError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not (isinstance(item, dict) and item.get("name") in names):
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None
        if not isinstance(arguments, dict):
            return None
        calls.append(ToolCall(item["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls or None
