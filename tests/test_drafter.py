"""The native DSpark drafter against the numpy reference, its index conventions and its checks."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import dspark_reference as ref
from conftest import copy_with_value
from pyllama_dspark import Batch, Context, Model
from pyllama_dspark.convert.converter import convert
from pyllama_dspark.drafter import DrafterError, DSparkDrafter, PromptLookupDrafter
from pyllama_dspark.testing import TinySpec, load_tiny_weights, tiny_model, write_tiny_dspark_checkpoint

TARGET = TinySpec(arch="llama", n_layer=3)


@pytest.fixture(scope="module")
def target_path(model_dir):
    return tiny_model(TARGET, cache_dir=model_dir)


@pytest.fixture(scope="module")
def make_drafter(model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("drafters")
    cache = {}

    def build(**options):
        key = tuple(sorted(options.items()))
        if key not in cache:
            name = "-".join(f"{k}{v}" for k, v in key) or "default"
            ck = write_tiny_dspark_checkpoint(folder / f"ck-{name}", target=TARGET, dtype="f32",
                                              target_cache_dir=model_dir, **options)
            out = folder / f"drafter-{name}.gguf"
            convert(ck, out, outtype="f32", target_gguf=tiny_model(TARGET, cache_dir=model_dir))
            cache[key] = out
        return cache[key]

    return build


@contextlib.contextmanager
def prefilled(target_path, drafter_path, n_context):
    """A drafter that has observed the target's capture rows of an n_context-token prompt: (drafter, rows)."""
    prompt = (np.arange(n_context) * 37 % 250 + 1).tolist()
    with Model(target_path) as model:
        ctx = Context(model, n_ctx=256, n_batch=64)
        drafter = DSparkDrafter(drafter_path, ctx)
        ctx.set_capture_layers(drafter.capture_layers, masked=False)
        batch = Batch(64)
        batch.add_tokens(prompt, 0, logits="last")
        ctx.decode(batch)
        rows = ctx.capture().copy()
        drafter.observe(np.array(prompt), rows, 0)
        try:
            yield drafter, rows
        finally:
            drafter.close()


def reference(target_path, drafter_path, rows, info, anchor=77, prev_tokens=None):
    weights = load_tiny_weights(target_path)
    return ref.draft_forward(drafter_path, features=rows, anchor=anchor, mask_token=info.mask_token,
                             block_size=info.block_size, target_token_embd=weights["token_embd.weight"],
                             target_output=weights["output.weight"], prev_tokens=prev_tokens)


def native_and_reference(target_path, drafter_path, n_context, anchor=77):
    """The native block and the reference's, the reference's Markov chain forced through the native tokens:
    one near-tied argmax (float32 against float64) then changes one token, not every later slot."""
    with prefilled(target_path, drafter_path, n_context) as (drafter, rows):
        draft = drafter.propose(anchor, n_context)
        expected = reference(target_path, drafter_path, rows, drafter.info, anchor,
                             prev_tokens=draft.tokens.tolist())
        return draft, expected, drafter.info


