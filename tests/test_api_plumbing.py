"""The facade's plumbing (``api.py``) with fakes in place of everything it drives: Model, Context, the drafters,
Speculator, plain ``generate``, the batch scheduler and the completion-dict shaping are replaced by recorders
(monkeypatched where api.py imports them), so what ``load`` and ``LLM`` pass on, refuse, close and cancel is
checked literally in milliseconds, with no model built and no native call. The tool-call helpers stay real
(wrapped in spies). ``test_api.py`` runs the same facade end to end on tiny models."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import numpy as np
import pytest

from pyllama_dspark import api, tools
from pyllama_dspark.cancel import CancelToken
from pyllama_dspark.errors import DecodeAbortedError
from pyllama_dspark.events import GenerationResult, TokenEvent
from pyllama_dspark.history import HISTORY_BLOCK
from pyllama_dspark.stats import SpecStats

LOG: list[tuple] = []  # what the fakes were asked to do, in order: (what, *arguments)


def logged(what: str) -> list[tuple]:
    """The arguments of every logged call of ``what``, in order."""
    return [entry[1:] for entry in LOG if entry[0] == what]


def closed() -> list:
    """The objects closed so far, in order."""
    return [obj for (obj,) in logged("close")]


def refused(exc_type, message, call, *args, **kwargs):
    """``call`` raises exactly ``exc_type`` with exactly ``message``."""
    with pytest.raises(exc_type, match=re.escape(message)) as info:
        call(*args, **kwargs)
    assert type(info.value) is exc_type and str(info.value) == message
    return info.value


class Closes:
    def close(self) -> None:
        LOG.append(("close", self))


class MayFail:
    failure: BaseException | None = None  # set on a class (monkeypatch) to make its construction raise

    def __init__(self):
        if self.failure is not None:
            raise self.failure


class FakeModel(Closes):
    """Model: ``Model(path, **placement)`` is logged; the attributes api.py reads are set per test."""

    def __init__(self, path="/models/target.gguf", **placement):
        self.path, self.placement = path, placement
        self.is_hybrid = self.is_recurrent = self.renders_tools = False
        LOG.append(("Model", path, placement))

    def apply_chat_template(self, messages, tools=None):
        LOG.append(("apply_chat_template", messages, tools))
        return f"<prompt of {len(messages)} messages>"

    def token_to_piece(self, token):
        return f"<{token}>"


class FakeHeader:
    values: ClassVar[dict] = {"dflash.block_size": np.uint32(6)}  # a header's value may be a numpy integer

    def __init__(self, path):
        self.path = path

    def value(self, key, default=None):
        return self.values.get(key, default)


def fake_read_header(path):
    LOG.append(("read_header", path))
    return FakeHeader(path)


class FakeContext(Closes):
    n_ctx_seq = 96  # what llama.cpp made of n_ctx per sequence
    n_batch = 64

    def __init__(self, model, **settings):
        self.model, self.settings, self.n_ctx = model, settings, settings["n_ctx"] + 3  # rounded up, as llama.cpp
        LOG.append(("Context", model, settings))

    @contextlib.contextmanager
    def abortable(self, token):
        LOG.append(("abortable", token))
        try:
            yield token
        finally:
            LOG.append(("abortable ended", token))


class FakeDSpark(Closes, MayFail):
    block_size = 5

    def __init__(self, path, ctx, **settings):
        super().__init__()
        self.ctx, self.settings = ctx, settings
        self.model = SimpleNamespace(path=path, gguf_header=settings.get("header"))
        LOG.append(("DSparkDrafter", path, ctx, settings))


class FakeLookup(Closes):
    block_size = 8

    def __init__(self):
        LOG.append(("PromptLookupDrafter",))


class FakeHybrid(Closes, MayFail):
    def __init__(self, drafter, *, lookup, history=None):
        super().__init__()
        self.model_drafter, self.lookup, self.history = drafter, lookup, history
        LOG.append(("HybridDrafter", drafter, lookup, history))


class FakeHistoryStore:
    def __init__(self, budget):
        self.budget = budget
        LOG.append(("HistoryStore", budget))


class FakeHistoryDrafter:
    block_size = HISTORY_BLOCK

    def __init__(self, store, *, block_size=HISTORY_BLOCK):  # the real one's default, which load relies on
        self.store = store
        LOG.append(("HistoryDrafter", store, block_size))


RESULT = GenerationResult("plain text", [1, 2], "max_tokens")  # what a non-streamed generation returns
SCRIPT: list = []  # the events a streamed generation gives: TokenEvents, or callables run when asked for one


def scripted_events():
    try:
        for i, item in enumerate(SCRIPT):
            LOG.append(("produced", i))
            yield item() if callable(item) else item
    finally:
        LOG.append(("events closed",))


def output(stream: bool):
    return scripted_events() if stream else RESULT


class FakeSpeculator(MayFail):
    def __init__(self, ctx, drafter, **settings):
        super().__init__()
        self.ctx, self.drafter, self.settings = ctx, drafter, settings
        self.last_stats = SpecStats(n_generated=2)
        LOG.append(("Speculator", ctx, drafter, settings))

    @staticmethod
    def target_rs_seq(block):
        return ("rs seqs for", block, type(block))

    def generate(self, prompt, **kwargs):
        LOG.append(("speculator.generate", prompt, kwargs))
        return output(kwargs["stream"])


def fake_generate(ctx, prompt, **kwargs):
    LOG.append(("generate", ctx, prompt, kwargs))
    return output(kwargs["stream"])


class FakeScheduler(Closes, MayFail):
    outcome: ClassVar = ["result 0", "result 1"]  # what run() returns, or raises when an exception

    def __init__(self, ctx, drafter, **settings):
        super().__init__()
        self.ctx, self.drafter, self.settings = ctx, drafter, settings
        LOG.append(("BatchScheduler", ctx, drafter, settings))

    def run(self, requests):
        LOG.append(("run", self, requests))
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome

    def reset(self):
        LOG.append(("reset", self))


class FakeGrammar:
    @staticmethod
    def from_response_format(response_format):
        return None if response_format["type"] == "text" else ("grammar for", response_format["type"])


def spy(name, function):
    def call(*args, **kwargs):
        out = function(*args, **kwargs)
        LOG.append((name, args, kwargs, out))
        return out

    return call


FAKES = {
    "Model": FakeModel, "read_header": fake_read_header, "Context": FakeContext, "DSparkDrafter": FakeDSpark,
    "PromptLookupDrafter": FakeLookup, "HybridDrafter": FakeHybrid, "Speculator": FakeSpeculator,
    "HistoryStore": FakeHistoryStore, "HistoryDrafter": FakeHistoryDrafter,
    "generate": fake_generate, "BatchScheduler": FakeScheduler, "Grammar": FakeGrammar,
    "prompt_tokens": lambda ctx, prompt, *, add_special: ("tokens of", prompt, ctx, add_special),
    "sampling_params": lambda temperature, top_k, top_p, seed: ("params", temperature, top_k, top_p, seed),
    "Sampler": lambda params: ("sampler", params),
    "output_options": lambda grammar, logprobs: (("checked", grammar), ("checked", logprobs)),
    "OutputRules": lambda model, grammar, logprobs: ("rules", model, grammar, logprobs),
    "BatchRequest": lambda *args, **kwargs: ("request", args, kwargs),
    "completion_head": lambda *, chat, model_name: {"chat": chat, "model": model_name},
    "completion": lambda result, head, **kwargs: ("completion", result, head, kwargs),
    "completion_chunks": lambda events, head, **kwargs: ("chunks", events, head, kwargs),
}


@pytest.fixture(autouse=True)
def fakes(monkeypatch):
    LOG.clear()
    SCRIPT[:] = [TokenEvent(7, "a"), TokenEvent(-1, "", stop_reason="max_tokens", result=RESULT)]
    for name, fake in FAKES.items():
        monkeypatch.setattr(api, name, fake)
    for name in ("check_tools", "check_tool_choice", "call_grammar", "prompt_messages"):
        monkeypatch.setattr(api, name, spy(name, getattr(tools, name)))
    yield
    LOG.clear()


def make_llm(drafter=None, *, model=None, owns_model=True, **settings) -> api.LLM:
    settings = {"n_ctx": 512, "n_threads": None, "n_draft": None, "n_gpu_layers": 0, **settings}
    llm = api.LLM(model or FakeModel(), drafter, owns_model=owns_model, **settings)
    LOG.clear()
    return llm


# --- load -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, exc_type, message", [
    ({"n_ctx": "4096"}, TypeError, "n_ctx must be an int, got str '4096'"),
    ({"n_ctx": 0}, ValueError, "n_ctx must be >= 1, got 0"),
    ({"n_threads": 0}, ValueError, "n_threads must be >= 1, got 0"),
    ({"n_threads": 2.0}, TypeError, "n_threads must be an int, got float 2.0"),
    ({"prompt_lookup": "yes"}, TypeError, "prompt_lookup must be a bool, got str 'yes'"),
    ({"prompt_lookup": 1}, TypeError, "prompt_lookup must be a bool, got int 1"),
    ({"history_tokens": -1}, ValueError, "history_tokens must be >= 0, got -1"),
    ({"history_tokens": "64k"}, TypeError, "history_tokens must be an int, got str '64k'"),
    ({"grammar_drafts": 1}, TypeError, "grammar_drafts must be a bool, got int 1"),
])
def test_load_refuses_bad_settings_before_opening_anything(kwargs, exc_type, message):
    refused(exc_type, message, api.load, "target.gguf", **kwargs)
    assert LOG == []


def test_load_refuses_a_target_that_is_neither_a_path_nor_a_model():
    for target, name in ((42, "int"), (b"target.gguf", "bytes"), (None, "NoneType")):
        refused(TypeError, f"target must be a GGUF path or a Model, got {name}", api.load, target)
    assert LOG == []


@pytest.mark.parametrize("placement", [{"rpc_servers": ["host:50052"]}, {"tensor_split": [1.0, 1.0]},
                                       {"tensor_split": []}])
def test_load_refuses_a_placement_for_an_open_model(placement):
    model = FakeModel()
    LOG.clear()
    refused(ValueError, "rpc_servers and tensor_split are for a path target; an open Model keeps its own placement",
            api.load, model, **placement)
    assert LOG == []


class LLMRecorder(list):
    """Stands for api.LLM: each construction's (args, kwargs) appended; returns "an LLM" or raises ``failure``."""

    failure: BaseException | None = None

    def __call__(self, *args, **kwargs):
        self.append((args, kwargs))
        if self.failure is not None:
            raise self.failure
        return "an LLM"


