"""Drafts that cost no drafter call: the tokens a grammar forces, and the history of earlier replies.

Both are drafts like any other, judged by the target: at temperature 0 the output stays plain (constrained)
decoding's token for token, in one sequence and batched; above 0 the constrained distribution holds (chi-square
against plain constrained sampling). The history's store is shared by an LLM's generations and its batches, and
``serve --history-per-request`` keeps none."""

from __future__ import annotations

import ctypes
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import pyllama_dspark
from conftest import ARCHS
from drafters import StatelessDrafter
from pyllama_dspark import Context, Model, generate
from pyllama_dspark.drafter import Draft, HistoryDrafter
from pyllama_dspark.generate import OutputRules
from pyllama_dspark.history import HistoryStore
from pyllama_dspark.hybrid import GRAMMAR, HISTORY, LOOKUP, free_length
from pyllama_dspark.sampling import Sampler, SamplingParams
from pyllama_dspark.speculative import Speculator
from pyllama_dspark.stats import SpecStats
from pyllama_dspark.structured import Grammar, GrammarState
from pyllama_dspark.testing import TinySpec
from test_rejection import chi2_critical

# long keys and enum values: the grammar forces most of the text
RECORD = {"type": "object",
          "properties": {"customer_full_name": {"type": "string", "maxLength": 10},
                         "priority_level_category": {"enum": ["low_priority", "medium_priority", "high_priority"]},
                         "number_of_items_ordered": {"type": "integer", "minimum": 0, "maximum": 99},
                         "is_returning_customer": {"type": "boolean"}},
          "required": ["customer_full_name", "priority_level_category", "number_of_items_ordered",
                       "is_returning_customer"],
          "additionalProperties": False}
PROMPTS = ["Extract the order as JSON:", "The ticket, as a record:", "Fill the form for Ana:"]
N = 64


def spec(arch: str) -> TinySpec:
    return TinySpec(arch=arch, n_layer=3, vocab="llama-spm")


def plain_constrained(model, prompt, grammar, max_tokens=N) -> list[int]:
    ctx = Context(model, n_ctx=512, n_batch=64)
    try:
        return generate(ctx, prompt, max_tokens=max_tokens, grammar=grammar).tokens
    finally:
        ctx.close()


# --- the grammar's draft --------------------------------------------------------------------------------------
def test_the_forced_draft_is_what_the_grammar_forces_and_leaves_the_state_alone(make_model):
    with Model(make_model(arch="llama", vocab="llama-spm", n_layer=2)) as model:
        state = GrammarState(Grammar.json_schema(RECORD), model)
        tokens, forced = state.forced_draft(16)
        assert tokens and all(forced)
        assert model.detokenize(tokens).startswith('{"customer_full_name')
        assert state.valid_prefix(tokens) == len(tokens)  # the state did not move: all still valid from here
        assert state.forced_draft(16) == (tokens, forced)
        assert state.forced_draft(3) == (tokens[:3], forced[:3])
        assert state.forced_draft(0) == ([], [])
        ahead = GrammarState(state.grammar, model)
        ahead.advance(tokens)
        refused = [int(np.flatnonzero(~ahead.allowed())[0])]
        assert state.forced_draft(30, lambda so_far: refused) == (tokens, forced)  # a refused continuation: cut


def test_the_forced_draft_goes_on_where_the_grammar_is_free_and_is_forced_again(make_model):
    """abc, a free digit, xyz: the forced "abc", the continuation's digit, then the forced "xyz"."""
    with Model(make_model(arch="llama", vocab="llama-spm", n_layer=2)) as model:
        state = GrammarState(Grammar.regex("abc[0-9]xyz"), model)
        seven = next(t for t in range(model.n_vocab) if model.token_to_piece(t) == b"7")
        asked = []

        def continuation(so_far):
            asked.append(list(so_far))
            return [seven, seven]  # the second 7 is refused: cut

        tokens, forced = state.forced_draft(20, continuation)
        head = state.forced_draft(20)[0]
        assert model.detokenize(head) == "abc" and asked[0] == head
        assert model.detokenize(tokens) == "abc7xyz"
        assert forced == [True] * len(head) + [False] + [True] * (len(tokens) - len(head) - 1)
        assert state.valid_prefix(tokens) == len(tokens) and not state.accepting


