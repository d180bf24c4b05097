"""The OpenAI wire format: request bodies checked into ``CompletionRequest``, errors in OpenAI's nested shape, and
the response and chunk dicts (with llama-server's ``timings`` and our ``speculative`` statistics).

A bad request is an ``APIError`` with a 4xx status, never a 500: the official client retries 5xx responses and
would send the same bad request again. Fields this server does not know are ignored; fields it knows but cannot
honour (``n`` > 1, penalties, ``logit_bias``, legacy ``functions``) are refused with a 400 that names them, never
dropped silently.

Structured output: ``response_format`` (OpenAI's), ``grammar`` (llama-server's: Lark or GBNF text), or vLLM's
``guided_json`` / ``guided_regex`` / ``guided_grammar``, one of them. Logprobs: chat's ``logprobs`` and
``top_logprobs`` (0..20), the completions API's ``logprobs`` (0..20). Tools: ``tools`` and ``tool_choice`` on chat
(``pyllama_dspark.tools``).
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..completions import ChunkWriter, chunk_object, completion, completion_chunk, completion_head, usage
from ..errors import GrammarError
from ..logprobs import MAX_TOP_LOGPROBS
from ..structured import Grammar
from ..tools import Tool, ToolError, call_grammar, check_tool_choice, check_tools


class APIError(Exception):
    """An error response: HTTP ``status`` and OpenAI's ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass
class CompletionRequest:
    """A checked ``/v1/chat/completions`` or ``/v1/completions`` body."""

    chat: bool
    model: str | None
    messages: list[dict] | None = None
    prompt: str | list[int] | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    grammar: Grammar | None = None  # from response_format, grammar, guided_*, or a forced tool call
    logprobs: int | None = None  # alternatives per token (None: no logprobs)
    tools: list[Tool] = field(default_factory=list)  # offered to the model (none under tool_choice "none")
    tool_choice: str = "none"

    def sampling(self, max_tokens: int) -> dict:
        """Keyword arguments of ``LLM.stream``."""
        return dict(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                    stop=self.stop, seed=self.seed, grammar=self.grammar, logprobs=self.logprobs)


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def parse_completion(body: dict, *, chat: bool) -> CompletionRequest:
    """Check a request body.

    Raises:
        APIError: 400 naming the field that has the wrong type or value, or that is not supported.
    """
    _refuse_unsupported(body, chat=chat)
    req = CompletionRequest(chat=chat, model=_optional(body, "model", str))
    if chat:
        req.messages = _messages(body)
    else:
        req.prompt = _prompt(body)
    limits = [(name, _optional_int(body, name, minimum=0)) for name in ("max_completion_tokens", "max_tokens")]
    req.max_tokens = next((value for _, value in limits if value is not None), None if chat else 16)
    temperature = _optional_number(body, "temperature", 0.0, 2.0)
    req.temperature = 1.0 if temperature is None else temperature
    top_p = _optional_number(body, "top_p", 0.0, 1.0)
    if top_p == 0.0:
        raise bad_request("top_p must be in (0, 1] (0 would keep no token; use temperature 0 for greedy)", "top_p")
    req.top_p = 1.0 if top_p is None else top_p
    req.top_k = _optional_int(body, "top_k", minimum=0) or 0
    req.stop = _stop(body)
    req.seed = _optional_int(body, "seed")
    req.stream = bool(_optional(body, "stream", bool))
    options = _optional(body, "stream_options", dict)
    if options is not None:
        if not req.stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        include = options.get("include_usage")
        if include is not None and not isinstance(include, bool):
            raise bad_request("stream_options.include_usage must be a boolean", "stream_options.include_usage")
        req.include_usage = bool(include)
    req.logprobs = _logprobs(body, chat=chat)
    req.grammar = _grammar(body)
    if chat:
        _tools(body, req)
    return req


def _logprobs(body: dict, *, chat: bool) -> int | None:
    if not chat:  # the completions API: logprobs is the number of alternatives
        n = _optional_int(body, "logprobs", minimum=0)
        if n is not None and n > MAX_TOP_LOGPROBS:
            raise bad_request(f"logprobs must be at most {MAX_TOP_LOGPROBS}, got {n}", "logprobs")
        return n
    wanted = _optional(body, "logprobs", bool)
    top = _optional_int(body, "top_logprobs", minimum=0)
    if top is not None and top > MAX_TOP_LOGPROBS:
        raise bad_request(f"top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {top}", "top_logprobs")
    if top is not None and not wanted:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if wanted else None