@pytest.fixture
def llm_calls(monkeypatch):
    calls = LLMRecorder()
    monkeypatch.setattr(api, "LLM", calls)
    return calls


def test_load_passes_its_defaults_on(llm_calls):
    assert api.load("target.gguf") == "an LLM"
    ((model_path, placement),) = logged("Model")
    assert (model_path, placement) == ("target.gguf", {"n_gpu_layers": None, "rpc_servers": (), "tensor_split": None})
    ((args, kwargs),) = llm_calls
    assert type(args[0]) is FakeModel and args[0].path == "target.gguf" and args[1:] == (None,)
    assert kwargs == {"owns_model": True, "n_ctx": 4096, "n_threads": None, "n_draft": None, "n_draft_min": 0,
                      "p_min": 0.0, "prompt_lookup": None, "n_gpu_layers": 0, "history_tokens": 65536,
                      "grammar_drafts": True}


def test_load_passes_every_setting_on(llm_calls):
    target, drafter = Path("models/target.gguf"), Path("models/drafter.gguf")
    api.load(target, drafter, n_ctx=np.int64(1024), n_threads=3, n_draft=4, n_draft_min=2, p_min=0.25,
             prompt_lookup=False, n_gpu_layers=7, rpc_servers=["h:1"], tensor_split=[3.0, 1.0], n_batch=32,
             kv_type="q8_0", history_tokens=np.int64(100), grammar_drafts=False)
    assert logged("Model") == [(target, {"n_gpu_layers": 7, "rpc_servers": ["h:1"], "tensor_split": [3.0, 1.0]})]
    ((args, kwargs),) = llm_calls
    assert args[1] is drafter
    assert kwargs == {"owns_model": True, "n_ctx": 1024, "n_threads": 3, "n_draft": 4, "n_draft_min": 2,
                      "p_min": 0.25, "prompt_lookup": False, "n_gpu_layers": 7, "n_batch": 32, "kv_type": "q8_0",
                      "history_tokens": 100, "grammar_drafts": False}
    assert type(kwargs["n_ctx"]) is int and type(kwargs["history_tokens"]) is int
    api.load("target.gguf", prompt_lookup=True)
    assert llm_calls[-1][1]["prompt_lookup"] is True


