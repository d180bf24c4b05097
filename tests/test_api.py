"""The first hour (issue 13): ``load`` and the LLM facade, OpenAI-shaped completions, one result type with
``.stats`` for plain and speculative decoding, stream events with ``from_draft`` and the stop reason, stop
strings as a string or a list, and argument types checked up front with errors that name the argument."""

from __future__ import annotations

import numpy as np
import pytest

import drafters
import pyllama_dspark
from pyllama_dspark import Context, GenerationResult, Model, PromptLookupDrafter, Speculator, generate
from pyllama_dspark.testing import TinySpec, tiny_model

SPEC = TinySpec(arch="llama", n_layer=3, vocab="llama-spm", chat_template="chatml")
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Name three fruits."}]


@pytest.fixture(scope="module")
def target(model_dir):
    return tiny_model(SPEC, cache_dir=model_dir)


@pytest.fixture(scope="module")
def drafter_path(make_pair):
    return make_pair(SPEC).drafter


@pytest.fixture(scope="module")
def plain(target):
    """Plain greedy decoding through the power-user API: the reference for every facade call."""
    with Model(target) as model:
        ctx = Context(model, n_ctx=512)
        text_run = generate(ctx, PROMPT, max_tokens=24, stop_at_eog=False)
        chat_run = generate(ctx, model.apply_chat_template(MESSAGES), max_tokens=24, stop_at_eog=False)
    return text_run, chat_run


@pytest.mark.parametrize("with_drafter", [False, True])
def test_load_generate_stream_and_chat_give_plain_greedy_decoding(target, drafter_path, plain, with_drafter):
    text_run, chat_run = plain
    # no history: the stream repeats the generate's prompt, and the store would draft the whole first reply
    # (tests/test_free_drafts.py covers that); here the stream's drafts must be the generate's sources
    with pyllama_dspark.load(target, drafter=drafter_path if with_drafter else None, n_ctx=512,
                             history_tokens=0) as llm:
        assert (llm.speculator is not None) == with_drafter
        result = llm.generate(PROMPT, max_tokens=24, stop_at_eog=False)
        assert isinstance(result, GenerationResult)
        assert (result.tokens, result.text) == (text_run.tokens, text_run.text)
        assert result.stats.n_generated == 24 and result.stats.n_prompt == result.n_prompt > 0
        assert result.stop_reason == "max_tokens" and result.finish_reason == "length"
        assert (result.stats.rounds > 0) == with_drafter
        events = list(llm.stream(PROMPT, max_tokens=24, stop_at_eog=False))
        assert [e.token for e in events[:-1]] == text_run.tokens and events[-1].token == -1
        assert "".join(e.text for e in events) == text_run.text
        assert events[-1].stop_reason == "max_tokens" and events[-1].finish_reason == "length"
        assert all(e.stop_reason is None for e in events[:-1])
        assert any(e.from_draft for e in events) == (with_drafter and result.stats.accepted > 0)
        chat = llm.chat(MESSAGES, max_tokens=24, stop_at_eog=False)
        assert chat.tokens == chat_run.tokens


def test_stream_events_say_which_tokens_a_draft_proposed(target):
    with Model(target) as model:
        ctx = Context(model, n_ctx=256)
        ids = model.tokenize(PROMPT, parse_special=True).tolist()
        expected = generate(ctx, PROMPT, max_tokens=20, stop_at_eog=False).tokens
        spec = Speculator(ctx, drafters.prefix(ids + expected, model.n_vocab, 2), n_draft=4)
        steps = list(spec.run(np.asarray(ids, dtype=np.int32), max_tokens=20, stop_at_eog=False))
        events = list(spec.generate(PROMPT, max_tokens=20, stop_at_eog=False, stream=True))
    assert [e.from_draft for e in events[:-1]] == [d for s in steps for d in s.from_draft]
    assert [e.from_draft for e in events[:3]] == [False, True, True]  # token 0, then two right drafts