_GRAMMAR_FIELDS = ("response_format", "grammar", "guided_json", "guided_regex", "guided_grammar")


def _grammar(body: dict) -> Grammar | None:
    given = [name for name in _GRAMMAR_FIELDS if body.get(name) is not None]
    if len(given) > 1:
        raise bad_request(f"give one of {', '.join(given)}: each one sets the output's grammar", given[1])
    if not given:
        return None
    name, value = given[0], body[given[0]]
    try:
        if name == "response_format":
            return Grammar.from_response_format(value)
        if name == "guided_json":
            return Grammar.json_schema(value)
        if not isinstance(value, str):
            raise bad_request(f"{name} must be a string, got {_json_type(value)}", name)
        return Grammar.regex(value) if name == "guided_regex" else Grammar.lark(value)
    except GrammarError as exc:
        raise bad_request(f"{name}: {exc}", name) from None


def _tools(body: dict, req: CompletionRequest) -> None:
    try:
        tools = check_tools(body["tools"]) if body.get("tools") else []  # [] as none, as llama-server
        choice = check_tool_choice(body.get("tool_choice"), tools)
    except ToolError as exc:
        raise bad_request(str(exc), exc.param) from None
    forced = call_grammar(tools, choice)
    if forced is not None:
        if req.grammar is not None:
            raise bad_request(f"tool_choice {choice!r} constrains the reply to a tool call: it cannot be combined "
                              "with a response_format or grammar", "tool_choice")
        req.grammar = forced
    req.tool_choice = choice
    req.tools = tools if choice != "none" else []


def _refuse_unsupported(body: dict, *, chat: bool) -> None:
    n = _optional_int(body, "n", minimum=1)
    if n is not None and n != 1:
        raise bad_request(f"n = {n} is not supported: this server returns one choice per request", "n")
    if body.get("functions") or body.get("function_call"):
        raise bad_request("the legacy functions / function_call are not supported: use tools and tool_choice",
                          "functions" if body.get("functions") else "function_call")
    if not chat and (body.get("tools") or body.get("tool_choice") not in (None, "none")):
        raise bad_request("tools are for /v1/chat/completions", "tools")
    for name in ("presence_penalty", "frequency_penalty"):
        value = _optional_number(body, name, -2.0, 2.0)
        if value:
            raise bad_request(f"{name} is not supported (only 0)", name)
    if body.get("logit_bias"):
        raise bad_request("logit_bias is not supported", "logit_bias")
    if not chat:
        if body.get("echo"):
            raise bad_request("echo is not supported", "echo")
        best_of = _optional_int(body, "best_of", minimum=1)
        if best_of is not None and best_of != 1:
            raise bad_request("best_of > 1 is not supported", "best_of")
        if body.get("suffix"):
            raise bad_request("suffix is not supported", "suffix")


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty array of {role, content} objects", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(f"{where} must be an object with a string role", where)
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(f"{where}.content[{j}] must be a text part ({{\"type\": \"text\", \"text\": ...}}"
                                      f"); images and audio are not supported", f"{where}.content")
                texts.append(part["text"])
            content = "".join(texts)
        calls = message.get("tool_calls")
        if calls is not None and (message["role"] != "assistant" or not isinstance(calls, list)):
            raise bad_request(f"{where}.tool_calls must be an array, on an assistant message", f"{where}.tool_calls")
        if content is None and calls:
            content = ""
        if not isinstance(content, str):
            raise bad_request(f"{where}.content must be a string or an array of text parts", f"{where}.content")
        out.append({"role": message["role"], "content": content, **({"tool_calls": calls} if calls else {})})
    return out


def _prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [int(t) for t in prompt]
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str) for p in prompt):
        raise bad_request("a batch of several prompts is not supported: send one request per prompt", "prompt")
    raise bad_request("prompt must be a non-empty string or an array of token ids", "prompt")


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return [s for s in stop if s]
    raise bad_request("stop must be a string or an array of strings", "stop")


