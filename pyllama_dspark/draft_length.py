"""Cost-aware draft length: how many tokens to draft and to verify in each round.

A round that drafts k tokens commits E[tokens | k] = 1 + sum_{i<k} prod_{j<=i} a_j tokens, where a_j
is the chance that slot j is accepted once slots < j were, and costs draft(k) + verify(k + 1). The
chooser picks the k in 0..k_max with the most expected tokens per second (ARCHITECTURE.md section 8).
k = 0 is a plain decode step.

Two decisions per round, both pure functions of the state below:

1. ``plan(k_max)``, before drafting: the number of slots to draft, from the running per-slot
   acceptance (this drafter on this text so far) and the measured costs;
2. ``cut(confidence, k_drafted)``, after drafting: how many of the drafted tokens to verify, from the
   drafter's per-slot confidences when it has a confidence head (the draft cost is spent by then, so
   only the verify cost of each further token weighs against its expected gain).

Costs are seconds measured on the running machine by the loop (``observe_round``), kept current with
a moving average per row count (``CostTable``: robust to one stalled round); row counts not measured yet
are filled from a straight line through the measured ones, weighted by how often each was measured (cost
grows about linearly with rows at these sizes). A chooser that
settled on k = 0 still probes one draft token now and then (every ``probe_every`` plain rounds, the gap
doubling after rejected probes while drafting keeps not paying), so a drafter that becomes useful later
in the text is noticed.

A drafter with several sources (``HybridDrafter``: prompt lookup and a model drafter) gets one chooser per
source from a ``SourceChooser``: each source keeps its own running acceptance and draft costs, all share the
verify costs (one target verifies every source's drafts), and each round the source whose best k promises
the most tokens per second drafts (ARCHITECTURE.md section 9). A source whose proposal is in hand before the
choice (prompt lookup: free to ask) is scored every round against what the target committed, so its
acceptance stays current even in rounds another source drafts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Collection, Mapping, Sequence

import numpy as np


def expected_tokens(accept: np.ndarray, k: int) -> float:
    """Committed tokens expected from a round verifying k drafts whose conditional acceptances are accept[:k]."""
    return float(expected_tokens_by_k(accept)[k])


def expected_tokens_by_k(accept: np.ndarray) -> np.ndarray:
    """E[tokens | k] for k = 0..len(accept): 1, 1 + a0, 1 + a0 + a0 a1, ..."""
    gains = np.cumprod(np.asarray(accept, dtype=np.float64))
    return np.concatenate([[1.0], 1.0 + np.cumsum(gains)])


def _rate(tokens: float, seconds: float) -> float:
    """tokens / seconds, infinite for no time (as numpy divides: a round measured at 0 s is the best)."""
    return tokens / seconds if seconds > 0 else math.inf


class CostTable:
    """Seconds per round part by row count: ``draft(k)`` (k slots drafted) and ``verify(n)`` (n target rows,
    including the commit work that follows).

    Each measured row count keeps a moving average of its measurements: the plain mean of the first 1 / alpha,
    then an exponential one with weight alpha. A measurement above twice the average of a row count measured
    before counts as twice the average: a stall of the machine is not the cost of a row count (a real change
    still comes through, alpha at a time). The fill-in is a line through the measured row counts, each
    weighted by how often it was measured (least squares), or the priors (in units of a one-row verify)
    scaled to the measurements. A row count's estimate is its average and the fill-in weighed together,
    the average by the number of its measurements and the fill-in by one: one slow round of a row count the
    loop rarely runs is not taken as its cost, and it still costs what it is measured to once measured often.
    """

    def __init__(self, n_max: int, *, alpha: float = 0.2, verify_prior: tuple[float, float] = (1.0, 0.5),
                 draft_prior: tuple[float, float] = (0.2, 0.05), refit_every: int = 32):
        self.alpha = float(alpha)
        self._measured = {"verify": np.full(n_max + 2, np.nan), "draft": np.full(n_max + 2, np.nan)}
        self._counts = {"verify": np.zeros(n_max + 2), "draft": np.zeros(n_max + 2)}
        self._prior = {"verify": verify_prior, "draft": draft_prior}
        # the fill-in for unmeasured row counts is refitted when a row count is measured for the first time and
        # every refit_every rounds (a least-squares fit per round would cost a few percent of a decode)
        self._refit_every = int(refit_every)
        self._sharing = [self]  # the tables that read one verify measurement (share_verify)
        self._refit()

    def observe(self, k: int, t_draft: float, t_verify: float, k_drafted: int | None = None) -> None:
        """One round's measured parts: a draft of k_drafted slots (default k; t_draft is 0 for none) and a
        verify of k + 1 rows (k <= k_drafted: the drafts kept after the confidence cut)."""
        k_drafted = k if k_drafted is None else k_drafted
        new = False
        if k_drafted > 0:
            new |= self._update("draft", k_drafted, t_draft)
        new |= self._update("verify", k + 1, t_verify)
        self._since_fit += 1
        if new or self._since_fit >= self._refit_every:
            for table in self._sharing:  # their fill-in reads the verify measurements just updated
                table._refit()

    def share_verify(self, other: CostTable) -> None:
        """Read and update ``other``'s verify measurements from now on (this table's own are dropped); the draft
        costs stay apart. For draft sources verified by one target: a verify of n rows costs the same whoever
        drafted them, so every source's rounds measure it for all."""
        if len(other._measured["verify"]) != len(self._measured["verify"]):
            raise ValueError(f"tables for different row counts ({len(other._measured['verify']) - 2} and "
                             f"{len(self._measured['verify']) - 2} drafts) cannot share verify costs")
        self._measured["verify"] = other._measured["verify"]
        self._counts["verify"] = other._counts["verify"]
        other._sharing.append(self)
        self._sharing = other._sharing
        self._refit()

    def _refit(self) -> None:
        self._fits = {name: self._fill(name) for name in self._measured}
        self._since_fit = 0
        # the estimates, kept up to date between fits (the chooser reads them several times a round)
        self._estimated = {name: self._estimates(name) for name in self._measured}
        self._estimated["draft"][0] = 0.0
        self._round = (self._estimated["draft"][:-1] + self._estimated["verify"][1:]).tolist()

    def _estimates(self, name: str) -> np.ndarray:
        """The measured average weighed with the last fit by the number of measurements; the fit alone where
        nothing is measured."""
        measured, counts, fit = self._measured[name], self._counts[name], self._fits[name]
        # an unmeasured row count has count 0: the fit alone
        return (counts * np.where(np.isnan(measured), 0.0, measured) + fit) / (counts + 1.0)

    def _estimate_again(self, name: str, n: int) -> None:
        """Row count n's estimate after a measurement of it (as _estimates, between fits)."""
        count = float(self._counts[name][n])
        value = (count * float(self._measured[name][n]) + float(self._fits[name][n])) / (count + 1.0)
        self._estimated[name][n] = value
        if name == "verify":
            self._round[n - 1] = float(self._estimated["draft"][n - 1]) + value
        elif n < len(self._round):  # a draft of n >= 1 slots (the last row count has no round: no verify row)
            self._round[n] = value + float(self._estimated["verify"][n + 1])

    def measured(self, name: str) -> list[int]:
        """The row counts with a measurement of ``name`` ("verify" or "draft")."""
        return [int(n) for n in np.flatnonzero(~np.isnan(self._measured[name]))]

    def verify(self, n: int) -> float:
        return float(self._estimated["verify"][n])

    def draft(self, k: int) -> float:
        return float(self._estimated["draft"][k])  # 0 for k = 0 (set by _refit)

    def round_seconds(self, k_max: int) -> np.ndarray:
        """draft(k) + verify(k + 1) for k = 0..k_max."""
        return np.array(self._round[: k_max + 1])

    def round_seconds_list(self, k_max: int) -> list[float]:
        """``round_seconds`` as a list (for the chooser's per-round arithmetic: a few floats, where numpy's
        overhead per call would be most of the time)."""
        return self._round[: k_max + 1]

    def _update(self, name: str, n: int, seconds: float) -> bool:
        """Fold one measurement in; True if this row count had none before."""
        table, counts = self._measured[name], self._counts[name]
        if n >= len(table) or not np.isfinite(seconds) or seconds < 0:
            return False
        first = bool(np.isnan(table[n]))
        counts[n] += 1
        if first:
            table[n] = seconds
        else:
            weight = max(self.alpha, 1.0 / counts[n])
            if table[n] > 0:  # (an average of 0 s would cap every later measurement at 0)
                seconds = min(seconds, 2.0 * table[n])
            table[n] += weight * (seconds - table[n])
        for sharer in self._sharing if name == "verify" else (self,):  # one verify measurement serves every sharer
            sharer._estimate_again(name, n)
        return first

    def _fill(self, name: str) -> np.ndarray:
        """Estimates for every row count from the measured ones (read only where nothing is measured)."""
        table, (base, per_row) = self._measured[name], self._prior[name]
        rows = np.arange(len(table), dtype=np.float64)
        shape = base + per_row * (rows - 1)  # the prior, relative to a one-row verify
        known = np.flatnonzero(~np.isnan(table))
        if len(known) >= 2:  # a line through the measured points (least squares), not falling with more rows
            # weighted least squares in closed form (np.polyfit's SVD cost ~50 us a fit, several fits a refit)
            weight, values = self._counts[name][known], table[known]
            total = weight.sum()
            x_mean, y_mean = float(weight @ known) / total, float(weight @ values) / total
            dx = known - x_mean
            slope = max(0.0, float(np.sum(weight * dx * values) / np.sum(weight * dx * dx)))  # sum(weight * dx) = 0
            icept = y_mean - slope * x_mean  # flat at the weighted mean where the line would fall
            estimate = np.maximum(icept + slope * rows, 0.25 * np.min(table[known]))
        elif len(known) == 1:  # one measurement: the prior's shape scaled to it
            estimate = shape * table[known[0]] / shape[known[0]]
        else:
            v1 = self._measured["verify"][1]
            estimate = shape * (1.0 if np.isnan(v1) else v1)
        return estimate