def test_load_takes_an_open_model_as_it_is(llm_calls):
    model = FakeModel()
    LOG.clear()
    api.load(model, "drafter.gguf", rpc_servers=(), tensor_split=None)
    ((args, kwargs),) = llm_calls
    assert args == (model, "drafter.gguf") and kwargs["owns_model"] is False
    assert logged("Model") == []


@pytest.mark.parametrize("failure", [ValueError("bad drafter"), KeyboardInterrupt()])
def test_a_failed_load_closes_the_model_it_opened_and_only_that(llm_calls, failure):
    llm_calls.failure = failure
    with pytest.raises(type(failure)) as info:
        api.load("target.gguf")
    assert info.value is failure
    ((args, _),) = llm_calls
    assert [type(obj) for obj in closed()] == [FakeModel] and closed()[0] is args[0]
    mine = FakeModel()
    LOG.clear()
    with pytest.raises(type(failure)):
        api.load(mine)
    assert closed() == []


# --- LLM construction -------------------------------------------------------------------------------------------
def test_plain_decoding_has_no_drafter_and_no_speculator():
    model = FakeModel()
    llm = api.LLM(model, None, owns_model=True, n_ctx=512, n_threads=2, n_draft=None, n_gpu_layers=0, n_batch=16)
    assert llm.model is model and llm.drafter is None and llm.speculator is None
    assert [entry[0] for entry in LOG if entry[0] != "Model"] == ["Context"]
    assert logged("Context") == [(model, {"n_ctx": 512, "n_threads": 2, "n_batch": 16})]
    assert type(llm.ctx) is FakeContext


@pytest.mark.parametrize("as_path", [str, Path])
def test_a_drafter_path_makes_a_dspark_drafter_with_prompt_lookup_by_default(as_path):
    model, path = FakeModel(), as_path("drafter.gguf")
    llm = api.LLM(model, path, owns_model=True, n_ctx=512, n_threads=3, n_draft=4, n_gpu_layers=5)
    assert logged("read_header") == [(path,)]
    ((dspark_path, ctx, settings),) = logged("DSparkDrafter")
    assert dspark_path is path and ctx is llm.ctx
    assert settings == {"n_threads": 3, "n_gpu_layers": 5, "p_min": 0.0, "header": llm._drafter_header}
    assert type(llm._drafter_header) is FakeHeader and llm._drafter_header.path is path
    assert logged("PromptLookupDrafter") == [()]
    assert type(llm.drafter) is FakeHybrid and type(llm.drafter.model_drafter) is FakeDSpark
    assert type(llm.drafter.lookup) is FakeLookup
    # the history of earlier replies: one store per LLM, read by the hybrid's third source
    assert logged("HistoryStore") == [(65536,)] and llm.history is llm.drafter.history.store
    assert logged("HistoryDrafter") == [(llm.history, 16)]
    assert logged("Speculator") == [(llm.ctx, llm.drafter, {"n_draft": 4, "n_draft_min": 0, "grammar_drafts": True})]


def test_no_history_budget_and_no_grammar_drafts_are_passed_on():
    llm = api.LLM(FakeModel(), "drafter.gguf", owns_model=True, n_ctx=512, n_threads=None, n_draft=None,
                  n_gpu_layers=0, history_tokens=0, grammar_drafts=False)
    assert llm.history is None and llm.drafter.history is None and logged("HistoryStore") == []
    assert logged("Speculator")[0][2] == {"n_draft": None, "n_draft_min": 0, "grammar_drafts": False}
    assert type(llm.speculator) is FakeSpeculator


def test_a_drafter_path_without_prompt_lookup_drafts_with_dspark_alone():
    llm = api.LLM(FakeModel(), "drafter.gguf", owns_model=True, n_ctx=512, n_threads=None, n_draft=None,
                  n_gpu_layers=0, n_draft_min=2, p_min=0.5, prompt_lookup=False)
    assert type(llm.drafter) is FakeDSpark and llm.drafter.settings["p_min"] == 0.5
    assert logged("PromptLookupDrafter") == [] and logged("HybridDrafter") == []
    assert logged("Speculator") == [(llm.ctx, llm.drafter, {"n_draft": None, "n_draft_min": 2,
                                                            "grammar_drafts": True})]
    assert llm.history is None  # the history rides with prompt lookup


def test_a_drafter_object_is_used_as_given_unless_prompt_lookup_is_asked_for():
    mine = object()
    llm = api.LLM(FakeModel(), mine, owns_model=True, n_ctx=512, n_threads=None, n_draft=3, n_gpu_layers=0)
    assert llm.drafter is mine and llm._drafter_header is None
    assert logged("read_header") == [] and logged("PromptLookupDrafter") == [] and logged("DSparkDrafter") == []
    assert llm.speculator.drafter is mine
    hybrid = api.LLM(FakeModel(), mine, owns_model=True, n_ctx=512, n_threads=None, n_draft=3, n_gpu_layers=0,
                     prompt_lookup=True)
    assert type(hybrid.drafter) is FakeHybrid and hybrid.drafter.model_drafter is mine


