"""Continuous batching (issue 25): several sequences share every decode, and each one's greedy output is its solo
plain greedy output, token for token; at T > 0 each sequence's tokens follow the target (chi-square)."""

from __future__ import annotations

import collections

import numpy as np
import pytest

import pyllama_dspark
from pyllama_dspark import CancelToken, Context, DSparkDrafter, Model, PromptLookupDrafter, generate, quantize
from pyllama_dspark.batching import BatchRequest, BatchScheduler
from pyllama_dspark.sampling import Sampler, SamplingParams
from pyllama_dspark.testing import TinySpec, tiny_model, write_tiny_dspark_checkpoint

from test_hybrid import static_costs
from test_rejection import (E2E_PROMPT, E2E_TARGET, chi2_critical, exact_conditionals, exact_joint_2_3,
                            pooled_chi_square)

pytestmark = pytest.mark.timeout(600)

PROMPTS = ["The quick brown fox", "Once upon a time " * 24, "Hello", "A B C D E F G", "In a land far away, there",
           "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12", "Why?"]


def spec(arch: str) -> TinySpec:
    return TinySpec(arch=arch, n_layer=3, vocab="llama-spm")


@pytest.fixture(scope="module")
def quantized_pair(make_pair, tmp_path_factory):
    cache = {}

    def get(arch: str, qtype: str):
        if (arch, qtype) not in cache:
            pair = make_pair(spec(arch))
            target = pair.target if qtype == "f32" else quantize(
                pair.target, tmp_path_factory.mktemp("q") / f"{arch}-{qtype}.gguf", qtype)
            cache[arch, qtype] = (target, pair.drafter)
        return cache[arch, qtype]

    return get


def solo_plain(model, prompts, max_tokens, *, n_ctx, n_batch, stop_at_eog=False):
    ctx = Context(model, n_ctx=n_ctx, n_batch=n_batch, n_rs_seq=4 if model.is_hybrid else 0)
    try:
        return [generate(ctx, p, max_tokens=m, stop_at_eog=stop_at_eog) for p, m in zip(prompts, max_tokens)]
    finally:
        ctx.close()


@pytest.mark.parametrize("arch,qtype", [("llama", "f32"), ("qwen3", "f32"), ("qwen35", "f32"), ("llama", "q8_0"),
                                        ("qwen35", "q4_0")])
@pytest.mark.parametrize("drafting", ["plain", "dspark-fixed", "dspark-cost-aware", "hybrid-cost-aware"])
def test_every_sequence_equals_its_solo_plain_greedy_output(quantized_pair, arch, qtype, drafting):
    """7 prompts of 2 to ~100 tokens (prefilled in chunks of 32), 4 sequences at a time, different max_tokens, so
    sequences join and leave at different steps; one prompt ends at the end of its context, one is cancelled.
    The hybrid run also drafts from each sequence's own prompt lookup (block 4: the hybrid target's rollback
    snapshots); on this 32k vocabulary its random outputs rarely repeat, the next test is where lookup drafts."""
    target, drafter_path = quantized_pair(arch, qtype)
    max_tokens = [40, 25, 33, 8, 40, 17, 29]
    with Model(target) as model:
        refs = solo_plain(model, PROMPTS, max_tokens, n_ctx=256, n_batch=32)
        ctx = Context(model, n_ctx=256 * 4, n_seq_max=4, n_batch=32, n_rs_seq=4 if model.is_hybrid else 0)
        drafter = None if drafting == "plain" else DSparkDrafter(drafter_path, ctx)
        lookup = PromptLookupDrafter(block_size=4) if drafting.startswith("hybrid") else None
        scheduler = BatchScheduler(ctx, drafter, n_draft=3 if drafting.endswith("fixed") else None,
                                   prompt_lookup=lookup)
        tokens = [model.tokenize(p, add_special=True, parse_special=True) for p in PROMPTS]
        # the last sequence starts near the end of its context: it must stop with "n_ctx" where solo would
        long = np.concatenate([tokens[1]] * 3)[: ctx.n_ctx_seq - 12]
        long_ref = solo_plain(model, [long], [40], n_ctx=256, n_batch=32)[0]
        cancel = CancelToken()
        handles = [scheduler.submit(BatchRequest(t, m, stop_at_eog=False)) for t, m in zip(tokens, max_tokens)]
        handles.append(scheduler.submit(BatchRequest(long, 40, stop_at_eog=False)))
        handles.append(scheduler.submit(BatchRequest(tokens[0], 40, stop_at_eog=False, cancel=cancel)))
        steps = 0
        while not all(h.finished for h in handles):
            scheduler.step()
            steps += 1
            if handles[-1].seq_id is not None and len(handles[-1].tokens) >= 5:
                cancel.cancel()
        for handle, ref in zip(handles, refs):
            assert handle.result.tokens == ref.tokens, (PROMPTS[handles.index(handle)], drafting)
            assert handle.result.stop_reason == "max_tokens"
        assert handles[-2].result.tokens == long_ref.tokens and handles[-2].result.stop_reason == "n_ctx"
        cancelled = handles[-1].result
        assert cancelled.stop_reason == "cancelled" and cancelled.tokens == refs[0].tokens[:len(cancelled.tokens)]
        assert scheduler.idle and all(ctx.seq_pos_max(i) == -1 for i in range(4))  # every sequence's KV freed
        if drafting != "plain":
            assert sum(h.result.stats.rounds for h in handles) > 0
        scheduler.close()
        if drafter is not None:
            drafter.close()
        ctx.close()