def test_completion_dicts_have_the_openai_shape(target, drafter_path, plain):
    text_run, chat_run = plain
    with pyllama_dspark.load(target, drafter=drafter_path, n_ctx=512) as llm:
        out = llm.create_completion(PROMPT, max_tokens=24)
        assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
        assert out["model"] == target.name and isinstance(out["created"], int)
        (choice,) = out["choices"]
        assert choice["text"] == text_run.text and choice["finish_reason"] == "length" and choice["index"] == 0
        assert out["usage"]["completion_tokens"] == 24
        assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + 24
        assert out["speculative"]["rounds"] > 0 and out["speculative"]["tau"] >= 1.0
        chat = llm.create_chat_completion(MESSAGES, max_tokens=24)
        assert chat["object"] == "chat.completion" and chat["id"].startswith("chatcmpl-")
        assert chat["choices"][0]["message"] == {"role": "assistant", "content": chat_run.text}
        chunks = list(llm.create_chat_completion(MESSAGES, max_tokens=24, stream=True))
        assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == chat_run.text
        assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
        pieces = list(llm.create_completion(PROMPT, max_tokens=24, stream=True))
        assert "".join(c["choices"][0]["text"] for c in pieces) == text_run.text
    with pyllama_dspark.load(target, n_ctx=512) as llm:
        assert "speculative" not in llm.create_completion(PROMPT, max_tokens=4)


def test_prompt_lookup_drafter_and_an_open_model_through_load(target, plain):
    text_run, _ = plain
    with Model(target) as model:
        with pyllama_dspark.load(model, drafter=PromptLookupDrafter(), n_ctx=512) as llm:
            assert llm.generate(PROMPT, max_tokens=24, stop_at_eog=False).tokens == text_run.tokens
        assert model.n_vocab > 0  # the caller's model stays open after the LLM closes


@pytest.mark.parametrize("with_drafter", [False, True])
def test_stop_takes_a_string_or_a_list_on_plain_and_speculative_generation(target, drafter_path, plain,
                                                                          with_drafter):
    text_run, _ = plain
    stop = text_run.text[10:13]
    assert len(stop) == 3 and text_run.text.find(stop) >= 6  # somewhere past the first round
    cut = text_run.text.find(stop)
    with pyllama_dspark.load(target, drafter=drafter_path if with_drafter else None, n_ctx=512) as llm:
        for form in (stop, [stop], (stop, "never appears")):
            result = llm.generate(PROMPT, max_tokens=24, stop_at_eog=False, stop=form)
            assert result.text == text_run.text[:cut] and result.stop_reason == "stop", form
            assert result.finish_reason == "stop"
            streamed = list(llm.stream(PROMPT, max_tokens=24, stop_at_eog=False, stop=form))
            assert "".join(e.text for e in streamed) == text_run.text[:cut]
            assert streamed[-1].stop_reason == "stop"
        assert not llm.ctx.busy, "a stop string released the context"


def test_wrong_argument_types_raise_type_errors_that_name_the_argument(target, drafter_path):
    with Model(target) as model:
        ctx = Context(model, n_ctx=128)
        spec = Speculator(ctx, drafters.never([], model.n_vocab))
        with pytest.raises(TypeError, match="ctx must be a Context, got Model"):
            generate(model, PROMPT)
        with pytest.raises(TypeError, match="drafter must be a Drafter .* got str"):
            Speculator(ctx, str(drafter_path))
        with pytest.raises(TypeError, match="target must be a Context"):
            Speculator(model, drafters.never([], model.n_vocab))
        for call in (lambda **kw: generate(ctx, PROMPT, **kw), lambda **kw: spec.generate(PROMPT, **kw)):
            with pytest.raises(TypeError, match="max_tokens must be an int, got str '8'"):
                call(max_tokens="8")
            with pytest.raises(TypeError, match="temperature must be a number"):
                call(temperature="0.5")
            with pytest.raises(TypeError, match="top_k must be an int"):
                call(top_k=2.5)
            with pytest.raises(TypeError, match="stop must be a string or a list of strings"):
                call(stop=[".", 3])
        with pytest.raises(TypeError, match="got bytes: decode it first"):
            generate(ctx, b"Hi")
        with pytest.raises(TypeError, match="1-D integer array, got 1-D float64"):
            generate(ctx, np.array([1.5, 2.0]))
        with pytest.raises(TypeError, match="token ids must be ints, got float"):
            spec.generate([1, 2.0])
        with pytest.raises(TypeError, match="messages must be a list"):
            spec.chat("Hi")
        with pytest.raises(TypeError, match=r"messages\[0\] must be a dict"):
            spec.chat([("user", "Hi")])
        # numpy integers are ints
        assert len(generate(ctx, np.array([1, 2, 3], dtype=np.int16), max_tokens=np.int64(2)).tokens) == 2
    with pytest.raises(TypeError, match="n_ctx must be an int"):
        pyllama_dspark.load(target, n_ctx="4096")
    with pytest.raises(TypeError, match="target must be a GGUF path or a Model"):
        pyllama_dspark.load(42)


