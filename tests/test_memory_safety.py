"""Memory safety and abort paths (issue 8): each test failed, or crashed its subprocess, before its fix.

Cases that could crash run in a fresh interpreter (``run_isolated``), so a signal fails the test instead
of the test run. Under the AddressSanitizer job (scripts/asan_pytest.sh) these are the tests that make
the use-after-free and the heap overflow visible as reports.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import drafters
from isolated import run_isolated
from pyllama_dspark import (Batch, CaptureError, ClosedHandleError, Context, ContextBusyError, Model, generate)
from pyllama_dspark import capture as cap
from pyllama_dspark.convert.converter import convert
from pyllama_dspark.speculative import Speculator
from pyllama_dspark.testing import TinySpec, tiny_model, write_tiny_dspark_checkpoint

CHAT_SPEC = TinySpec(arch="llama", n_layer=2, vocab="llama-spm", chat_template="chatml")
TARGET = TinySpec(arch="llama", n_layer=3)
BLOCK = 7
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three fruits, in alphabetical order."},
            {"role": "assistant", "content": "Apple, banana, cherry."},
            {"role": "user", "content": "And three more?"}]


def chatml(messages) -> str:
    """The ChatML text llama.cpp's built-in "chatml" template produces (add_assistant=True)."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + \
        "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def chat_target(model_dir):
    return tiny_model(CHAT_SPEC, cache_dir=model_dir)


@pytest.fixture(scope="module")
def pair(model_dir, tmp_path_factory):
    """(target, drafter) paths: a 3-layer llama target and a converted DSpark drafter with a confidence head."""
    target = tiny_model(TARGET, cache_dir=model_dir)
    folder = tmp_path_factory.mktemp("memsafety")
    ck = write_tiny_dspark_checkpoint(folder / "ck", target=TARGET, block_size=BLOCK, dtype="f32",
                                      target_cache_dir=model_dir)
    return target, convert(ck, folder / "drafter.gguf", target_gguf=target).path


# --- 1. use-after-free in apply_chat_template ---------------------------------------------------------

def test_chat_template_is_the_same_text_over_many_calls_in_a_fresh_process(chat_target):
    # The role/content pointers once pointed into temporaries freed before the native call: in a fresh
    # process about one call in 50 came back with garbage where the role should be.
    proc = run_isolated(f"""
        import json
        import pyllama_dspark as p
        messages = {MESSAGES!r}
        model = p.Model({str(chat_target)!r}, vocab_only=True)
        texts = []
        for i in range(300):
            junk = [bytes([i % 251]) * (16 + k) for k in range(64)]  # churn the allocator between calls
            texts.append(model.apply_chat_template(messages))
        print(json.dumps(texts))
    """)
    texts = json.loads(proc.stdout)
    expected = chatml(MESSAGES)
    wrong = [i for i, text in enumerate(texts) if text != expected]
    assert not wrong, f"{len(wrong)} of 300 calls differ from the ChatML text, first {texts[wrong[0]]!r}"


def test_speculative_chat_equals_plain_generate_on_the_templated_text(chat_target):
    with Model(chat_target) as model:
        text = model.apply_chat_template(MESSAGES)
        assert text == chatml(MESSAGES)
        plain_ctx = Context(model, n_ctx=256, n_batch=64)
        expected = generate(plain_ctx, text, max_tokens=16, stop_at_eog=False).tokens
        prompt = list(model.tokenize(text, parse_special=True))
        ctx = Context(model, n_ctx=256, n_batch=64)
        drafter = drafters.oracle(prompt + expected, model.n_vocab)
        spec = Speculator(ctx, drafter, n_draft=4)
        for _ in range(20):
            result = spec.chat(MESSAGES, max_tokens=16, stop_at_eog=False)
            assert result.tokens == expected


# --- 2. capture: pending reorders, contexts without memory -----------------------------------------------