def rel_err(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


DECISIVE_MARGIN = 1e-2


def assert_decisive_tokens_match(tokens, expected_logits):
    """Each native token is the reference's argmax wherever the reference's top two logits are at least
    DECISIVE_MARGIN apart (closer ones may round either way in float32)."""
    top_two = np.sort(expected_logits, axis=1)[:, -2:]
    decisive = top_two[:, 1] - top_two[:, 0] >= DECISIVE_MARGIN
    assert decisive.sum() >= len(decisive) // 2, "most slots must be decisive, or the check says little"
    np.testing.assert_array_equal(np.asarray(tokens)[decisive], np.argmax(expected_logits, axis=1)[decisive],
                                  err_msg="a native slot token is not the reference's clear argmax")


@pytest.mark.parametrize("block_size", [4, 7])
@pytest.mark.parametrize("confidence_head", [True, False])
@pytest.mark.parametrize("markov_rank", [0, 8])
def test_slot_logits_match_the_numpy_reference(target_path, make_drafter, block_size, confidence_head, markov_rank):
    path = make_drafter(block_size=block_size, confidence_head=confidence_head and markov_rank > 0,
                        markov_rank=markov_rank)
    for n_context in (3, 17, 40):
        draft, expected, info = native_and_reference(target_path, path, n_context)
        assert len(draft.tokens) == block_size  # anchor-first: B drafts from a block of B
        assert rel_err(draft.logits, expected.logits) < 1e-3
        assert_decisive_tokens_match(draft.tokens, expected.logits)
        if info.has_confidence:
            np.testing.assert_allclose(draft.confidence, expected.confidence, atol=1e-3)


@pytest.mark.parametrize("block_size", [4, 7])
def test_a_short_draft_computes_only_its_slots_and_matches_the_full_blocks_first_slots(target_path, make_drafter,
                                                                                       block_size):
    """propose(n_max=k) flags the first k slots (patch 0009 runs the heads on those rows only): k logit rows,
    k confidences, equal to the reference's first k slots, for every k."""
    path = make_drafter(block_size=block_size, confidence_head=True, markov_rank=8)
    with prefilled(target_path, path, 17) as (drafter, rows):
        full = drafter.propose(77, 17)
        expected = reference(target_path, path, rows, drafter.info, prev_tokens=full.tokens.tolist())
        for k in range(1, block_size + 1):
            draft = drafter.propose(77, 17, k)
            assert draft.logits.shape[0] == len(draft.tokens) == len(draft.confidence) == k
            assert rel_err(draft.logits, expected.logits[:k]) < 1e-3
            assert draft.tokens.tolist() == full.tokens[:k].tolist()
            assert_decisive_tokens_match(draft.tokens, expected.logits[:k])
            np.testing.assert_allclose(draft.confidence, expected.confidence[:k], atol=1e-3)
        with pytest.raises(ValueError):
            drafter.propose(77, 17, 0)


def test_markov_chain_uses_the_chosen_previous_token(target_path, make_drafter):
    """A graph that biased every slot with the block's input ids (anchor, then mask) would match this
    alternative reference, not the real one."""
    path = make_drafter(block_size=4, markov_rank=8)
    with prefilled(target_path, path, 12) as (drafter, rows):
        draft, info = drafter.propose(77, 12), drafter.info
    expected = reference(target_path, path, rows, info)
    wrong = reference(target_path, path, rows, info, prev_tokens=[info.mask_token] * 3)
    assert rel_err(draft.logits, expected.logits) < 1e-3
    assert rel_err(draft.logits[1:], wrong.logits[1:]) > 1e-2


def test_capture_ids_are_gguf_taps_minus_one(target_path, make_drafter):
    """GGUF dflash.target_layers are layer inputs (HF id + 1); the capture API takes outputs (HF id).
    Feeding the drafter the rows of the neighbouring layers changes its logits: an off-by-one would show."""
    path = make_drafter(block_size=4, markov_rank=8)
    with Model(target_path) as model, Model(path) as drafter_model:
        taps = drafter_model.target_layers
        ctx = Context(model, n_ctx=64)
        drafter = DSparkDrafter(path, ctx)
        assert drafter.capture_layers == [t - 1 for t in taps]
        drafter.close()
    with prefilled(target_path, path, 12) as (drafter, rows):
        draft, info = drafter.propose(77, 12), drafter.info
    expected = reference(target_path, path, rows, info)
    shifted = reference(target_path, path, np.roll(rows, 1, axis=1), info)
    assert rel_err(draft.logits, expected.logits) < 1e-3
    assert rel_err(draft.logits, shifted.logits) > 1e-2


def test_incompatible_target_is_refused(make_drafter, model_dir, tmp_path):
    path = make_drafter(block_size=4, markov_rank=8)
    for other, message in ((TinySpec(arch="llama", n_layer=3, n_embd=128), "fc expects feature rows"),
                           (TinySpec(arch="llama", n_layer=3, n_vocab=300), "vocabulary size 256 differs"),
                           (TinySpec(arch="llama", n_layer=1), "outside the target's 1..1")):
        with Model(tiny_model(other, cache_dir=model_dir)) as model:
            ctx = Context(model, n_ctx=64)
            with pytest.raises(DrafterError, match=message):
                DSparkDrafter(path, ctx)
    # the target's vocabulary is 0..255
    outside = copy_with_value(path, tmp_path / "mask-outside.gguf", "tokenizer.ggml.mask_token_id", 256)
    with Model(tiny_model(TARGET, cache_dir=model_dir)) as model:
        ctx = Context(model, n_ctx=64)
        with pytest.raises(DrafterError, match="not a DFlash"):
            DSparkDrafter(tiny_model(TARGET, cache_dir=model_dir), ctx)
        with pytest.raises(DrafterError, match="mask token 256 is not in the vocabulary"):
            DSparkDrafter(outside, ctx)


def test_sampled_drafts_chain_the_markov_bias_through_the_drawn_tokens(target_path, make_drafter):
    """With temperature > 0 each slot's q must be conditioned on the token actually drawn at the previous
    slot (not the graph's greedy chain)."""
    from pyllama_dspark.sampling import Sampler, SamplingParams, probabilities

    path = make_drafter(block_size=4, markov_rank=8)
    params = SamplingParams(temperature=1.5, seed=11)
    sampler, differs = Sampler(params), False
    with prefilled(target_path, path, 12) as (drafter, rows):
        for _ in range(5):
            draft = drafter.propose(77, 12, sampler=sampler)
            expected = reference(target_path, path, rows, drafter.info, prev_tokens=draft.tokens[:-1].tolist())
            assert rel_err(draft.logits, expected.logits) < 1e-3
            q = np.stack([probabilities(row, params) for row in expected.logits])
            np.testing.assert_allclose(draft.probs, q, atol=1e-3)
            differs |= draft.tokens[:-1].tolist() != expected.tokens[:-1]
    assert differs, "no draw left the greedy chain: the test did not exercise the re-chaining"


# --- a reduced draft vocabulary (d2t): its own head rows, scattered to the target's ids -------------------

def draft_ids(path) -> np.ndarray:
    import gguf

    return np.array(next(t for t in gguf.GGUFReader(path).tensors if t.name == "d2t").data, dtype=np.int64)


def test_a_reduced_vocabulary_drafter_matches_the_reference_and_drafts_only_its_tokens(target_path, make_drafter):
    path = make_drafter(block_size=4, markov_rank=8, draft_vocab_size=100)
    ids = draft_ids(path)
    outside = np.setdiff1d(np.arange(256), ids)
    for n_context in (3, 17, 40):
        draft, expected, info = native_and_reference(target_path, path, n_context)
        assert info.n_vocab_draft == 100
        assert np.isneginf(draft.logits[:, outside]).all() and np.isfinite(draft.logits[:, ids]).all()
        assert rel_err(draft.logits[:, ids], expected.logits[:, ids]) < 1e-3
        assert set(draft.tokens.tolist()) <= set(ids.tolist())
        assert_decisive_tokens_match(draft.tokens, expected.logits)


def test_a_reduced_vocabulary_drafter_samples_with_q_zero_outside_its_tokens(target_path, make_drafter):
    """T > 0: q is the softmax of the chained logits over the draft vocabulary, exactly 0 elsewhere (rejection
    sampling then never accepts a token the drafter cannot propose, and stays exact)."""
    from pyllama_dspark.sampling import Sampler, SamplingParams, probabilities

    path = make_drafter(block_size=4, markov_rank=8, draft_vocab_size=100)
    ids = draft_ids(path)
    outside = np.setdiff1d(np.arange(256), ids)
    params = SamplingParams(temperature=1.5, seed=3)
    sampler, differs = Sampler(params), False
    with prefilled(target_path, path, 12) as (drafter, rows):
        for _ in range(5):
            draft = drafter.propose(77, 12, sampler=sampler)
            assert (draft.probs[:, outside] == 0).all() and set(draft.tokens.tolist()) <= set(ids.tolist())
            expected = reference(target_path, path, rows, drafter.info, prev_tokens=draft.tokens[:-1].tolist())
            assert rel_err(draft.logits[:, ids], expected.logits[:, ids]) < 1e-3
            q = np.stack([probabilities(row, params) for row in expected.logits])
            np.testing.assert_allclose(draft.probs, q, atol=1e-3)
            differs |= draft.tokens[:-1].tolist() != expected.tokens[:-1]
    assert differs, "no draw left the greedy chain: the test did not exercise the re-chaining"


def _edit_d2t(src, dst, edit):
    """A copy of the GGUF at src whose d2t values are changed in place by edit(array)."""
    import shutil

    import gguf

    shutil.copy(src, dst)
    edit(next(t for t in gguf.GGUFReader(dst, "r+").tensors if t.name == "d2t").data)
    return dst


@pytest.mark.parametrize("case, edit, message", [
    ("repeated id", lambda d: d.__setitem__(1, d[0]), "maps two draft tokens to the same target id"),
    ("id beyond the vocabulary", lambda d: d.__setitem__(-1, 256), r"outside \[0, 256\)"),
    ("negative id", lambda d: d.__setitem__(0, -1), r"outside \[0, 256\)"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_a_malformed_d2t_is_refused_before_any_decode(target_path, make_drafter, tmp_path, case, edit, message):
    """llama.cpp would scatter through d2t unchecked: out of range writes outside the logits."""
    path = _edit_d2t(make_drafter(block_size=4, markov_rank=8, draft_vocab_size=100), tmp_path / "bad.gguf", edit)
    with Model(target_path) as model:
        ctx = Context(model, n_ctx=64)
        with pytest.raises(DrafterError, match=message):
            DSparkDrafter(path, ctx)


def test_a_d2t_holding_the_mask_token_is_refused(target_path, make_drafter, tmp_path):
    path = make_drafter(block_size=4, markov_rank=8, draft_vocab_size=100)
    with Model(target_path) as model:
        ctx = Context(model, n_ctx=64)
        mask = DSparkDrafter(path, ctx).info.mask_token
        bad = _edit_d2t(path, tmp_path / "mask.gguf", lambda d: d.__setitem__(-1, mask))
        with pytest.raises(DrafterError, match=f"d2t contains the mask token {mask}"):
            DSparkDrafter(bad, ctx)


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    d = PromptLookupDrafter(ngram_max=2, block_size=3)
    d.observe(np.array([5, 6, 7, 8, 5, 6, 9, 1, 2]), None, 0)
    # the text is tokens[:pos] + [anchor] (later observed tokens are not context): [5, 6, 7, 8, 5, 6];
    # its suffix (5, 6) occurred at 0, followed by 7, 8, 5
    assert d.propose(6, 5, 3).tokens.tolist() == [7, 8, 5]
    assert d.propose(6, 7, 3).tokens.tolist() == [9, 6]  # [.., 5, 6, 9, 6]: (9, 6) none; (6,) latest at 5
    assert d.propose(7, 2, 3).tokens.tolist() == []  # (6, 7) and (7,) occur nowhere earlier in [5, 6, 7]
    d.observe(np.array([7]), None, 3)  # a later observe at pos 3 replaces what followed
    assert d.propose(5, 4, 2).tokens.tolist() == [6, 7]  # [5, 6, 7, 7, 5]: (7, 5) none, (5,) at 0 -> 6, 7
    d.reset()
    assert d.propose(1, 0, 2).tokens.tolist() == []
    with pytest.raises(ValueError):
        PromptLookupDrafter(ngram_min=3, ngram_max=2)
    with pytest.raises(ValueError):
        d.observe(np.array([1]), None, 5)  # a gap in the positions


def _lookup_by_windows(tokens: list[int], anchor: int, pos: int, n_max: int, ngram_max: int, ngram_min: int):
    """Prompt lookup as first written: every n-gram window of the text compared with its suffix."""
    text = np.asarray(tokens[:pos] + [anchor], dtype=np.int64)
    for n in range(min(ngram_max, len(text) - 1), ngram_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(text[:-1], n)
        hits = np.flatnonzero((windows == text[-n:]).all(axis=1))
        if hits.size:
            return text[int(hits[-1]) + n:int(hits[-1]) + n + n_max].tolist()
    return []


@pytest.mark.parametrize("ngram_min, ngram_max", [(1, 3), (2, 4), (1, 1)])
def test_prompt_lookup_proposes_what_the_window_search_proposes(ngram_min, ngram_max):
    """The search from the occurrences of the last token (no text rebuilt per round) against every window
    compared, on random texts of a few distinct tokens (many matches of every length), with rollbacks and a
    text long enough to grow the buffer."""
    rng = np.random.default_rng(ngram_min * 10 + ngram_max)
    d = PromptLookupDrafter(ngram_min=ngram_min, ngram_max=ngram_max, block_size=5)
    tokens: list[int] = []
    for _ in range(300):
        pos = int(rng.integers(max(0, len(tokens) - 3), len(tokens) + 1))  # now and then a rollback
        new = rng.integers(0, 4, size=int(rng.integers(1, 9))).tolist()
        d.observe(np.array(new), None, pos)
        tokens = tokens[:pos] + new
        assert d.tokens == tokens
        anchor, at = int(rng.integers(0, 4)), int(rng.integers(0, len(tokens) + 1))
        n_max = int(rng.integers(1, 7))
        assert d.propose(anchor, at, n_max).tokens.tolist() == \
            _lookup_by_windows(tokens, anchor, at, min(n_max, 5), ngram_max, ngram_min)
    assert len(tokens) > 256


def test_prompt_lookup_in_the_loop_matches_plain_greedy(target_path):
    from pyllama_dspark import Speculator, generate

    prompt = [3, 4, 5, 6] * 6
    with Model(target_path) as model:
        ctx = Context(model, n_ctx=256)
        expected = generate(ctx, prompt, max_tokens=48, stop_at_eog=False).tokens
        for n_draft in (None, 3):
            spec = Speculator(ctx, PromptLookupDrafter(block_size=4), n_draft=n_draft)
            steps = list(spec.run(np.array(prompt, dtype=np.int32), max_tokens=48, stop_at_eog=False))
            assert [t for s in steps for t in s.tokens] == expected


def test_observations_in_pieces_with_stale_overwrites_inject_what_one_observation_would(target_path, make_drafter):
    """Observed rows wait (as a list of pieces) until the next propose: pieces at the end extend them, a piece at an
    earlier position replaces what was observed there and after. The drafter then drafts exactly as if the final
    rows had been observed at once."""
    rng = np.random.default_rng(0)
    with Model(target_path) as model:
        ctx = Context(model, n_ctx=256, n_batch=64)
        pieces, whole = DSparkDrafter(make_drafter(), ctx), DSparkDrafter(make_drafter(), ctx)
        try:
            rows = rng.standard_normal((30, pieces.width)).astype(np.float32)
            stale = rng.standard_normal((8, pieces.width)).astype(np.float32)
            tokens = np.arange(30, dtype=np.int32) % 200 + 1
            pieces.observe(tokens[:10], rows[:10], 0)
            pieces.observe(tokens[10:16], stale[:6], 10)     # rejected later: replaced from 12 and from 10
            pieces.observe(tokens[12:20], stale[:8], 12)
            pieces.observe(tokens[10:20], rows[10:20], 10)
            pieces.observe(tokens[20:23], rows[20:23], 20)
            pieces.observe(tokens[22:30], rows[22:30], 22)   # overlaps the last piece by one row
            whole.observe(tokens, rows, 0)
            a, b = pieces.propose(7, 30), whole.propose(7, 30)
            np.testing.assert_array_equal(a.logits, b.logits)
            np.testing.assert_array_equal(a.tokens, b.tokens)
        finally:
            pieces.close()
            whole.close()
