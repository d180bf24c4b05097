"""The server's prompt cache and its request limits (issue 35), through the official ``openai`` client and raw
sockets on loopback.

- A 6-turn chat: from turn 2 on only the new tokens are evaluated (``/metrics``), ``cached_tokens`` and
  ``timings.cache_n`` say how many were reused, and every reply equals the cold one (plain greedy decoding of the
  whole conversation); then a request sharing a few tokens and one sharing all but the last, on llama, qwen3 and
  qwen35, with one slot and with four.
- Eight clients holding 3-turn conversations on four slots: every reply equals its cold reference, and most turns
  find their conversation's memory, in its slot or brought back from host memory (the hit rate is printed).
- ``--no-cache-prompt`` evaluates every prompt whole.
- A 64 MiB body gets 413 in under a second, before it is read (declared or chunked); a body that lies about its
  Content-Length is refused; one that stops arriving gets 408; the server stays healthy, and serves a request
  beside 300 half-open connections.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import tracemalloc

import pytest

pytest.importorskip("starlette", reason="the server needs the [server] extra: pip install '.[server]'")
pytest.importorskip("uvicorn", reason="the server needs the [server] extra: pip install '.[server]'")
openai = pytest.importorskip("openai", reason="the server tests need the openai client: pip install '.[test]'")
httpx = pytest.importorskip("httpx", reason="the server tests need httpx: pip install '.[test]'")

from conftest import ARCHS  # noqa: E402
from pyllama_dspark import Context, Model, generate  # noqa: E402
from pyllama_dspark.server import BackgroundServer, app as server_app  # noqa: E402
from pyllama_dspark.testing import TinySpec  # noqa: E402

pytestmark = pytest.mark.timeout(600)

N = 16
USER_TURNS = ["Name three fruits.", "And three colours?", "Which one is red?", "Say it again.", "Why?",
              "Thank you, goodbye."]


def spec(arch: str) -> TinySpec:
    return TinySpec(arch=arch, n_layer=3, vocab="llama-spm", chat_template="chatml")


def client(server) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def metrics(server) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


class Cold:
    """Plain greedy replies of whole conversations on a fresh context each (what a server without a cache gives)."""

    def __init__(self, target):
        self.model = Model(target)

    def prompt(self, messages) -> list[int]:
        text = self.model.apply_chat_template(messages)
        return [int(t) for t in self.model.tokenize(text, add_special=True, parse_special=True)]

    def reply(self, messages, max_tokens: int = N):
        ctx = Context(self.model, n_ctx=512, n_rs_seq=4 if self.model.is_hybrid else 0)
        try:
            return generate(ctx, self.model.apply_chat_template(messages), max_tokens=max_tokens)
        finally:
            ctx.close()

    def close(self):
        self.model.close()


def common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def ask(api, messages, max_tokens: int = N):
    reply = api.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens, temperature=0)
    return reply, reply.choices[0].message.content


@pytest.mark.parametrize("parallel", [1, 4])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_six_turn_chat_evaluates_only_the_new_tokens_and_equals_the_cold_replies(make_pair, arch, parallel):
    pair = make_pair(spec(arch))
    cold = Cold(pair.target)
    try:
        with BackgroundServer(pair.target, drafter=pair.drafter, n_ctx=512, parallel=parallel, alias="m",
                              load_kwargs={"n_draft": 3}) as srv:
            api = client(srv)
            messages, previous = [], None
            for turn, text in enumerate(USER_TURNS):
                messages.append({"role": "user", "content": text})
                before = metrics(srv)
                reply, content = ask(api, messages)
                after = metrics(srv)
                ref = cold.reply(messages)
                assert content == ref.text, f"{arch} turn {turn + 1}: the reply differs from the cold one"
                prompt = cold.prompt(messages)
                cached = reply.usage.prompt_tokens_details.cached_tokens
                evaluated = after["llamacpp:prompt_tokens_total"] - before["llamacpp:prompt_tokens_total"]
                assert reply.usage.prompt_tokens == len(prompt)
                assert evaluated == len(prompt) - cached
                assert reply.model_extra["timings"]["cache_n"] == cached
                assert reply.model_extra["timings"]["prompt_n"] == evaluated
                assert (after["pyllama_dspark:prompt_tokens_cached_total"]
                        - before["pyllama_dspark:prompt_tokens_cached_total"]) == cached
                if previous is None:
                    assert cached == 0
                else:
                    # the memory held the last prompt and its reply (all of it, or all but the token never decoded)
                    held_prompt, held_reply = previous
                    helds = [held_prompt + held_reply[:n] for n in (len(held_reply) - 1, len(held_reply))]
                    if arch == "qwen35":  # a recurrent state is kept whole or not at all: the reply, re-tokenized
                        # from its text, may differ from the tokens generated
                        assert cached in {len(h) if common_prefix(h, prompt) == len(h) else 0 for h in helds}
                    else:
                        assert cached in {min(common_prefix(h, prompt), len(prompt) - 1) for h in helds}
                        assert cached >= len(held_prompt) - 1
                previous = (prompt, list(ref.tokens))
                messages.append({"role": "assistant", "content": content})

            # a prompt of token ids that continues the last turn exactly: all of the memory is kept, a recurrent
            # state's too (the chat turns above may not keep it: a reply re-tokenized from its text can differ)
            held_prompt, held_reply = previous
            body = {"model": "m", "prompt": held_prompt + held_reply + [7, 8], "max_tokens": 4, "temperature": 0}
            out = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120).json()
            assert out["usage"]["prompt_tokens_details"]["cached_tokens"] in (len(held_prompt) + len(held_reply) - 1,
                                                                             len(held_prompt) + len(held_reply))

            # a request sharing only the first few tokens, then one sharing all but its last token
            few = [{"role": "user", "content": "Something else entirely, and quite a bit longer than before."}]
            reply, content = ask(api, few)
            assert content == cold.reply(few).text
            assert reply.usage.prompt_tokens_details.cached_tokens < 16  # the chat template's opening, at most
            body = {"model": "m", "prompt": cold.prompt(few)[:-1] + [7], "max_tokens": N, "temperature": 0}
            out = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120).json()
            # the memory held "few" and its reply: all of the new prompt but its last token is kept (not by a
            # recurrent state, which cannot be rewound)
            cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == (0 if arch == "qwen35" else len(body["prompt"]) - 1)
            ctx = Context(cold.model, n_ctx=512, n_rs_seq=4 if cold.model.is_hybrid else 0)
            try:
                assert out["choices"][0]["text"] == generate(ctx, body["prompt"], max_tokens=N).text
            finally:
                ctx.close()
    finally:
        cold.close()


def test_eight_conversations_on_four_slots_keep_their_prefixes(make_pair):
    pair = make_pair(spec("llama"))
    cold = Cold(pair.target)
    n_clients, n_turns = 8, 3
    outcomes: dict[int, list] = {}
    try:
        with BackgroundServer(pair.target, drafter=pair.drafter, n_ctx=512, parallel=4, alias="m",
                              load_kwargs={"n_draft": 3}) as srv:
            def converse(i: int) -> None:
                api = client(srv)
                messages, seen = [], []
                for turn in range(n_turns):
                    messages.append({"role": "user", "content": f"Client {i}, question {turn}: {USER_TURNS[turn]}"})
                    reply, content = ask(api, messages)
                    seen.append((list(messages), content, reply.usage.prompt_tokens_details.cached_tokens))
                    messages.append({"role": "assistant", "content": content})
                outcomes[i] = seen

            threads = [threading.Thread(target=converse, args=(i,)) for i in range(n_clients)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(300)
            assert len(outcomes) == n_clients
            scheduler = srv.engine.llm.batch_scheduler(4)
            assert max(len(h) for h in scheduler.held) <= 512  # each slot's memory within its own context
            assert 0 < scheduler.saved_bytes <= 1024 << 20 and scheduler.cache_hits_saved > 0
        later_turns = [(messages, cached) for seen in outcomes.values() for messages, _, cached in seen[1:]]
        hits = sum(cached >= len(cold.prompt(messages[:-2])) - 1 for messages, cached in later_turns)
        print(f"prompt cache hit rate, 8 clients on 4 slots: {hits}/{len(later_turns)}")
        assert hits > len(later_turns) // 2
        for seen in outcomes.values():
            for messages, content, _ in seen:
                assert content == cold.reply(messages).text
    finally:
        cold.close()


def test_sampling_with_a_kept_prefix_equals_sampling_cold(make_pair):
    """At temperature > 0 with a seed, a turn that reuses the conversation's memory draws what a cold server draws:
    the kept memory is bit for bit a cold prefill's, and the sampler's stream is the request's own.

    The draft length is fixed: rejection sampling draws as many uniforms as it judges drafts, so with the
    cost-aware length (measured seconds) two servers on the same memory draw different, equally distributed
    replies whenever their timings differ (under AddressSanitizer they did)."""
    pair = make_pair(spec("llama"))
    messages = [{"role": "user", "content": USER_TURNS[0]}]
    replies = {}
    for cache in (True, False):
        with BackgroundServer(pair.target, drafter=pair.drafter, n_ctx=512, alias="m", cache_prompt=cache,
                              load_kwargs={"n_draft": 4}) as srv:
            api = client(srv)
            _, first = ask(api, messages)
            follow = messages + [{"role": "assistant", "content": first}, {"role": "user", "content": USER_TURNS[1]}]
            reply = api.chat.completions.create(model="m", messages=follow, max_tokens=N, temperature=0.9, seed=7)
            assert (reply.usage.prompt_tokens_details.cached_tokens > 0) == cache
            replies[cache] = reply.choices[0].message.content
    assert replies[True] == replies[False]


def test_without_the_cache_every_prompt_is_evaluated_whole(make_pair):
    pair = make_pair(spec("llama"))
    with BackgroundServer(pair.target, n_ctx=512, alias="m", cache_prompt=False) as srv:
        api = client(srv)
        messages = [{"role": "user", "content": USER_TURNS[0]}]
        _, content = ask(api, messages)
        messages += [{"role": "assistant", "content": content}, {"role": "user", "content": USER_TURNS[1]}]
        before = metrics(srv)
        reply, _ = ask(api, messages)
        after = metrics(srv)
        assert reply.usage.prompt_tokens_details.cached_tokens == 0
        assert after["llamacpp:prompt_tokens_total"] - before["llamacpp:prompt_tokens_total"] == \
            reply.usage.prompt_tokens


# --- limits ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_server(make_pair):
    pair = make_pair(spec("llama"))
    with BackgroundServer(pair.target, n_ctx=256, alias="m") as srv:
        yield srv


def raw_request(server, head: bytes, parts, *, read_timeout: float = 10.0) -> tuple[int, dict, float]:
    """Send a request head, then body parts until the server answers (or stops reading); the status, the body
    (parsed when JSON) and the seconds until the answer came."""
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=read_timeout)
    t0 = time.perf_counter()
    try:
        sock.sendall(head)
        sock.setblocking(False)
        answer = b""
        for part in parts:
            try:
                answer += sock.recv(65536)
            except BlockingIOError:
                pass
            if answer:
                break
            try:
                sock.sendall(part)
            except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                break
        sock.setblocking(True)
        sock.settimeout(read_timeout)
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            more = sock.recv(65536)
            if not more:
                break
            answer += more
        elapsed = time.perf_counter() - t0
    finally:
        sock.close()
    status = int(answer.split(b" ", 2)[1])
    payload = answer.split(b"\r\n\r\n", 1)[1]
    return status, json.loads(payload) if payload.startswith(b"{") else payload.decode(), elapsed


def head(length: str | None, *, chunked: bool = False) -> bytes:
    lines = ["POST /v1/completions HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    if chunked:
        lines.append("Transfer-Encoding: chunked")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def assert_healthy(server) -> None:
    assert httpx.get(f"{server.url}/health", timeout=10).json() == {"status": "ok"}
    reply = httpx.post(f"{server.url}/v1/completions", json={"prompt": [4, 5], "max_tokens": 3}, timeout=60)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3


def test_a_64_mib_body_is_refused_before_it_is_read(small_server):
    assert_healthy(small_server)  # the limit is computed with the model loaded
    size = 64 << 20
    part = b'{"prompt": "' + b"x" * (1 << 20)
    chunk = b"%x\r\n%s\r\n" % (len(part), part)
    # The server runs in this process: the peak of Python's allocations while it reads says what it held.
    # Not RSS: the allocator keeps freed pages, and AddressSanitizer's quarantine holds every freed buffer.
    tracemalloc.start()
    try:
        status, body, elapsed = raw_request(small_server, head(str(size)), [part] * 64)
        assert status == 413 and elapsed < 1.0
        assert body["error"]["code"] == "request_too_large" and body["error"]["type"] == "invalid_request_error"
        # chunked: no length declared, refused once what arrived passes the limit
        status, body, elapsed = raw_request(small_server, head(None, chunked=True), [chunk] * 64)
        assert status == 413 and elapsed < 1.0 and body["error"]["code"] == "request_too_large"
        held_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert held_peak < 16 << 20, held_peak  # nothing near 64 MiB was held
    assert_healthy(small_server)


def test_a_body_that_lies_about_its_length_is_refused(small_server, monkeypatch):
    payload = json.dumps({"prompt": "Hello", "max_tokens": 2}).encode()
    # shorter than declared, then silence: 408 once the body stops arriving
    monkeypatch.setattr(server_app, "BODY_IDLE_TIMEOUT_S", 0.5)
    status, body, _ = raw_request(small_server, head(str(len(payload) + 100)), [payload])
    assert status == 408 and body["error"]["code"] == "request_timeout"
    # longer than declared: the request ends where its length says, and that is not JSON
    status, body, _ = raw_request(small_server, head(str(len(payload) // 2)), [payload])
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body, _ = raw_request(small_server, head("12abc"), [payload])
    assert status == 400  # uvicorn's parser refuses it before the app sees it
    assert_healthy(small_server)


def test_half_open_connections_do_not_hold_up_a_request(small_server):
    """300 connections that never finish their request head (uvicorn has no timeout for them): a normal request is
    still served, and the server stays healthy after they go."""
    host, port = small_server.url.removeprefix("http://").split(":")
    sockets = []
    try:
        for _ in range(300):
            sock = socket.create_connection((host, int(port)), timeout=10)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: app")
            sockets.append(sock)
        t0 = time.perf_counter()
        reply = httpx.post(f"{small_server.url}/v1/completions", json={"prompt": [4, 5], "max_tokens": 3}, timeout=60)
        print(f"a request beside 300 half-open connections: {time.perf_counter() - t0:.2f} s")
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
    finally:
        for sock in sockets:
            sock.close()
    assert_healthy(small_server)


def test_an_explicit_body_limit_and_a_prompt_known_too_long_without_tokenizing(make_pair, monkeypatch):
    pair = make_pair(spec("llama"))
    with BackgroundServer(pair.target, n_ctx=256, alias="m", max_body_bytes=2000) as srv:
        reply = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "a" * 3000}, timeout=30)
        assert reply.status_code == 413 and "2000 bytes" in reply.json()["error"]["message"]
        reply = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "a" * 1000, "max_tokens": 2}, timeout=30)
        assert reply.status_code == 200
    with BackgroundServer(pair.target, n_ctx=64, alias="m") as srv:
        llm = srv.engine.llm
        longest = llm.model.max_token_bytes
        assert longest == max(len(llm.model.token_to_piece(t, special=True)) for t in range(llm.model.n_vocab))
        n_ctx = llm.ctx.n_ctx  # llama.cpp rounds a context up (to 256 cells here)
        assert server_app.default_body_limit(llm) == (1 << 20) + 6 * longest * n_ctx
        calls = []
        tokenize = llm.model.tokenize
        monkeypatch.setattr(llm.model, "tokenize", lambda *a, **k: calls.append(1) or tokenize(*a, **k))
        text = "b" * (n_ctx * longest + 1)
        reply = httpx.post(f"{srv.url}/v1/completions", json={"prompt": text}, timeout=30)
        error = reply.json()["error"]
        assert reply.status_code == 400 and error["code"] == "context_length_exceeded" and not calls
        assert f"{len(text)} bytes" in error["message"]
