"""``pyllama-dspark serve`` through the official ``openai`` client and raw HTTP (issue 24): completions streaming and
not, equal to ``LLM.generate`` and plain decoding; 16 concurrent clients; a full queue; clients that vanish while
streaming, while waiting for a whole response, and during a long prefill; bad requests as 4xx in OpenAI's error
shape; an error in the middle of a stream; the CLI process from start to SIGTERM. Loopback only; every test has a
timeout."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pytest.importorskip("starlette", reason="the server needs the [server] extra: pip install '.[server]'")
pytest.importorskip("uvicorn", reason="the server needs the [server] extra: pip install '.[server]'")
openai = pytest.importorskip("openai", reason="the server tests need the openai client: pip install '.[test]'")
httpx = pytest.importorskip("httpx", reason="the server tests need httpx: pip install '.[test]'")

import pyllama_dspark  # noqa: E402
from pyllama_dspark import Context, Model, generate  # noqa: E402
from pyllama_dspark.server import BackgroundServer  # noqa: E402
from pyllama_dspark.testing import TinySpec, tiny_model  # noqa: E402

pytestmark = pytest.mark.timeout(300)

SPEC = TinySpec(arch="llama", n_layer=3, vocab="llama-spm", chat_template="chatml")
# a model whose prefill of 8,000 tokens takes seconds: the cancel-during-prefill and busy-engine tests
SLOW = TinySpec(arch="llama", n_layer=4, n_embd=256, n_head=4, n_head_kv=2, n_ff=768, vocab="llama-spm",
                n_ctx_train=8192, dtype="f16")
MESSAGES = [{"role": "user", "content": "Name three fruits."}]
PROMPTS = ["The quick brown fox", "Once upon a time", "In the beginning", "A short poem about rain",
           "Dear diary, today"]
N = 20


def model_name(server) -> str:
    return os.path.basename(server.options.model)


def client(server, **kwargs) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=kwargs.pop("api_key", "unused"), max_retries=0,
                         timeout=120, **kwargs)


@pytest.fixture(scope="module")
def target(model_dir):
    return tiny_model(SPEC, cache_dir=model_dir)


@pytest.fixture(scope="module")
def drafter_path(make_pair):
    return make_pair(SPEC).drafter


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "dspark"])
def server(request, target, drafter_path):
    # a fixed draft length: the cost-aware one soon stops drafting with a random-weight drafter
    with BackgroundServer(target, drafter=drafter_path if request.param else None, n_ctx=512,
                          load_kwargs={"n_draft": 3} if request.param else None) as srv:
        srv.speculative = request.param
        yield srv


@pytest.fixture(scope="module")
def references(target):
    """Plain greedy decoding of every prompt (text) and of MESSAGES (chat), through the power-user API."""
    with Model(target) as model:
        ctx = Context(model, n_ctx=512)
        text = {p: generate(ctx, p, max_tokens=N) for p in PROMPTS}
        chat = generate(ctx, model.apply_chat_template(MESSAGES), max_tokens=N)
    return text, chat


@pytest.fixture(scope="module")
def slow_model(model_dir):
    return tiny_model(SLOW, cache_dir=model_dir)


def metrics(server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_for(predicate, timeout: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


# --- completions -------------------------------------------------------------------------------------------------
def test_chat_and_text_completions_equal_llm_generate_and_plain_decoding(server, target, drafter_path, references):
    text_refs, chat_ref = references
    api = client(server)
    model_id = api.models.list().data[0].id
    assert model_id == target.name
    chat = api.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=N, temperature=0)
    assert chat.choices[0].message.content == chat_ref.text and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason == chat_ref.finish_reason
    assert chat.usage.prompt_tokens == chat_ref.n_prompt and chat.usage.completion_tokens == len(chat_ref.tokens)
    streamed = api.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=N, temperature=0, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_ref.text
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == \
        chat_ref.finish_reason
    with pyllama_dspark.load(target, drafter=drafter_path if server.speculative else None, n_ctx=512) as llm:
        for prompt in PROMPTS:
            text = api.completions.create(model=model_id, prompt=prompt, max_tokens=N, temperature=0)
            assert text.choices[0].text == text_refs[prompt].text == llm.generate(prompt, max_tokens=N).text
            pieces = [c.choices[0].text for c in api.completions.create(model=model_id, prompt=prompt, max_tokens=N,
                                                                        temperature=0, stream=True)]
            assert "".join(pieces) == text.choices[0].text


def test_timings_usage_chunk_and_done(server, references):
    api = client(server)
    reply = api.chat.completions.create(model=model_name(server),
                                        messages=MESSAGES, max_tokens=N, temperature=0)
    timings = reply.model_extra["timings"]
    assert timings["predicted_n"] == reply.usage.completion_tokens and timings["prompt_n"] > 0
    assert {"draft_n", "draft_n_accepted", "prompt_ms", "predicted_per_second"} <= set(timings)
    if server.speculative:
        assert reply.model_extra["speculative"]["drafted"] == timings["draft_n"] > 0
        assert 0 <= timings["draft_n_accepted"] <= timings["draft_n"]
    else:
        assert "speculative" not in reply.model_extra and timings["draft_n"] == 0
    plain = list(api.chat.completions.create(model=reply.model, messages=MESSAGES, max_tokens=4, temperature=0,
                                             stream=True))
    assert all(c.choices for c in plain) and all(c.usage is None for c in plain)
    with_usage = list(api.chat.completions.create(model=reply.model, messages=MESSAGES, max_tokens=4, temperature=0,
                                                  stream=True, stream_options={"include_usage": True}))
    assert with_usage[-1].choices == [] and with_usage[-1].usage.completion_tokens == 4
    assert all(c.choices for c in with_usage[:-1])
    assert with_usage[-2].model_extra["timings"]["predicted_n"] == 4  # the finish chunk carries the timings
    # the raw stream: server-sent events ending with [DONE]
    body = {"model": reply.model, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_models_health_and_metrics(server):
    assert httpx.get(f"{server.url}/health", timeout=10).json() == {"status": "ok"}
    models = httpx.get(f"{server.url}/v1/models", timeout=10).json()
    assert models["object"] == "list" and models["data"][0]["meta"]["speculative"] == server.speculative
    before = metrics(server)
    reply = client(server).completions.create(model=models["data"][0]["id"], prompt=PROMPTS[1], max_tokens=6,
                                              temperature=0)
    after = metrics(server)
    assert after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"] == 6
    assert after["llamacpp:prompt_tokens_total"] > before["llamacpp:prompt_tokens_total"]
    assert after["llamacpp:requests_processing"] == 0 and after["llamacpp:requests_deferred"] == 0
    drafts = [name for name in after if name.startswith("vllm:spec_decode_num_drafts_total")]
    rounds = reply.model_extra["speculative"]["rounds"] if server.speculative else 0
    assert len(drafts) == 1 and after[drafts[0]] - before[drafts[0]] == rounds and (rounds > 0) == server.speculative
    if server.speculative:
        per_pos = [v for k, v in after.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos")]
        accepted = next(v for k, v in after.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_total"))
        assert per_pos and sum(per_pos) == accepted
        # by source: the rounds of every source sum to the vLLM total, and the reply's own sources are all there
        by_source = {k: v for k, v in after.items() if k.startswith("pyllama_dspark:draft_rounds_total")}
        assert sum(by_source.values()) == after[drafts[0]]
        for source in reply.model_extra["speculative"]["by_source"]:
            assert any(f'source="{source}"' in k for k in by_source), (source, by_source)


@pytest.mark.skipif("libasan" in os.environ.get("LD_PRELOAD", ""),
                    reason="80 requests through the native paths the other server tests use: the main CI job runs it; "
                           "under AddressSanitizer it would take minutes for no new coverage")
def test_sixteen_concurrent_clients_get_the_single_request_answers(server, references):
    text_refs, _ = references

    async def one_client(i: int) -> list[tuple[str, str]]:
        api = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=240)
        out = []
        try:
            for j in range(5):
                prompt = PROMPTS[(i + j) % len(PROMPTS)]
                if (i + j) % 2:
                    chunks = await api.completions.create(model=model_name(server), prompt=prompt,
                                                          max_tokens=N, temperature=0, stream=True)
                    out.append((prompt, "".join([c.choices[0].text async for c in chunks])))
                else:
                    reply = await api.completions.create(model=model_name(server), prompt=prompt,
                                                         max_tokens=N, temperature=0)
                    out.append((prompt, reply.choices[0].text))
        finally:
            await api.close()
        return out

    async def main():
        return await asyncio.gather(*(one_client(i) for i in range(16)))

    results = [pair for batch in asyncio.run(main()) for pair in batch]
    assert len(results) == 80
    assert [text for _, text in results] == [text_refs[prompt].text for prompt, _ in results]
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert metrics(server)["llamacpp:requests_processing"] == 0


# --- a busy engine: the queue, clients that vanish, a long prefill ------------------------------------------------
@pytest.fixture(scope="module")
def slow_server(slow_model):
    with BackgroundServer(slow_model, n_ctx=8192, max_queue=1) as srv:
        yield srv


def long_prompt(n: int = 8000) -> list[int]:
    return np.random.default_rng(1).integers(100, 30000, n).tolist()


def cancelled(server) -> float:
    return metrics(server)["pyllama_dspark:requests_cancelled_total"]


@pytest.mark.slow  # 6.5 s here, 36 s under AddressSanitizer
def test_a_full_queue_gets_503_with_retry_after_and_the_server_recovers(slow_server):
    url = f"{slow_server.url}/v1/completions"
    body = {"prompt": long_prompt(), "max_tokens": 1, "temperature": 0}
    results = {}

    def post(name):
        results[name] = httpx.post(url, json=body, timeout=120)

    first = threading.Thread(target=post, args=("first",))
    first.start()
    wait_for(lambda: metrics(slow_server)["llamacpp:requests_processing"] == 1, what="the first request to run")
    second = threading.Thread(target=post, args=("second",))
    second.start()
    wait_for(lambda: metrics(slow_server)["llamacpp:requests_deferred"] == 1, what="the second request to wait")
    third = httpx.post(url, json=body, timeout=60)
    assert third.status_code == 503 and third.headers["retry-after"] == "1"
    assert third.json()["error"]["type"] == "unavailable_error"
    with pytest.raises(openai.InternalServerError):  # what the client raises for a 503 it would retry
        openai.OpenAI(base_url=f"{slow_server.url}/v1", api_key="x", max_retries=0, timeout=60).completions.create(
            model=model_name(slow_server), prompt=long_prompt(), max_tokens=1)
    first.join(120)
    second.join(120)
    assert results["first"].status_code == results["second"].status_code == 200
    assert results["first"].json()["choices"][0]["text"] == results["second"].json()["choices"][0]["text"]
    assert httpx.get(f"{slow_server.url}/health", timeout=10).status_code == 200
    assert httpx.post(url, json={**body, "prompt": [5, 6, 7]}, timeout=60).status_code == 200


def test_a_client_that_disconnects_mid_stream_frees_the_engine(slow_server):
    before = metrics(slow_server)
    body = {"prompt": "Once upon a time", "max_tokens": 8000, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{slow_server.url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    # the engine stops within a round and takes the next request at once
    wait_for(lambda: metrics(slow_server)["llamacpp:requests_processing"] == 0, timeout=30, what="the engine to stop")
    after = metrics(slow_server)
    assert after["pyllama_dspark:requests_cancelled_total"] == before["pyllama_dspark:requests_cancelled_total"] + 1
    assert after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"] < 8000
    reply = httpx.post(f"{slow_server.url}/v1/completions", json={"prompt": [4, 5], "max_tokens": 3}, timeout=60)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3


def test_a_client_that_disconnects_from_a_whole_response_frees_the_engine(slow_server):
    before = metrics(slow_server)
    body = {"prompt": "Once upon a time", "max_tokens": 8000, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{slow_server.url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    wait_for(lambda: metrics(slow_server)["llamacpp:requests_processing"] == 0, timeout=30, what="the engine to stop")
    after = metrics(slow_server)
    assert after["pyllama_dspark:requests_cancelled_total"] == before["pyllama_dspark:requests_cancelled_total"] + 1
    assert after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"] < 8000


def test_cancel_during_a_long_prefill_is_honoured(slow_server):
    """The client leaves while the engine decodes an 8,000-token prompt: the abort callback stops the decode,
    so the job ends with no token generated (it would have generated one had the prefill run to its end)."""
    before = metrics(slow_server)
    body = {"prompt": long_prompt(), "max_tokens": 1, "temperature": 0}
    done = threading.Event()

    def post():
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{slow_server.url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.3))
        done.set()

    thread = threading.Thread(target=post)
    thread.start()
    thread.join(60)
    assert done.is_set()
    wait_for(lambda: metrics(slow_server)["llamacpp:requests_processing"] == 0, timeout=30, what="the engine to stop")
    after = metrics(slow_server)
    assert after["pyllama_dspark:requests_cancelled_total"] == before["pyllama_dspark:requests_cancelled_total"] + 1
    assert after["llamacpp:tokens_predicted_total"] == before["llamacpp:tokens_predicted_total"]


# --- bad requests --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed_server(target):
    with BackgroundServer(target, n_ctx=256, api_key="sesame", alias="tiny") as srv:
        yield srv


def test_bad_requests_are_4xx_in_openai_shape_never_500(keyed_server):
    api = client(keyed_server, api_key="sesame")
    url = f"{keyed_server.url}/v1/chat/completions"
    auth = {"Authorization": "Bearer sesame"}
    raw = httpx.post(url, content=b"{not json", headers=auth, timeout=30)
    assert raw.status_code == 400 and set(raw.json()["error"]) == {"message", "type", "param", "code"}
    cases = [
        (dict(temperature="hot"), "temperature"),
        (dict(max_tokens="8"), "max_tokens"),
        (dict(n=2), "n"),
        (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
        (dict(top_logprobs=2), "top_logprobs"),  # without logprobs
        (dict(logprobs="yes"), "logprobs"),
        (dict(tools=[{"type": "function", "function": {"parameters": {}}}]), "tools[0].function.name"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]),
         "tools[0].function.parameters"),
        (dict(tools=[{"type": "function", "function": {"name": "f"}}],
              tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),  # without tools
        (dict(functions=[{"name": "f"}]), "functions"),
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}),
         "response_format"),
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"if": {}}}}),
         "response_format"),  # a keyword the grammar engine does not implement
        (dict(response_format={"type": "yaml"}), "response_format"),
        (dict(guided_regex="a(b"), "guided_regex"),
        (dict(grammar="start: 'a'"), "grammar"),
        (dict(grammar="start: /a/", guided_regex="a"), "guided_regex"),
        (dict(stop=[1, 2]), "stop"),
        (dict(top_p=0), "top_p"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, extra_body=extra)
        assert info.value.status_code == 400 and info.value.body["param"] == param, extra
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(model="tiny", messages=[{"role": "user"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "word " * 400}], max_tokens=2)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model="tiny", prompt="word " * 400, max_tokens=2, stream=True)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError) as info:
        api.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)
    assert info.value.code == "model_not_found"
    for key in (None, "wrong"):
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/metrics")):
            response = httpx.request(method, f"{keyed_server.url}{path}", json={}, headers=headers, timeout=30)
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client(keyed_server, api_key="wrong").chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert httpx.get(f"{keyed_server.url}/health", timeout=10).status_code == 200  # not guarded
    assert httpx.get(f"{keyed_server.url}/nowhere", headers=auth, timeout=10).status_code == 404
    # unknown fields are ignored; the file name answers as well as the alias
    reply = api.chat.completions.create(model=model_name(keyed_server), messages=MESSAGES,
                                        max_tokens=2, extra_body={"mirostat": 2, "cache_prompt": True})
    assert reply.usage.completion_tokens == 2


class FailingLLM:
    """A real LLM whose streams raise after ``after`` tokens (a native failure in the middle of a generation)."""

    def __init__(self, llm, after: int):
        self._llm, self._after = llm, after

    def __getattr__(self, name):
        return getattr(self._llm, name)

    def stream(self, prompt, **kwargs):
        events = self._llm.stream(prompt, **kwargs)
        for i, event in enumerate(events):
            if i == self._after:
                events.close()
                raise pyllama_dspark.FatalDecodeError("llama_decode failed", op="llama_decode", code=-3)
            yield event


def test_an_error_in_the_middle_of_a_stream_arrives_as_an_error_event(target):
    with BackgroundServer(target, n_ctx=256, open_llm=lambda: FailingLLM(pyllama_dspark.load(target, n_ctx=256),
                                                                         3)) as srv:
        api = client(srv)
        stream = api.completions.create(model=target.name, prompt=PROMPTS[0], max_tokens=10, temperature=0,
                                        stream=True)
        got = []
        with pytest.raises(openai.APIError, match="llama_decode failed"):
            for chunk in stream:
                got.append(chunk.choices[0].text)
        assert len(got) >= 1
        with pytest.raises(openai.InternalServerError, match="llama_decode failed"):  # not streamed: a 500
            api.completions.create(model=target.name, prompt=PROMPTS[0], max_tokens=10, temperature=0)
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200


def test_health_is_503_while_loading(target):
    release = threading.Event()

    def slow_load():
        release.wait(60)
        return pyllama_dspark.load(target, n_ctx=256)

    with BackgroundServer(target, open_llm=slow_load, wait=False) as srv:
        health = httpx.get(f"{srv.url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["error"]["type"] == "unavailable_error"
        busy = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=10)
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        release.set()
        assert srv.engine.wait_ready(60)
        assert httpx.get(f"{srv.url}/health", timeout=10).json() == {"status": "ok"}


# --- the command ------------------------------------------------------------------------------------------------
def test_serve_command_starts_answers_and_stops_on_sigterm(target, drafter_path, tmp_path):
    # cwd=tmp_path here and below: `python -m` puts the working directory first on sys.path, and a source tree there
    # has no compiled part
    key_file = tmp_path / "key"
    key_file.write_text("k3y\n")
    proc = subprocess.Popen([sys.executable, "-m", "pyllama_dspark", "serve", "-m", str(target), "-md",
                             str(drafter_path), "--port", "0", "-c", "256", "-t", "2", "--api-key-file", str(key_file),
                             "--alias", "tiny-pair"], stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        line = proc.stderr.readline()
        url = re.search(r"(http://127\.0\.0\.1:\d+)/v1", line).group(1)
        wait_for(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200, what="the model to load")
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="k3y", max_retries=0, timeout=60)
        reply = api.chat.completions.create(model="tiny-pair", messages=MESSAGES, max_tokens=5, temperature=0)
        assert reply.usage.completion_tokens == 5 and reply.model == "tiny-pair"
        assert reply.model_extra["speculative"]["drafted"] > 0
        proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down (the engine cancels, the model closes), then dies of the signal it caught, as servers do
        assert proc.wait(timeout=60) == -signal.SIGTERM
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        proc.stderr.close()


def test_serve_command_refuses_bad_options_in_one_line(target, tmp_path):
    for args, message in ((["--parallel", "65"], "--parallel must be in [1, 64]"),
                          (["-md", str(tmp_path / "no.gguf")], "not found"), (["--max-queue", "-1"], "max-queue")):
        run = subprocess.run([sys.executable, "-m", "pyllama_dspark", "serve", "-m", str(target), "--port", "0", *args],
                             capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert run.returncode == 1 and message in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_shutdown_cancels_a_running_stream_and_closes_the_model(slow_model):
    srv = BackgroundServer(slow_model, n_ctx=8192)
    llm = srv.engine.llm
    body = {"prompt": "Once upon a time", "max_tokens": 8000, "temperature": 0, "stream": True}
    try:
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            closer = threading.Thread(target=srv.close)
            closer.start()
            rest = [line for line in lines if line]
            closer.join(60)
        assert not closer.is_alive()
        assert "event: error" in rest and "shutting down" in rest[-1]
        assert srv.engine.state == "stopped" and llm.ctx.closed
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{srv.url}/health", timeout=5)
    finally:
        srv.close()


# --- several slots (continuous batching) ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def parallel_server(target, drafter_path):
    with BackgroundServer(target, drafter=drafter_path, n_ctx=512, parallel=4, load_kwargs={"n_draft": 3}) as srv:
        yield srv


def test_eight_clients_on_four_slots_get_their_single_request_answers(parallel_server, references):
    text_refs, chat_ref = references
    server = parallel_server
    busy = []

    async def one_client(i: int) -> list[tuple[str, str]]:
        api = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=240)
        out = []
        try:
            for j in range(3):
                prompt = PROMPTS[(i + j) % len(PROMPTS)]
                if j == 1:
                    reply = await api.chat.completions.create(model=model_name(server), messages=MESSAGES,
                                                              max_tokens=N, temperature=0)
                    out.append(("chat", reply.choices[0].message.content))
                elif (i + j) % 2:
                    chunks = await api.completions.create(model=model_name(server), prompt=prompt, max_tokens=N,
                                                          temperature=0, stream=True)
                    out.append((prompt, "".join([c.choices[0].text async for c in chunks])))
                else:
                    reply = await api.completions.create(model=model_name(server), prompt=prompt, max_tokens=N,
                                                         temperature=0)
                    out.append((prompt, reply.choices[0].text))
        finally:
            await api.close()
        return out

    async def watch(stop: asyncio.Event):
        async with httpx.AsyncClient() as http:
            while not stop.is_set():
                text = (await http.get(f"{server.url}/metrics", timeout=10)).text
                busy.append(float(re.search(r"^pyllama_dspark:slots_busy (\S+)$", text, re.M).group(1)))
                await asyncio.sleep(0.005)

    async def main():
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch(stop))
        results = await asyncio.gather(*(one_client(i) for i in range(8)))
        stop.set()
        await watcher
        return results

    results = [pair for batch in asyncio.run(main()) for pair in batch]
    assert len(results) == 24
    expected = [chat_ref.text if key == "chat" else text_refs[key].text for key, _ in results]
    assert [text for _, text in results] == expected
    assert max(busy) > 1 and max(busy) <= 4  # requests did share the decodes
    after = metrics(server)
    assert after["pyllama_dspark:slots_total"] == 4 and after["pyllama_dspark:slots_busy"] == 0


def test_disconnects_free_their_slot_at_once(slow_model):
    with BackgroundServer(slow_model, n_ctx=8192, parallel=3) as srv:
        body = {"prompt": "Once upon a time", "max_tokens": 8000, "temperature": 0, "stream": True}
        with httpx.Client(timeout=60) as http:
            streams = [http.stream("POST", f"{srv.url}/v1/completions", json=body) for _ in range(3)]
            responses = [s.__enter__() for s in streams]
            try:
                lines = [response.iter_lines() for response in responses]  # kept: a dropped one closes its stream
                for line in lines:
                    assert next(line).startswith("data: ")
                assert metrics(srv)["pyllama_dspark:slots_busy"] == 3
                for stream in streams[:2]:
                    stream.__exit__(None, None, None)
                wait_for(lambda: metrics(srv)["pyllama_dspark:slots_busy"] == 1, timeout=30,
                         what="two slots to be freed")
                # a new request runs beside the one still streaming
                reply = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=60)
                assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
                assert metrics(srv)["pyllama_dspark:slots_busy"] == 1
            finally:
                streams[2].__exit__(None, None, None)
            wait_for(lambda: metrics(srv)["pyllama_dspark:slots_busy"] == 0, timeout=30, what="the last slot")
            assert metrics(srv)["pyllama_dspark:requests_cancelled_total"] == 3
