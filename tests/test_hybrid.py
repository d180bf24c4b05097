"""HybridDrafter: prompt lookup and a DSpark drafter under one cost-aware chooser. The choice of source as a
pure function of made-up acceptances and costs; the loop on tiny llama and qwen35 targets (exact greedy output,
both sources used, the model drafter shown every committed row); per-source statistics; the distribution kept
at temperature > 0; ``load(prompt_lookup=True)`` and the CLI flag."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

import drafters
import test_speculative as speculative_tests
import pyllama_dspark
from pyllama_dspark import (Context, DSparkDrafter, HybridDrafter, Model, PromptLookupDrafter, SpecStats, Speculator,
                            generate)
from pyllama_dspark.draft_length import SourceChooser, StaticCostTable
from pyllama_dspark.sampling import Sampler, SamplingParams
from pyllama_dspark.testing import TinySpec
from test_rejection import (E2E_TARGET, NoisyOracleDrafter, chi2_critical, exact_conditionals, exact_joint_2_3,
                            pooled_chi_square)

# SmolLM2 Q4_1 on 2 threads (ms): a verify of n rows, a DSpark draft of k slots; prompt lookup is a numpy search
VERIFY = {1: 8.0, 2: 9.2, 3: 10.9, 4: 12.5, 5: 14.2, 6: 15.9, 7: 17.6, 8: 19.3, 9: 21.0}  # prompt lookup: 8 drafts
DSPARK_DRAFT = {1: 2.7, 2: 2.8, 3: 2.9, 4: 3.0}
LOOKUP_DRAFT = {k: 0.05 for k in range(1, 9)}

SPECS = {"llama": TinySpec(arch="llama", n_layer=2), "qwen35": TinySpec(arch="qwen35", n_layer=3)}
SEED_TEXT = [1, 17, 42, 99, 3, 250, 7]
PROMPTS = [
    SEED_TEXT * 3,                                     # repeated text: lookup matches from the first round
    (np.arange(12) * 37 % 251 + 1).tolist() * 3,       # 36 tokens, longer than n_batch 16: chunked prefill
]
N_TOKENS = 96


def static_costs(chooser: SourceChooser) -> None:
    """Known costs instead of measured ones (a tiny model's timings on a busy machine are noise): decisions then
    depend on acceptance alone, and are reproducible."""
    for name, per_source in chooser.choosers.items():
        per_source.costs = StaticCostTable(verify=VERIFY, draft=LOOKUP_DRAFT if name == "lookup" else DSPARK_DRAFT)


def sourced_chooser(lookup_accept: int = 0, model_accept: int = 0, rounds: int = 40) -> SourceChooser:
    """A chooser for lookup and dspark (4 slots each) that has seen ``rounds`` rounds of each source accepting the
    first lookup_accept / model_accept of 4 drafts."""
    chooser = SourceChooser({"lookup": 4, "dspark": 4})
    static_costs(chooser)
    for _ in range(rounds):
        chooser.choosers["lookup"].observe_acceptance(4, lookup_accept)
        chooser.choosers["dspark"].observe_acceptance(4, model_accept)
    return chooser


# --- the choice of source, pure ------------------------------------------------------------------------------

def test_lookup_is_chosen_when_its_acceptance_is_high():
    chooser = sourced_chooser(lookup_accept=4, model_accept=2)
    assert chooser.choose({"lookup": 4, "dspark": 4}, free=["lookup"]) == ("lookup", 4)


def test_the_model_is_chosen_when_lookups_acceptance_is_low():
    chooser = sourced_chooser(lookup_accept=0, model_accept=3)
    source, k = chooser.choose({"lookup": 4, "dspark": 4}, free=["lookup"])
    assert source == "dspark" and k >= 3


def test_the_model_is_chosen_when_lookup_has_no_match():
    chooser = sourced_chooser(lookup_accept=4, model_accept=2)
    source, k = chooser.choose({"dspark": 4}, free=[])
    assert source == "dspark" and k >= 2


def test_a_short_match_caps_lookups_length_and_can_lose_to_the_model():
    """Equal acceptance (always right): a 1-token match promises at most 2 tokens a round, the model 5."""
    chooser = sourced_chooser(lookup_accept=4, model_accept=4)
    assert chooser.choose({"lookup": 1, "dspark": 4}, free=["lookup"])[0] == "dspark"
    assert chooser.choose({"lookup": 4, "dspark": 4}, free=["lookup"]) == ("lookup", 4)  # free beats paid


def test_when_neither_pays_the_round_is_plain_and_only_the_model_is_probed():
    chooser = sourced_chooser(lookup_accept=0, model_accept=0)
    picks = [chooser.choose({"lookup": 4, "dspark": 4}, free=["lookup"]) for _ in range(80)]  # gap now up to 64
    assert all(k == 0 or (source, k) == ("dspark", 1) for source, k in picks), picks
    assert ("dspark", 1) in picks  # a probe: the model drafts one token now and then
    assert not any(source == "lookup" and k for source, k in picks)  # lookup is scored for free, never probed


def test_a_free_proposal_is_scored_against_what_the_target_committed():
    chooser = sourced_chooser(lookup_accept=0, model_accept=2)
    assert chooser.choose({"lookup": 4, "dspark": 4}, free=["lookup"])[0] == "dspark"
    for _ in range(40):  # rounds the model drafted; lookup's proposal was what the target committed
        chooser.observe_free("lookup", [5, 6, 7, 8], committed=[5, 6, 7, 8, 9])
    assert chooser.choose({"lookup": 4, "dspark": 4}, free=["lookup"]) == ("lookup", 4)
    lookup = chooser.choosers["lookup"]
    before = lookup.accept.copy()
    chooser.observe_free("lookup", [5, 6, 7, 8], committed=[5, 3])  # slot 0 right, slot 1 wrong, 2-3 unknown
    assert lookup.accept[0] > before[0] and lookup.accept[1] < before[1]
    assert lookup.accept[2:].tolist() == before[2:].tolist()


def test_a_free_proposal_longer_than_the_round_waits_for_the_next_rounds_tokens():
    chooser = SourceChooser({"lookup": 4, "dspark": 4})
    lookup = chooser.choosers["lookup"]
    prior = lookup.accept.copy()
    chooser.observe_free("lookup", [5, 6, 7, 8], committed=[5])  # a plain round: slot 0 right, 1-3 unknown yet
    assert lookup.accept.tolist() == prior.tolist()  # nothing scored yet
    chooser.observe_commit([6])  # the next round: slot 1 right
    assert lookup.accept.tolist() == prior.tolist()
    chooser.observe_commit([9, 4])  # slot 2 wrong: scored now, slots 0-1 right, 2 wrong, 3 not reached
    assert lookup.accept[:2].tolist() == pytest.approx((prior[:2] + 0.1 * (1 - prior[:2])).tolist())
    assert lookup.accept[2] == pytest.approx(prior[2] * 0.9) and lookup.accept[3] == prior[3]
    chooser.observe_commit([1])  # scored once: nothing waits any more
    assert lookup.accept[2] == pytest.approx(prior[2] * 0.9)
    chooser.observe_free("lookup", [1, 2], committed=[1])
    chooser.observe_commit([2, 3])  # used up: both slots right
    assert lookup.accept[1] == pytest.approx(1 - 0.9 ** 2 * (1 - prior[1]))  # right twice now
    before = lookup.accept.copy()
    chooser.observe_free("lookup", [4, 4], committed=[4, 4])  # used up by the round itself: scored now
    assert lookup.accept[:2].tolist() == pytest.approx((1 - 0.9 * (1 - before[:2])).tolist())
    chooser.observe_free("lookup", [7, 7], committed=[7])
    chooser.forget_waiting()  # a new text: the proposal's next token never comes
    chooser.observe_commit([7])
    assert lookup.accept[0] == pytest.approx(1 - 0.9 ** 3 * (1 - prior[0]))  # the three scored proposals only


def test_the_sources_share_the_verify_costs_and_keep_their_own_draft_costs():
    chooser = SourceChooser({"lookup": 4, "dspark": 4})
    chooser.observe_round("dspark", 3, 1, 0.003, 0.012)
    chooser.observe_round("lookup", 2, 2, 0.0001, 0.010)
    lookup, model = chooser.choosers["lookup"].costs, chooser.choosers["dspark"].costs
    assert lookup.measured("verify") == model.measured("verify") == [3, 4]
    assert lookup.verify(4) == model.verify(4) == pytest.approx(0.012)
    assert lookup.verify(3) == model.verify(3) == pytest.approx(0.010)
    assert lookup.draft(2) == pytest.approx(0.0001) and model.draft(3) == pytest.approx(0.003)


# --- the drafter alone ---------------------------------------------------------------------------------------

def test_the_hybrid_drafter_forwards_to_both_sources():
    expected = SEED_TEXT * 3
    model = drafters.ScriptedDrafter(expected, n_vocab=256, block_size=6, capture_layers=[0])
    hybrid = HybridDrafter(model)
    assert hybrid.capture_layers == [0] and hybrid.block_size == 8  # prompt lookup's default block is larger
    assert hybrid.sources == {"lookup": 8, "draft": 6}
    rows = np.zeros((len(SEED_TEXT) + 3, 8), np.float32)
    hybrid.observe(np.array(SEED_TEXT + [1, 17, 42]), rows, 0)
    assert model.observed[0][0] == 0 and model.observed[0][2].shape == rows.shape
    # the text so far ends in 1 17 42 99 (the anchor): lookup proposes what followed, 3 250 7
    offers = hybrid.offers(99, 10, 3)
    assert offers["lookup"].tokens.tolist() == [3, 250, 7] and offers["lookup"].source == "lookup"
    assert offers["draft"] is None
    assert hybrid.propose(99, 10, 3).source == "lookup"  # the fixed-length pick: lookup when it matches
    fallback = hybrid.propose(99, 10, 8, source="draft")
    assert fallback.source == "draft" and len(fallback.tokens) == 6  # capped by the model drafter's block
    hybrid.reset()
    assert model.observed == [] and hybrid.lookup.tokens == []
    assert "lookup" not in hybrid.offers(5, 0, 3)  # nothing observed: no match
    assert hybrid.propose(5, 0, 3, source="lookup").tokens.tolist() == []
    with pytest.raises(ValueError, match="unknown draft source"):
        hybrid.propose(5, 0, 3, source="dspark")


def test_the_hybrid_drafter_refuses_what_it_cannot_use():
    with pytest.raises(TypeError, match="model_drafter must be a Drafter"):
        HybridDrafter("drafter.gguf")
    with pytest.raises(ValueError, match="use it alone"):
        HybridDrafter(PromptLookupDrafter())


def test_close_closes_the_model_drafter():
    closed = []

    class Closable(drafters.ScriptedDrafter):
        def close(self):
            closed.append(True)

    HybridDrafter(Closable([], n_vocab=8)).close()
    HybridDrafter(drafters.ScriptedDrafter([], n_vocab=8)).close()  # no close: nothing to do
    assert closed == [True]


# --- in the loop ---------------------------------------------------------------------------------------------

def plain_greedy(model, prompt, n=N_TOKENS):
    return speculative_tests.plain_greedy(model, prompt, n)


@pytest.fixture(scope="module", params=list(SPECS))
def arch_pair(request, make_pair):
    return request.param, make_pair(SPECS[request.param])


def run_hybrid(model, drafter_path, prompt, n_draft, sampler=None):
    """(tokens, steps, stats) of a HybridDrafter over the DSpark drafter at drafter_path (static costs when
    cost-aware)."""
    ctx = Context(model, n_ctx=512, n_batch=16, n_ubatch=12, n_rs_seq=Speculator.target_rs_seq(8))
    hybrid = HybridDrafter(DSparkDrafter(drafter_path, ctx))
    spec = Speculator(ctx, hybrid, n_draft=n_draft)
    if spec.source_chooser is not None:
        static_costs(spec.source_chooser)
    stats = SpecStats()
    steps = list(spec.run(np.asarray(prompt, dtype=np.int32), max_tokens=N_TOKENS, stop_at_eog=False, stats=stats,
                          sampler=sampler))
    hybrid.close()
    ctx.close()
    return [t for s in steps for t in s.tokens], steps, stats


@pytest.mark.parametrize("n_draft", [None, 4, 2], ids=["cost-aware", "n_draft=4", "n_draft=2"])
def test_hybrid_output_equals_plain_greedy_and_both_sources_draft(arch_pair, n_draft):
    arch, pair = arch_pair
    drafted_by = Counter()
    with Model(pair.target) as model:
        for prompt in PROMPTS:
            tokens, steps, stats = run_hybrid(model, pair.drafter, prompt, n_draft)
            assert tokens == plain_greedy(model, prompt), f"{arch} n_draft={n_draft} prompt={prompt[:4]}..."
            assert stats.n_generated == N_TOKENS
            drafted_by.update(s.source for s in steps if s.n_draft > 0)
            assert all(s.source == "" for s in steps if s.n_draft == 0)
            if n_draft is not None:  # lookup whenever it matches, else the model: every round drafts
                assert all(s.n_draft > 0 for s in steps[1:-1])
    assert drafted_by["lookup"] > 0 and drafted_by["dspark"] > 0, drafted_by
    assert set(drafted_by) == {"lookup", "dspark"}


def test_the_model_drafter_observes_every_committed_row_whatever_source_drafted(make_model):
    with Model(make_model(arch="llama", n_layer=2)) as model:
        prompt = PROMPTS[0]
        expected = plain_greedy(model, prompt)
        full = prompt + expected
        scripted = drafters.prefix(full, model.n_vocab, 1, block_size=4)
        scripted.capture_layers = [0]
        ctx = Context(model, n_ctx=512, n_batch=16, n_ubatch=8)
        spec = Speculator(ctx, HybridDrafter(scripted))
        static_costs(spec.source_chooser)
        steps = list(spec.run(np.asarray(prompt, dtype=np.int32), max_tokens=N_TOKENS, stop_at_eog=False))
        ctx.close()
    assert [t for s in steps for t in s.tokens] == expected
    assert {s.source for s in steps if s.n_draft} == {"lookup", "draft"}
    text: list[int] = []
    for pos0, tokens, rows in scripted.observed:  # later observations replace from pos0 on (none do here)
        assert pos0 == len(text) and rows is not None and len(rows) == len(tokens)
        text = text[:pos0] + tokens
    assert text == full[:-1]  # everything committed, up to the last anchor (never decoded)


def test_per_source_statistics_sum_to_the_totals(arch_pair):
    arch, pair = arch_pair
    with Model(pair.target) as model:
        _, steps, stats = run_hybrid(model, pair.drafter, PROMPTS[0], None)
    shares = stats.by_source
    assert set(shares) == {"lookup", "dspark"}
    for key in ("rounds", "drafted", "accepted"):
        assert sum(getattr(share, key) for share in shares.values()) == getattr(stats, key), key
    width = len(stats.reached_per_pos)
    for key in ("reached_per_pos", "accepted_per_pos"):
        summed = np.sum([np.pad(getattr(s, key), (0, width - len(getattr(s, key)))) for s in shares.values()], axis=0)
        assert summed.tolist() == getattr(stats, key), key
    for name, share in shares.items():  # each source's share is what its Steps say
        mine = [s for s in steps if s.source == name]
        assert share.rounds == len(mine) and share.drafted == sum(s.n_draft for s in mine)
        assert share.accepted == sum(s.n_accept for s in mine)
        assert share.tau == pytest.approx(share.accepted / share.rounds + 1)
        assert share.t_draft > 0
    assert sum(share.t_draft for share in shares.values()) <= stats.t_draft + 1e-9
    text = stats.format()
    for name in shares:
        line = next(line for line in text.splitlines() if line.startswith(f"by {name}"))
        assert f"rounds {shares[name].rounds}, drafted {shares[name].drafted}" in line and "t_draft" in line
    data = json.loads(json.dumps(stats.as_dict()))
    assert set(data["by_source"]) == {"lookup", "dspark"}
    assert sum(d["drafted"] for d in data["by_source"].values()) == data["drafted"]
    assert set(data["by_source"]["lookup"]) == {"rounds", "drafted", "accepted", "accept_rate", "tau",
                                                "accepted_per_pos", "reached_per_pos", "t_draft"}


def test_statistics_by_source_have_the_literal_values_of_a_known_sequence_of_rounds():
    stats = SpecStats()
    for drafted, accepted, source, t in [(4, 4, "lookup", 0.1), (4, 0, "dspark", 2.0), (2, 1, "lookup", 0.1),
                                         (0, 0, "", 0.05), (0, 0, "dspark", 1.0)]:
        stats.observe_round(drafted, accepted, source=source, t_draft=t)
    lookup, model = stats.by_source["lookup"], stats.by_source["dspark"]
    assert (lookup.rounds, lookup.drafted, lookup.accepted, lookup.tau) == (2, 6, 5, 3.5)
    assert lookup.reached_per_pos == [2, 2, 1, 1] and lookup.accepted_per_pos == [2, 1, 1, 1]
    assert (model.rounds, model.drafted, model.accepted, model.accept_rate) == (1, 4, 0, 0.0)
    assert model.t_draft == pytest.approx(3.0)  # its drafts that were all cut still cost draft time
    assert (stats.rounds, stats.plain_steps, stats.t_draft) == (3, 2, pytest.approx(3.25))
    assert SpecStats().as_dict()["by_source"] == {}


# --- temperature > 0 -----------------------------------------------------------------------------------------

@pytest.mark.statistical
def test_hybrid_sampling_follows_the_targets_joint_distribution(model_dir):
    """Tokens 2 and 3 (0-based) of 4 against the target's exact joint, with the hybrid drafting 2 tokens a round:
    prompt lookup's deterministic drafts (q one-hot) where it matches, a model drafter's sampled ones (its own q)
    elsewhere, in the same runs."""
    from pyllama_dspark.testing import tiny_model

    sampling = dict(temperature=0.7, top_k=4)
    n_runs = 2000
    with Model(tiny_model(E2E_TARGET, cache_dir=model_dir)) as model:
        ctx = Context(model, n_ctx=64, n_batch=32)
        seed = [3, 14, 15, 9]
        prompt = seed + generate(ctx, seed, max_tokens=8, stop_at_eog=False).tokens + seed  # lookup matches
        table = exact_conditionals(ctx, prompt, sampling)
        expected = exact_joint_2_3(table)
        hybrid = HybridDrafter(NoisyOracleDrafter(table, len(prompt), model.n_vocab))
        spec = Speculator(ctx, hybrid, n_draft=2)
        sampler = Sampler(SamplingParams(seed=11, **sampling))
        counts: dict = {}
        sources = Counter()
        for _ in range(n_runs):
            steps = list(spec.run(np.array(prompt), max_tokens=4, sampler=sampler, stop_at_eog=False))
            tokens = [t for step in steps for t in step.tokens]
            counts[tuple(tokens[2:])] = counts.get(tuple(tokens[2:]), 0) + 1
            sources.update((s.source, s.n_accept > 0) for s in steps if s.n_draft)
    # both sources drafted, and the drafts of each were accepted at times and rejected at times
    assert all(sources[source, accepted] > n_runs // 50 for source in ("lookup", "draft") for accepted in (0, 1)), \
        sources
    assert set(counts) <= set(expected), f"pairs the target cannot produce: {sorted(set(counts) - set(expected))}"
    stat, dof = pooled_chi_square(counts, expected, n_runs)
    assert stat < chi2_critical(dof), f"tokens 2 and 3 do not follow the target: chi2 {stat:.1f}, {dof} dof"


# --- load() and the command line -----------------------------------------------------------------------------

def test_load_with_prompt_lookup_wraps_the_drafter_and_stays_exact(make_pair):
    pair = make_pair(SPECS["llama"])
    prompt = PROMPTS[0]
    with Model(pair.target) as model:
        expected = plain_greedy(model, prompt, 32)
        with pyllama_dspark.load(model, drafter=pair.drafter, n_ctx=512, prompt_lookup=True) as llm:
            assert isinstance(llm.drafter, HybridDrafter) and isinstance(llm.drafter.model_drafter, DSparkDrafter)
            result = llm.generate(prompt, max_tokens=32, stop_at_eog=False)
            assert result.tokens == expected
            assert set(result.stats.by_source) <= {"lookup", "dspark"} and result.stats.by_source
            completion = llm.create_completion(prompt, max_tokens=8)
            assert "by_source" in completion["speculative"]
        with pyllama_dspark.load(model, n_ctx=512, prompt_lookup=True) as llm:  # no drafter: lookup alone
            assert isinstance(llm.drafter, PromptLookupDrafter)
            assert llm.generate(prompt, max_tokens=32, stop_at_eog=False).tokens == expected
        with pyllama_dspark.load(model, drafter=pair.drafter, n_ctx=512) as llm:  # the default: the hybrid
            assert isinstance(llm.drafter, HybridDrafter)
        with pyllama_dspark.load(model, drafter=pair.drafter, n_ctx=512, prompt_lookup=False) as llm:
            assert isinstance(llm.drafter, DSparkDrafter)
        with pyllama_dspark.load(model, n_ctx=512) as llm:  # no drafter: plain decoding stays plain
            assert llm.drafter is None
        with pytest.raises(TypeError, match="prompt_lookup"):
            pyllama_dspark.load(model, drafter=pair.drafter, prompt_lookup="yes")


def test_qwen35_target_gets_snapshots_for_the_larger_block_through_load(make_pair):
    """A 2-slot drafter, 8-token lookups and 16-token history drafts: the hybrid target's context must roll back
    16 drafts (8 without history)."""
    pair = make_pair(SPECS["qwen35"], block_size=2)
    with pyllama_dspark.load(pair.target, drafter=pair.drafter, n_ctx=512, prompt_lookup=True,
                             history_tokens=0) as llm:
        assert llm.drafter.block_size == 8 and llm.ctx.n_rs_seq >= 8
    with pyllama_dspark.load(pair.target, drafter=pair.drafter, n_ctx=512, prompt_lookup=True) as llm:
        assert llm.drafter.block_size == 16 and llm.ctx.n_rs_seq >= 16
        expected = plain_greedy(llm.model, PROMPTS[0], 32)
        assert llm.generate(PROMPTS[0], max_tokens=32, stop_at_eog=False).tokens == expected


def test_the_prompt_lookup_flag_is_on_every_drafting_subcommand():
    from pyllama_dspark.cli import build_parser

    parser = build_parser()
    common = {"generate": ["-m", "t.gguf", "-p", "x"], "chat": ["-m", "t.gguf"],
              "bench": ["-m", "t.gguf", "-md", "d.gguf", "--prompts", "p.jsonl"], "demo": []}
    for command, args in common.items():
        assert parser.parse_args([command, *args]).prompt_lookup is None, command  # on with a drafter, else off
        assert parser.parse_args([command, *args, "--prompt-lookup"]).prompt_lookup is True, command
        assert parser.parse_args([command, *args, "--prompt-lookup", "--no-prompt-lookup"]).prompt_lookup is False


def test_generate_with_prompt_lookup_prints_the_plain_text_and_the_sources(make_pair, tmp_path):
    from test_cli import cli

    pair = make_pair(TinySpec(arch="llama", n_layer=2, vocab="llama-spm"))
    prompt = "one two three four, one two three four, one two"
    plain = cli("generate", "-m", str(pair.target), "-p", prompt, "-n", "16")
    hybrid = cli("generate", "-m", str(pair.target), "-md", str(pair.drafter), "-p", prompt, "-n", "16",
                 "--prompt-lookup", "--stats", "--json", str(tmp_path / "out.json"))
    assert plain.returncode == 0 and hybrid.returncode == 0, hybrid.stderr
    assert hybrid.stdout == plain.stdout
    assert "prompt lookup" in hybrid.stderr and "sources lookup, history, dspark" in hybrid.stderr
    data = json.loads((tmp_path / "out.json").read_text())
    assert set(data["speculative"]["by_source"]) <= {"lookup", "dspark"}
    for name in data["speculative"]["by_source"]:
        assert f"\nby {name}" in hybrid.stderr