def test_n_ctx_rounding_is_logged_and_visible(target, caplog):
    with Model(target) as model, caplog.at_level("INFO", logger="pyllama_dspark"):
        ctx = Context(model, n_ctx=32)
        assert ctx.n_ctx == 256
    assert "n_ctx 32 rounded up to 256 by llama.cpp" in caplog.text


def test_the_library_prints_nothing_unless_logging_is_configured(target, drafter_path):
    """Native warnings go to the ``pyllama_dspark`` loggers, which have a NullHandler: a script that configures
    no logging sees no native lines on stderr (Python's last-resort handler would print every warning)."""
    import subprocess
    import sys
    import tempfile

    code = ("import pyllama_dspark, logging\n"
            "logging.getLogger('pyllama_dspark.native').warning('a native warning')\n"
            f"with pyllama_dspark.load({str(target)!r}, drafter={str(drafter_path)!r}, n_ctx=32) as llm:\n"
            "    print(llm.generate('Hello', max_tokens=4).text)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=tempfile.gettempdir())  # not the source tree, whose package is uncompiled
    assert proc.returncode == 0 and proc.stdout.strip() and proc.stderr == "", proc.stderr


def test_load_passes_the_draft_cut_settings_on(target, drafter_path):
    with pyllama_dspark.load(target, drafter=drafter_path, n_draft=3, n_draft_min=2, p_min=0.25) as llm:
        assert (llm.speculator.n_draft, llm.speculator.n_draft_min, llm.drafter.model_drafter.p_min) == (3, 2, 0.25)
        assert llm.speculator.plain_tok_s_estimate() is None  # nothing measured yet
        llm.generate(PROMPT, max_tokens=16)
        assert llm.speculator.plain_tok_s_estimate() > 0


TIMINGS = {"t_prefill", "t_decode", "decode_tok_s", "t_draft"}


def without_timings(stats: dict) -> dict:
    """The statistics that do not depend on the clock (every field but the times and rates of time)."""
    out = {k: v for k, v in stats.items() if k not in TIMINGS}
    if "by_source" in out:
        out["by_source"] = {name: without_timings(share) for name, share in out["by_source"].items()}
    return out


@pytest.fixture(scope="module")
def eog_targets(target, tmp_path_factory):
    """{chat: the target with its end-of-generation token set to a token it generates after PROMPT (chat=False)
    or after the chat-templated MESSAGES (chat=True), 8th or later and not generated before, so a completion
    ends on "eog" there}."""
    from conftest import copy_with_value

    out = {}
    with Model(target) as model:
        for chat in (False, True):
            prompt = model.apply_chat_template(MESSAGES) if chat else PROMPT
            free = generate(Context(model, n_ctx=512), prompt, max_tokens=24, stop_at_eog=False).tokens
            index = next(i for i in range(7, 24) if free[i] not in free[:i])
            out[chat] = copy_with_value(target, tmp_path_factory.mktemp("eog") / "eog.gguf",
                                        "tokenizer.ggml.eos_token_id", free[index])
    return out


FINISH_PATHS = ["length", "stop", "eog"]


@pytest.mark.parametrize("with_drafter", [False, True], ids=["plain", "speculative"])
@pytest.mark.parametrize("chat", [False, True], ids=["text", "chat"])
@pytest.mark.parametrize("finish", FINISH_PATHS)
def test_every_field_of_every_completion_dict_on_every_finish_path(target, eog_targets, drafter_path, with_drafter,
                                                                   chat, finish):
    """create_completion / create_chat_completion, whole and streamed, field by field against the facade's own
    generate and stream with the same settings (literal constants for the OpenAI fields, the generation's
    values for text, finish reason and usage, the clock-free statistics for ``speculative``)."""
    import re
    import time

    path = eog_targets[chat] if finish == "eog" else target
    # a fixed draft length: the cost-aware chooser learns across generations, so its rounds would differ per call;
    # no history, whose store grows with every call (a repeated prompt drafts from the replies before it)
    with pyllama_dspark.load(path, drafter=drafter_path if with_drafter else None, n_ctx=512, n_draft=3,
                             history_tokens=0) as llm:
        prompt = llm.model.apply_chat_template(MESSAGES) if chat else PROMPT
        knobs = dict(max_tokens=24)
        if finish == "stop":
            text = llm.generate(prompt, max_tokens=24).text
            knobs["stop"] = [text[9:12], "never in the output"]
        reference = llm.generate(prompt, **knobs)
        events = list(llm.stream(prompt, **knobs))
        assert reference.stop_reason == {"length": "max_tokens", "stop": "stop", "eog": "eog"}[finish]
        assert reference.finish_reason == {"length": "length", "stop": "stop", "eog": "stop"}[finish]
        make = llm.create_chat_completion if chat else llm.create_completion
        call = MESSAGES if chat else PROMPT
        t0 = int(time.time())
        out = make(call, **knobs)
        chunks = list(make(call, stream=True, **knobs))
        t1 = int(time.time())

    prefix = "chatcmpl" if chat else "cmpl"
    for head in [out] + chunks:
        assert re.fullmatch(prefix + r"-[0-9a-f]{32}", head["id"]), head["id"]
        assert t0 <= head["created"] <= t1 and type(head["created"]) is int
    assert out["id"] != chunks[0]["id"] and all(c["id"] == chunks[0]["id"] for c in chunks)
    assert all(c["created"] == chunks[0]["created"] for c in chunks)

    finish_reason = reference.finish_reason
    choice = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
    choice.update({"message": {"role": "assistant", "content": reference.text}} if chat else {"text": reference.text})
    expected = {"id": out["id"], "created": out["created"], "model": path.name,
                "object": "chat.completion" if chat else "text_completion", "choices": [choice],
                "usage": {"prompt_tokens": reference.n_prompt, "completion_tokens": len(reference.tokens),
                          "total_tokens": reference.n_prompt + len(reference.tokens),
                          "prompt_tokens_details": {"cached_tokens": 0}}}
    got = dict(out)
    if with_drafter:
        assert set(got["speculative"]) == set(reference.stats.as_dict())
        assert without_timings(got.pop("speculative")) == without_timings(reference.stats.as_dict())
    assert got == expected
    assert reference.text and len(reference.tokens) > 0

    def chunk(piece, finish_reason_=None, role=False):
        if chat:
            delta = {"role": "assistant"} if role else ({} if piece is None else {"content": piece})
            body = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason_}
        else:
            body = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish_reason_}
        return {"id": chunks[0]["id"], "created": chunks[0]["created"], "model": path.name,
                "object": "chat.completion.chunk" if chat else "text_completion", "choices": [body]}

    wanted = [chunk(None, role=True)] if chat else []
    wanted += [chunk(e.text) for e in events if e.text]
    wanted.append(chunk(None, finish_reason))
    assert events[-1].finish_reason == finish_reason
    assert chunks == wanted


