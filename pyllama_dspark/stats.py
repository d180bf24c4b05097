"""SpecStats: what a speculative generation did, in vLLM / llama.cpp vocabulary.

Definitions (DSPARK.md "Metrics"):
- drafted: draft tokens sent to verify; accepted: of those, accepted.
- accept rate = accepted / drafted.
- rounds: verify decodes that checked at least one draft token; plain steps (a round that drafted
  nothing: the cost-aware loop's k = 0, or a draft shorter than n_draft_min) are counted apart.
- tau (mean acceptance length) = accepted / rounds + 1 (the +1 is the target's own token).
- per-position acceptance (1-based i): position i is reached iff i <= a + 1 (and i <= drafted that
  round), accepted iff i <= a.
- by source: the same counts for each draft source (``Step.source``: "dspark", "lookup", "history",
  "grammar"), which sum to the totals; a source's draft time includes rounds whose drafts were all cut
  (they count as plain steps). A "grammar" round's block starts with the tokens the grammar forces and may
  go on with a free source's tokens; ``n_forced`` / ``n_forced_accepted`` count the forced tokens alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DraftCounts:
    """Rounds that verified drafts and what became of the drafts: a generation's totals, or one source's share."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    reached_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)
    t_draft: float = 0.0

    def _count(self, n_drafted: int, n_accepted: int) -> None:
        """One verify that checked n_drafted > 0 draft tokens and accepted n_accepted."""
        self.rounds += 1
        self.drafted += n_drafted
        self.accepted += n_accepted
        while len(self.reached_per_pos) < n_drafted:
            self.reached_per_pos.append(0)
            self.accepted_per_pos.append(0)
        for i in range(1, n_drafted + 1):
            self.reached_per_pos[i - 1] += i <= n_accepted + 1
            self.accepted_per_pos[i - 1] += i <= n_accepted

    @property
    def accept_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tau(self) -> float:
        """Mean acceptance length, bonus token included."""
        return self.accepted / self.rounds + 1.0 if self.rounds else 0.0

    @property
    def per_position_rate(self) -> list[float]:
        return [a / r if r else 0.0 for a, r in zip(self.accepted_per_pos, self.reached_per_pos)]

    def summary(self) -> str:
        """One line: rounds, drafted, accepted, accept rate, tau, per-position acceptance, draft time."""
        return (f"rounds {self.rounds}, drafted {self.drafted}, accepted {self.accepted}, "
                f"accept {100 * self.accept_rate:.3f}%, tau {self.tau:.3f}, "
                f"per_position {' '.join(f'{r:.2f}' for r in self.per_position_rate) or '-'}, "
                f"t_draft {self.t_draft:.3f} s")

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
            "accept_rate": self.accept_rate, "tau": self.tau,
            "accepted_per_pos": list(self.accepted_per_pos), "reached_per_pos": list(self.reached_per_pos),
            "t_draft": self.t_draft,
        }