def interleaved_batch(n: int = 12) -> Batch:
    """Two sequences interleaved, every row with logits: a multi-stream context computes them grouped by
    sequence, so the decode leaves output swaps (and dense-row reorders) pending until the first read."""
    batch = Batch(2 * n)
    for i in range(n):
        batch.add((i * 37) % 250 + 1, i, seq_id=0, logits=True)
        batch.add((i * 53) % 250 + 3, i, seq_id=1, logits=True)
    return batch


def decoded(model, capture, *, switch_to=None):
    """Decode the interleaved batch with ``capture`` = (ids, masked) on and layer input 2 extracted; with
    ``switch_to`` the capture is switched before anything is read. Returns (logits, layer input) copies and
    the context."""
    ctx = Context(model, n_ctx=256, n_batch=32, n_seq_max=2, kv_type="f32", flash_attn=False)
    ctx.set_layer_input(2)
    ids, masked = capture
    ctx.set_capture_layers(ids, masked=masked)
    ctx.decode(interleaved_batch())
    if switch_to is not None:
        ctx.set_capture_layers(switch_to[0], masked=switch_to[1])
    return ctx.all_logits().copy(), ctx.layer_input(2).copy(), ctx


@pytest.mark.parametrize("before, after", [
    (([0], True), ([0, 1, 2], True)),     # wider masked rows
    (([0], False), ([0, 1, 2], False)),   # wider dense rows
    (([0, 1, 2], True), ([0, 1, 2], False)),  # masked -> dense
    (([0, 1], False), ([2], True)),       # dense -> narrower masked
])
def test_capture_switched_with_pending_reorders_gives_the_right_rows(make_model, before, after):
    # Before the fix the pending swaps were applied with the new width/layout over the old buffer: a heap
    # overflow that also scrambled the layer-input rows stored after the capture rows.
    with Model(make_model(arch="llama", n_layer=3)) as model:
        logits_ref, layer_ref, ref = decoded(model, before)
        logits, layer, ctx = decoded(model, before, switch_to=after)
        np.testing.assert_array_equal(logits, logits_ref)
        np.testing.assert_array_equal(layer, layer_ref)
        with pytest.raises(CaptureError, match="captured no rows"):
            ctx.capture()  # the old rows are gone with the old layout, never read in the new one
        # the next decode captures with the new layers, in batch order, like a fresh context
        ctx.seq_rm(-1)
        ctx.decode(interleaved_batch())
        ref.set_capture_layers(*after[:1], masked=after[1])
        ref.seq_rm(-1)
        ref.decode(interleaved_batch())
        np.testing.assert_array_equal(ctx.capture(), ref.capture())
        np.testing.assert_array_equal(ctx.all_logits(), ref.all_logits())


def test_capture_on_a_context_without_memory_is_refused(chat_target):
    # A vocab-only model's context has no memory: decode falls back to encode, which captured 0 rows silently.
    proc = run_isolated(f"""
        import pyllama_dspark as p
        model = p.Model({str(chat_target)!r}, vocab_only=True)
        try:
            ctx = p.Context(model, n_ctx=64, n_batch=8)
        except p.ContextInitError:
            print("no context")
        else:
            from pyllama_dspark._lib import ffi, lib
            native = lib.llama_set_capture_layers(ctx.ptr, ffi.new("int32_t[]", [0]), 1, False)
            try:
                ctx.set_capture_layers([0])
                print("accepted", native)
            except p.CaptureError as exc:
                print("refused", native, exc.code)
    """)
    out = proc.stdout.split()
    assert out[0] in ("refused", "no context"), proc.stdout
    if out[0] == "refused":
        assert int(out[1]) == int(out[2]) == cap.ERR_CONTEXT_TYPE


# --- 3. our C entry points return codes, never abort -----------------------------------------------------

