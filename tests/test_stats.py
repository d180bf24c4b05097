"""SpecStats against literal values, with every term of every formula non-zero (so a changed formula, a swapped
term or a dropped count shows), on what users read: the properties, ``format()`` (``--stats``, the demo) and
``as_dict()`` (``--json``, completion dicts). Pure: no model."""

from __future__ import annotations

import pytest

from pyllama_dspark.stats import DraftCounts, SpecStats


def made_up() -> SpecStats:
    """Three verify rounds from two sources and one plain step; times in exact binary fractions."""
    stats = SpecStats(n_prompt=7, n_reused=3, n_generated=40, t_prefill=0.5, t_decode=2.0, t_verify=1.25,
                      stop_reason="length", n_draft_invalid=2)
    stats.observe_round(4, 2, source="dspark", t_draft=0.25)
    stats.observe_round(3, 3, source="lookup", t_draft=0.125)
    stats.observe_round(2, 0, source="dspark", t_draft=0.0625)
    stats.observe_round(0, 0, source="dspark", t_draft=0.03125)  # drafted nothing: a plain step
    return stats


def test_counts_and_rates_of_the_made_up_generation():
    s = made_up()
    assert (s.rounds, s.drafted, s.accepted, s.plain_steps) == (3, 9, 5, 1)
    # round (4 drafted, 2 accepted) reaches positions 1-3 and accepts 1-2; (3, 3) reaches and accepts 1-3;
    # (2, 0) reaches position 1 only and accepts none
    assert s.reached_per_pos == [3, 2, 2, 0]
    assert s.accepted_per_pos == [2, 2, 1, 0]
    assert s.per_position_rate == [2 / 3, 1.0, 0.5, 0.0]
    assert s.accept_rate == 5 / 9
    assert s.tau == 5 / 3 + 1
    assert s.t_draft == 0.46875
    assert s.decode_tok_s == 20.0  # 40 tokens / 2.0 s of decoding
    assert s.total_tok_s == 16.0  # 40 tokens / (0.5 + 2.0) s


def test_each_source_keeps_its_own_share():
    s = made_up()
    assert list(s.by_source) == ["dspark", "lookup"]  # in the order they first drafted
    dspark, lookup = s.by_source["dspark"], s.by_source["lookup"]
    assert (dspark.rounds, dspark.drafted, dspark.accepted) == (2, 6, 2)
    assert dspark.reached_per_pos == [2, 1, 1, 0] and dspark.accepted_per_pos == [1, 1, 0, 0]
    assert dspark.t_draft == 0.34375  # its plain step's draft time included
    assert dspark.accept_rate == 1 / 3 and dspark.tau == 2.0
    assert (lookup.rounds, lookup.drafted, lookup.accepted, lookup.t_draft) == (1, 3, 3, 0.125)
    assert lookup.tau == 4.0 and lookup.accept_rate == 1.0 and lookup.per_position_rate == [1.0, 1.0, 1.0]
    assert dspark.rounds + lookup.rounds == s.rounds and dspark.accepted + lookup.accepted == s.accepted


def test_format_prints_every_figure():
    assert made_up().format() == "\n".join([
        "n_prompt      = 7",
        "n_reused      = 3",
        "n_generated   = 40",
        "rounds        = 3",
        "plain_steps   = 1",
        "n_drafted     = 9",
        "n_accepted    = 5",
        "accept        = 55.556%",
        "tau           = 2.667",
        "per_position  = 0.67 1.00 0.50 0.00",
        "draft_invalid = 2",
        "by dspark     = rounds 2, drafted 6, accepted 2, accept 33.333%, tau 2.000, per_position 0.50 1.00 0.00 "
        "0.00, t_draft 0.344 s",
        "by lookup     = rounds 1, drafted 3, accepted 3, accept 100.000%, tau 4.000, per_position 1.00 1.00 1.00, "
        "t_draft 0.125 s",
        "t_prefill     = 0.500 s",
        "t_decode      = 2.000 s",
        "t_draft       = 0.469 s",
        "t_verify      = 1.250 s",
        "decode_tok_s  = 20.00",
        "total_tok_s   = 16.00",
    ])