def test_prompt_lookup_without_a_drafter_drafts_by_prompt_lookup_alone():
    llm = api.LLM(FakeModel(), None, owns_model=True, n_ctx=512, n_threads=None, n_draft=None, n_gpu_layers=0,
                  prompt_lookup=True)
    assert type(llm.drafter) is FakeLookup and llm.speculator.drafter is llm.drafter
    assert logged("HybridDrafter") == []


NO_BLOCK = object()  # a Drafter object without a block_size


@pytest.mark.parametrize("memory, drafter, settings, header, n_rs_seq", [
    ("hybrid", "drafter.gguf", {"prompt_lookup": False}, None, 6),
    ("hybrid", "drafter.gguf", {}, None, 16),  # the history's larger block
    ("hybrid", "drafter.gguf", {"history_tokens": 0}, None, 8),  # prompt lookup's
    ("recurrent", "drafter.gguf", {"prompt_lookup": False, "n_draft": 2}, None, 2),
    ("recurrent", "drafter.gguf", {"prompt_lookup": False, "n_draft": 9}, None, 6),
    ("hybrid", "drafter.gguf", {"prompt_lookup": False}, {}, 0),  # no block size in the header
    ("hybrid", None, {"prompt_lookup": True}, None, 8),
    ("hybrid", None, {}, None, None),  # plain decoding rolls nothing back
    ("neither", "drafter.gguf", {}, None, None),
    ("hybrid", SimpleNamespace(block_size=3), {}, None, 3),
    ("recurrent", NO_BLOCK, {}, None, 0),
    ("hybrid", "drafter.gguf", {"n_rs_seq": 11}, None, 11),  # the caller's own setting
])
def test_a_target_that_cannot_trim_its_memory_gets_snapshots_for_the_largest_block(monkeypatch, memory, drafter,
                                                                                    settings, header, n_rs_seq):
    if header is not None:
        monkeypatch.setattr(FakeHeader, "values", header)
    model = FakeModel()
    model.is_hybrid, model.is_recurrent = memory == "hybrid", memory == "recurrent"
    settings = {"n_ctx": 512, "n_threads": None, "n_draft": None, "n_gpu_layers": 0, **settings}
    llm = api.LLM(model, drafter, owns_model=True, **settings)
    made_with = llm.ctx.settings
    if n_rs_seq is None:
        assert "n_rs_seq" not in made_with
    elif "n_rs_seq" in settings:
        assert made_with["n_rs_seq"] == n_rs_seq
    else:
        assert made_with["n_rs_seq"] == ("rs seqs for", n_rs_seq, int)
    assert llm._batch_settings["context_kwargs"] == {k: v for k, v in made_with.items() if k == "n_rs_seq"}


@pytest.mark.parametrize("failing", [FakeDSpark, FakeHybrid, FakeSpeculator])
@pytest.mark.parametrize("failure", [RuntimeError("no fit"), KeyboardInterrupt()])
def test_a_failure_after_the_context_closes_the_context_and_not_the_model(monkeypatch, failing, failure):
    monkeypatch.setattr(failing, "failure", failure)
    with pytest.raises(type(failure)) as info:
        api.LLM(FakeModel(), "drafter.gguf", owns_model=True, n_ctx=512, n_threads=None, n_draft=None,
                n_gpu_layers=0)
    assert info.value is failure
    assert [type(obj) for obj in closed()] == [FakeContext]


# --- generate, stream, chat -------------------------------------------------------------------------------------
def test_generate_and_stream_go_to_the_speculator_or_to_plain_decoding():
    spec = make_llm(prompt_lookup=True)
    assert spec.generate("Hi", max_tokens=5) is RESULT
    assert logged("speculator.generate") == [("Hi", {"stream": False, "max_tokens": 5})]
    events = spec.stream([1, 2], top_k=3)
    assert logged("speculator.generate")[-1] == ([1, 2], {"stream": True, "top_k": 3})
    assert list(events) == SCRIPT
    plain = make_llm()
    assert plain.generate("Hi", stream=False, seed=4) is RESULT
    assert logged("generate") == [(plain.ctx, "Hi", {"stream": False, "seed": 4})]
    assert list(plain.stream("Hi")) == SCRIPT
    assert logged("generate")[-1] == (plain.ctx, "Hi", {"stream": True})
    assert logged("speculator.generate") == []


def test_generate_refuses_stream_true():
    llm = make_llm()
    refused(TypeError, "use LLM.stream(...) for a stream of events", llm.generate, "Hi", stream=True)
    assert LOG == []


def test_chat_applies_the_template_and_keeps_the_conversation_memory_by_default():
    llm = make_llm()
    messages = [{"role": "user", "content": "Hi", "name": "ignored"}]
    assert llm.chat(messages, max_tokens=3) is RESULT
    assert logged("apply_chat_template") == [([{"role": "user", "content": "Hi"}], None)]
    assert logged("generate") == [(llm.ctx, "<prompt of 1 messages>", {"stream": False, "max_tokens": 3,
                                                                      "reuse_prefix": True})]
    assert list(llm.chat(messages, stream=True, reuse_prefix=False)) == SCRIPT
    assert logged("generate")[-1][2] == {"stream": True, "reuse_prefix": False}
    refused(TypeError, "messages must be a list of {'role': ..., 'content': ...} dicts, got str 'Hi'; for one user "
            "turn: [{'role': 'user', 'content': text}]", llm.chat, "Hi")


def test_response_format_becomes_the_grammar():
    llm = make_llm()
    llm.generate("Hi", response_format={"type": "json_object"})
    assert logged("generate")[-1][2] == {"stream": False, "grammar": ("grammar for", "json_object")}
    llm.generate("Hi", response_format={"type": "text"}, grammar="my grammar")
    assert logged("generate")[-1][2] == {"stream": False, "grammar": "my grammar"}
    refused(ValueError, "give response_format or grammar, not both", llm.generate, "Hi",
            response_format={"type": "json_object"}, grammar="my grammar")
    llm.generate("Hi", grammar="my grammar")
    assert logged("generate")[-1][2] == {"stream": False, "grammar": "my grammar"}