def test_every_c_entry_point_refuses_bad_arguments(pair):
    target, drafter = pair
    proc = run_isolated(f"""
        import numpy as np
        import pyllama_dspark as p
        from pyllama_dspark._lib import ffi, lib
        N = ffi.NULL
        ok = []
        def check(name, got, want):
            assert got == want, f"{{name}}: {{got}} != {{want}}"
            ok.append(name)
        # NULL handles
        check("n_target_layers", lib.llama_dspark_model_n_target_layers(N), -1)
        check("target_layers", lib.llama_dspark_model_target_layers(N, N, 0), -1)
        check("get_ctx_other", lib.llama_dspark_get_ctx_other(N), N)
        check("set_layer_inp", lib.llama_dspark_set_embeddings_layer_inp(N, 0, True), -1)
        check("get_layer_inp", lib.llama_dspark_get_embeddings_layer_inp(N, 0), N)
        check("set_nextn", lib.llama_dspark_set_embeddings_nextn(N, True, True), -1)
        check("get_nextn", lib.llama_dspark_get_embeddings_nextn_ith(N, 0), N)
        check("set_capture", lib.llama_set_capture_layers(N, N, 0, False), lib.LLAMA_DSPARK_CAPTURE_ERR_NULL)
        check("n_capture", lib.llama_get_n_capture(N), -1)
        check("capture_rows", lib.llama_get_capture_n_rows(N), -1)
        check("capture", lib.llama_get_embeddings_capture(N), N)
        check("capture_ith", lib.llama_get_embeddings_capture_ith(N, 0), N)
        check("narrowing", lib.llama_dspark_set_narrowing(N, True), -1)
        check("consistent", lib.llama_dspark_set_consistent_numerics(N, True), -1)

        model = p.Model({str(target)!r})
        ctx = p.Context(model, n_ctx=256, n_batch=32)
        check("target_layers out", lib.llama_dspark_model_target_layers(model.ptr, N, 4), -1)
        check("layer_inp range", lib.llama_dspark_set_embeddings_layer_inp(ctx.ptr, model.n_layer + 1, True), -1)
        check("layer_inp negative", lib.llama_dspark_set_embeddings_layer_inp(ctx.ptr, -1, True), -1)
        # nextn on an architecture whose graph has no nextn rows: NULL, not rows that were never written
        check("set_nextn llama", lib.llama_dspark_set_embeddings_nextn(ctx.ptr, True, True), 0)
        batch = p.Batch(8)
        batch.add_tokens([1, 2, 3, 4], 0, logits="all")
        ctx.decode(batch)
        check("nextn unwritten", lib.llama_dspark_get_embeddings_nextn_ith(ctx.ptr, 0), N)
        try:
            ctx.nextn_row(0)
        except IndexError:
            ok.append("nextn_row IndexError")

        d = p.DSparkDrafter({str(drafter)!r}, ctx)
        d.propose(4, 4)
        # a dflash graph never sets layer inputs: enabling one used to abort the next decode in llama-graph.cpp
        check("layer_inp dflash", lib.llama_dspark_set_embeddings_layer_inp(d.ctx.ptr, 1, True), -2)
        try:
            d.ctx.set_layer_input(1)
        except p.CaptureError:
            ok.append("set_layer_input CaptureError")
        d.propose(4, 4)
        # the drafter's nextn rows (its confidence) exist, but not at a bad index
        assert lib.llama_dspark_get_embeddings_nextn_ith(d.ctx.ptr, 0) != N
        check("nextn bad index", lib.llama_dspark_get_embeddings_nextn_ith(d.ctx.ptr, 999), N)
        check("nextn negative", lib.llama_dspark_get_embeddings_nextn_ith(d.ctx.ptr, -999), N)
        print(len(ok))
    """)
    assert int(proc.stdout.split()[-1]) == 24, proc.stdout


# --- 4. a drafter outliving its target -----------------------------------------------------------------

