"""Analytic bound (DESIGN §5), from a configuration's own statistics (pure).

A round that drafts k tokens, each accepted with probability α, commits in
expectation

    E = (1 − α^(k+1)) / (1 − α)         (E = k + 1 when α = 1)

tokens — the accepted drafts plus the recovered or bonus token — and costs
T = k·t_draft + t_verify + t_rpc, where target-only decoding pays t_target a
token. Speculation therefore runs at most E·t_target/T times as fast as
target-only decoding. The bench fills in, per configuration and summed over
prompts:

    α        = acceptance_rate = accepted_tokens / draft_tokens
    k        = k̄ = draft_tokens / rounds (prompt lookup often proposes fewer than K)
    t_draft  = draft_time_s / draft_tokens
    t_verify = verify_time_s / rounds
    t_rpc    = rpc_time_s / rounds (RPC + coordinator)
    t_target = verify_time_s / rounds of outrider-k0 (a one-token target step)

and reports ``bound_speedup`` = E·t_target/T (relative to outrider-k0) next
to the achieved speedup relative to outrider-k0 (tokens_per_s ÷ tokens_per_s
of outrider-k0) and their ratio ``achieved_over_bound``. The measured
``mean_acceptance_length`` (tokens committed per round) is printed next to E:
the formula assumes every position is accepted independently with the same
α, and real drafts are not like that (early positions are accepted more
often), so E and the measured length differ; with α = accepted/drafted, E
tends to come out below the measured length, which makes the bound lenient.
The workers' times include their prefill, spread over the rounds.
"""

from __future__ import annotations

from dataclasses import dataclass

from outrider.bench.measurements import Totals


def expected_tokens_per_round(alpha: float, k: float) -> float:
    """E = (1 − α^(k+1)) / (1 − α): tokens a round of k drafts commits when each is accepted with probability α."""
    if not 0.0 <= alpha <= 1.0 or k < 0:
        raise ValueError(f"need 0 <= alpha <= 1 and k >= 0, got alpha={alpha}, k={k}")
    if alpha == 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1.0)) / (1.0 - alpha)


@dataclass(frozen=True)
class Bound:
    """DESIGN §5's bound, from one configuration's totals and outrider-k0's."""

    alpha: float
    mean_draft_tokens: float
    """k̄ = draft_tokens / rounds."""
    expected_tokens_per_round: float
    """E."""
    t_target_s: float
    t_draft_s: float
    t_verify_s: float
    t_rpc_s: float

    @property
    def round_time_s(self) -> float:
        """T = k̄·t_draft + t_verify + t_rpc."""
        return self.mean_draft_tokens * self.t_draft_s + self.t_verify_s + self.t_rpc_s

    @property
    def speedup(self) -> float:
        """E·t_target / T."""
        return self.expected_tokens_per_round * self.t_target_s / self.round_time_s


def analytic_bound(totals: Totals, target_only: Totals) -> Bound | None:
    """The bound of a configuration; None without the time split or rounds."""
    if None in (totals.draft_time_s, totals.verify_time_s, totals.rpc_time_s, target_only.verify_time_s):
        return None
    if not totals.rounds or not target_only.rounds:
        return None
    k_mean = totals.draft_tokens / totals.rounds
    alpha = totals.acceptance_rate or 0.0
    return Bound(
        alpha=alpha,
        mean_draft_tokens=k_mean,
        expected_tokens_per_round=expected_tokens_per_round(alpha, k_mean),
        t_target_s=target_only.verify_time_s / target_only.rounds,
        t_draft_s=totals.draft_time_s / totals.draft_tokens if totals.draft_tokens else 0.0,
        t_verify_s=totals.verify_time_s / totals.rounds,
        t_rpc_s=totals.rpc_time_s / totals.rounds,
    )