def test_verify_masks_in_one_call_are_the_grammar_s_row_by_row_and_the_greedy_shortcut_its_argmax(make_model):
    """``row_bitmasks`` (every verify row's mask in one llguidance call) against the state advanced token by token;
    ``greedy_rows`` / ``greedy`` (a row's raw argmax where the grammar allows it) against the argmax of the masked
    rows, on rows whose top token is allowed in some rows and refused in others, and on all-equal rows (ties go to
    the first allowed index)."""
    with Model(make_model(arch="llama", vocab="llama-spm", n_layer=2)) as model:
        state = GrammarState(Grammar.json_schema(RECORD), model)
        drafts, _ = state.forced_draft(12)
        assert len(drafts) >= 4
        masks = state.row_bitmasks(drafts)
        assert masks.shape[0] == len(drafts) + 1
        ahead = GrammarState(state.grammar, model)
        rows = np.random.default_rng(0).standard_normal((len(drafts) + 1, model.n_vocab)).astype(np.float32)
        for i in range(len(drafts) + 1):
            allowed = ahead.allowed()
            unpacked = np.unpackbits(masks[i].view(np.uint8), bitorder="little")[:model.n_vocab].astype(bool)
            np.testing.assert_array_equal(unpacked, allowed, err_msg=f"row {i}")
            top = np.flatnonzero(allowed)[-1] if i % 2 == 0 else np.flatnonzero(~allowed)[0]
            rows[i, top] = 100.0  # even rows: an allowed token on top (the shortcut); odd rows: a refused one
            if i < len(drafts):
                ahead.advance([drafts[i]])
        expected = np.argmax(state.mask_rows(rows, drafts), axis=1)
        np.testing.assert_array_equal(state.greedy_rows(rows, drafts), expected)
        ties = np.zeros_like(rows)
        np.testing.assert_array_equal(state.greedy_rows(ties, drafts), np.argmax(state.mask_rows(ties, drafts), axis=1))
        for row in (rows[0], rows[1], ties[0]):
            assert state.greedy(row) == int(np.argmax(state.mask(row)))
        assert state.valid_prefix(drafts) == len(drafts)  # nothing consumed


def test_verify_rows_llguidance_leaves_out_are_computed_on_a_copy_of_the_state(make_model, monkeypatch):
    """Should llguidance's one call stop before a draft token that its own mask allows, the rows after it come from a
    copy of the state advanced by the drafts (not left unmasked)."""
    import pyllama_dspark.structured as structured

    class FirstRowOnly:
        def unsafe_compute_mask_ptr_with_draft_token(self, interpreters, pointer, row_bytes, n_rows):
            (matcher, index, _), = interpreters
            words = matcher.compute_bitmask()
            ctypes.memmove(pointer + index * row_bytes, words, min(len(words), row_bytes))

    with Model(make_model(arch="llama", vocab="llama-spm", n_layer=2)) as model:
        state = GrammarState(Grammar.json_schema(RECORD), model)
        drafts, _ = state.forced_draft(6)
        expected = state.row_bitmasks(drafts)
        monkeypatch.setattr(structured, "_executor", FirstRowOnly)
        np.testing.assert_array_equal(state.row_bitmasks(drafts), expected)


