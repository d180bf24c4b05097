"""Patch 0018 on a Vulkan device: with consistent numerics a batched decode is bit-identical to decoding its
tokens one by one, so speculative greedy output equals plain greedy output on Vulkan too.

These tests need a build with a GPU backend (CMAKE_ARGS="-DGGML_VULKAN=on") and a device. CI runs them on
Mesa's lavapipe (a CPU-side Vulkan device, which ggml skips unless GGML_VK_VISIBLE_DEVICES names it) with
PYLLAMA_DSPARK_REQUIRE_GPU=1, which turns "no device" into a failure instead of a skip. Exactness here means
Vulkan batch == Vulkan single token; Vulkan and CPU logits differ slightly, as expected.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

import drafters
import token_scan
from conftest import ARCHS
from pyllama_dspark import Batch, Context, Model, generate, rpc
from pyllama_dspark._lib import ffi, lib
from pyllama_dspark.speculative import Speculator

GPU = bool(rpc.local_gpu_devices())  # not llama_supports_gpu_offload(): true in every RPC build
REQUIRE_GPU = os.environ.get("PYLLAMA_DSPARK_REQUIRE_GPU") == "1"

pytestmark = pytest.mark.skipif(not GPU and not REQUIRE_GPU,
                                reason="no GPU device in this build (Vulkan builds: CMAKE_ARGS=-DGGML_VULKAN=on; "
                                       "lavapipe needs GGML_VK_VISIBLE_DEVICES=<its index>)")

TOKENS = (np.arange(72) * 37 % 241 + 5).tolist()
WIDTHS = (2, 3, 4, 5, 6, 7, 8, 16)


def test_a_gpu_device_is_present():
    """The Vulkan CI job sets PYLLAMA_DSPARK_REQUIRE_GPU=1: there, a missing device fails instead of skipping."""
    assert GPU, "PYLLAMA_DSPARK_REQUIRE_GPU=1 but llama.cpp reports no GPU device"


def gpu_context(model, consistent=True):
    return Context(model, n_ctx=256, n_batch=64, flash_attn=True, consistent_numerics=consistent)


def single_rows(model, consistent=True, tokens=TOKENS):
    with gpu_context(model, consistent) as ctx:
        return token_scan.single_rows(ctx, tokens)


def batched_rows(model, width, consistent=True, tokens=TOKENS):
    with gpu_context(model, consistent) as ctx:
        return token_scan.batched_rows(ctx, tokens, width)


@pytest.mark.parametrize("qtype", ["f32", "f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("arch", ARCHS)
def test_batched_rows_are_bit_identical_to_single_tokens_on_the_gpu(quantized, arch, qtype):
    with Model(quantized(arch, qtype), n_gpu_layers=-1) as model:
        single = single_rows(model)
        for width in WIDTHS:
            np.testing.assert_array_equal(batched_rows(model, width), single, err_msg=f"{arch} {qtype} width {width}")


def multi_col_mmv_dispatches() -> int:
    """Mat-vec dispatches of several columns per pipeline taken under the mode (patch 0022's counter)."""
    reg = lib.ggml_backend_reg_by_name(b"Vulkan")
    assert reg != ffi.NULL, "no Vulkan backend in this build"
    address = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_vk_dspark_multi_col_mmv")
    assert address != ffi.NULL, "the Vulkan backend lacks patch 0022's counter"
    return int(ffi.cast("int64_t (*)(void)", address)())


@pytest.mark.parametrize("per_column", [False, True], ids=["num-cols-n", "per-column"])
def test_small_batches_run_the_multi_column_mat_vec_bit_identically(quantized, monkeypatch, per_column):
    """Patch 0022: under the mode a batch of 2-8 columns takes the NUM_COLS=n mat-vec, whose every column must
    equal the NUM_COLS=1 pipeline's bit for bit; GGML_VK_CONSISTENT_PER_COLUMN=1 (read when a context is
    created) keeps one NUM_COLS=1 dispatch per column. A batch above 8 columns goes per column either way."""
    if per_column:
        monkeypatch.setenv("GGML_VK_CONSISTENT_PER_COLUMN", "1")
    else:
        monkeypatch.delenv("GGML_VK_CONSISTENT_PER_COLUMN", raising=False)
    tokens = TOKENS[:64]  # whole batches of every width below, so width 16 never leaves a short last batch
    for qtype in ("f32", "f16", "q8_0", "q4_0"):
        with Model(quantized("llama", qtype), n_gpu_layers=-1) as model:
            single = single_rows(model, tokens=tokens)
            for width in (2, 4, 8, 16):
                before = multi_col_mmv_dispatches()
                rows = batched_rows(model, width, tokens=tokens)
                taken = multi_col_mmv_dispatches() - before
                np.testing.assert_array_equal(rows, single, err_msg=f"{qtype} width {width}")
                if width <= 8 and not per_column:
                    assert taken > 0, f"{qtype} width {width}: the NUM_COLS=n mat-vec was not taken"
                else:
                    assert taken == 0, f"{qtype} width {width}: {taken} multi-column dispatches"


def test_without_the_mode_the_first_divergence_is_recorded(quantized, record_property):
    """Why the mode exists: without it, batches above 8 columns take the tiled matmul and smaller ones a
    mat-vec specialised per column count. Records the first (width, row) whose logits differ, per type."""
    found = {}
    for qtype in ("f32", "q8_0"):
        with Model(quantized("llama", qtype), n_gpu_layers=-1) as model:
            single = single_rows(model, consistent=False)
            for width in WIDTHS:
                rows = batched_rows(model, width, consistent=False)
                differs = np.flatnonzero(np.any(rows != single, axis=1))
                if differs.size:
                    found[qtype] = (width, int(differs[0]), float(np.abs(rows - single).max()))
                    break
    record_property("first_divergence", found)
    print(f"first divergence without the mode (width, row, max |diff|): {found}")
    assert found, "no batch width differed without the mode: this device cannot show the mode's effect"


@pytest.mark.parametrize("arch, qtype, widths", [("llama", "q8_0", (2, 8, 16)), ("qwen3", "f32", (8, 37, 64))])
def test_a_partial_offload_stays_exact(quantized, arch, qtype, widths):
    """Layers on the CPU take the CPU's mode, layers on the device the device's: rows stay bit-identical. On
    qwen3 the CPU layers' per-head q/k norms ([head_dim, n_head, n_tokens]) of a 37-token batch have more
    than 64 rows: the device's op offload must judge them by their tokens and leave them where a lone
    token's run (patch 0023), or batch 37 differs from single tokens."""
    with Model(quantized(arch, qtype), n_gpu_layers=1) as model:
        single = single_rows(model)
        for width in widths:
            np.testing.assert_array_equal(batched_rows(model, width), single, err_msg=f"{arch} {qtype} width {width}")


def test_a_model_with_no_gpu_layers_runs_on_the_cpu_alone(quantized):
    """n_gpu_layers=0 in a GPU build gives the model no GPU device: its weights are the CPU's, the mode is
    accepted without flash attention (refused before: the idle Vulkan backend of every context counted as a
    GPU without it), and a 37-token batch (row counts above the device's op-offload threshold) is not
    computed by the device, whose rows for the same batch differ."""
    with Model(quantized("qwen3", "f32"), n_gpu_layers=0) as model:
        assert not any("Vulkan" in name for name in model.buffer_sizes), model.buffer_sizes
        with Context(model, n_ctx=256, n_batch=64, flash_attn=False) as ctx:
            assert ctx.consistent_numerics and not ctx.offloaded
            cpu_rows = token_scan.batched_rows(ctx, TOKENS, 37)
    with Model(quantized("qwen3", "f32"), n_gpu_layers=-1) as model:
        assert any("Vulkan" in name for name in model.buffer_sizes), model.buffer_sizes
        gpu_rows = batched_rows(model, 37)
    assert not np.array_equal(cpu_rows, gpu_rows), "the device computed the CPU's rows bit for bit: no contrast"


def test_rows_stay_exact_where_the_kv_cache_crosses_512_cells(quantized):
    """The mode splits flash attention into fixed 128-cell chunks merged by the split-k reduce, whatever n_kv
    is: a batch at positions 500-531 (n_kv 768) against lone tokens before and after the 512-cell boundary."""
    prefix = (np.arange(500) * 53 % 241 + 5).tolist()
    scan = (np.arange(32) * 29 % 241 + 5).tolist()
    with Model(quantized("qwen3", "q8_0"), n_gpu_layers=-1) as model:
        rows = {}
        for width in (1, 4, 8):
            ctx = Context(model, n_ctx=1024, n_batch=512, flash_attn=True)
            batch = Batch(512)
            batch.add_tokens(prefix, 0, logits="last")  # > 64 tokens: the fast path, the same in every context
            ctx.decode(batch)
            out = []
            for start in range(0, len(scan), width):
                batch.clear()
                batch.add_tokens(scan[start:start + width], len(prefix) + start, logits="all")
                ctx.decode(batch)
                out.append(ctx.all_logits().copy())
            ctx.close()
            rows[width] = np.concatenate(out)
        for width in (4, 8):
            np.testing.assert_array_equal(rows[width], rows[1], err_msg=f"width {width}")


PROMPTS = [[1, 17, 42, 99, 3, 250, 7], (np.arange(20) * 37 % 251 + 1).tolist(), [200, 13, 5]]


@pytest.mark.parametrize("arch", ARCHS)
def test_speculative_greedy_equals_plain_greedy_on_the_gpu(make_model, arch):
    """Verify batches of every width from 2 to 8 (n_draft 1..7 spread over the prompts), each drafter right for
    a different number of its drafts, so rounds accept all, some and none."""
    with Model(make_model(arch=arch, n_layer=3), n_gpu_layers=-1) as model:
        for i, prompt in enumerate(PROMPTS):
            plain_ctx = gpu_context(model)
            expected = generate(plain_ctx, prompt, max_tokens=64, stop_at_eog=False).tokens
            plain_ctx.close()
            for n_draft in range(1 + i, 8, len(PROMPTS)):
                right = (3 * n_draft + i) % (n_draft + 1)
                drafter = drafters.prefix(list(prompt) + list(expected), model.n_vocab, right, block_size=7)
                ctx = Context(model, n_ctx=256, n_batch=16, flash_attn=True,
                              n_rs_seq=Speculator.target_rs_seq(n_draft))
                spec = Speculator(ctx, drafter, n_draft=n_draft)
                steps = list(spec.run(np.asarray(prompt, dtype=np.int32), max_tokens=64, stop_at_eog=False))
                ctx.close()
                tokens = [t for s in steps for t in s.tokens]
                assert tokens == list(expected), f"{arch} n_draft={n_draft} right={right} prompt={prompt[:3]}"
                assert any(s.n_draft == n_draft for s in steps), f"no verify of {n_draft + 1} rows"


def test_a_converted_dspark_drafter_on_the_gpu_keeps_output_exact(make_pair):
    from pyllama_dspark.drafter import DSparkDrafter
    from pyllama_dspark.testing import TinySpec

    pair = make_pair(TinySpec(arch="llama", n_layer=3), block_size=4)
    with Model(pair.target, n_gpu_layers=-1) as model:
        for prompt in PROMPTS:
            plain_ctx = gpu_context(model)
            expected = generate(plain_ctx, prompt, max_tokens=64, stop_at_eog=False).tokens
            plain_ctx.close()
            ctx = Context(model, n_ctx=256, n_batch=16, flash_attn=True)
            drafter = DSparkDrafter(pair.drafter, ctx, n_gpu_layers=-1)
            spec = Speculator(ctx, drafter, n_draft=4)
            tokens = [t for s in spec.run(np.asarray(prompt, dtype=np.int32), max_tokens=64, stop_at_eog=False)
                      for t in s.tokens]
            ctx.close()
            assert tokens == list(expected), f"prompt={prompt[:3]}"


def test_a_gpu_target_without_the_mode_warns_once(make_model, monkeypatch):
    import pyllama_dspark.speculative as speculative

    monkeypatch.setattr(speculative, "_warned_inexact_verify", False)
    with Model(make_model(arch="llama", n_layer=3), n_gpu_layers=-1) as model:
        ctx = gpu_context(model, consistent=False)
        drafter = drafters.never([1] * 8, model.n_vocab)
        with pytest.warns(UserWarning, match="consistent_numerics=False"):
            Speculator(ctx, drafter, n_draft=2)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            Speculator(ctx, drafter, n_draft=2)  # once per process
        ctx.set_consistent_numerics(True)
        ctx.close()


def test_the_mode_is_refused_on_the_gpu_without_flash_attention(make_model):
    from pyllama_dspark import UnsupportedModeError

    with Model(make_model(arch="llama", n_layer=3), n_gpu_layers=-1) as model:
        with pytest.raises(UnsupportedModeError, match="flash attention is off on a GPU"):
            Context(model, n_ctx=64, flash_attn=False)
        Context(model, n_ctx=64, flash_attn=False, consistent_numerics=False).close()