def test_a_cancel_must_be_a_cancel_token():
    llm = make_llm()
    refused(TypeError, "cancel must be a CancelToken, got str 'stop'", llm.generate, "Hi", cancel="stop")
    refused(TypeError, "cancel must be a CancelToken, got str 'stop'", llm.stream, "Hi", cancel="stop")
    assert LOG == []


# --- cancel -----------------------------------------------------------------------------------------------------
def test_an_uncancelled_watch_passes_every_event_on_inside_abortable():
    llm, token = make_llm(), CancelToken()
    events = llm.stream("Hi", cancel=token, max_tokens=2)
    assert LOG == [("generate", llm.ctx, "Hi", {"stream": True, "max_tokens": 2})]  # no event asked for yet
    assert list(events) == SCRIPT
    assert [entry for entry in LOG if entry[0] != "generate"] == [
        ("abortable", token), ("produced", 0), ("produced", 1), ("events closed",), ("abortable ended", token)]
    assert llm.generate("Hi", cancel=token) is RESULT  # the last event's result


def test_a_stream_that_ends_without_a_stop_event_ends_there():
    SCRIPT[:] = [TokenEvent(7, "a"), TokenEvent(8, "b")]
    llm, token = make_llm(), CancelToken()
    assert list(llm.stream("Hi", cancel=token)) == SCRIPT
    assert logged("produced") == [(0,), (1,)] and logged("events closed") == [()]


def cancelled_event(events) -> TokenEvent:
    last = events[-1]
    assert last == TokenEvent(-1, "", stop_reason="cancelled") and last.result is not None
    return last


@pytest.mark.parametrize("with_drafter", [False, True])
def test_a_cancel_between_rounds_stops_before_the_next_round_with_what_was_committed(with_drafter):
    SCRIPT[:] = [TokenEvent(7, "a"), TokenEvent(8, "bc", from_draft=True), TokenEvent(9, "d"),
                 TokenEvent(-1, "", stop_reason="max_tokens", result=RESULT)]
    llm, token = make_llm(prompt_lookup=with_drafter), CancelToken()
    seen = []
    for event in llm.stream("Hi", cancel=token):
        seen.append(event)
        if event.token == 8:
            token.cancel()
            at_cancel = len(LOG)
    assert seen[:2] == SCRIPT[:2] and len(seen) == 3
    last = cancelled_event(seen)
    assert logged("produced") == [(0,), (1,)]  # the next round was never decoded
    # the producer and the abort callback are released before the cancelled event comes out
    assert LOG[at_cancel:] == [("events closed",), ("abortable ended", token)]
    result = last.result
    assert (result.text, result.tokens, result.stop_reason) == ("abc", [7, 8], "cancelled")
    if with_drafter:
        assert result.stats is llm.speculator.last_stats and result.stats.n_generated == 2
    else:
        assert type(result.stats) is SpecStats and result.stats.n_generated == 0
    assert result.stats.stop_reason == "cancelled"


def test_a_generation_cancelled_before_it_starts_returns_an_empty_cancelled_result():
    llm, token = make_llm(), CancelToken()
    token.cancel()
    result = llm.generate("Hi", cancel=token)
    assert (result.text, result.tokens, result.stop_reason) == ("", [], "cancelled")
    assert result.stats == SpecStats(stop_reason="cancelled")
    assert logged("produced") == []
    events = list(llm.stream("Hi", cancel=token))
    assert len(events) == 1 and cancelled_event(events).result.tokens == []


def test_chat_passes_its_cancel_on():
    llm, token = make_llm(), CancelToken()
    token.cancel()
    assert llm.chat(MESSAGES, cancel=token).stop_reason == "cancelled"
    assert [e.stop_reason for e in llm.chat(MESSAGES, stream=True, cancel=token)] == ["cancelled"]


def test_an_aborted_decode_after_a_cancel_ends_as_cancelled_and_before_it_propagates():
    token = CancelToken()
    abort = DecodeAbortedError("llama_decode aborted", op="llama_decode", code=2)

    def cancel_inside_the_decode():
        token.cancel()
        raise abort

    SCRIPT[:] = [TokenEvent(7, "a"), cancel_inside_the_decode]
    llm = make_llm()
    events = list(llm.stream("Hi", cancel=token))
    assert events[0] == SCRIPT[0] and len(events) == 2
    assert cancelled_event(events).result.tokens == [7]
    assert logged("abortable ended") == [(token,)]

    def abort_without_a_cancel():
        raise abort

    SCRIPT[:] = [TokenEvent(7, "a"), abort_without_a_cancel]
    with pytest.raises(DecodeAbortedError) as info:
        llm.generate("Hi", cancel=CancelToken())
    assert info.value is abort


# --- generate_batch and its scheduler ---------------------------------------------------------------------------
@pytest.mark.parametrize("prompts, name", [("Hello", "str"), (b"Hello", "bytes"), (5, "int"), ({"a"}, "set")])
def test_generate_batch_wants_a_list_of_prompts(prompts, name):
    llm = make_llm()
    refused(TypeError, f"prompts must be a list of prompts (text or token ids), got {name}", llm.generate_batch,
            prompts)
    assert LOG == []


@pytest.mark.parametrize("kwargs, exc_type, message", [
    ({"parallel": "4"}, TypeError, "parallel must be an int, got str '4'"),
    ({"parallel": 0}, ValueError, "parallel must be >= 1, got 0"),
    ({"max_tokens": -1}, ValueError, "max_tokens must be >= 0, got -1"),
    ({"max_tokens": 1.5}, TypeError, "max_tokens must be an int, got float 1.5"),
    ({"stop": [1]}, TypeError, "stop must be a string or a list of strings, got list [1]"),
    ({"seed": "1"}, TypeError, "seed must be an int, got str '1'"),
])
def test_generate_batch_refuses_bad_settings_before_running(kwargs, exc_type, message):
    llm = make_llm()
    refused(exc_type, message, llm.generate_batch, ["Hi"], **kwargs)
    assert logged("run") == []