def test_free_length_drafts_forced_tokens_whole_and_history_at_its_length():
    forced = Draft(np.arange(6, dtype=np.int32), forced=np.array([True] * 4 + [False] * 2))
    history = Draft(np.array([1, 2, 3, 4, 5], np.int32))
    lookup = Draft(np.array([1, 2, 9], np.int32))
    assert free_length({GRAMMAR: forced, LOOKUP: lookup}, LOOKUP, 2) == (GRAMMAR, 4)
    assert free_length({GRAMMAR: forced}, GRAMMAR, 5) == (GRAMMAR, 5)
    assert free_length({GRAMMAR: forced}, "dspark", 0) == (GRAMMAR, 4)  # a plain step would waste them
    assert free_length({HISTORY: history, LOOKUP: lookup}, HISTORY, 2) == (HISTORY, 5)
    assert free_length({HISTORY: history, LOOKUP: lookup}, LOOKUP, 2) == (HISTORY, 5)  # the two agree
    assert free_length({HISTORY: history, LOOKUP: lookup}, LOOKUP, 3) == (LOOKUP, 3)  # they differ at slot 3
    assert free_length({HISTORY: history, LOOKUP: lookup}, LOOKUP, 0) == (LOOKUP, 0)
    assert free_length({LOOKUP: lookup}, LOOKUP, 2) == (LOOKUP, 2)


@pytest.mark.parametrize("arch", ARCHS)
def test_grammar_drafts_keep_plain_constrained_greedy_output(make_pair, arch):
    """The default configuration (DSpark, prompt lookup, history) under a schema: the grammar drafts, and every
    output is plain constrained greedy decoding's; a second run of the same prompts drafts from the history too."""
    pair = make_pair(spec(arch))
    grammar = Grammar.json_schema(RECORD)
    with Model(pair.target) as model:
        expected = {p: plain_constrained(model, p, grammar) for p in PROMPTS}
        with pyllama_dspark.load(model, drafter=pair.drafter, n_ctx=512, n_batch=64) as llm:
            stats = SpecStats()
            for _ in range(2):
                for p in PROMPTS:
                    result = llm.generate(p, max_tokens=N, grammar=grammar)
                    assert result.tokens == expected[p], p
                    _add(stats, result.stats)
    assert stats.n_forced > 0 and stats.by_source[GRAMMAR].drafted >= stats.n_forced
    assert stats.n_forced_accepted <= stats.n_forced


def _add(total: SpecStats, stats: SpecStats) -> None:
    total.n_forced += stats.n_forced
    total.n_forced_accepted += stats.n_forced_accepted
    for name, share in stats.by_source.items():
        mine = total.by_source.setdefault(name, type(share)())
        mine.rounds += share.rounds
        mine.drafted += share.drafted
        mine.accepted += share.accepted


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_grammar_drafts_in_a_batch_keep_each_solo_output(make_pair, arch):
    pair = make_pair(spec(arch))
    grammar = Grammar.json_schema(RECORD)
    prompts = PROMPTS * 2
    with Model(pair.target) as model:
        expected = [plain_constrained(model, p, grammar) for p in prompts]
        with pyllama_dspark.load(model, drafter=pair.drafter, n_ctx=512, n_batch=64) as llm:
            results = llm.generate_batch(prompts, parallel=3, max_tokens=N, grammar=grammar)
            off = pyllama_dspark.load(model, drafter=pair.drafter, n_ctx=512, n_batch=64, grammar_drafts=False)
            with off:
                without = off.generate_batch(prompts, parallel=3, max_tokens=N, grammar=grammar)
    assert [r.tokens for r in results] == expected
    assert [r.tokens for r in without] == expected
    assert sum(r.stats.n_forced for r in results) > 0
    assert all(GRAMMAR in r.stats.by_source for r in results)
    assert all(GRAMMAR not in r.stats.by_source and r.stats.n_forced == 0 for r in without)


def test_a_fixed_draft_length_drafts_the_forced_tokens_first(make_pair):
    pair = make_pair(spec("llama"))
    grammar = Grammar.json_schema(RECORD)
    with Model(pair.target) as model:
        expected = plain_constrained(model, PROMPTS[0], grammar)
        with pyllama_dspark.load(model, drafter=pair.drafter, n_ctx=512, n_batch=64, n_draft=3) as llm:
            result = llm.generate(PROMPTS[0], max_tokens=N, grammar=grammar)
    assert result.tokens == expected
    assert result.stats.by_source[GRAMMAR].rounds > 0 and result.stats.n_forced > 0