LOOKUP_PROMPTS = [[1, 17, 42, 99, 3, 250, 7] * 3, (np.arange(12) * 37 % 251 + 1).tolist() * 3, [5, 6, 7, 8] * 5,
                  [200, 100, 50, 25], [9, 8, 7, 6, 5] * 4]


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
@pytest.mark.parametrize("drafting", ["lookup-fixed", "hybrid-fixed", "hybrid-cost-aware"])
def test_prompt_lookup_drafts_in_the_batch_and_every_sequence_equals_its_solo_plain_greedy_output(make_pair, arch,
                                                                                                  drafting):
    """A small vocabulary, where the outputs repeat their prompts and themselves: each sequence's prompt lookup
    drafts and is accepted. With a fixed n_draft, lookup drafts wherever it matches and the DSpark drafter
    elsewhere; cost-aware, each sequence's chooser picks (with test_hybrid's static costs). 5 prompts, 4 at a
    time (one joins later), prompts longer than n_batch (chunked prefill)."""
    pair = make_pair(TinySpec(arch=arch, n_layer=3 if arch == "qwen35" else 2))
    n_tokens = 64
    with Model(pair.target) as model:
        refs = solo_plain(model, LOOKUP_PROMPTS, [n_tokens] * len(LOOKUP_PROMPTS), n_ctx=512, n_batch=16)
        ctx = Context(model, n_ctx=512 * 4, n_seq_max=4, n_batch=16, n_rs_seq=8 if model.is_hybrid else 0)
        drafter = DSparkDrafter(pair.drafter, ctx) if drafting.startswith("hybrid") else None
        scheduler = BatchScheduler(ctx, drafter, n_draft=4 if drafting.endswith("fixed") else None,
                                   prompt_lookup=PromptLookupDrafter())
        handles = [scheduler.submit(BatchRequest(np.asarray(p, dtype=np.int32), n_tokens, stop_at_eog=False))
                   for p in LOOKUP_PROMPTS]
        for handle in handles:
            if handle.chooser is not None:
                static_costs(handle.chooser)  # decisions on acceptance alone: a tiny model's timings are noise
        while not all(h.finished for h in handles):
            scheduler.step()
        results = [h.result for h in handles]
        assert [r.tokens for r in results] == [r.tokens for r in refs]
        drafted, accepted = collections.Counter(), collections.Counter()
        for result in results:
            for name, counts in result.stats.by_source.items():
                drafted[name] += counts.drafted
                accepted[name] += counts.accepted
        assert accepted["lookup"] > 0, (drafted, accepted)
        if drafting == "lookup-fixed":
            assert set(drafted) == {"lookup"}
        if drafting == "hybrid-fixed":
            assert drafted["dspark"] > 0
        scheduler.close()
        if drafter is not None:
            drafter.close()
        ctx.close()