def test_generate_batch_passes_its_defaults_on():
    llm = make_llm()
    assert llm.generate_batch(["Hi", [5, 6]]) == FakeScheduler.outcome
    ((ctx_model, settings),) = logged("Context")
    assert ctx_model is llm.model and settings == {"n_ctx": 96 * 4, "n_seq_max": 4, "n_threads": None,
                                                    "n_batch": 64}
    ((scheduler, requests),) = logged("run")
    assert scheduler.ctx.settings is settings
    rules = ("rules", llm.model, ("checked", None), ("checked", None))
    assert requests == [
        ("request", (("tokens of", "Hi", scheduler.ctx, True), 128, ("sampler", ("params", 0.0, 0, 1.0, None)), []),
         {"stop_at_eog": True, "rules": rules}),
        ("request", (("tokens of", [5, 6], scheduler.ctx, True), 128, ("sampler", ("params", 0.0, 0, 1.0, None)),
                     []), {"stop_at_eog": True, "rules": rules})]
    assert logged("reset") == []


def test_generate_batch_passes_every_setting_on():
    llm = make_llm(n_threads=2)
    llm.generate_batch(("A", "B", "C"), parallel=np.int64(2), max_tokens=np.int64(9), temperature=0.7, top_k=5,
                       top_p=0.9, seed=np.int64(40), stop="\n", stop_at_eog=False, add_special=False,
                       grammar="a grammar", logprobs=3)
    ((_, settings),) = logged("Context")
    assert settings == {"n_ctx": 96 * 2, "n_seq_max": 2, "n_threads": 2, "n_batch": 64}
    ((scheduler, requests),) = logged("run")
    rules = ("rules", llm.model, ("checked", "a grammar"), ("checked", 3))
    assert requests == [("request", (("tokens of", prompt, scheduler.ctx, False), 9,
                                     ("sampler", ("params", 0.7, 5, 0.9, 40 + i)), ["\n"]),
                         {"stop_at_eog": False, "rules": rules}) for i, prompt in enumerate("ABC")]
    assert type(requests[0][1][1]) is int and type(requests[2][1][2][1][4]) is int


@pytest.mark.parametrize("failure", [RuntimeError("decode failed"), KeyboardInterrupt()])
def test_a_failed_batch_resets_its_scheduler(monkeypatch, failure):
    monkeypatch.setattr(FakeScheduler, "outcome", failure)
    llm = make_llm()
    with pytest.raises(type(failure)) as info:
        llm.generate_batch(["Hi"])
    assert info.value is failure
    ((scheduler, _),) = logged("run")
    assert logged("reset") == [(scheduler,)] and LOG[-1] == ("reset", scheduler)


def test_a_batch_scheduler_is_made_once_per_parallel_and_closed_with_the_llm():
    llm = make_llm(n_threads=3, n_draft=4, n_batch=32, kv_type="q8_0")
    two = llm.batch_scheduler(2)
    assert llm.batch_scheduler(2) is two and len(logged("Context")) == 1
    three = llm.batch_scheduler(3)
    assert three is not two and llm.batch_scheduler(2) is two and llm.batch_scheduler(3) is three
    assert [settings for _, settings in logged("Context")] == [
        {"n_ctx": 96 * n, "n_seq_max": n, "n_threads": 3, "n_batch": 32, "kv_type": "q8_0"} for n in (2, 3)]
    batching = {"n_draft": 4, "prompt_lookup": None, "history": None, "grammar_drafts": True}
    assert logged("BatchScheduler") == [(two.ctx, None, batching), (three.ctx, None, batching)]
    assert closed() == []
    llm.close()
    assert closed() == [two, two.ctx, three, three.ctx, llm.ctx, llm.model]
    LOG.clear()
    assert llm.batch_scheduler(2) is not two  # a closed LLM's schedulers are gone


@pytest.mark.parametrize("kind", ["dspark", "hybrid"])
def test_a_dspark_llm_batches_with_its_own_dspark_drafter(kind):
    llm = make_llm("drafter.gguf", n_threads=3, n_gpu_layers=6, p_min=0.3, n_draft=2,
                   prompt_lookup=kind == "hybrid")
    own = llm.drafter.model_drafter if kind == "hybrid" else llm.drafter
    scheduler = llm.batch_scheduler(2)
    ((path, ctx, settings),) = logged("DSparkDrafter")
    assert path == "drafter.gguf" and ctx is scheduler.ctx
    assert settings == {"n_threads": 3, "n_gpu_layers": 6, "p_min": 0.3, "header": own.model.gguf_header}
    assert settings["header"] is llm._drafter_header
    assert type(scheduler.drafter) is FakeDSpark and scheduler.drafter is not own
    lookup = llm.drafter.lookup if kind == "hybrid" else None  # its settings are each sequence's lookup's
    assert kind == "dspark" or type(lookup) is FakeLookup
    # the LLM's one history store, shared with the batches (none with DSpark alone)
    assert (llm.history is None) == (kind == "dspark")
    assert logged("BatchScheduler") == [(scheduler.ctx, scheduler.drafter, {"n_draft": 2, "prompt_lookup": lookup,
                                                                            "history": llm.history,
                                                                            "grammar_drafts": True})]
    assert "n_rs_seq" not in scheduler.ctx.settings
    llm.close()
    assert closed() == [scheduler, scheduler.drafter, scheduler.ctx, llm.drafter, llm.ctx, llm.model]


@pytest.mark.parametrize("drafter, settings", [(None, {"prompt_lookup": True}), (object(), {}),
                                               (object(), {"prompt_lookup": True})])
def test_other_drafters_batch_without_a_model_drafter_and_prompt_lookup_batches(drafter, settings):
    llm = make_llm(drafter, **settings)
    scheduler = llm.batch_scheduler(2)
    assert scheduler.drafter is None and logged("DSparkDrafter") == []
    # prompt lookup alone, a hybrid over a drafter that is not DSpark, that drafter alone
    lookup = llm.drafter if drafter is None else llm.drafter.lookup if settings else None
    assert scheduler.settings["prompt_lookup"] is lookup and (lookup is None or type(lookup) is FakeLookup)


