"""CancelToken: a generation stops between rounds, a running decode stops through llama.cpp's abort callback (a C
function reading the token's flag), and the context is left fit for the next generation."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import pyllama_dspark
from pyllama_dspark import Batch, CancelToken, Context, DecodeAbortedError, Model
from pyllama_dspark.testing import TinySpec, tiny_model

SPEC = TinySpec(arch="llama", n_layer=3, vocab="llama-spm", chat_template="chatml")
PROMPT = "The quick brown fox"

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def target(model_dir):
    return tiny_model(SPEC, cache_dir=model_dir)


def test_a_cancelled_token_aborts_a_decode_and_only_inside_abortable(target):
    with Model(target) as model:
        ctx = Context(model, n_ctx=256)
        token = CancelToken()
        token.cancel()
        batch = Batch(8)
        batch.add_tokens(np.arange(10, 18), 0, logits="last")
        with ctx.abortable(token):
            with pytest.raises(DecodeAbortedError):
                ctx.decode(batch)
        ctx.clear()
        ctx.decode(batch)  # the callback is gone with the block
        assert ctx.logits(-1).shape == (model.n_vocab,)
        with pytest.raises(TypeError, match="token must be a CancelToken"):
            with ctx.abortable(threading.Event()):
                pass
        batch.close()


@pytest.mark.parametrize("with_drafter", [False, True])
def test_cancel_stops_a_generation_and_the_next_one_is_exact(target, make_pair, with_drafter):
    drafter = make_pair(SPEC).drafter if with_drafter else None
    with pyllama_dspark.load(target, drafter=drafter, n_ctx=512) as llm:
        reference = llm.generate(PROMPT, max_tokens=40, stop_at_eog=False)
        token = CancelToken()
        token.cancel()
        early = llm.generate(PROMPT, max_tokens=40, stop_at_eog=False, cancel=token)
        assert (early.stop_reason, early.finish_reason, early.tokens) == ("cancelled", "cancelled", [])
        # cancelled between rounds from the consumer's side: the stream ends with a "cancelled" event
        token = CancelToken()
        events = []
        for event in llm.stream(PROMPT, max_tokens=40, stop_at_eog=False, cancel=token):
            events.append(event)
            if len(events) == 5:
                token.cancel()
        assert events[-1].stop_reason == "cancelled" and events[-1].result.stop_reason == "cancelled"
        kept = [e.token for e in events[:-1]]
        assert 5 <= len(kept) < 40 and kept == reference.tokens[:len(kept)]
        assert events[-1].result.tokens == kept
        again = llm.generate(PROMPT, max_tokens=40, stop_at_eog=False)
        assert again.tokens == reference.tokens and not llm.ctx.busy
        # a token never cancelled changes nothing
        assert llm.generate(PROMPT, max_tokens=40, stop_at_eog=False, cancel=CancelToken()).tokens == reference.tokens


def test_cancel_from_another_thread_stops_a_long_prefill(model_dir):
    """A prompt of 4,000 tokens in one ubatch: the abort callback stops it inside the decode (no token generated),
    and the context then decodes the same prompt in full."""
    with pyllama_dspark.load(tiny_model(SPEC, cache_dir=model_dir), n_ctx=4096, n_batch=4096) as llm:
        ids = np.random.default_rng(0).integers(100, 30000, 4000).tolist()
        token = CancelToken()
        stream = llm.stream(ids, max_tokens=2, cancel=token)
        timer = threading.Timer(0.02, token.cancel)
        timer.start()
        events = list(stream)
        timer.join()
        assert events[-1].stop_reason == "cancelled" and events[-1].result.tokens == []
        full = llm.generate(ids, max_tokens=2)
        assert full.stop_reason == "max_tokens" and len(full.tokens) == 2


def test_cancel_argument_is_type_checked(target):
    with pyllama_dspark.load(target, n_ctx=256) as llm:
        with pytest.raises(TypeError, match="cancel must be a CancelToken"):
            llm.generate(PROMPT, max_tokens=2, cancel=True)


def test_a_token_calls_each_listener_once_and_a_taken_back_one_never():
    token = CancelToken()
    calls = []
    first = token.on_cancel(lambda: calls.append("first"))
    token.on_cancel(lambda: calls.append("second"))
    taken = token.on_cancel(lambda: calls.append("taken back"))
    taken()
    assert calls == [] and not token.cancelled
    token.cancel()
    token.cancel()  # a second cancel calls nobody again
    assert calls == ["first", "second"] and token.cancelled and token.wait(0)
    first()  # taking back a listener that ran is a no-op
    token.on_cancel(lambda: calls.append("late"))  # registered after the cancel: called at once
    assert calls == ["first", "second", "late"]


def test_a_context_leaves_no_listener_on_the_token_and_a_late_cancel_is_harmless(target):
    with Model(target) as model:
        ctx = Context(model, n_ctx=256)
        token = CancelToken()
        with ctx.abortable(token):
            assert len(token._listeners) == 1
        assert token._listeners == []
        token.cancel()  # after the block: no flag is written, the next decode runs
        batch = Batch(8)
        batch.add_tokens(np.arange(10, 18), 0, logits="last")
        ctx.decode(batch)
        ctx.close()


def _native_modules() -> set[str]:
    import ast
    from pathlib import Path

    package = Path(pyllama_dspark.__file__).parent
    out = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "_lib":
                out.add(path.relative_to(package).with_suffix("").as_posix().replace("/", "."))
    return out


def _imports(module: str) -> set[str]:
    """The package modules a module imports at its top level (relative imports; the package itself left out)."""
    import ast
    from pathlib import Path

    package = Path(pyllama_dspark.__file__).parent
    path = package / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = package / module.replace(".", "/") / "__init__.py"
    parent = module.split(".")[:-1] if path.name != "__init__.py" else module.split(".")
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.level:
            base = parent[:len(parent) - (node.level - 1)]
            names = [".".join(base + [node.module])] if node.module else [".".join(base + [a.name]) for a in node.names]
            for name in names:
                name = name.strip(".")
                if name and ((package / (name.replace(".", "/") + ".py")).exists()
                             or (package / name.replace(".", "/")).is_dir()):
                    out.add(name)
    return out


@pytest.mark.parametrize("module", ["server.engine", "server.app", "server.protocol", "server.metrics"])
def test_the_server_imports_no_module_that_calls_native_code(module):
    """The engine holds CancelTokens, requests and events; none of what it imports (all the way down) owns
    native code. ``server/__init__``'s loader imports the facade inside a function, when the model loads."""
    native = _native_modules()
    assert {"context", "model", "batch"} <= native  # the scan sees the native modules
    seen, todo = set(), [module]
    while todo:
        for name in _imports(todo.pop()):
            if name not in seen:
                seen.add(name)
                todo.append(name)
    assert not seen & native, f"{module} imports {sorted(seen & native)}"
