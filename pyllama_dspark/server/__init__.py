"""``pyllama-dspark serve``: an OpenAI-compatible HTTP server over ``LLM`` (the ``[server]`` extra).

Layers: this package (HTTP, the OpenAI wire format, the engine thread) -> ``LLM`` (the facade) -> the speculative
loop -> the native boundary. Nothing here touches ``ffi``/``lib``.

    from pyllama_dspark.server import BackgroundServer
    with BackgroundServer("target.gguf", drafter="drafter.gguf") as server:   # 127.0.0.1, a free port
        print(server.url)                                                    # http://127.0.0.1:PORT/v1 ...
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from dataclasses import dataclass
from typing import Any

SERVER_INSTALL = "pip install 'pyllama-dspark[server]'"
# uvicorn closes a keep-alive connection idle this long after its last response (uvicorn's default, set here so it
# stays one); a connection that never completes its request head stays open until its client closes it (uvicorn has
# no timeout for that), costing a socket and at most h11's 16 KiB of buffered head, never the engine
KEEP_ALIVE_TIMEOUT_S = 5


def _require_stack() -> None:
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"pyllama-dspark serve needs Starlette and uvicorn: {SERVER_INSTALL} ({exc})") from None


@dataclass
class ServeOptions:
    """``serve``'s settings (the CLI's options)."""

    model: str
    drafter: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    alias: str | None = None
    api_key: str | None = None
    n_ctx: int = 4096
    n_threads: int | None = None
    n_batch: int = 512
    n_gpu_layers: int | None = None  # None: all with rpc_servers, else 0 (as Model)
    rpc_servers: tuple[str, ...] = ()
    tensor_split: list[float] | None = None
    max_queue: int = 64
    parallel: int = 1
    cache_prompt: bool = True
    cache_ram_mib: int = 1024  # host memory for slot memories that requests cut or replace (--parallel > 1)
    max_body_bytes: int | None = None  # None: derived from n_ctx and the vocabulary (app.default_body_limit)
    load_kwargs: dict[str, Any] | None = None  # further ``load`` arguments (n_draft, prompt_lookup, ...)


def build(options: ServeOptions, *, open_llm=None):
    """(app, engine) for the options; the engine starts loading the model at once, on its own thread.

    ``open_llm`` replaces the loader (a callable returning an ``LLM``-like object; tests use it for faults)."""
    _require_stack()
    from .app import ServerConfig, create_app
    from .engine import Engine

    if not os.path.isfile(options.model):
        raise FileNotFoundError(f"model file not found: {options.model}")
    if options.drafter is not None and not os.path.isfile(options.drafter):
        raise FileNotFoundError(f"drafter file not found: {options.drafter}")

    def load_llm():
        from ..api import load
        from ..errors import INEXACT_BACKEND, UnsupportedModeError
        from ..speculative import inexact_verify_said

        kwargs = dict(n_ctx=options.n_ctx, n_threads=options.n_threads, n_batch=options.n_batch,
                      n_gpu_layers=options.n_gpu_layers, rpc_servers=options.rpc_servers,
                      tensor_split=options.tensor_split, **(options.load_kwargs or {}))
        try:
            return load(options.model, options.drafter, **kwargs)
        except UnsupportedModeError:
            if kwargs.get("consistent_numerics") is not None:
                raise  # asked for explicitly (serve's CLI passes False only)
            print(f"pyllama-dspark: {INEXACT_BACKEND}", file=sys.stderr, flush=True)
            inexact_verify_said()
            return load(options.model, options.drafter, **kwargs, consistent_numerics=False)

    engine = Engine(open_llm or load_llm, max_queue=options.max_queue, parallel=options.parallel,
                    cache_prompt=options.cache_prompt, cache_ram_bytes=options.cache_ram_mib << 20)
    config = ServerConfig(options.model, alias=options.alias, api_key=options.api_key,
                          max_body_bytes=options.max_body_bytes)
    return create_app(engine, config), engine


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: a free port, read back with ``getsockname``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(128)
    return sock


def _uvicorn_server(app, engine, log_level: str, on_started=None):
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if on_started is not None and self.started:  # announced once connections are served, not before
                on_started()

        def handle_exit(self, sig, frame) -> None:
            # cancel the running and waiting generations first: uvicorn waits for open responses before it
            # runs the app's shutdown, and a streaming one would otherwise run to its end
            engine.stop(timeout=0)
            super().handle_exit(sig, frame)

    return Server(uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=10,
                                 timeout_keep_alive=KEEP_ALIVE_TIMEOUT_S, h11_max_incomplete_event_size=16 * 1024))


def serve(options: ServeOptions, *, log_level: str = "warning", on_listen=None) -> None:
    """Run the server until SIGINT/SIGTERM; ``on_listen(url)`` is called once it serves connections."""
    app, engine = build(options)
    try:
        sock = bind(options.host, options.port)
    except BaseException:
        engine.stop()
        raise
    url = _url(sock)
    server = _uvicorn_server(app, engine, log_level, on_started=None if on_listen is None else lambda: on_listen(url))
    try:
        server.run(sockets=[sock])
    finally:
        engine.stop()
        sock.close()


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


class BackgroundServer:
    """The server on a background thread of this process, on 127.0.0.1 and a free port (``url``); for tests,
    notebooks and benchmarks. ``with`` stops it (cancelling what runs) and closes the model.

    Args: as ``ServeOptions`` (``model`` first); ``open_llm`` as in ``build``; ``wait``: block until the model is
    loaded (raising what loading raised)."""

    def __init__(self, model: str, *, open_llm=None, wait: bool = True, log_level: str = "warning", **options):
        options.setdefault("port", 0)
        self.options = ServeOptions(model=str(model), **options)
        self.app, self.engine = build(self.options, open_llm=open_llm)
        try:
            self._sock = bind(self.options.host, self.options.port)
        except BaseException:
            self.engine.stop()
            raise
        self.url = _url(self._sock)
        self._server = _uvicorn_server(self.app, self.engine, log_level)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="pyllama-dspark-http", daemon=True)
        self._thread.start()
        if wait and not self.engine.wait_ready(timeout=600):
            self.close()
            raise self.engine.load_error or RuntimeError("the server's model did not load in 10 minutes")

    def close(self) -> None:
        self.engine.stop(timeout=0)
        self._server.should_exit = True
        self._thread.join(30)
        self.engine.stop()
        self._sock.close()

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
