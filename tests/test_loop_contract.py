"""What the speculative loop promises beyond "same tokens": where it stops on an end-of-generation
token, exactly which rows a drafter observes, and a target memory rolled back to the committed tokens.

Every expectation is computed independently of the loop: plain decoding (``generate``) for tokens,
one plain decode with capture for the rows, a fresh context for the memory after a rollback.
"""

from __future__ import annotations

import numpy as np
import pytest

import drafters
from conftest import ARCHS, copy_with_value
from pyllama_dspark import Context, Model, generate
from pyllama_dspark.batch import Batch
from pyllama_dspark.speculative import Speculator

PROMPT = (np.arange(40) * 37 % 251 + 1).tolist()  # 40 tokens: three prefill chunks at n_batch 16
N_TOKENS = 24
BLOCK = 4


def plain_tokens(model, prompt, n, **kw):
    ctx = Context(model, n_ctx=256)
    try:
        return generate(ctx, prompt, max_tokens=n, **kw)
    finally:
        ctx.close()


def spec_context(model):
    return Context(model, n_ctx=256, n_batch=16, n_ubatch=8, n_rs_seq=Speculator.target_rs_seq(BLOCK))


# --------------------------------------------------------------------------
# an end-of-generation token inside an accepted block


def with_eos(src, tmp_path, token: int):
    """A copy of the GGUF at src whose end-of-sequence token is ``token``."""
    return copy_with_value(src, tmp_path / f"eos-{token}.gguf", "tokenizer.ggml.eos_token_id", token)


@pytest.mark.parametrize("stream", [False, True])
def test_eog_inside_an_accepted_block_ends_the_generation_there(make_model, tmp_path, stream):
    base = make_model(arch="llama", vocab="llama-spm")
    prompt = "The quick brown fox"
    with Model(base) as model:
        ids = model.tokenize(prompt, parse_special=True).tolist()
        free = plain_tokens(model, prompt, 20, stop_at_eog=False).tokens
    # the oracle's rounds commit tokens [0], [1..5], [6..10]: token 7 is the second draft of round 2
    eog_index = 7
    assert free[eog_index] not in free[:eog_index], "the fixture needs a token not seen before index 7"
    with Model(with_eos(base, tmp_path, free[eog_index])) as model:
        assert model.is_eog(free[eog_index])
        plain = plain_tokens(model, prompt, 20)
        assert plain.tokens == free[: eog_index + 1] and plain.stop_reason == "eog"
        ctx = Context(model, n_ctx=256)
        spec = Speculator(ctx, drafters.oracle(ids + free, model.n_vocab, BLOCK), n_draft=BLOCK)
        if stream:
            events = list(spec.generate(prompt, max_tokens=20, stream=True))
            tokens, text, stop_reason = [e.token for e in events if e.token >= 0], "".join(e.text for e in events), \
                spec.last_stats.stop_reason
        else:
            result = spec.generate(prompt, max_tokens=20)
            tokens, text, stop_reason = result.tokens, result.text, result.stop_reason
        assert tokens == plain.tokens, "the end-of-generation token and nothing after it ends the output"
        assert text == plain.text and stop_reason == "eog"
        steps = list(spec.run(np.asarray(ids, dtype=np.int32), max_tokens=20))
        assert [s.tokens for s in steps] == [free[:1], free[1:6], free[6:8]]
        assert steps[-1].from_draft == [True, True] and steps[-1].n_accept == 4
        assert spec.n_draft == BLOCK and sum(len(s.tokens) for s in steps) == eog_index + 1


# --------------------------------------------------------------------------
# the rows a drafter observes


def reference_capture(model, tokens, layers) -> np.ndarray:
    """The target's capture rows of ``tokens`` from one plain decode, by position."""
    ctx = Context(model, n_ctx=256, n_batch=256)
    try:
        ctx.set_capture_layers(layers, masked=False)
        batch = Batch(len(tokens))
        batch.add_tokens(np.asarray(tokens, dtype=np.int32), 0, logits="last")
        ctx.decode(batch)
        return ctx.capture().copy()
    finally:
        ctx.close()


