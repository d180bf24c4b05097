"""The HTTP side: a Starlette app over an ``Engine``, with server-sent events written directly.

Every request runs on the event loop and only waits: tokenizing a prompt runs in a worker thread, generation on
the engine thread. A request that loses its client (a closed stream, or a dropped connection while it waits for a
whole response) cancels its job, which frees the engine within one round, or inside a long prefill.

Limits a public endpoint needs:

- the request body is read up to ``body_limit`` bytes, checked against the declared Content-Length before reading
  and against what arrives (chunked bodies too) while reading; beyond it the request gets 413 before anything is
  parsed. The default limit is what a prompt filling the context could take (every token as long as the
  vocabulary's longest, every byte JSON-escaped to 6) plus 1 MiB for the rest of the body;
- a body that stops arriving for ``BODY_IDLE_TIMEOUT_S`` gets 408;
- a text prompt longer in bytes than ``n_ctx`` tokens of the longest length is refused before it is tokenized.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from starlette.requests import ClientDisconnect

from ..chat import ChatTemplateError
from ..errors import LlamaError
from ..tools import prompt_messages
from .engine import Engine, EngineUnavailableError, Job, QueueFullError
from .metrics import prometheus_text
from .protocol import APIError, CompletionRequest, ResponseShape, bad_request, parse_completion, parse_json, sse

log = logging.getLogger("pyllama_dspark.server")

RETRY_AFTER_S = "1"
# events already waiting in a mailbox go out in one write, up to this many (so a fast engine still streams)
MAX_EVENTS_PER_WRITE = 16
BODY_IDLE_TIMEOUT_S = 30.0  # most seconds between two parts of a request body
BODY_SLACK_BYTES = 1 << 20  # the default body limit's room for everything in a body but the prompt
JSON_ESCAPE_FACTOR = 6  # a byte may take up to 6 in a JSON string (\u00XX)


class ServerConfig:
    """What the app needs besides the engine: the names the model answers to, and the API key (None: open)."""

    def __init__(self, model_path: str, *, alias: str | None = None, api_key: str | None = None,
                 max_body_bytes: int | None = None):
        path = Path(model_path)
        self.max_body_bytes = max_body_bytes  # None: default_body_limit of the loaded model
        self.model_id = alias or path.name
        self.model_names = {name for name in (alias, path.name, path.stem) if name}
        self.api_key = api_key
        self.created = int(time.time())


def create_app(engine: Engine, config: ServerConfig) -> Starlette:
    """The ASGI app; closing it (lifespan shutdown) stops the engine."""

    def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), config.api_key.encode()):
            raise APIError(401, "invalid or missing API key (send Authorization: Bearer <key>)",
                           code="invalid_api_key")

    def ready() -> Any:
        if engine.state != "ready":
            raise APIError(503, engine.unavailable_reason(), type="unavailable_error",
                           headers={"Retry-After": RETRY_AFTER_S})
        return engine.llm

    async def health(request: Request) -> Response:
        if engine.state == "ready":
            return JSONResponse({"status": "ok"})
        return _error_response(APIError(503, engine.unavailable_reason(), type="unavailable_error",
                                        headers={"Retry-After": RETRY_AFTER_S}))

    async def models(request: Request) -> Response:
        authorize(request)
        entry = {"id": config.model_id, "object": "model", "created": config.created, "owned_by": "pyllama-dspark"}
        if engine.state == "ready":
            llm = engine.llm
            entry["meta"] = {"n_ctx": llm.ctx.n_ctx, "n_vocab": llm.model.n_vocab,
                             "speculative": llm.speculator is not None}
        return JSONResponse({"object": "list", "data": [entry]})

    async def metrics(request: Request) -> Response:
        authorize(request)
        text = prometheus_text(engine.counters, config.model_id, engine.n_waiting, engine.parallel)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    body_limit: list[int] = []  # the limit in force, computed once the model is loaded

    async def read_body(request: Request, llm) -> bytes | None:
        """The request body, refused (413) past the limit before it is read whole; None if the client left."""
        if not body_limit:
            limit = config.max_body_bytes
            body_limit.append(limit if limit is not None else await asyncio.to_thread(default_body_limit, llm))
        limit = body_limit[0]
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise bad_request(f"Content-Length must be a number of bytes, got {declared[:40]!r}")
            if int(declared) > limit:
                raise body_too_large(limit)
        parts, size = [], 0
        stream = request.stream().__aiter__()
        while True:
            try:
                part = await asyncio.wait_for(stream.__anext__(), BODY_IDLE_TIMEOUT_S)
            except StopAsyncIteration:
                return b"".join(parts)
            except asyncio.TimeoutError:
                raise APIError(408, f"the request body stopped arriving for {BODY_IDLE_TIMEOUT_S:g} s",
                               code="request_timeout") from None
            except ClientDisconnect:
                return None
            size += len(part)
            if size > limit:
                raise body_too_large(limit)
            parts.append(part)

    async def completions(request: Request, *, chat: bool) -> Response:
        authorize(request)
        llm = ready()
        raw = await read_body(request, llm)
        if raw is None:
            return Response(status_code=499)  # nobody reads it: the client is gone
        req = await asyncio.to_thread(parse_completion, parse_json(raw), chat=chat)  # compiles grammars
        if req.model is not None and req.model not in config.model_names:
            raise APIError(404, f"model {req.model!r} not found: this server serves {config.model_id!r}",
                           param="model", code="model_not_found")
        prompt = await asyncio.to_thread(_prompt_tokens, llm, req)
        max_tokens = llm.ctx.n_ctx if req.max_tokens is None else req.max_tokens
        job = Job(prompt=prompt, sampling=req.sampling(max_tokens), loop=asyncio.get_running_loop())
        try:
            engine.submit(job)
        except QueueFullError as exc:
            raise APIError(503, f"the server is busy: {exc}; retry later", type="unavailable_error",
                           headers={"Retry-After": RETRY_AFTER_S}) from None
        except EngineUnavailableError as exc:
            raise APIError(503, str(exc), type="unavailable_error", headers={"Retry-After": RETRY_AFTER_S}) from None
        shape = ResponseShape(req, config.model_id, speculative=llm.speculator is not None,
                              piece=llm.model.token_to_piece)
        disconnect = asyncio.ensure_future(_wait_disconnect(request.receive))
        try:
            first = await _next_item(job, disconnect)
        except BaseException:
            disconnect.cancel()
            job.cancel.cancel()
            raise
        if first is None or isinstance(first, BaseException):
            disconnect.cancel()
            job.cancel.cancel()
            if first is None:
                return Response(status_code=499)  # nobody reads it: the client is gone
            raise _engine_error(first)
        if req.stream:
            return EventStream(job, shape, req, first, disconnect)
        try:
            item = first
            while item.result is None:
                item = await _next_item(job, disconnect)
                if item is None:
                    return Response(status_code=499)
                if isinstance(item, BaseException):
                    raise _engine_error(item)
            return JSONResponse(shape.completion(item.result))
        finally:
            disconnect.cancel()
            job.cancel.cancel()  # a no-op once the job has finished; stops it when this request ends early

    async def chat_completions(request: Request) -> Response:
        return await completions(request, chat=True)

    async def text_completions(request: Request) -> Response:
        return await completions(request, chat=False)

    async def on_api_error(request: Request, exc: APIError) -> Response:
        return _error_response(exc)

    async def on_http_error(request: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(exc.status_code, str(exc.detail), type=kind))

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error on %s", request.url.path)
        return _error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(engine.stop)

    return Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", text_completions, methods=["POST"]),
        ],
        exception_handlers={APIError: on_api_error, HTTPException: on_http_error, Exception: on_unexpected},
        lifespan=lifespan,
    )


def default_body_limit(llm) -> int:
    """The largest body a prompt that fits the context could need: ``n_ctx`` tokens of the vocabulary's longest
    piece, every byte JSON-escaped, and ``BODY_SLACK_BYTES`` for the rest."""
    return BODY_SLACK_BYTES + JSON_ESCAPE_FACTOR * llm.model.max_token_bytes * llm.ctx.n_ctx


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server reads ({limit} bytes; --max-body-bytes)",
                    code="request_too_large")


def _prompt_tokens(llm, req: CompletionRequest) -> list[int]:
    """The token ids ``LLM.chat`` / ``LLM.generate`` would decode for this request (in a worker thread)."""
    model = llm.model
    if req.chat:
        try:
            messages = prompt_messages(req.messages, req.tools, req.tool_choice,
                                       template_renders_tools=model.renders_tools)
            text = model.apply_chat_template(messages, tools=[t.as_openai() for t in req.tools] or None)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), "messages") from None
    else:
        text = req.prompt
    n_ctx = llm.ctx.n_ctx
    if isinstance(text, str):
        n_bytes = len(text.encode("utf-8", "surrogatepass"))
        # every token covers at most max_token_bytes of the text: a longer text cannot fit, so it is not tokenized
        if n_bytes > n_ctx * model.max_token_bytes:
            raise bad_request(f"the prompt has {n_bytes} bytes, more than {n_ctx} tokens of this vocabulary can hold "
                              f"(at most {model.max_token_bytes} bytes each); this server's context holds {n_ctx}",
                              "messages" if req.chat else "prompt", code="context_length_exceeded")
        tokens = [int(t) for t in model.tokenize(text, add_special=True, parse_special=True)]
    else:
        bad = [t for t in text if not 0 <= t < model.n_vocab]
        if bad:
            raise bad_request(f"token id {bad[0]} outside the vocabulary [0, {model.n_vocab})", "prompt")
        tokens = list(text)
    if not tokens:
        raise bad_request("the prompt has no tokens", "messages" if req.chat else "prompt")
    if len(tokens) >= n_ctx:
        raise bad_request(f"the prompt has {len(tokens)} tokens; this server's context holds {n_ctx} (and needs room "
                          f"for at least one generated token)", "messages" if req.chat else "prompt",
                          code="context_length_exceeded")
    return tokens


class EventStream:
    """A streamed completion as server-sent events: OpenAI's chunks, then ``data: [DONE]``. Events already in the
    mailbox go out together (``MAX_EVENTS_PER_WRITE`` at most per write). An error after the first chunk is an
    ``error`` event (the status is sent by then)."""

    def __init__(self, job: Job, shape: ResponseShape, req: CompletionRequest, first, disconnect: asyncio.Future):
        self.job, self.shape, self.req, self.first, self.disconnect = job, shape, req, first, disconnect

    async def __call__(self, scope, receive, send) -> None:
        job, shape = self.job, self.shape
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                    (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
            out = [sse(shape.chunk(None, role=True))] if self.req.chat else []
            writer = shape.writer()
            item = self.first
            while True:
                if isinstance(item, BaseException):
                    out.append(sse(_engine_error(item).body(), event="error"))
                    break
                out.extend(sse(chunk) for chunk in writer.feed(item))
                if item.result is not None:
                    out.append(sse(shape.final_chunk(item.result, writer.finish_reason)))
                    if self.req.include_usage:
                        out.append(sse(shape.usage_chunk(item.result)))
                    out.append(sse("[DONE]"))
                    break
                if job.mailbox.empty() or len(out) >= MAX_EVENTS_PER_WRITE:
                    await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
                    out = []
                item = await _next_item(job, self.disconnect)
                if item is None:
                    return
            await send({"type": "http.response.body", "body": b"".join(out), "more_body": False})
        except OSError:  # the connection broke while writing
            pass
        finally:
            self.disconnect.cancel()
            job.cancel.cancel()


async def _wait_disconnect(receive) -> None:
    """Returns when the client has gone (the request body was read already, so only the disconnect comes)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _next_item(job: Job, disconnect: asyncio.Future):
    """The next event or error from the job's mailbox, or None once the client has disconnected. A generation
    cancelled while its client is still there was stopped by shutdown: that comes as an error."""
    if job.mailbox.empty():
        if disconnect.done():
            return None
        get = asyncio.ensure_future(job.mailbox.get())
        await asyncio.wait({get, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        if not get.done():
            get.cancel()
            return None
        item = get.result()
    else:
        item = job.mailbox.get_nowait()
    if not isinstance(item, BaseException) and item.stop_reason == "cancelled":
        return EngineUnavailableError("the server is shutting down")
    return item


def _engine_error(exc: BaseException) -> APIError:
    """An APIError for what ended a job on the engine thread."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineUnavailableError):
        return APIError(503, str(exc), type="unavailable_error", headers={"Retry-After": RETRY_AFTER_S})
    if isinstance(exc, (ValueError, TypeError)) and not isinstance(exc, LlamaError):
        return APIError(400, str(exc))
    log.error("generation failed: %s: %s", type(exc).__name__, exc)
    return APIError(500, f"generation failed: {type(exc).__name__}: {exc}", type="server_error")


def _error_response(exc: APIError) -> Response:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