@pytest.mark.parametrize("how", ["context closed", "model with-block ended"])
def test_drafter_after_its_target_closes_raises_closed_handle_error(pair, how):
    target, drafter = pair
    proc = run_isolated(f"""
        import numpy as np
        import pyllama_dspark as p
        how = {how!r}
        if how == "context closed":
            model = p.Model({str(target)!r})
            ctx = p.Context(model, n_ctx=256, n_batch=32)
            d = p.DSparkDrafter({str(drafter)!r}, ctx)
            ctx.close()
        else:
            with p.Model({str(target)!r}) as model:
                ctx = p.Context(model, n_ctx=256, n_batch=32)
                d = p.DSparkDrafter({str(drafter)!r}, ctx)
        calls = {{"propose": lambda: d.propose(1, 5, 4),
                  "observe": lambda: d.observe(np.array([1]), np.zeros((1, d.width), np.float32), 0),
                  "reset": d.reset,
                  "speculate": lambda: p.Speculator(ctx, d).generate([1, 2, 3], max_tokens=4)}}
        for name, call in calls.items():
            try:
                call()
                print(name, "no-error")
            except p.ClosedHandleError:
                print(name, "closed")
            except Exception as exc:
                print(name, type(exc).__name__)
    """)
    assert proc.stdout.split() == ["propose", "closed", "observe", "closed", "reset", "closed",
                                   "speculate", "closed"], proc.stdout


def test_drafter_on_a_closed_target_is_refused(pair):
    target, drafter = pair
    with Model(target) as model:
        ctx = Context(model, n_ctx=256, n_batch=32)
        ctx.close()
        with pytest.raises(ClosedHandleError):
            from pyllama_dspark import DSparkDrafter
            DSparkDrafter(drafter, ctx)


# --- 5. one Context, two threads -----------------------------------------------------------------------

THREADS_SCRIPT = """
import threading
import numpy as np
import pyllama_dspark as p

model = p.Model({target!r})
ctx = p.Context(model, n_ctx=512, n_batch=64, n_threads=2)
drafter = p.DSparkDrafter({drafter!r}, ctx)
spec = p.Speculator(ctx, drafter, n_draft=4)
prompt = [1, 17, 42, 99, 3, 250, 7]
N = 96
ref = p.generate(ctx, prompt, max_tokens=N, stop_at_eog=False).tokens
out = {{}}

def owner(kind, owned, go_on):
    gen = (p.generate(ctx, prompt, max_tokens=N, stop_at_eog=False, stream=True) if kind == "plain" else
           spec.generate(prompt, max_tokens=N, stop_at_eog=False, stream=True))
    tokens = []
    for event in gen:
        tokens.append(event.token)
        if not owned.is_set():
            owned.set()
            go_on.wait(60)
    out[kind + " owner"] = [t for t in tokens if t >= 0] == ref

def intruder(kind, owned, go_on):
    owned.wait(60)
    try:
        if kind == "plain":
            spec.generate(prompt, max_tokens=N, stop_at_eog=False)
        else:
            p.generate(ctx, prompt, max_tokens=N, stop_at_eog=False)
        out[kind + " intruder"] = "ran"
    except p.ContextBusyError as exc:
        out[kind + " intruder"] = "busy" if "one Context per thread" in str(exc) else str(exc)
    finally:
        go_on.set()

for kind in ("plain", "speculative"):
    owned, go_on = threading.Event(), threading.Event()
    threads = [threading.Thread(target=owner, args=(kind, owned, go_on)),
               threading.Thread(target=intruder, args=(kind, owned, go_on))]
    for t in threads: t.start()
    for t in threads: t.join()

# both threads at once, as a web handler would: whoever comes second is refused, nobody crashes
barrier = threading.Barrier(2)
def racer(i):
    barrier.wait()
    try:
        got = p.generate(ctx, prompt, max_tokens=N, stop_at_eog=False).tokens
        out[f"race {{i}}"] = "equal" if got == ref else "differ"
    except p.ContextBusyError:
        out[f"race {{i}}"] = "busy"
racers = [threading.Thread(target=racer, args=(i,)) for i in range(2)]
for t in racers: t.start()
for t in racers: t.join()
import json
print(json.dumps(out, sort_keys=True))
"""