@pytest.mark.statistical
def test_forced_drafts_keep_the_constrained_distribution_at_temperature_one(make_model):
    """A regex: a free letter, then "ordinary " forced, then a free digit. The grammar's draft is the forced
    tokens (llguidance's masks allow only its spelling of forced bytes: they are always accepted) continued by
    the history's digit from an earlier reply, which the target at temperature 1 often rejects: the residual
    path is taken. The joint distribution of the generated token sequences through the speculative loop against
    plain constrained sampling, seeded on both sides: a two-sample chi-square at p = 0.001."""
    grammar = Grammar.regex("[ab]ordinary [0-9]")
    runs = 1200
    with Model(make_model(arch="llama", vocab="llama-spm", n_layer=2)) as model:
        ctx = Context(model, n_ctx=64, n_batch=16)
        prompt = model.tokenize("Say the order number:", add_special=True)
        plain = Counter()
        for seed in range(runs):
            tokens = generate(ctx, prompt, max_tokens=16, temperature=1.0, seed=seed, grammar=grammar).tokens
            plain[tuple(tokens)] += 1
        store = HistoryStore(1000)
        for reply in plain:  # every earlier reply: the history proposes their most frequent digit
            store.add(list(reply), prompt)
        spec = Speculator(ctx, HistoryDrafter(store))
        sampler = Sampler(SamplingParams(temperature=1.0, seed=5))
        drafted = Counter()
        stats = SpecStats()
        for _ in range(runs):
            tokens = [t for step in spec.run(prompt, max_tokens=16, sampler=sampler, stats=stats,
                                             rules=OutputRules(model, grammar)) for t in step.tokens]
            drafted[tuple(tokens)] += 1
    grammar_share = stats.by_source[GRAMMAR]
    assert stats.n_forced == stats.n_forced_accepted > 0
    assert grammar_share.drafted - stats.n_forced > grammar_share.accepted - stats.n_forced_accepted > 0
    statistic, dof = _homogeneity(plain, drafted)
    assert dof >= 5
    assert statistic < chi2_critical(dof)


class EndDrafter(StatelessDrafter):
    """Proposes the end of generation every round."""

    block_size = 1

    def __init__(self, eos: int):
        self.eos = eos

    def propose(self, anchor, pos, n_max, sampler=None):
        return Draft(tokens=np.array([self.eos], np.int32))


def test_an_end_of_generation_draft_where_the_grammar_is_complete_is_accepted_at_temperature_one(make_model):
    """llguidance refuses an end of generation in ``validate_tokens`` once the grammar cannot grow, though its mask
    allows it there: the draft was cut as refused, and rejection sampling then drew from an empty residual (a
    token the grammar refuses, and a GrammarError). Now it is valid, accepted, and the rows after it unused."""
    grammar = Grammar.regex("[ab]")
    with Model(make_model(arch="llama", vocab="llama-spm", n_layer=2)) as model:
        ctx = Context(model, n_ctx=64, n_batch=16)
        eos = model.special_tokens["eos"]
        prompt = model.tokenize("Pick a letter:", add_special=True)
        spec = Speculator(ctx, EndDrafter(eos), n_draft=1, grammar_drafts=False)
        sampler = Sampler(SamplingParams(temperature=1.0, seed=3))
        stats = SpecStats()
        for _ in range(50):
            tokens = [t for step in spec.run(prompt, max_tokens=4, sampler=sampler, stats=stats,
                                             rules=OutputRules(model, grammar)) for t in step.tokens]
            assert len(tokens) == 2 and model.token_to_piece(tokens[0]) in (b"a", b"b") and tokens[1] == eos
    assert stats.drafted == stats.accepted == 50 and stats.n_draft_invalid == 0