class _PassBoundCosts:
    """A verify cost model whose passes cost far more than rows (a small target's on a CPU, exaggerated), known
    from the start: a round then takes more passes than it must only for as many more tokens expected."""

    def observe(self, *args, **kwargs) -> None:
        pass

    def coefficients(self) -> np.ndarray:
        return np.array([1.0, 1e-6, 0.0])

    def share(self, seconds, rows, total_rows, n_sequences, cells, passes_share=None) -> float:
        return seconds * rows / total_rows


def test_common_cap_takes_a_further_pass_only_for_its_tokens_and_the_output_stays_exact(make_pair):
    """Issue 34: the scheduler caps every sequence's draft at one length for the batch where a further pass would
    not pay; drafts it drops are scored against the committed token (the dropped DSpark drafts keep its chooser's
    acceptance measured), and the output still equals solo plain greedy."""
    from pyllama_dspark.batching import ubatch_passes

    pair = make_pair(TinySpec(arch="llama", n_layer=2))
    n_tokens = 48
    with Model(pair.target) as model:
        refs = solo_plain(model, LOOKUP_PROMPTS[:4], [n_tokens] * 4, n_ctx=512, n_batch=16)
        ctx = Context(model, n_ctx=384 * 4, n_seq_max=4, n_batch=32)
        drafter = DSparkDrafter(pair.drafter, ctx)
        scheduler = BatchScheduler(ctx, drafter, prompt_lookup=PromptLookupDrafter())
        scheduler.verify_costs = _PassBoundCosts()
        verifies, decode = [], ctx.decode

        def recording_decode(batch):
            rows = collections.Counter(int(s) for s in batch.seq_ids)
            if len(rows) > 1:
                fewest = len(ubatch_passes([(seq, 1) for seq in sorted(rows)], ctx.n_ubatch))  # no drafts at all
                verifies.append((len(ubatch_passes(sorted(rows.items()), ctx.n_ubatch)), fewest, len(rows),
                                 batch.n_tokens - len(rows)))
            return decode(batch)

        ctx.decode = recording_decode
        handles = [scheduler.submit(BatchRequest(np.asarray(p, dtype=np.int32), n_tokens, stop_at_eog=False))
                   for p in LOOKUP_PROMPTS[:4]]
        scored = collections.Counter()
        for handle in handles:
            static_costs(handle.chooser)
            observe_free = handle.chooser.observe_free

            def counting(source, proposed, committed, observe_free=observe_free):
                scored[source] += 1
                observe_free(source, proposed, committed)

            handle.chooser.observe_free = counting
        while not all(h.finished for h in handles):
            scheduler.step()
        assert [h.result.tokens for h in handles] == [r.tokens for r in refs]
        # (tokens expected) / passes must beat n_seqs / fewest passes, and a draft row adds at most one token
        assert all(drafted >= n_seqs * (passes / fewest - 1) for passes, fewest, n_seqs, drafted in verifies), \
            verifies
        assert any(drafted for _, _, _, drafted in verifies)  # drafts were verified
        assert any(passes == fewest and drafted for passes, fewest, _, drafted in verifies)  # some sharing a pass
        assert scored["dspark"] > 0  # only a dropped DSpark draft is scored free (its proposal is not in hand)
        scheduler.close()
        drafter.close()
        ctx.close()


def test_generate_batch_equals_generate_and_keeps_order(make_pair):
    pair = make_pair(spec("llama"))
    with pyllama_dspark.load(pair.target, drafter=pair.drafter, n_ctx=256, n_batch=32, n_draft=3) as llm:
        solo = [llm.generate(p, max_tokens=20) for p in PROMPTS]
        for parallel in (1, 3, 8):
            batch = llm.generate_batch(PROMPTS, parallel=parallel, max_tokens=20)
            assert [r.tokens for r in batch] == [r.tokens for r in solo], parallel
            assert [r.text for r in batch] == [r.text for r in solo]
        stopped = llm.generate_batch(PROMPTS[:2], max_tokens=20, stop=solo[0].text[3:6])
        assert stopped[0].stop_reason == "stop" and stopped[0].text == solo[0].text[:solo[0].text.index(
            solo[0].text[3:6])]
        assert llm.generate(PROMPTS[0], max_tokens=20).tokens == solo[0].tokens  # the solo path is untouched
        with pytest.raises(TypeError, match="prompts must be a list"):
            llm.generate_batch("one prompt")
        with pytest.raises(ValueError, match="does not fit"):
            llm.generate_batch(["word " * 400])