_WATCHED_OPENS: dict[str, list] = {}


def _count_opens(event: str, args) -> None:
    if event == "open" and args and str(args[0]) in _WATCHED_OPENS:
        _WATCHED_OPENS[str(args[0])].append(args)


def test_a_load_opens_the_drafter_file_once_in_python(target, drafter_path):
    """``load(target, drafter)`` reads the drafter's GGUF header once (block size, Model's checks, the drafter's
    checks) and hands it down; a batch scheduler's drafter takes the same header. llama.cpp's own read of the
    weights (native, not audited) is the only other."""
    import sys

    sys.addaudithook(_count_opens)  # audit hooks cannot be removed: this one counts only watched paths
    _WATCHED_OPENS[str(drafter_path)] = []
    try:
        with pyllama_dspark.load(target, drafter_path, n_ctx=256) as llm:
            assert len(_WATCHED_OPENS[str(drafter_path)]) == 1
            llm.batch_scheduler(2)
            assert len(_WATCHED_OPENS[str(drafter_path)]) == 1
            assert llm.generate(PROMPT, max_tokens=4).tokens  # the drafter works
        with pytest.raises(ValueError, match="header must be read_header"):
            Model(target, header=pyllama_dspark.model.read_header(drafter_path))
    finally:
        del _WATCHED_OPENS[str(drafter_path)]
