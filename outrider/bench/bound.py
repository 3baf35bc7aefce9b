"""Analytic bound (docs/design.md#cost-model), from a configuration's own statistics (pure).

**Tokens per round.** The cost model writes E = (1 − α^(k+1)) / (1 − α), which
assumes every draft position is accepted independently with the same α. Real
drafts are not like that: acceptances come in runs (prompt lookup copies a
whole span or nothing; early positions are accepted more often than late
ones), and with α = accepted/drafted that formula comes out below the tokens
a round really commits — a "bound" the implementation beats for prompt
lookup (docs/benchmark.md#machines-and-method). So E is taken from the measured
accepted-per-position distribution instead. With R = ``num_drafts`` (rounds
that verified at least one draft) and a_i = ``accepted_per_position[i]``
(rounds whose draft at position i was accepted), a drafting round commits
its accepted drafts plus the recovered or bonus token, so exactly

    E = 1 + Σ_i a_i / R                 (tokens per drafting round)

Rounds that drafted nothing (adaptive K may pick 0) commit one token, so over
all rounds a round commits 1 + (R/rounds)·(E − 1) = 1 + Σ_i a_i / rounds —
the measured mean acceptance length — and that is what the speedup uses. E
is no longer a model of acceptance; the bound is one of time: how fast these
very acceptances would run if a round cost nothing beyond the modelled terms.

**Round time.** With d̄ the draft's compute per round (k̄·t_draft), a
synchronous round costs

    T = d̄ + t_verify + t_rpc

A pipelined round (the draft drafts round i+1, assuming round i is accepted
whole, while the target verifies round i) costs, on a *hit* (the verdict
matched the assumption: the next drafts are ready at once), its RPCs and
the coordinator's work and the longer of the verify and the draft's
speculative work (its drafts and its guess of the bonus token, which the
draft worker's compute of the round includes) — the two are asked at once,
each over an RPC — and on a *miss* a fresh draft on the critical path first:

    T = t_rpc + max(t_verify, d̄) + (1 − P_hit)·d̄

with P_hit = hits / (hits + misses) as measured (0 where no round
speculated). Target-only decoding costs t_target a token, so speculation
runs at most (tokens per round)·t_target/T times as fast. The bench fills in,
per configuration and summed over prompts:

    k̄        = draft_tokens / rounds (prompt lookup often proposes fewer than K)
    d̄        = draft_time_s / rounds (t_draft = draft_time_s / draft_tokens)
    t_verify = verify_time_s / rounds
    t_rpc    = overhead_time_s / rounds (RPC + coordinator)
    t_target = (verify_time_s + overhead_time_s) / rounds of outrider-k0: a
               target-only round, its RPC included, as the achieved speedup's
               reference (outrider-k0's tokens/s) includes it

and reports ``bound_speedup`` (relative to outrider-k0) next to the achieved
speedup relative to outrider-k0 (tokens_per_s ÷ tokens_per_s of outrider-k0)
and their ratio ``achieved_over_bound``. The workers' times include their
prefill, spread over the rounds; the client's time per request is in the
achieved figures only (it is the same for every configuration).

A miss may also wait for the rest of the speculation it discards, which no
term counts: the bound leaves it out, as it should (it is a cost of the
implementation, not of the method).
"""

from __future__ import annotations

from dataclasses import dataclass

from outrider.bench.measurements import Totals


@dataclass(frozen=True)
class Bound:
    """The cost model's bound, from one configuration's totals and outrider-k0's."""

    alpha: float
    """accepted / drafted; reported, not used: E comes from the distribution."""
    mean_draft_tokens: float
    """k̄ = draft_tokens / rounds."""
    expected_tokens_per_round: float
    """E = 1 + Σ a_i / R: tokens committed per round that drafted."""
    drafting_share: float
    """R / rounds: the share of rounds that drafted (1 at fixed K)."""
    t_target_s: float
    t_draft_s: float
    t_verify_s: float
    t_rpc_s: float
    hit_rate: float | None = None
    """P_hit of a pipelined configuration; None: synchronous."""

    @property
    def tokens_per_round(self) -> float:
        """Over all rounds, target-only ones (one token) included: 1 + (R/rounds)·(E − 1)."""
        return 1.0 + self.drafting_share * (self.expected_tokens_per_round - 1.0)

    @property
    def round_time_s(self) -> float:
        """T: synchronous d̄ + t_verify + t_rpc; pipelined, hits overlap and
        misses draft afresh first."""
        drafting = self.mean_draft_tokens * self.t_draft_s  # d̄
        if self.hit_rate is None:
            return drafting + self.t_verify_s + self.t_rpc_s
        return self.t_rpc_s + max(self.t_verify_s, drafting) + (1.0 - self.hit_rate) * drafting

    @property
    def speedup(self) -> float:
        """(tokens per round)·t_target / T."""
        return self.tokens_per_round * self.t_target_s / self.round_time_s


def analytic_bound(totals: Totals, target_only: Totals, *, pipelined: bool = False) -> Bound | None:
    """The bound of a configuration (``pipelined``: of pipelined rounds);
    None without the time split or rounds."""
    draft_s, verify_s = totals.draft_time_s, totals.verify_time_s
    overhead_s = totals.overhead_time_s
    target_verify_s, target_overhead_s = target_only.verify_time_s, target_only.overhead_time_s
    if (
        draft_s is None
        or verify_s is None
        or overhead_s is None
        or target_verify_s is None
        or target_overhead_s is None
    ):
        return None
    if not totals.rounds or not target_only.rounds:
        return None
    accepted = sum(totals.accepted_per_position)
    # R: rounds that drafted; a server that does not count them drafted in
    # every round it says drafted anything.
    drafting_rounds = totals.num_drafts or (totals.rounds if totals.draft_tokens else 0)
    speculated = totals.speculation_hits + totals.speculation_misses
    return Bound(
        alpha=totals.acceptance_rate or 0.0,
        mean_draft_tokens=totals.draft_tokens / totals.rounds,
        expected_tokens_per_round=1.0 + accepted / drafting_rounds if drafting_rounds else 1.0,
        drafting_share=drafting_rounds / totals.rounds,
        t_target_s=(target_verify_s + target_overhead_s) / target_only.rounds,
        t_draft_s=draft_s / totals.draft_tokens if totals.draft_tokens else 0.0,
        t_verify_s=verify_s / totals.rounds,
        t_rpc_s=overhead_s / totals.rounds,
        hit_rate=(totals.speculation_hits / speculated if speculated else 0.0)
        if pipelined
        else None,
    )