def test_scheduler_refuses_what_it_cannot_keep_exact(make_pair):
    pair = make_pair(spec("llama"))
    with Model(pair.target) as model:
        ctx = Context(model, n_ctx=256 * 2, n_seq_max=2)
        with pytest.raises(ValueError, match="max_rows must be <= 64"):
            BatchScheduler(ctx, max_rows=65)
        drafter = DSparkDrafter(pair.drafter, ctx, n_seq_max=1)
        with pytest.raises(ValueError, match="n_seq_max=2"):
            BatchScheduler(ctx, drafter)
        drafter.close()
        with pytest.raises(TypeError, match="several sequences.*prompt_lookup="):
            BatchScheduler(ctx, pyllama_dspark.PromptLookupDrafter())
        with pytest.raises(TypeError, match="prompt_lookup must be"):
            BatchScheduler(ctx, prompt_lookup=True)
        with pytest.raises(ValueError, match=r"n_batch \(2\) must be at least n_seq_max \(4\)"):
            Context(model, n_ctx=128 * 4, n_seq_max=4, n_batch=2)  # llama.cpp would abort
        narrow = Context(model, n_ctx=128 * 4, n_seq_max=4, n_batch=4)
        scheduler = BatchScheduler(narrow, max_rows=8)
        assert scheduler.max_rows == 4  # one decode holds n_batch tokens
        scheduler.close()
        narrow.close()


@pytest.mark.statistical  # 3,000 sequences through the native paths of the greedy tests
def test_each_sequence_follows_the_target_at_temperature(model_dir, tmp_path):
    """3,000 sequences of one prompt, 8 at a time, each with its own seed, drafted 2 tokens per round by a DSpark
    drafter: generated tokens 2 and 3 follow the target's exact joint distribution."""
    sampling = dict(temperature=0.8, top_k=3)
    n_runs = 3000
    target = tiny_model(E2E_TARGET, cache_dir=model_dir)
    ck = write_tiny_dspark_checkpoint(tmp_path / "ck", target=E2E_TARGET, block_size=2, dtype="f32",
                                      target_cache_dir=model_dir)
    from pyllama_dspark.convert.converter import convert

    drafter_path = convert(ck, tmp_path / "drafter.gguf", outtype="f32", target_gguf=target).path
    with Model(target) as model:
        solo = Context(model, n_ctx=64, n_batch=16)
        expected = exact_joint_2_3(exact_conditionals(solo, E2E_PROMPT, sampling))
        ctx = Context(model, n_ctx=256 * 8, n_seq_max=8, n_batch=16)
        drafter = DSparkDrafter(drafter_path, ctx)
        scheduler = BatchScheduler(ctx, drafter, n_draft=2)
        results = scheduler.run([BatchRequest(np.array(E2E_PROMPT), 4, Sampler(SamplingParams(seed=i, **sampling)),
                                              stop_at_eog=False) for i in range(n_runs)])
        drafter.close()
    counts: dict = {}
    for r in results:
        assert len(r.tokens) == 4
        counts[tuple(r.tokens[2:])] = counts.get(tuple(r.tokens[2:]), 0) + 1
    assert sum(r.stats.accepted for r in results) > n_runs // 50  # drafts were accepted at times
    assert set(counts) <= set(expected), f"pairs the target cannot produce: {sorted(set(counts) - set(expected))}"
    stat, dof = pooled_chi_square(counts, expected, n_runs)
    assert stat < chi2_critical(dof), f"tokens 2 and 3 do not follow the target: chi2 {stat:.1f}, {dof} dof"