@pytest.mark.slow
def test_one_context_in_two_threads_raises_context_busy_and_never_crashes(pair):
    target, drafter = pair
    code = THREADS_SCRIPT.format(target=str(target), drafter=str(drafter))
    for _ in range(20):
        out = json.loads(run_isolated(code).stdout.splitlines()[-1])
        assert out["plain owner"] is True and out["speculative owner"] is True, out
        assert out["plain intruder"] == "busy" and out["speculative intruder"] == "busy", out
        races = sorted(out[f"race {i}"] for i in range(2))
        assert races in (["busy", "equal"], ["equal", "equal"]), out


def test_context_busy_error_is_exported_and_a_llama_error():
    import pyllama_dspark

    assert pyllama_dspark.ContextBusyError is ContextBusyError
    assert issubclass(ContextBusyError, pyllama_dspark.LlamaError)


def test_a_second_generation_in_the_same_thread_is_refused_until_the_first_is_closed(make_model):
    with Model(make_model(arch="llama", n_layer=2)) as model:
        ctx = Context(model, n_ctx=256, n_batch=32)
        stream = generate(ctx, [1, 2, 3], max_tokens=8, stream=True)
        next(stream)
        assert ctx.busy
        with pytest.raises(ContextBusyError, match="one Context per thread"):
            generate(ctx, [1, 2, 3], max_tokens=8)
        stream.close()
        assert not ctx.busy
        assert len(generate(ctx, [1, 2, 3], max_tokens=8, stop_at_eog=False).tokens) == 8


# --- 6. end of context ---------------------------------------------------------------------------------

@pytest.mark.parametrize("drafter_kind", ["dspark", "oracle"])
def test_speculative_end_of_context_equals_plain(pair, drafter_kind):
    target, drafter_path = pair
    prompt = [1, 17, 42, 99, 3, 250, 7, 8, 9, 10]
    with Model(target) as model:
        plain_ctx = Context(model, n_ctx=256, n_batch=64)
        plain = generate(plain_ctx, prompt, max_tokens=1000, stop_at_eog=False)
        assert plain.stop_reason == "n_ctx" and len(plain.tokens) == plain_ctx.n_ctx - len(prompt) + 1
        ctx = Context(model, n_ctx=256, n_batch=64)
        if drafter_kind == "dspark":
            from pyllama_dspark import DSparkDrafter
            drafter = DSparkDrafter(drafter_path, ctx)
        else:
            drafter = drafters.oracle(prompt + plain.tokens, model.n_vocab, block_size=BLOCK)
        # a fixed draft length: full blocks are drafted up to the last positions of the context
        result = Speculator(ctx, drafter, n_draft=BLOCK).generate(prompt, max_tokens=1000, stop_at_eog=False)
        assert result.tokens == plain.tokens
        assert result.stop_reason == "n_ctx"
        assert result.stats.rounds > 0


def test_drafter_context_too_small_for_a_block_at_the_end_is_refused(pair):
    target, drafter = pair
    from pyllama_dspark import DSparkDrafter
    with Model(target) as model:
        ctx = Context(model, n_ctx=256, n_batch=64)
        with pytest.raises(ValueError, match="n_ctx >= 262"):
            DSparkDrafter(drafter, ctx, n_ctx=ctx.n_ctx)


def test_cli_speculative_generation_to_the_end_of_the_context_exits_0(chat_target, tmp_path, model_dir):
    import subprocess
    import sys
    import tempfile

    ck = write_tiny_dspark_checkpoint(tmp_path / "ck", target=CHAT_SPEC, block_size=4, target_cache_dir=model_dir)
    drafter = convert(ck, tmp_path / "drafter.gguf", target_gguf=chat_target).path
    args = ["generate", "--model", str(chat_target), "--prompt", "Hello world", "-n", "1000", "--n-ctx", "256"]

    def cli(*extra):
        return subprocess.run([sys.executable, "-m", "pyllama_dspark", *args, *extra], capture_output=True,
                              text=True, errors="replace", cwd=tempfile.gettempdir(), timeout=300)
    plain, spec = cli(), cli("--drafter", str(drafter))
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr[-2000:]
    assert spec.stdout == plain.stdout and len(plain.stdout) > 0