@dataclass
class SpecStats(DraftCounts):
    """What one generation did: token counts, timings, why it stopped, and what became of its drafts, in total and
    per draft source (the definitions are in the module docstring). Plain decoding fills the counts and timings;
    its drafting figures stay 0. ``GenerationResult.stats`` and ``Speculator.last_stats`` hold one.

    Attributes:
        rounds: verify decodes that checked at least one draft token.
        drafted: draft tokens sent to verify.
        accepted: of those, accepted.
        reached_per_pos: per draft position (index i - 1 for position i), the rounds that reached it.
        accepted_per_pos: per draft position, the rounds that accepted it.
        t_draft: seconds spent drafting.
        n_prompt: prompt tokens.
        n_generated: generated tokens.
        plain_steps: rounds that verified no draft (the cost-aware loop's k = 0, or a draft shorter than
            n_draft_min).
        t_prefill: seconds spent decoding the prompt.
        t_decode: seconds from the end of the prefill to the end of the generation.
        t_verify: seconds spent in rounds after drafting (the verify decode, acceptance, commit).
        stop_reason: "eog", "stop", "max_tokens", "n_ctx" or "cancelled"; "" until known.
        n_reused: prompt tokens whose memory a previous generation left (``reuse_prefix``).
        n_draft_invalid: drafted tokens cut because the grammar refused them or a token before them.
        n_forced: of the drafted tokens, those a grammar forced (in rounds of source "grammar").
        n_forced_accepted: of those, accepted.
        by_source: draft source name ("dspark", "lookup", "history", "grammar") -> its ``DraftCounts``, in the
            order the sources first drafted; their counts sum to the totals.

    The derived figures are properties: ``accept_rate``, ``tau`` (mean acceptance length, bonus token included),
    ``per_position_rate``, ``decode_tok_s`` and ``total_tok_s``. ``format()`` writes the figures as a text block,
    ``as_dict()`` as plain JSON values.
    """

    n_prompt: int = 0
    n_generated: int = 0
    plain_steps: int = 0
    t_prefill: float = 0.0
    t_decode: float = 0.0
    t_verify: float = 0.0
    stop_reason: str = ""
    n_reused: int = 0  # prompt tokens whose memory a previous generation left (reuse_prefix)
    n_draft_invalid: int = 0  # drafted tokens cut because the grammar refused them or a token before them
    n_forced: int = 0  # of the drafted tokens, those a grammar forced (in rounds of source "grammar")
    n_forced_accepted: int = 0  # of those, accepted
    by_source: dict[str, DraftCounts] = field(default_factory=dict)  # in the order the sources first drafted

    def observe_round(self, n_drafted: int, n_accepted: int, *, source: str = "", t_draft: float = 0.0,
                      forced=None) -> None:
        """Record one verify decode that checked n_drafted draft tokens and accepted n_accepted.

        ``source`` names what drafted this round ("" for nothing: its counts then go to the totals only);
        ``t_draft`` (seconds spent drafting) is added to the totals and to the source's; ``forced`` (a grammar's
        draft: one flag per drafted token, true where the grammar forced it) adds to ``n_forced`` and
        ``n_forced_accepted``.
        """
        if not 0 <= n_accepted <= n_drafted:
            raise ValueError(f"accepted {n_accepted} of {n_drafted} drafted")
        if forced is not None:
            self.n_forced += int(sum(bool(f) for f in forced[:n_drafted]))
            self.n_forced_accepted += int(sum(bool(f) for f in forced[:n_accepted]))
        self.t_draft += t_draft
        share = self.by_source.setdefault(source, DraftCounts()) if source else None
        if share is not None:
            share.t_draft += t_draft
        if n_drafted == 0:
            self.plain_steps += 1
            return
        self._count(n_drafted, n_accepted)
        if share is not None:
            share._count(n_drafted, n_accepted)

    @property
    def decode_tok_s(self) -> float:
        """Generated tokens per second of decode time (prefill excluded)."""
        return self.n_generated / self.t_decode if self.t_decode > 0 else 0.0

    @property
    def total_tok_s(self) -> float:
        """Generated tokens per second including prefill."""
        total = self.t_prefill + self.t_decode
        return self.n_generated / total if total > 0 else 0.0

    def format(self) -> str:
        """An aligned `key = value` block, like speculative-simple's; one ``by <source>`` line per draft source."""
        rows = [
            ("n_prompt", self.n_prompt), ("n_reused", self.n_reused), ("n_generated", self.n_generated),
            ("rounds", self.rounds),
            ("plain_steps", self.plain_steps),
            ("n_drafted", self.drafted), ("n_accepted", self.accepted),
            ("accept", f"{100 * self.accept_rate:.3f}%"), ("tau", f"{self.tau:.3f}"),
            ("per_position", " ".join(f"{r:.2f}" for r in self.per_position_rate)),
            *((("draft_invalid", self.n_draft_invalid),) if self.n_draft_invalid else ()),
            *((("forced", f"{self.n_forced_accepted} of {self.n_forced} accepted"),) if self.n_forced else ()),
            *((f"by {name}", share.summary()) for name, share in self.by_source.items()),
            ("t_prefill", f"{self.t_prefill:.3f} s"), ("t_decode", f"{self.t_decode:.3f} s"),
            ("t_draft", f"{self.t_draft:.3f} s"), ("t_verify", f"{self.t_verify:.3f} s"),
            ("decode_tok_s", f"{self.decode_tok_s:.2f}"), ("total_tok_s", f"{self.total_tok_s:.2f}"),
        ]
        return "\n".join(f"{key:<13} = {value}" for key, value in rows)

    def as_dict(self) -> dict:
        """The figures as plain JSON values; ``by_source`` maps each draft source to its rounds, drafted, accepted,
        accept_rate, tau, accepted_per_pos, reached_per_pos and t_draft."""
        return {
            "n_prompt": self.n_prompt, "n_reused": self.n_reused, "n_generated": self.n_generated,
            "rounds": self.rounds,
            "plain_steps": self.plain_steps,
            "drafted": self.drafted, "accepted": self.accepted, "accept_rate": self.accept_rate, "tau": self.tau,
            "draft_invalid": self.n_draft_invalid, "forced": self.n_forced, "forced_accepted": self.n_forced_accepted,
            "accepted_per_pos": list(self.accepted_per_pos), "reached_per_pos": list(self.reached_per_pos),
            "t_prefill": self.t_prefill, "t_decode": self.t_decode, "decode_tok_s": self.decode_tok_s,
            "by_source": {name: share.as_dict() for name, share in self.by_source.items()},
        }