def test_propose_many_drafts_what_propose_drafts_for_each_sequence(make_pair):
    """One drafter decode for three sequences (different anchors, positions, lengths and histories) gives each the
    draft a decode of its own gives."""
    pair = make_pair(spec("llama"))
    rng = np.random.default_rng(0)
    with Model(pair.target) as model:
        ctx = Context(model, n_ctx=256 * 3, n_seq_max=3)
        drafter = DSparkDrafter(pair.drafter, ctx, kv_type="f32", flash_attn=False)
        width = drafter.width
        histories = [rng.normal(size=(n, width)).astype(np.float32) for n in (5, 9, 2)]
        asks = [(0, 11, 5, 3), (1, 12, 9, 1), (2, 13, 2, 4)]
        alone = []
        for (seq, anchor, pos, n_max), rows in zip(asks, histories):
            drafter.reset()
            drafter.observe(np.zeros(len(rows), np.int32), rows, 0, seq_id=seq)
            alone.append(drafter.propose(anchor, pos, n_max, seq_id=seq))
        drafter.reset()
        for (seq, *_), rows in zip(asks, histories):
            drafter.observe(np.zeros(len(rows), np.int32), rows, 0, seq_id=seq)
        together = drafter.propose_many([(seq, anchor, pos, n_max, None) for seq, anchor, pos, n_max in asks])
        for a, b, (_, _, _, n_max) in zip(alone, together, asks):
            assert len(b.tokens) == n_max and list(a.tokens) == list(b.tokens)
            np.testing.assert_allclose(a.logits, b.logits, rtol=0, atol=1e-4)
            np.testing.assert_allclose(a.confidence, b.confidence, rtol=0, atol=1e-5)
        with pytest.raises(ValueError, match="one request per sequence"):
            drafter.propose_many([(0, 1, 5, 2, None), (0, 1, 5, 2, None)])
        with pytest.raises(ValueError, match="seq_id 3 outside"):
            drafter.propose(1, 0, 2, seq_id=3)
        drafter.close()


def test_the_training_data_generator_runs_on_the_scheduler_and_matches_solo_runs(make_pair):
    """``train``'s data generator (continue_side_by_side) batches through the scheduler: each continuation is the
    prompt's solo greedy output, and its f16 capture rows and teacher top-k are those of a run of that prompt alone."""
    from pyllama_dspark.train.data import continue_side_by_side

    with Model(make_pair(spec("llama")).target) as model:
        prompts = [model.tokenize(p, add_special=True, parse_special=True).tolist() for p in PROMPTS[:5]]
        solo = solo_plain(model, PROMPTS[:5], [12] * 5, n_ctx=256, n_batch=512, stop_at_eog=True)

        def run(group):
            ctx = Context(model, n_ctx=256 * len(group), n_seq_max=len(group), n_batch=512)
            ctx.set_capture_layers([0, 2], masked=False)
            try:
                return continue_side_by_side(ctx, group, [Sampler() for _ in group], 12, capture=True,
                                             teacher_top_k=4, stop_tokens=[])
            finally:
                ctx.close()

        together = run(prompts)
        for prompt, ref, out in zip(prompts, solo, together):
            alone = run([prompt])[0]
            assert out.tokens == prompt + ref.tokens == alone.tokens
            assert out.rows.shape == (len(out.tokens) - 1, 2 * model.n_embd) and np.array_equal(out.rows, alone.rows)
            assert np.array_equal(out.top_ids, alone.top_ids) and len(out.top_ids) == len(ref.tokens)
            assert out.top_ids[:, 0].tolist() == ref.tokens  # greedy: each token is its row's most likely one


def test_generate_batch_after_an_interrupted_run_starts_clean(make_pair, monkeypatch):
    pair = make_pair(spec("llama"))
    with pyllama_dspark.load(pair.target, drafter=pair.drafter, n_ctx=256, n_draft=2) as llm:
        reference = [r.tokens for r in llm.generate_batch(PROMPTS[:3], parallel=2, max_tokens=10)]
        scheduler = llm.batch_scheduler(2)
        real_step, calls = scheduler.step, []

        def interrupted():
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt
            return real_step()

        monkeypatch.setattr(scheduler, "step", interrupted)
        with pytest.raises(KeyboardInterrupt):
            llm.generate_batch(PROMPTS[:3], parallel=2, max_tokens=10)
        monkeypatch.undo()
        assert scheduler.idle
        assert [r.tokens for r in llm.generate_batch(PROMPTS[:3], parallel=2, max_tokens=10)] == reference


