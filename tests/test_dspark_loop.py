"""End to end: a tiny DSpark drafter (HF checkpoint -> our converter -> GGUF) speculating for tiny llama,
qwen3 and qwen35 targets, and qwen2, whose taps are its graph's "l_out" tensors (patch 0027): the output is
plain greedy decoding, token for token."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import ARCHS
from pyllama_dspark import Context, Model, generate
from pyllama_dspark.convert.converter import convert
from pyllama_dspark.drafter import DSparkDrafter
from pyllama_dspark.speculative import Speculator
from pyllama_dspark.stats import SpecStats
from pyllama_dspark.testing import TinySpec, tiny_model, write_tiny_dspark_checkpoint

BLOCK = 7
PROMPTS = [
    [1, 17, 42, 99, 3, 250, 7],
    [5, 5, 5, 5],
    (np.arange(40) * 37 % 251 + 1).tolist(),  # longer than n_batch: chunked prefill
    [200, 13],
    [9, 8, 7, 6, 5, 4, 3, 2, 1, 100, 101],
]
N_TOKENS = 128


@pytest.fixture(scope="module", params=[*ARCHS, "qwen2"])
def target_and_drafter(request, model_dir, tmp_path_factory):
    spec = TinySpec(arch=request.param, n_layer=3)
    target = tiny_model(spec, cache_dir=model_dir)
    folder = tmp_path_factory.mktemp(f"dspark-{request.param}")
    ck = write_tiny_dspark_checkpoint(folder / "ck", target=spec, block_size=BLOCK, dtype="bf16",
                                      target_cache_dir=model_dir)
    drafter = convert(ck, folder / "drafter.gguf", target_gguf=target).path
    return request.param, target, drafter


@pytest.mark.parametrize("n_draft", [1, 4, BLOCK])
def test_dspark_output_equals_plain_greedy(target_and_drafter, n_draft):
    arch, target_path, drafter_path = target_and_drafter
    with Model(target_path) as model:
        for prompt in PROMPTS:
            plain_ctx = Context(model, n_ctx=512, n_batch=16, n_ubatch=8)
            expected = generate(plain_ctx, prompt, max_tokens=N_TOKENS, stop_at_eog=False).tokens
            plain_ctx.close()
            # n_ubatch 10: a verify of B + 1 = 8 rows fits, the 16-token prefill chunks cross ubatches
            ctx = Context(model, n_ctx=512, n_batch=16, n_ubatch=10, n_rs_seq=Speculator.target_rs_seq(n_draft))
            drafter = DSparkDrafter(drafter_path, ctx)
            stats = SpecStats()
            steps = Speculator(ctx, drafter, n_draft=n_draft).run(np.asarray(prompt), max_tokens=N_TOKENS,
                                                                  stop_at_eog=False, stats=stats)
            tokens = [t for step in steps for t in step.tokens]
            drafter.close()
            ctx.close()
            assert tokens == expected, f"{arch} n_draft={n_draft} prompt={prompt[:4]}"
            assert stats.drafted > 0 and stats.rounds > 0


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_reduced_vocabulary_dspark_output_equals_plain_greedy(model_dir, tmp_path, arch):
    """A drafter with its own head over 120 of the 256 ids (d2t): drafts only those, output still exact."""
    spec = TinySpec(arch=arch, n_layer=3)
    target = tiny_model(spec, cache_dir=model_dir)
    ck = write_tiny_dspark_checkpoint(tmp_path / "ck", target=spec, block_size=4, dtype="f32",
                                      target_cache_dir=model_dir, draft_vocab_size=120)
    drafter_path = convert(ck, tmp_path / "drafter.gguf", target_gguf=target).path
    with Model(target) as model:
        for prompt in PROMPTS[:3]:
            plain_ctx = Context(model, n_ctx=512, n_batch=16)
            expected = generate(plain_ctx, prompt, max_tokens=64, stop_at_eog=False).tokens
            plain_ctx.close()
            ctx = Context(model, n_ctx=512, n_batch=16, n_rs_seq=Speculator.target_rs_seq(4))
            drafter = DSparkDrafter(drafter_path, ctx)
            assert drafter.info.n_vocab_draft == 120
            stats = SpecStats()
            steps = Speculator(ctx, drafter, n_draft=4).run(np.asarray(prompt), max_tokens=64, stop_at_eog=False,
                                                            stats=stats)
            tokens = [t for step in steps for t in step.tokens]
            drafter.close()
            ctx.close()
            assert tokens == expected, f"{arch} prompt={prompt[:4]}"
            assert stats.drafted > 0
