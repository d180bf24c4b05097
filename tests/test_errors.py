"""Bad input raises the documented exception and the interpreter survives.

Each case that could reach native code runs in a subprocess too, so an abort
(a signal) would fail the test instead of killing the test runner.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pyllama_dspark import (
    Batch,
    ClosedHandleError,
    Context,
    InvalidBatchError,
    KvCacheFullError,
    MemoryOpError,
    Model,
    ModelLoadError,
)
from isolated import run_isolated


@pytest.fixture(scope="module")
def llama_path(make_model):
    return make_model(arch="llama")


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        Model(tmp_path / "nope.gguf")


def test_not_a_gguf(tmp_path):
    path = tmp_path / "text.gguf"
    path.write_text("hello, I am not a model")
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        Model(path)


@pytest.mark.parametrize("keep", [0.05, 0.5, 0.97])
def test_truncated_gguf(tmp_path, llama_path, keep):
    data = llama_path.read_bytes()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[: int(len(data) * keep)])
    proc = run_isolated(f"""
        import pyllama_dspark as p
        try:
            p.Model({str(path)!r})
        except p.ModelLoadError as exc:
            print("raised", exc.op, str(exc).splitlines()[0])
    """)
    # refused by the header check before llama.cpp reads it: the message says the file ends too early
    assert proc.stdout.startswith("raised open truncated.gguf: ") and ("end" in proc.stdout), proc.stdout


def test_corrupt_gguf_header(tmp_path, llama_path):
    data = bytearray(llama_path.read_bytes())
    data[8:16] = (2**62).to_bytes(8, "little")  # absurd tensor count
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(bytes(data))
    proc = run_isolated(f"""
        import pyllama_dspark as p
        try:
            p.Model({str(path)!r})
        except p.ModelLoadError as exc:
            print("raised", str(exc).splitlines()[0])
    """)
    assert "raised corrupt.gguf: implausible counts" in proc.stdout, proc.stdout


@pytest.mark.parametrize("key, value, message", [
    ("llama.block_count", 32767, "outside [1, 512]"),  # GGML_ASSERT in llama.cpp's hyperparameter loading
    ("llama.attention.layer_norm_rms_epsilon", float("nan"), "not a finite number"),  # GGML_ASSERT(eps >= 0)
    ("llama.attention.layer_norm_rms_epsilon", -1.0, "must not be negative"),
])
def test_metadata_llama_cpp_would_abort_on_is_refused_first(tmp_path, llama_path, key, value, message):
    """Found by fuzzing: each of these aborted the process inside llama.cpp."""
    from conftest import copy_with_value

    bad = copy_with_value(llama_path, tmp_path / "bad.gguf", key, value)
    with pytest.raises(ModelLoadError, match=message.replace("[", r"\[")):
        Model(bad)


@pytest.fixture
def ctx(llama_path):
    model = Model(llama_path)
    context = Context(model, n_ctx=64, n_batch=16)
    yield context
    model.close()


def test_token_out_of_range(ctx):
    batch = Batch(4)
    batch.add(ctx.model.n_vocab, 0, logits=True)
    with pytest.raises(InvalidBatchError, match="out of range"):
        ctx.decode(batch)
    with pytest.raises(InvalidBatchError):
        Batch(2).add(-5, 0)


def test_batch_larger_than_n_batch(ctx):
    batch = Batch(32)
    batch.add_tokens(np.arange(20), 0)
    with pytest.raises(InvalidBatchError, match="exceeds n_batch=16"):
        ctx.decode(batch)
    with pytest.raises(InvalidBatchError, match="capacity"):
        Batch(2).add_tokens([1, 2, 3], 0)


def test_context_overflow(ctx):
    batch = Batch(16)
    pos = 0
    n_ctx = ctx.n_ctx  # llama.cpp may round the requested size up
    with pytest.raises(KvCacheFullError) as info:
        for _ in range(n_ctx // 16 + 2):
            batch.clear()
            batch.add_tokens(np.arange(16) % 7, pos)
            ctx.decode(batch)
            pos += 16
    assert info.value.code == 1
    assert pos == n_ctx  # the first batch past the cache was the one without room
    # The context is still usable after the failed decode.
    ctx.seq_rm(0, 32, -1)
    batch.clear()
    batch.add_tokens([1, 2, 3], 32)
    ctx.decode(batch)


def test_seq_rm_the_memory_cannot_honour(make_model):
    with Model(make_model(arch="qwen35")) as model:
        ctx = Context(model, n_ctx=64, n_batch=16)  # no recurrent snapshots (n_rs_seq=0)
        batch = Batch(16)
        batch.add_tokens(np.arange(8), 0)
        ctx.decode(batch)
        with pytest.raises(MemoryOpError, match="cannot remove"):
            ctx.seq_rm(0, 4, -1)
        ctx.seq_rm(0)  # a whole sequence can always go
        assert ctx.seq_pos_max(0) == -1


def test_use_after_close(llama_path):
    model = Model(llama_path)
    ctx = Context(model, n_ctx=32, n_batch=8)
    batch = Batch(4)
    batch.add(1, 0, logits=True)
    ctx.decode(batch)
    model.close()  # closes the context first
    assert ctx.closed
    with pytest.raises(ClosedHandleError):
        ctx.decode(batch)
    with pytest.raises(ClosedHandleError):
        ctx.logits()
    with pytest.raises(ClosedHandleError):
        model.n_vocab
    with pytest.raises(ClosedHandleError):
        Context(model)
    model.close()  # idempotent
    batch.close()
    with pytest.raises(ClosedHandleError):
        batch.add(1, 0)


def test_logits_of_a_row_without_output(ctx):
    batch = Batch(4)
    batch.add_tokens([1, 2, 3], 0, logits="last")
    ctx.decode(batch)
    ctx.logits(2)
    with pytest.raises(IndexError, match="no logits"):
        ctx.logits(0)
    with pytest.raises(IndexError):
        ctx.logits(7)


def test_bad_context_sizes(llama_path):
    with Model(llama_path) as model:
        with pytest.raises(ValueError, match="n_batch"):
            Context(model, n_batch=0)
        with pytest.raises(ValueError, match="n_ubatch"):
            Context(model, n_batch=8, n_ubatch=16)


def test_bad_sequence_ids(ctx):
    batch = Batch(2)
    batch.add(1, 0, seq_id=3)
    with pytest.raises(InvalidBatchError, match="sequence id"):
        ctx.decode(batch)
    with pytest.raises(ValueError):
        ctx.seq_rm(5)


def test_too_many_recurrent_snapshots_for_the_ubatch(make_model):
    """llama.cpp asserts (aborts) when n_rs_seq + 1 >= n_ubatch on a hybrid model; we refuse first."""
    with Model(make_model(arch="qwen35")) as model:
        with pytest.raises(ValueError, match="n_rs_seq"):
            Context(model, n_ctx=64, n_batch=16, n_ubatch=8, n_rs_seq=7)
        Context(model, n_ctx=64, n_batch=16, n_ubatch=8, n_rs_seq=6).close()


def test_an_empty_batch_is_refused_before_native_code(ctx):
    with pytest.raises(InvalidBatchError, match="empty batch"):
        ctx.decode(Batch(4))


@pytest.mark.parametrize("code,cls,meaning", [
    (1, "KvCacheFullError", "could not find a KV slot"),
    (2, "DecodeAbortedError", "aborted"),
    (-1, "InvalidBatchError", "invalid input batch"),
    (-2, "FatalDecodeError", "fatal error"),
    (-7, "FatalDecodeError", "fatal error"),
])
def test_each_decode_return_code_has_its_named_error(code, cls, meaning):
    import pyllama_dspark
    from pyllama_dspark.errors import DecodeError, LlamaError, decode_error

    err = decode_error(code, "llama_decode", ["a native line"])
    assert type(err) is getattr(pyllama_dspark, cls), "the class is exported under its documented name"
    assert isinstance(err, DecodeError) and isinstance(err, LlamaError) and isinstance(err, RuntimeError)
    assert (err.code, err.op, list(err.log_tail)) == (code, "llama_decode", ["a native line"])
    assert f"returned {code}: {meaning}" in str(err)


def test_errors_about_what_the_caller_passed_are_also_value_errors():
    """docs/troubleshooting.md promises these are ValueErrors too, so `except ValueError` catches bad input."""
    from pyllama_dspark import CaptureError, DecodeAbortedError, DrafterError, FatalDecodeError, KvCacheFullError

    for cls in (InvalidBatchError, DrafterError, CaptureError, ClosedHandleError):
        assert issubclass(cls, ValueError), cls.__name__
    for cls in (KvCacheFullError, DecodeAbortedError, FatalDecodeError, MemoryOpError):
        assert not issubclass(cls, ValueError), f"{cls.__name__} is a runtime condition, not bad input"


def test_text_for_a_model_without_a_tokenizer_is_refused_not_aborted(make_model, tmp_path):
    """llama.cpp's tokenizer GGML_ASSERTs on a vocabulary of type none (found through the CLI with a tiny model:
    the process died); the Model raises first, and the CLI reports it."""
    path = make_model(arch="llama", n_layer=2)
    with Model(path) as model:
        assert not model.has_vocab
        with pytest.raises(ValueError, match="no tokenizer"):
            model.tokenize("hello")
    cli = str(Path(sys.executable).with_name("pyllama-dspark"))
    out = subprocess.run([cli, "generate", "-m", str(path), "-p", "hello", "-n", "4"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "no tokenizer" in out.stderr, (out.returncode, out.stderr[-1500:])
