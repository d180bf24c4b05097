"""The history store of earlier replies (pyllama_dspark.history): what it proposes, its budget, its threads.

Pure Python and numpy: no model. The loops that draft from it are tested in test_free_drafts.py."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from pyllama_dspark.history import KEY, HistoryStore


def test_a_stored_reply_is_proposed_after_its_suffix():
    store = HistoryStore(1000, context=0)
    store.add([10, 11, 12, 13, 14, 15, 16, 17])
    tokens, match = store.propose([99, 10, 11, 12], 8, spec_factor=2.0)
    assert match == 3
    assert tokens == [13, 14, 15, 16, 17]  # up to the entry's end: never past its separator


def test_nothing_is_proposed_without_a_match_or_room():
    store = HistoryStore(1000, context=0)
    store.add([1, 2, 3, 4])
    assert store.propose([7, 8], 4) == ([], 0)
    assert store.propose([1, 2], 0) == ([], 0)
    assert store.propose([2], 4) == ([], 0)  # shorter than a key


def test_the_draft_grows_with_the_match():
    """At most spec_factor x the match length: a two-token match drafts 4 at factor 2, a longer one more, and
    the default factor 1 drafts as many tokens as matched."""
    reply = list(range(100, 140))
    store = HistoryStore(1000, context=0)
    store.add(reply)
    short, m_short = store.propose([1, 100, 101], 30, spec_factor=2.0)
    long, m_long = store.propose(reply[:12], 30, spec_factor=2.0)
    assert (m_short, len(short)) == (2, 4)
    assert m_long == 12 and long == reply[12:36]
    assert store.propose(reply[:12], 30)[0] == reply[12:24]


def test_the_longest_suffix_wins_over_more_recent_shorter_ones():
    store = HistoryStore(1000, context=0)
    store.add([5, 6, 7, 8, 50, 51, 52])  # the long match: 5 6 7 8 -> 50 ...
    store.add([1, 7, 8, 60, 61, 62])  # a later, shorter one: 7 8 -> 60
    tokens, match = store.propose([5, 6, 7, 8], 3)
    assert match == 4 and tokens == [50, 51, 52]


def test_continuations_are_scored_by_frequency_and_stop_below_the_minimum_probability():
    store = HistoryStore(1000, context=0)
    for _ in range(3):
        store.add([1, 2, 3, 4, 5])
    store.add([1, 2, 3, 9, 9])
    tokens, _ = store.propose([1, 2, 3], 2, spec_factor=10)
    assert tokens == [4, 5]  # 3 of 4 occurrences go on with 4
    # p(4) = 3/4 then p(5 | 4) = 1: a minimum of 0.8 stops before the first token
    assert store.propose([1, 2, 3], 2, spec_factor=10, min_probability=0.8)[0] == []
    for _ in range(4):
        store.add([1, 2, 3, 8, 8])
    # now 4 of 8 go on with 8, 3 with 4: 8 is proposed while its share holds
    assert store.propose([1, 2, 3], 2, spec_factor=10, min_probability=0.4)[0] == [8, 8]


def test_the_prompt_context_lets_a_reply_start_be_matched():
    store = HistoryStore(1000, context=3)
    store.add([40, 41, 42, 43], prompt=[1, 2, 3, 7, 8, 9])
    assert store.n_tokens == 3 + 4 + 1  # context, reply, separator
    assert store.propose([0, 8, 9], 4, spec_factor=2.0)[0] == [40, 41, 42, 43]


def test_the_oldest_entries_go_first():
    store = HistoryStore(20, context=0)
    store.add([1, 2, 3, 4, 5, 6, 7, 8, 9])  # 10 with its separator
    store.add([11, 12, 13, 14, 15, 16, 17, 18, 19])  # 20: full
    assert store.propose([1, 2], 4, spec_factor=2.0)[0] == [3, 4, 5, 6]
    store.add([21, 22, 23])  # the first entry goes
    assert store.n_tokens == 14 and store.n_entries == 2
    assert store.propose([1, 2], 4) == ([], 0)
    assert store.propose([11, 12], 4, spec_factor=2.0)[0] == [13, 14, 15, 16]
    assert store.propose([21, 22], 4)[0] == [23]


def test_an_entry_larger_than_the_budget_keeps_its_end():
    store = HistoryStore(8, context=0)
    store.add(list(range(100, 120)))
    assert store.n_tokens == 8 and store.n_entries == 1
    assert store.propose([113, 114], 2)[0] == [115, 116]
    assert store.propose([100, 101], 2) == ([], 0)


def test_memory_stays_within_the_budget_over_ten_thousand_requests():
    """10,000 replies of random length and repetitive content into a 500-token store: the tokens held, the
    index's positions and keys never exceed the budget, and the buffer stays bounded."""
    rng = np.random.default_rng(0)
    budget = 500
    store = HistoryStore(budget, context=4)
    high_water = 0
    for i in range(10_000):
        reply = rng.integers(0, 40, size=int(rng.integers(0, 60))).tolist()
        store.add(reply, prompt=rng.integers(0, 40, size=10).tolist())
        assert store.n_tokens <= budget
        assert store.n_postings <= store.n_tokens
        assert store.n_keys <= store.n_postings
        high_water = max(high_water, len(store._buf))
        if i % 97 == 0:
            tail = rng.integers(0, 40, size=8).tolist()
            tokens, _ = store.propose(tail, 8)
            assert len(tokens) <= 8
    assert high_water <= 4 * budget + 64
    # the index is exactly the live tokens' keys: every posting lies in the live range
    live = set(range(store._start, store._end))
    assert all(g in live for postings in store._index.values() for g in postings)


def test_a_zero_budget_keeps_nothing():
    store = HistoryStore(0)
    store.add([1, 2, 3, 4])
    assert store.n_tokens == 0 and store.propose([1, 2], 4) == ([], 0)


@pytest.mark.parametrize("budget", [-1, 1.5, True, "100"])
def test_a_bad_budget_is_refused(budget):
    with pytest.raises(ValueError, match="budget"):
        HistoryStore(budget)


def test_token_ids_outside_the_key_range_are_refused():
    with pytest.raises(ValueError, match="token ids"):
        HistoryStore(100).add([1, -5, 3])


def test_threads_adding_and_proposing_at_once_keep_the_store_consistent():
    store = HistoryStore(300, context=2)
    errors: list[BaseException] = []

    def writer(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(400):
                store.add(rng.integers(0, 30, size=int(rng.integers(KEY, 40))).tolist(), prompt=[1, 2, 3])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def reader(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(2000):
                tokens, match = store.propose(rng.integers(0, 30, size=6).tolist(), 8)
                assert len(tokens) <= 8 and (match == 0 or match >= KEY)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(s,)) for s in range(3)]
    threads += [threading.Thread(target=reader, args=(s,)) for s in range(10, 13)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    assert store.n_tokens <= 300 and store.n_postings <= store.n_tokens