def test_a_hybrid_memory_target_batches_with_snapshots_for_the_larger_block():
    model = FakeModel()
    model.is_hybrid = True
    scheduler = make_llm("drafter.gguf", model=model).batch_scheduler(2)
    assert scheduler.ctx.settings["n_rs_seq"] == ("rs seqs for", 16, int)  # the history's block, the largest
    scheduler = make_llm("drafter.gguf", model=model, history_tokens=0).batch_scheduler(2)
    assert scheduler.ctx.settings["n_rs_seq"] == ("rs seqs for", 8, int)  # without it, prompt lookup's
    scheduler = make_llm("drafter.gguf", model=model, n_draft=6).batch_scheduler(2)
    assert scheduler.ctx.settings["n_rs_seq"] == ("rs seqs for", 6, int)  # a fixed n_draft below it
    model = FakeModel()
    model.is_recurrent = True
    scheduler = make_llm("drafter.gguf", model=model, prompt_lookup=False).batch_scheduler(2)
    assert scheduler.ctx.settings["n_rs_seq"] == ("rs seqs for", 5, int)
    scheduler = make_llm(None, model=model).batch_scheduler(2)
    assert "n_rs_seq" not in scheduler.ctx.settings  # nothing drafts: nothing to roll back
    # prompt lookup alone, made with the LLM's own context settings
    scheduler = make_llm(None, model=model, prompt_lookup=True).batch_scheduler(2)
    assert scheduler.ctx.settings["n_rs_seq"] == ("rs seqs for", 8, int)


@pytest.mark.parametrize("failing", [FakeDSpark, FakeScheduler])
@pytest.mark.parametrize("failure", [RuntimeError("no room"), KeyboardInterrupt()])
def test_a_failed_batch_scheduler_closes_its_context_and_is_not_kept(monkeypatch, failing, failure):
    llm = make_llm("drafter.gguf")
    with monkeypatch.context() as patch:
        patch.setattr(failing, "failure", failure)
        with pytest.raises(type(failure)) as info:
            llm.batch_scheduler(2)
    assert info.value is failure
    ((_, settings),) = logged("Context")
    assert [type(obj) for obj in closed()] == [FakeContext] and closed()[0].settings is settings
    assert llm._schedulers == {}
    scheduler = llm.batch_scheduler(2)  # the next call tries again
    assert type(scheduler) is FakeScheduler and len(logged("Context")) == 2


# --- OpenAI-shaped completions ----------------------------------------------------------------------------------
def test_create_completion_passes_its_defaults_on():
    llm = make_llm(prompt_lookup=True)
    out = llm.create_completion("Hi")
    assert logged("speculator.generate") == [("Hi", {"stream": False, "max_tokens": 16, "temperature": 0.0,
                                                     "top_p": 1.0, "top_k": 0, "stop": None, "seed": None,
                                                     "logprobs": None, "grammar": None})]
    kind, result, head, shaping = out
    assert (kind, result, head) == ("completion", RESULT, {"chat": False, "model": "target.gguf"})
    assert shaping == {"chat": False, "speculative": True, "piece": llm.model.token_to_piece, "tools": []}
    plain = make_llm(model=FakeModel(Path("elsewhere/plain.gguf")))
    assert plain.create_completion([1, 2])[2:] == ({"chat": False, "model": "plain.gguf"},
                                                   {"chat": False, "speculative": False,
                                                    "piece": plain.model.token_to_piece, "tools": []})


def test_create_completion_passes_every_setting_on_and_streams():
    llm = make_llm()
    kind, events, head, shaping = llm.create_completion(
        "Hi", max_tokens=np.int64(5), temperature=0.5, top_p=0.8, top_k=4, stop=["."], seed=3, stream=True,
        logprobs=2, grammar="a grammar")
    assert (kind, head) == ("chunks", {"chat": False, "model": "target.gguf"})
    assert shaping == {"chat": False, "piece": llm.model.token_to_piece, "tools": []}
    assert list(events) == SCRIPT
    assert logged("generate") == [(llm.ctx, "Hi", {"stream": True, "max_tokens": 5, "temperature": 0.5, "top_p": 0.8,
                                                   "top_k": 4, "stop": ["."], "seed": 3, "logprobs": 2,
                                                   "grammar": "a grammar"})]
    assert type(logged("generate")[0][2]["max_tokens"]) is int
    llm.create_completion("Hi", max_tokens=None, response_format={"type": "json_object"})
    knobs = logged("generate")[-1][2]
    assert knobs["max_tokens"] == 515 and knobs["grammar"] == ("grammar for", "json_object")  # the context's n_ctx


def test_create_completion_refuses_bad_arguments():
    llm = make_llm()
    refused(ValueError, "max_tokens must be >= 0, got -1", llm.create_completion, "Hi", max_tokens=-1)
    refused(TypeError, "max_tokens must be an int, got str '16'", llm.create_completion, "Hi", max_tokens="16")
    refused(ValueError, "give response_format or grammar, not both", llm.create_completion, "Hi",
            response_format={"type": "json_object"}, grammar="a grammar")
    assert LOG == []
    assert llm.create_completion("Hi", max_tokens=0) and logged("generate")[-1][2]["max_tokens"] == 0


MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}}}}}]


def test_create_chat_completion_passes_its_defaults_on():
    llm = make_llm()
    kind, result, head, shaping = llm.create_chat_completion(MESSAGES)
    assert (kind, result, head) == ("completion", RESULT, {"chat": True, "model": "target.gguf"})
    assert shaping == {"chat": True, "speculative": False, "piece": llm.model.token_to_piece, "tools": []}
    assert logged("apply_chat_template") == [(MESSAGES, None)]
    assert logged("generate") == [(llm.ctx, "<prompt of 1 messages>", {
        "stream": False, "max_tokens": 515, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "stop": None,
        "seed": None, "logprobs": None, "grammar": None})]
    assert logged("check_tools") == [] and logged("call_grammar")[0][0] == ([], "none")