def test_as_dict_has_every_figure():
    assert made_up().as_dict() == {
        "n_prompt": 7, "n_reused": 3, "n_generated": 40, "rounds": 3, "plain_steps": 1,
        "drafted": 9, "accepted": 5, "accept_rate": 5 / 9, "tau": 5 / 3 + 1, "draft_invalid": 2,
        "forced": 0, "forced_accepted": 0, "accepted_per_pos": [2, 2, 1, 0], "reached_per_pos": [3, 2, 2, 0],
        "t_prefill": 0.5, "t_decode": 2.0, "decode_tok_s": 20.0,
        "by_source": {
            "dspark": {"rounds": 2, "drafted": 6, "accepted": 2, "accept_rate": 1 / 3, "tau": 2.0,
                       "accepted_per_pos": [1, 1, 0, 0], "reached_per_pos": [2, 1, 1, 0], "t_draft": 0.34375},
            "lookup": {"rounds": 1, "drafted": 3, "accepted": 3, "accept_rate": 1.0, "tau": 4.0,
                       "accepted_per_pos": [1, 1, 1], "reached_per_pos": [1, 1, 1], "t_draft": 0.125},
        },
    }


def test_forced_tokens_are_counted_apart_within_their_rounds():
    """A grammar round's block: forced tokens, a free source's continuation, a forced key; 2 accepted."""
    s = SpecStats()
    s.observe_round(4, 2, source="grammar", forced=[True, True, False, True])
    s.observe_round(2, 2, source="grammar", forced=[True, True, True])  # a draft cut to 2 of its 3 tokens
    assert (s.n_forced, s.n_forced_accepted) == (5, 4)
    assert s.by_source["grammar"].drafted == 6 and s.by_source["grammar"].accepted == 4
    assert "forced        = 4 of 5 accepted" in s.format()
    assert s.as_dict()["forced"] == 5 and s.as_dict()["forced_accepted"] == 4
    assert "forced" not in made_up().format()  # shown only when a grammar forced drafts


def test_as_dict_copies_the_per_position_lists():
    s = made_up()
    d = s.as_dict()
    d["accepted_per_pos"].append(9)
    d["by_source"]["lookup"]["reached_per_pos"].append(9)
    assert s.accepted_per_pos == [2, 2, 1, 0] and s.by_source["lookup"].reached_per_pos == [1, 1, 1]


def test_an_empty_generation_reads_zero_everywhere():
    s = SpecStats()
    assert (s.accept_rate, s.tau, s.decode_tok_s, s.total_tok_s, s.per_position_rate) == (0.0, 0.0, 0.0, 0.0, [])
    assert "per_position  = \n" in s.format() and "by " not in s.format()
    assert "draft_invalid" not in s.format()  # shown only when a grammar cut drafts
    assert DraftCounts().summary() == ("rounds 0, drafted 0, accepted 0, accept 0.000%, tau 0.000, per_position -, "
                                       "t_draft 0.000 s")


def test_prefill_alone_still_gives_a_total_rate():
    s = SpecStats(n_generated=6, t_prefill=1.5, t_decode=0.0)
    assert s.decode_tok_s == 0.0 and s.total_tok_s == 4.0


def test_rounds_without_a_source_count_in_the_totals_only():
    s = SpecStats()
    s.observe_round(2, 1, t_draft=0.5)
    s.observe_round(0, 0, t_draft=0.25)
    assert (s.rounds, s.drafted, s.accepted, s.plain_steps, s.t_draft, s.by_source) == (1, 2, 1, 1, 0.75, {})


def test_plain_steps_add_up_and_an_untimed_round_adds_no_draft_time():
    s = SpecStats()
    for _ in range(3):
        s.observe_round(0, 0, source="lookup")
    s.observe_round(1, 1, source="lookup")
    assert (s.plain_steps, s.rounds, s.t_draft, s.by_source["lookup"].t_draft) == (3, 1, 0.0, 0.0)


@pytest.mark.parametrize("drafted, accepted", [(2, 3), (1, -1), (0, 1)])
def test_impossible_rounds_are_refused(drafted, accepted):
    s = SpecStats()
    with pytest.raises(ValueError, match=f"accepted {accepted} of {drafted} drafted"):
        s.observe_round(drafted, accepted, source="dspark")
    assert (s.rounds, s.plain_steps, s.by_source) == (0, 0, {})