def _optional(body: dict, name: str, kind: type) -> Any:
    value = body.get(name)
    if value is not None and not isinstance(value, kind):
        raise bad_request(f"{name} must be {_KIND_NAMES[kind]}, got {_json_type(value)}", name)
    return value


def _optional_int(body: dict, name: str, *, minimum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name} must be an integer, got {_json_type(value)}", name)
    if minimum is not None and value < minimum:
        raise bad_request(f"{name} must be >= {minimum}, got {value}", name)
    return value


def _optional_number(body: dict, name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise bad_request(f"{name} must be a number, got {_json_type(value)}", name)
    if not low <= value <= high:
        raise bad_request(f"{name} must be in [{low:g}, {high:g}], got {value}", name)
    return float(value)


_KIND_NAMES = {str: "a string", bool: "a boolean", dict: "an object", list: "an array"}


def _json_type(value: Any) -> str:
    """What a value that is not None is, in JSON's words (the callers let None through as absent)."""
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(value), type(value).__name__)


# --- responses ------------------------------------------------------------------------------------------------
class ResponseShape:
    """Builds one request's response or chunks (``completions.py``'s, with ``timings``): one id and creation time
    for all of them, the object names, usage and statistics."""

    def __init__(self, req: CompletionRequest, model_id: str, *, speculative: bool, piece=None):
        self.req, self.speculative, self.piece = req, speculative, piece
        self.head = completion_head(chat=req.chat, model_name=model_id)

    def completion(self, result) -> dict:
        """The non-streaming response for a ``GenerationResult``."""
        return {**completion(result, self.head, chat=self.req.chat, speculative=False, piece=self.piece,
                             tools=self.req.tools), **self.extras(result)}

    def writer(self) -> ChunkWriter:
        """The stream's text chunks, with logprobs and tool calls (``completions.ChunkWriter``)."""
        return ChunkWriter(self.head, chat=self.req.chat, piece=self.piece, tools=self.req.tools)

    def chunk(self, text: str | None, finish_reason: str | None = None, *, role: bool = False) -> dict:
        """A stream chunk; ``role``: chat's opening one, ``{"role": "assistant", "content": ""}`` as OpenAI sends."""
        return completion_chunk(self.head, text, finish_reason, chat=self.req.chat,
                                opening={"role": "assistant", "content": ""} if role else None)

    def final_chunk(self, result, finish_reason: str | None = None) -> dict:
        """The chunk with the finish reason (the result's, or the writer's "tool_calls"); it also carries
        ``timings`` (and ``speculative``)."""
        return {**self.chunk(None, finish_reason or result.finish_reason), **self.extras(result)}

    def usage_chunk(self, result) -> dict:
        """``stream_options.include_usage``: no choices, the usage."""
        return {**self.head, "object": chunk_object(self.req.chat), "choices": [], "usage": usage(result)}

    def extras(self, result) -> dict:
        out = {"timings": timings(result.stats)}
        if self.speculative:
            out["speculative"] = result.stats.as_dict()
        return out


def timings(stats) -> dict:
    """llama-server's ``timings`` object, from our ``SpecStats`` (``cache_n``: prompt tokens taken from the prompt
    cache; ``prompt_n``: the prompt tokens evaluated)."""
    n_prompt = stats.n_prompt - stats.n_reused
    prompt_ms, predicted_ms = 1000 * stats.t_prefill, 1000 * stats.t_decode
    return {
        "cache_n": stats.n_reused, "prompt_n": n_prompt, "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / n_prompt if n_prompt else 0.0,
        "prompt_per_second": 1000 * n_prompt / prompt_ms if prompt_ms else 0.0,
        "predicted_n": stats.n_generated, "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / stats.n_generated if stats.n_generated else 0.0,
        "predicted_per_second": 1000 * stats.n_generated / predicted_ms if predicted_ms else 0.0,
        "draft_n": stats.drafted, "draft_n_accepted": stats.accepted,
        # ours: the same two by draft source ("lookup", "history", "grammar", "dspark")
        "draft_by_source": {name: {"draft_n": share.drafted, "draft_n_accepted": share.accepted}
                            for name, share in stats.by_source.items()},
    }


def sse(data: dict | str, event: str | None = None) -> bytes:
    """One server-sent event."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {payload}\n\n".encode()