def test_create_chat_completion_passes_every_setting_on_and_streams():
    llm = make_llm(prompt_lookup=True)
    kind, events, head, shaping = llm.create_chat_completion(
        MESSAGES, max_tokens=7, temperature=0.2, top_p=0.5, top_k=9, stop="!", seed=1, stream=True,
        logprobs=True, top_logprobs=4, response_format={"type": "json_object"})
    assert (kind, head) == ("chunks", {"chat": True, "model": "target.gguf"})
    assert shaping == {"chat": True, "piece": llm.model.token_to_piece, "tools": []}
    assert list(events) == SCRIPT
    assert logged("speculator.generate") == [("<prompt of 1 messages>", {
        "stream": True, "max_tokens": 7, "temperature": 0.2, "top_p": 0.5, "top_k": 9, "stop": "!", "seed": 1,
        "logprobs": 4, "grammar": ("grammar for", "json_object")})]
    llm.create_chat_completion(MESSAGES, logprobs=True)
    assert logged("speculator.generate")[-1][1]["logprobs"] == 0


@pytest.mark.parametrize("kwargs, exc_type, message", [
    ({"logprobs": 1}, TypeError, "logprobs must be a bool, got int 1"),
    ({"logprobs": None}, TypeError, "logprobs must be a bool, got NoneType None"),
    ({"logprobs": True, "top_logprobs": -1}, ValueError, "top_logprobs must be >= 0, got -1"),
    ({"logprobs": True, "top_logprobs": "2"}, TypeError, "top_logprobs must be an int, got str '2'"),
    ({"top_logprobs": 2}, ValueError, "top_logprobs needs logprobs=True"),
    ({"top_logprobs": 0}, ValueError, "top_logprobs needs logprobs=True"),
    ({"max_tokens": -1}, ValueError, "max_tokens must be >= 0, got -1"),
    ({"response_format": {"type": "json_object"}, "grammar": "g"}, ValueError,
     "give response_format or grammar, not both"),
    ({"tools": []}, tools.ToolError,
     'tools must be a non-empty array of {"type": "function", "function": {...}}'),
    ({"tool_choice": "required"}, tools.ToolError, "tool_choice 'required' needs tools"),
    ({"tools": WEATHER, "tool_choice": "required", "grammar": "g"}, ValueError,
     ("tool_choice 'required' constrains the reply to a tool call: it cannot be combined with response_format or "
      "grammar")),
    ({"tools": WEATHER, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
      "response_format": {"type": "json_object"}}, ValueError,
     ("tool_choice {'type': 'function', 'function': {'name': 'get_weather'}} constrains the reply to a tool call: "
      "it cannot be combined with response_format or grammar")),
])
def test_create_chat_completion_refuses_bad_arguments_before_generating(kwargs, exc_type, message):
    llm = make_llm()
    refused(exc_type, message, llm.create_chat_completion, MESSAGES, **kwargs)
    assert logged("generate") == []


def test_offered_tools_reach_the_template_and_the_reply_shaping():
    llm = make_llm()
    llm.model.renders_tools = True
    shaping = llm.create_chat_completion(MESSAGES, tools=WEATHER)[3]
    ((args, _, offered),) = logged("check_tools")
    assert args == (WEATHER,) and [t.name for t in offered] == ["get_weather"]
    assert logged("check_tool_choice")[0][:2] == ((None, offered), {})
    assert logged("prompt_messages") == [((MESSAGES, offered, "auto"), {"template_renders_tools": True}, MESSAGES)]
    assert logged("apply_chat_template") == [(MESSAGES, [offered[0].as_openai()])]
    assert shaping["tools"] == offered and logged("generate")[-1][2]["grammar"] is None
    # a template that does not render tools gets them described in a system message
    llm.model.renders_tools = False
    llm.create_chat_completion(MESSAGES, tools=WEATHER, stream=True)
    ((rendered, _),) = logged("apply_chat_template")[1:]
    assert [m["role"] for m in rendered] == ["system", "user"] and "get_weather" in rendered[0]["content"]
    assert logged("prompt_messages")[-1][1] == {"template_renders_tools": False}


def test_tool_choice_none_hides_the_tools_and_required_forces_a_call():
    llm = make_llm()
    shaping = llm.create_chat_completion(MESSAGES, tools=WEATHER, tool_choice="none")[3]
    assert shaping["tools"] == [] and logged("apply_chat_template") == [(MESSAGES, None)]
    assert logged("generate")[-1][2]["grammar"] is None
    shaping = llm.create_chat_completion(MESSAGES, tools=WEATHER, tool_choice="required")[3]
    ((_, _, forced),) = logged("call_grammar")[1:]
    assert forced is not None and logged("generate")[-1][2]["grammar"] is forced
    assert [t.name for t in shaping["tools"]] == ["get_weather"]


# --- lifetime ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("owns_model", [True, False])
def test_close_closes_schedulers_then_the_drafter_the_context_and_an_owned_model(owns_model):
    llm = make_llm("drafter.gguf", owns_model=owns_model, prompt_lookup=False)
    scheduler = llm.batch_scheduler(2)
    LOG.clear()
    llm.close()
    model = [llm.model] if owns_model else []
    assert closed() == [scheduler, scheduler.drafter, scheduler.ctx, llm.drafter, llm.ctx] + model
    LOG.clear()
    llm.close()  # again: the schedulers are gone; the rest are closed again (each close is idempotent)
    assert closed() == [llm.drafter, llm.ctx] + model


@pytest.mark.parametrize("drafter", [None, object()])
def test_close_skips_a_drafter_without_close(drafter):
    llm = make_llm(drafter)
    llm.close()
    assert closed() == [llm.ctx, llm.model]


def test_with_closes_the_llm_on_the_way_out_and_lets_errors_through():
    llm = make_llm()
    with llm as inside:
        assert inside is llm and closed() == []
    assert closed() == [llm.ctx, llm.model]
    LOG.clear()
    with pytest.raises(KeyError, match="boom"), make_llm(prompt_lookup=True) as other:
        raise KeyError("boom")
    assert closed() == [other.drafter, other.ctx, other.model]