def _homogeneity(a: Counter, b: Counter, min_expected: float = 5.0) -> tuple[float, int]:
    """Two-sample chi-square statistic and degrees of freedom; outcomes rarer than ``min_expected`` pooled."""
    outcomes = sorted(set(a) | set(b), key=lambda o: -(a[o] + b[o]))
    n_a, n_b = sum(a.values()), sum(b.values())
    rows, rest = [], [0, 0]
    for o in outcomes:
        if (a[o] + b[o]) * min(n_a, n_b) / (n_a + n_b) >= min_expected:
            rows.append([a[o], b[o]])
        else:
            rest[0] += a[o]
            rest[1] += b[o]
    if sum(rest):
        rows.append(rest)
    table = np.array(rows, dtype=np.float64)
    expected = table.sum(axis=1, keepdims=True) * table.sum(axis=0, keepdims=True) / table.sum()
    return float(((table - expected) ** 2 / expected).sum()), len(rows) - 1


# --- the history ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_a_repeated_request_drafts_from_the_history_and_keeps_plain_output(make_pair, arch):
    """The default configuration: one store behind generate and generate_batch, outputs plain greedy decoding's
    with the history on and off. (Whether its chooser drafts from the history in a repeat depends on costs: on
    these tiny models a verify row costs almost a token, so it drafts only once the history's acceptance is
    measured near 1; the next test fixes the draft length to see every history draft.)"""
    pair = make_pair(spec(arch))
    prompt = "Tell me about the sea"
    with Model(pair.target) as model:
        ctx = Context(model, n_ctx=512, n_batch=64)
        expected = generate(ctx, prompt, max_tokens=N, stop_at_eog=False).tokens
        ctx.close()
        with pyllama_dspark.load(model, drafter=pair.drafter, n_ctx=512, n_batch=64) as llm:
            first = llm.generate(prompt, max_tokens=N, stop_at_eog=False)
            assert llm.history.n_entries == 1
            second = llm.generate(prompt, max_tokens=N, stop_at_eog=False)
            batched = llm.generate_batch([prompt, "Something else entirely"], parallel=2, max_tokens=N,
                                         stop_at_eog=False)
            assert llm.history.n_entries == 4  # the batch's sequences added theirs to the same store
        with pyllama_dspark.load(model, drafter=pair.drafter, n_ctx=512, n_batch=64, history_tokens=0) as off:
            assert off.history is None
            off.generate(prompt, max_tokens=N, stop_at_eog=False)
            again = off.generate(prompt, max_tokens=N, stop_at_eog=False)
    assert first.tokens == second.tokens == batched[0].tokens == again.tokens == expected
    assert HISTORY not in first.stats.by_source and HISTORY not in again.stats.by_source


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_history_drafts_a_repeated_reply_whole_alone_and_batched(make_pair, arch):
    """The history alone at a fixed draft length: the repeat of a reply drafts from it every round and every draft
    is right, in one sequence and in a batch that reads the same store (and adds its replies to it)."""
    from pyllama_dspark.batching import BatchScheduler
    from pyllama_dspark.events import BatchRequest

    pair = make_pair(spec(arch))
    with Model(pair.target) as model:
        n_rs = Speculator.target_rs_seq(8) if (model.is_hybrid or model.is_recurrent) else 0
        ctx = Context(model, n_ctx=512, n_batch=64, n_rs_seq=n_rs)
        prompt = model.tokenize("Tell me about the sea", add_special=True)
        expected = generate(ctx, prompt, max_tokens=N, stop_at_eog=False).tokens
        store = HistoryStore(4096)
        spec_ = Speculator(ctx, HistoryDrafter(store), n_draft=8)
        first = spec_.generate(prompt, max_tokens=N, stop_at_eog=False)
        second = spec_.generate(prompt, max_tokens=N, stop_at_eog=False)
        ctx.close()
        multi = Context(model, n_ctx=1024, n_batch=64, n_seq_max=2, n_rs_seq=n_rs)
        scheduler = BatchScheduler(multi, None, n_draft=8, history=store)
        other = model.tokenize("Something else", add_special=True)
        batched = scheduler.run([BatchRequest(prompt, N, stop_at_eog=False), BatchRequest(other, N, stop_at_eog=False)])
        multi.close()
    assert first.tokens == second.tokens == batched[0].tokens == expected
    assert HISTORY not in first.stats.by_source and store.n_entries == 4
    for repeat in (second, batched[0]):
        share = repeat.stats.by_source[HISTORY]
        # every round drafted from the history and all of it was right: each token after the first is a draft or a
        # round's own token, but for one plain step where a single token was left to make
        stats = repeat.stats
        assert share.accepted == share.drafted == N - 1 - share.rounds - stats.plain_steps and stats.plain_steps <= 1