def test_verify_cost_model_charges_the_fixed_part_shared_and_each_row_its_marginal_cost():
    """Issue 34: a sequence's verify cost in a batch is its share of the decode's fixed part plus what its own rows
    add at its own context length (fitted from the decodes), not its rows' fraction of the whole decode."""
    from pyllama_dspark.batching import VerifyCostModel

    model = VerifyCostModel()
    assert model.share(0.012, 1, 4, 4, 400) == pytest.approx(0.003)  # proportional until fitted
    rng = np.random.default_rng(0)
    fixed, per_row, per_kcell = 0.008, 0.0006, 0.0004
    for _ in range(40):
        rows = int(rng.integers(4, 20))
        cells = int(rows * rng.integers(100, 3000))
        model.observe(rows, cells, fixed + per_row * rows + per_kcell * cells / 1000)
    assert model.ready
    np.testing.assert_allclose(model.coefficients(), [fixed, per_row, per_kcell], rtol=1e-3)
    # one of 4 sequences verifying 4 rows at 1000 cells each pays a quarter of the fixed part and its rows
    assert model.share(0.02, 4, 10, 4, 4000) == pytest.approx(fixed / 4 + 4 * per_row + 4 * per_kcell, rel=1e-3)


def test_verify_cost_model_stays_proportional_without_a_usable_fit():
    from pyllama_dspark.batching import VerifyCostModel

    model = VerifyCostModel()
    for _ in range(20):  # one row count only: the fixed part and the per-row cost cannot be told apart
        model.observe(4, 4000, 0.01)
    assert not model.ready and model.share(0.01, 1, 4, 4, 1000) == pytest.approx(0.0025)
    falling = VerifyCostModel()
    for rows in (2, 4, 8, 16) * 4:  # more rows, less time: a negative per-row cost is refused
        falling.observe(rows, 100 * rows, 0.02 - 0.001 * rows)
    assert not falling.ready


def test_common_cap_drops_a_lone_draft_that_would_cost_the_batch_a_pass():
    """Issue 34: with one draft on one of four sequences, the decode takes two passes where there was one; the
    common cap drops a weak lone draft, keeps a strong one, and keeps drafts that share the passes."""
    from pyllama_dspark.batching import best_common_cap
    from pyllama_dspark.draft_length import expected_tokens_by_k

    coef = np.array([0.006, 0.0005, 0.0])  # a pass costs 12 rows: the figures of SmolLM2 at short context
    plain = expected_tokens_by_k(np.zeros(0))

    def gains(*accept):
        return expected_tokens_by_k(np.array(accept))

    weak = [(0, 100, 1, gains(0.3)), (1, 100, 0, plain), (2, 100, 0, plain), (3, 100, 0, plain)]
    assert best_common_cap(weak, coef, 64) == 0  # 4.3 tokens in 2 passes against 4 in one
    strong = [(0, 100, 6, gains(*[0.95] * 6)), (1, 100, 0, plain), (2, 100, 0, plain), (3, 100, 0, plain)]
    assert best_common_cap(strong, coef, 64) == 6  # ~8.9 tokens in two passes
    assert best_common_cap([weak[0][:3] + (gains(1.0),)] + weak[1:], coef, 64) == 0  # even a certain one
    shared = [(seq, 100, 2, gains(0.8, 0.7)) for seq in range(4)]
    assert best_common_cap(shared, coef, 64) == 2  # still one pass: each draft costs a row only
    uneven = [(0, 100, 3, gains(0.7, 0.6, 0.5)), (1, 100, 1, gains(0.7)), (2, 100, 1, gains(0.7)),
              (3, 100, 1, gains(0.7))]
    assert best_common_cap(uneven, coef, 64) == 1  # a second pass for sequence 0's last two slots does not pay
    weak_shared = [(seq, 100, 2, gains(0.6, 0.5)) for seq in range(4)]
    assert best_common_cap(weak_shared, coef, 64) == 1  # slot 2: +19 % tokens (0.3 on 1.6) for +20 % verify
    assert best_common_cap([(0, 5, 0, plain)], coef, 64) == 0 and best_common_cap([], coef, 64) == 0