class StaticCostTable(CostTable):
    """Costs given, not measured: ``verify[n]`` for n = 1..k_max + 1 rows and ``draft[k]`` for k = 1..k_max
    slots (seconds, or any common unit); ``observe`` changes nothing."""

    def __init__(self, verify: dict[int, float], draft: dict[int, float]):
        n_max = max(max(verify) - 1, max(draft, default=0))
        super().__init__(n_max)
        for name, given in (("verify", verify), ("draft", draft)):
            for n, seconds in given.items():
                self._measured[name][n], self._counts[name][n] = seconds, 1  # the fill-in weighs them alike
        self._refit()

    def observe(self, k: int, t_draft: float, t_verify: float, k_drafted: int | None = None) -> None:
        return None

    def _estimates(self, name: str) -> np.ndarray:
        """The given cost where there is one, the fit elsewhere (given costs are not averages to be doubted)."""
        given = self._measured[name]
        return np.where(np.isnan(given), self._fits[name], given)


@dataclass
class DraftLengthChooser:
    """Picks each round's draft length; see the module docstring.

    Args:
        k_max: most drafts per round (the drafter's block size or the loop's n_draft).
        accept_prior: assumed conditional acceptance of every slot before any round was seen (optimistic,
            so a good drafter is tried; a bad one is dropped after a few rejections).
        alpha: weight of the newest round in the running acceptance averages.
        probe_every: plain rounds between probes of one draft token once k = 0 was chosen (doubles, up to
            64, after each rejected probe while slot 0's running acceptance or a slow average of it
            (``slow_alpha``) is below the break-even; after an accepted probe, back to probe_every if the slow
            average is at the break-even or above, else halved, down to probe_every; back to probe_every once
            drafting pays); also, every probe_every-th
            drafting round drafts one slot more than planned, so the acceptance of the slot after the plan
            stays measured.
        margin: a draft is planned only where it promises at least 1 + margin times a plain step's tokens per
            second. The acceptances and costs are running estimates, and on a small target a round that
            drafts is at best a few percent better than a plain step on much text: without a margin the
            loop drafts wherever the noise says it pays, and loses a few percent where nothing pays.

    ``costs`` may be replaced by a ``StaticCostTable`` (known costs, not measured): decisions then depend on
    acceptance alone, which makes them reproducible.
    """

    k_max: int
    accept_prior: float = 0.8
    alpha: float = 0.1
    probe_every: int = 4
    costs: CostTable = field(init=False)
    accept: np.ndarray = field(init=False)
    _plain_rounds: int = field(default=0, init=False)
    _probe_gap: int = field(default=0, init=False)
    _drafted_rounds: int = field(default=0, init=False)
    slow_alpha: float = 0.05
    margin: float = 0.05
    _accept0_slow: float = field(default=0.0, init=False)

    def __post_init__(self):
        if self.k_max < 0:
            raise ValueError(f"k_max must be >= 0, got {self.k_max}")
        self.costs = CostTable(self.k_max)
        self.accept = np.full(self.k_max, float(self.accept_prior))
        self._probe_gap = self.probe_every
        self._accept0_slow = float(self.accept_prior)

    def best(self, k_max: int | None = None) -> int:
        """The k in 0..k_max with the most expected tokens per second by the running acceptance."""
        return self.best_rate(k_max)[0]

    def best_rate(self, k_max: int | None = None) -> tuple[int, float]:
        """``best(k_max)`` and the expected tokens per second (per cost unit) of a round drafting that many."""
        k_max = self.k_max if k_max is None else max(0, min(int(k_max), self.k_max))
        # expected_tokens_by_k over round_seconds, the first best k; in floats, not numpy (called a few times a
        # round on a few values, where numpy's overhead per call was ~20 us of each call's ~21)
        seconds = self.costs.round_seconds_list(k_max)
        best_k, best = 0, _rate(1.0, seconds[0])
        gain, gains = 1.0, 0.0  # summed as expected_tokens_by_k sums them, to the same float
        for k, accept in enumerate(self.accept[:k_max].tolist(), start=1):
            gain *= accept
            gains += gain
            rate = _rate(1.0 + gains, seconds[k]) / (1.0 + self.margin)  # a draft must beat a plain step by the margin
            if rate > best:
                best_k, best = k, rate
        return best_k, best

    def plan(self, k_max: int | None = None) -> int:
        """Slots to draft this round (0 = a plain decode step)."""
        cap = self.k_max if k_max is None else min(int(k_max), self.k_max)
        if cap <= 0:  # nothing may be drafted (end of the context or of max_tokens): no decision to make
            return 0
        best = self.best(cap)
        if best > 0:
            self._plain_rounds = 0
            self._drafted_rounds += 1
            if self._drafted_rounds % self.probe_every == 0:  # now and then one slot further, so the
                best = min(best + 1, cap)  # slot after the plan is measured
            return best
        self._plain_rounds += 1
        if self._plain_rounds >= self._probe_gap:  # now and then, check whether drafting pays again
            self._plain_rounds = 0
            return 1
        return 0

    def cut(self, confidence: np.ndarray | None, k_drafted: int, t_draft: float) -> int:
        """Drafted tokens to verify, given this round's per-slot confidences (None: keep them all).

        The draft time is spent: only each further token's verify cost weighs against its expected gain.
        At least one token is kept, so the running acceptance keeps learning from planned drafts.
        """
        if confidence is None or k_drafted <= 1:
            return k_drafted
        conf = np.clip(np.asarray(confidence[:k_drafted], dtype=np.float64), 0.0, 1.0)
        verify = np.array([self.costs.verify(k + 1) for k in range(1, k_drafted + 1)])
        rates = expected_tokens_by_k(conf)[1:] / (max(t_draft, 0.0) + verify)
        return 1 + int(np.argmax(rates))

    def observe_round(self, k: int, n_accepted: int, t_draft: float, t_verify: float,
                      k_drafted: int | None = None) -> None:
        """What the round did: k verified drafts (of k_drafted drafted, default k), n_accepted of them accepted,
        and its measured parts."""
        self.costs.observe(k, t_draft, t_verify, k_drafted)
        self.observe_acceptance(k, n_accepted)

    def observe_acceptance(self, k: int, n_accepted: int) -> None:
        """k drafts checked against the target, the first n_accepted of them right (a verified round, or a free
        proposal scored against what the target committed); no costs."""
        reached = min(k, n_accepted + 1, self.k_max)  # slot i was reached; accepted iff i < n_accepted
        for i in range(reached):
            self.accept[i] += self.alpha * (float(i < n_accepted) - self.accept[i])
        if k > 0:
            self._accept0_slow += self.slow_alpha * (float(n_accepted > 0) - self._accept0_slow)
            if self.best() > 0:  # drafting pays
                self._probe_gap = self.probe_every
            elif n_accepted > 0:
                # a right probe while drafting does not pay. Where the slow average says the drafter usually pays,
                # this was a dip: probe every probe_every rounds again. Where it does not, the text may be
                # changing: probe twice as often, not at once every few rounds (a drafter right 40 % of the time,
                # below its break-even, was then probed every few rounds and lost ~5 % of plain speed on QA: each
                # probe pays a draft and a verify row)
                self._probe_gap = self.probe_every if self._accept0_slow >= self.break_even() \
                    else max(self._probe_gap // 2, self.probe_every)
            elif min(self._accept0_slow, self.accept[0]) < self.break_even():
                # a rejected probe, and drafting does not pay by the running acceptance or a slow average of it:
                # probe half as often (the slow average alone kept an optimistic prior for some 14 probes)
                self._probe_gap = min(self._probe_gap * 2, 64)

    def break_even(self) -> float:
        """The acceptance of slot 0 at which drafting one token pays as much as a plain step (by the margin)."""
        return (1.0 + self.margin) * (self.costs.draft(1) + self.costs.verify(2)) / self.costs.verify(1) - 1.0


class SourceChooser:
    """Picks each round's draft source and draft length for a drafter with several sources (ARCHITECTURE.md
    section 9); see the module docstring.

    Args:
        k_max: source name -> most drafts per round from it, in the order the drafter lists its sources (ties
            go to the first).
        margin: every source's ``DraftLengthChooser.margin``.

    Attributes:
        choosers: source name -> its DraftLengthChooser (running acceptance, probing, cost table; the cost
            tables share one verify measurement). A table may be replaced by a ``StaticCostTable``.
    """

    def __init__(self, k_max: Mapping[str, int], *, margin: float = DraftLengthChooser.margin):
        if not k_max:
            raise ValueError("a SourceChooser needs at least one source")
        rows = max(int(k) for k in k_max.values())
        self.choosers = {name: DraftLengthChooser(int(k), margin=margin) for name, k in k_max.items()}
        # free proposals whose slots so far all matched, waiting for the next rounds' tokens: (source, the slots
        # not scored yet, the proposal's length, its slots found right)
        self._waiting: list[tuple[str, list[int], int, int]] = []
        first = None
        for chooser in self.choosers.values():
            chooser.costs = CostTable(rows)  # one size for all, so that the verify measurements can be shared
            if first is None:
                first = chooser.costs
            else:
                chooser.costs.share_verify(first)

    def choose(self, available: Mapping[str, int], *, free: Collection[str] = ()) -> tuple[str, int]:
        """This round's source and number of slots to draft from it (0: a plain decode step).

        Args:
            available: source -> most tokens it can draft now (the loop's cap, or a prompt lookup match's
                length); a source absent here cannot draft this round (prompt lookup without a match).
            free: sources whose proposals are in hand already and scored every round (``observe_free``): they
                never need a probe.

        The source whose best k promises the most tokens per second drafts, planned by its own chooser (which
        now and then drafts one slot more, to keep measuring the slot after its plan). When no source's best k
        drafts anything, the sources that are not free are asked in turn, so one that settled at plain steps
        still probes now and then. With nothing to draft the source returned is the last one asked.
        """
        caps = {name: max(0, min(int(n), self.choosers[name].k_max)) for name, n in available.items()}
        if not caps:
            return next(reversed(self.choosers)), 0
        rates = {name: self.choosers[name].best_rate(cap) for name, cap in caps.items()}
        drafting = [name for name in caps if rates[name][0] > 0]
        if drafting:
            source = max(drafting, key=lambda name: rates[name][1])  # the first of equals
            return source, self.choosers[source].plan(caps[source])
        source = next(reversed(caps))
        for name, cap in caps.items():
            if name in free:
                continue
            source = name
            k = self.choosers[name].plan(cap)
            if k > 0:
                return name, k
        return source, 0

    def observe_round(self, source: str, k: int, n_accepted: int, t_draft: float, t_verify: float,
                      k_drafted: int | None = None) -> None:
        """What the round drafted by ``source`` did (as ``DraftLengthChooser.observe_round``); its verify time
        serves every source."""
        self.choosers[source].observe_round(k, n_accepted, t_draft, t_verify, k_drafted)

    def observe_free(self, source: str, proposed: Sequence[int], committed: Sequence[int]) -> None:
        """A free source's proposal that was not verified, scored against the tokens the round committed (the
        accepted drafts, then the target's token): slot i is reached while the slots before it match and the
        target's token there is known, and accepted if it matches that token. Where every committed token
        matched and the proposal goes on, its rest is scored against what the next rounds commit
        (``observe_commit``): a plain round commits one token, and scoring only that left the acceptance of
        the later slots to the rounds that draft them, at their optimistic prior until then. At temperature
        > 0 a committed token is a draw from the target's distribution, so a deterministic proposal matches it
        with exactly the probability that rejection sampling would have accepted it."""
        self._score(source, [int(t) for t in proposed], len(proposed), 0, committed)

    def observe_commit(self, committed: Sequence[int]) -> None:
        """The tokens a round committed, for the free proposals of earlier rounds still waiting for them; call it
        every round, before that round's ``observe_free``."""
        waiting, self._waiting = self._waiting, []
        for source, rest, length, matched in waiting:
            self._score(source, rest, length, matched, committed)

    def forget_waiting(self) -> None:
        """Drop the proposals still waiting for tokens (a new text: the tokens they wait for never come)."""
        self._waiting = []

    def _score(self, source: str, rest: list[int], length: int, matched: int, committed: Sequence[int]) -> None:
        """Compare a proposal's unscored slots ``rest`` (of ``length``, ``matched`` right before them) with the
        committed tokens that follow them; score it once a slot is wrong or the proposal is used up."""
        known = min(len(rest), len(committed))
        right = next((i for i in range(known) if rest[i] != int(committed[i])), known)
        if right == len(committed) < len(rest):
            self._waiting.append((source, rest[right:], length, matched + right))
        else:
            self.choosers[source].observe_acceptance(length, matched + right)