def test_history_drafter_reads_the_store_and_adds_only_when_told(make_model):
    store = HistoryStore(1000, context=2)
    drafter = HistoryDrafter(store, block_size=4)
    drafter.observe(np.array([5, 6, 7]), None, 0)
    assert len(drafter.propose(8, 3).tokens) == 0
    drafter.remember([1, 5, 6], [7, 8, 9, 10, 11])  # kept: 5 6 (the prompt's last 2), the reply
    assert store.n_entries == 1
    assert drafter.propose(8, 3).tokens.tolist() == [9, 10, 11]  # 5 6 7 8 matched
    assert drafter.propose(8, 3, n_max=2).tokens.tolist() == [9, 10]
    drafter.observe(np.array([8, 9]), None, 3)
    assert drafter.propose(10, 5).tokens.tolist() == [11]  # only 11 is left of the reply
    with pytest.raises(TypeError, match="HistoryStore"):
        HistoryDrafter({})


def test_serve_history_per_request_keeps_no_store(make_pair, monkeypatch):
    """``serve --history-per-request`` loads with history_tokens=0; without it the budget is --history-tokens."""
    from pyllama_dspark import cli, server

    seen = []
    monkeypatch.setattr(server, "serve", lambda options, **kwargs: seen.append(options))
    pair = make_pair(spec("llama"))
    base = ["serve", "-m", str(pair.target), "-md", str(pair.drafter)]
    assert cli.main(base + ["--history-per-request"]) == 0
    assert cli.main(base + ["--history-tokens", "123"]) == 0
    assert cli.main(base) == 0
    assert [o.load_kwargs["history_tokens"] for o in seen] == [0, 123, pyllama_dspark.history.DEFAULT_HISTORY_TOKENS]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("parallel", [1, 2])
def test_a_server_shares_its_history_unless_kept_per_request(make_pair, parallel):
    """Two clients send the same prompt. Shared (the default), the first reply enters the server's store before the
    second request runs, and its slots read that store; per request (``serve --history-per-request``, which loads
    with history_tokens=0) there is no store: no reply of one client can draft for another, and no reply
    carries a "history" source. Outputs are plain greedy decoding's either way."""
    pytest.importorskip("starlette", reason="the server needs the [server] extra")
    pytest.importorskip("uvicorn", reason="the server needs the [server] extra")
    openai = pytest.importorskip("openai", reason="the server tests need the openai client")
    from pyllama_dspark.server import BackgroundServer

    pair = make_pair(TinySpec(arch="llama", n_layer=3, vocab="llama-spm", chat_template="chatml"))
    prompt = "Tell me about the sea"
    with Model(pair.target) as model:
        ctx = Context(model, n_ctx=512)
        expected = generate(ctx, prompt, max_tokens=24).text
        ctx.close()
    for per_request in (False, True):
        kwargs = {"history_tokens": 0} if per_request else {}
        with BackgroundServer(pair.target, drafter=pair.drafter, n_ctx=512, parallel=parallel,
                              load_kwargs=kwargs) as server:
            texts, sources = [], []
            for _ in range(2):  # two clients, one after the other
                client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
                reply = client.completions.create(model=Path(pair.target).name, prompt=prompt, max_tokens=24,
                                                  temperature=0)
                texts.append(reply.choices[0].text)
                sources.append(set(reply.model_extra["speculative"]["by_source"]))
            history = server.engine.llm.history
            assert texts == [expected, expected]
            if per_request:
                assert history is None and all(HISTORY not in s for s in sources)
            else:
                assert history.n_entries == 2 and HISTORY not in sources[0]