def test_common_cap_keeps_a_forced_run_the_grammar_sources_running_figure_would_cut():
    """Issue 48: the grammar source's running acceptance mixes forced tokens with their free continuations; planned
    from it, the cap dropped most forced runs. Slots the grammar forced count as accepted, the others keep the
    chooser's figure."""
    from pyllama_dspark.batching import best_common_cap, forced_accepted
    from pyllama_dspark.draft_length import expected_tokens_by_k

    coef = np.array([0.006, 0.0005, 0.0])
    plain = expected_tokens_by_k(np.zeros(0))
    running = np.array([0.3] * 5 + [0.05])
    forced = np.array([True] * 5 + [False])
    others = [(1, 100, 0, plain), (2, 100, 0, plain), (3, 100, 0, plain)]
    assert best_common_cap([(0, 100, 6, expected_tokens_by_k(running))] + others, coef, 64) == 0
    accept = forced_accepted(running, forced)
    assert accept.tolist() == [1.0] * 5 + [0.05]
    assert best_common_cap([(0, 100, 6, expected_tokens_by_k(accept))] + others, coef, 64) == 5  # not the weak 6th
    assert forced_accepted(running, None) is running
    assert forced_accepted(running[:3], forced).tolist() == [1.0] * 3  # a draft cut shorter than its flags


def test_ubatch_passes_follow_llama_cpps_equal_split_over_consecutive_sequences():
    """Measured on SmolLM2 (2 threads, n_seq_max 4, 200 cells): one row on sequences 0 and 2 took 15.4 ms, on 0 and
    1 9.5 ms (one row alone 7.3); rows 5/1/1/1 took 27.0 ms, one row on each of 4 sequences 14.9 and 4 rows on one
    12.3: two passes each, as modelled here."""
    from pyllama_dspark.batching import ubatch_passes

    assert ubatch_passes([(0, 5), (1, 1), (2, 1), (3, 1)], 64) == [{0: 1, 1: 1, 2: 1, 3: 1}, {0: 4}]
    assert ubatch_passes([(0, 1), (2, 1)], 64) == [{0: 1}, {2: 1}]  # a free slot between: two passes
    assert ubatch_passes([(0, 1), (1, 1), (2, 1), (3, 1)], 64) == [{0: 1, 1: 1, 2: 1, 3: 1}]
    assert ubatch_passes([(0, 3), (1, 3), (2, 1)], 64) == [{0: 1, 1: 1, 2: 1}, {0: 2, 1: 2}]
    assert ubatch_passes([(1, 2), (2, 4), (3, 2)], 64) == [{1: 2, 2: 2, 3: 2}, {2: 2}]
    assert ubatch_passes([(0, 40), (1, 40)], 64) == [{0: 32, 1: 32}, {0: 8, 1: 8}]  # at most n_ubatch rows a pass
    assert ubatch_passes([(0, 0), (1, 2)], 64) == [{1: 2}] and ubatch_passes([], 64) == []


def test_verify_cost_model_charges_each_pass_to_the_sequences_in_it():
    from pyllama_dspark.batching import VerifyCostModel

    model = VerifyCostModel()
    rng = np.random.default_rng(1)
    fixed, per_row, per_kcell = 0.007, 0.0005, 0.0003
    for _ in range(60):
        rows, passes = int(rng.integers(4, 20)), int(rng.integers(1, 4))
        cells = int(rows * rng.integers(100, 3000))
        model.observe(rows, cells, fixed * passes + per_row * rows + per_kcell * cells / 1000, passes=passes)
    np.testing.assert_allclose(model.coefficients(), [fixed, per_row, per_kcell], rtol=1e-3)
    # rows 5/1/1/1: sequence 0 is in both passes (a quarter of the first, all of the second), the others in one
    assert model.share(0.03, 5, 8, 4, 500, passes_share=1.25) == pytest.approx(
        1.25 * fixed + 5 * per_row + 0.5 * per_kcell, rel=1e-3)
    assert model.share(0.03, 1, 8, 4, 100, passes_share=0.25) == pytest.approx(
        0.25 * fixed + per_row + 0.1 * per_kcell, rel=1e-3)
    assert model.share(0.03, 1, 8, 4, 100) == model.share(0.03, 1, 8, 4, 100, passes_share=0.25)