@pytest.mark.parametrize("kind,right", [("full acceptance", BLOCK), ("partial acceptance", 2), ("rejection", 0)])
@pytest.mark.parametrize("arch", ARCHS)
def test_drafter_observes_exactly_the_committed_rows(make_model, arch, kind, right):
    with Model(make_model(arch=arch, n_layer=3)) as model:
        expected = plain_tokens(model, PROMPT, N_TOKENS, stop_at_eog=False).tokens
        full = PROMPT + expected
        layers = [0, 2]
        drafter = drafters.ScriptedDrafter(full, n_vocab=model.n_vocab, block_size=BLOCK, right=right,
                                           capture_layers=layers)
        ctx = spec_context(model)
        steps = list(Speculator(ctx, drafter, n_draft=BLOCK).run(np.asarray(PROMPT, dtype=np.int32),
                                                                max_tokens=N_TOKENS, stop_at_eog=False))
        ctx.close()
        assert [t for s in steps for t in s.tokens] == expected
        # prefill in n_batch chunks, then per round the anchor and the accepted drafts at the anchor's position
        want = [(p, min(16, len(PROMPT) - p)) for p in range(0, len(PROMPT), 16)]
        pos = len(PROMPT)
        for step in steps[1:]:
            want.append((pos, step.n_accept + 1))
            pos += len(step.tokens)
        assert [(p, len(t)) for p, t, _ in drafter.observed] == want, f"observe (pos0, n) calls, {kind}"
        rows = reference_capture(model, full[:pos], layers)
        for pos0, tokens, observed_rows in drafter.observed:
            assert tokens == full[pos0: pos0 + len(tokens)], f"tokens observed at {pos0}"
            np.testing.assert_array_equal(observed_rows, rows[pos0: pos0 + len(tokens)],
                                          err_msg=f"{arch} {kind}: rows observed at {pos0} are not the target's")


# --------------------------------------------------------------------------
# rollback


@pytest.mark.parametrize("arch", ARCHS)
def test_a_rejected_tail_leaves_the_target_as_if_only_the_committed_tokens_were_decoded(make_model, arch):
    with Model(make_model(arch=arch, n_layer=3)) as model:
        prompt = PROMPT[:7]
        full = prompt + plain_tokens(model, prompt, N_TOKENS, stop_at_eog=False).tokens
        ctx = spec_context(model)
        # one right draft of four: each round commits 2 tokens and must drop 3 verified cells
        run = Speculator(ctx, drafters.prefix(full, model.n_vocab, 1, BLOCK), n_draft=BLOCK).run(
            np.asarray(prompt, dtype=np.int32), max_tokens=N_TOKENS, stop_at_eog=False)
        first, round_with_rejection = next(run), next(run)
        run.close()  # the consumer stops right after the rejection, before any further decode could notice it
        assert round_with_rejection.n_draft == BLOCK and round_with_rejection.n_accept == 1
        committed = first.tokens + round_with_rejection.tokens
        anchor_pos = len(prompt) + len(committed) - 1  # the last token is the anchor, not yet decoded
        assert ctx.seq_pos_max(0) == anchor_pos - 1, "the target's memory must end at the last committed cell"
        batch = Batch(8)
        batch.add_tokens(np.asarray([committed[-1]], dtype=np.int32), anchor_pos, logits="last")
        ctx.decode(batch)
        after_rollback = ctx.logits(-1).copy()
        ctx.close()
        fresh = Context(model, n_ctx=256, n_rs_seq=Speculator.target_rs_seq(BLOCK))
        sequence = prompt + committed
        batch = Batch(len(sequence))
        batch.add_tokens(np.asarray(sequence, dtype=np.int32), 0, logits="last")
        fresh.decode(batch)
        np.testing.assert_array_equal(after_rollback, fresh.logits(-1),
                                      err_msg=f"{arch}: the next token's logits after a rollback differ from a "
                                              "fresh decode of the committed tokens")
        fresh.close()
