"""``outrider bench``: Outrider against its peers, in one run, on the same prompts.

Every configuration decodes every prompt greedily (temperature 0), so all of
them must produce the same tokens; the bench checks that and reports each
mismatch loudly (it does not abort). The configurations:

* ``hf-generate`` — plain Hugging Face ``generate(do_sample=False)`` on the
  stock target (no Outrider patches): the baseline a user would otherwise run.
  **speedup = tokens/s of a configuration ÷ tokens/s of hf-generate.**
* ``outrider-k0`` — target-only decoding through Outrider's services (K=0).
* ``outrider-<drafter>-k<K>`` and ``outrider-<drafter>-adaptive`` — Outrider
  with each drafter, each fixed K and adaptive K, against real services
  started as processes: one target worker shared by all, one draft worker and
  one coordinator per drafter.
* ``hf-assisted-...`` — the peer: Hugging Face assisted generation in this
  process on the same models and prompts: ``assistant_model=`` the target in
  bfloat16 with K fixed (``-k<K>``) or transformers' own default schedule
  (``-default``: up to 20 tokens, drafting stops early when the assistant's
  confidence falls below 0.4), and ``prompt_lookup_num_tokens=K``.

Prompts are JSONL rows with ``turns`` (the first turn is used) or ``prompt``;
each is sent as one user message rendered with the target's chat template,
HumanEval's code prompts included. A row's ``category`` names its category,
else the file's stem does (``HumanEval_prompts.jsonl`` → ``humaneval``).

Configurations run interleaved — for each prompt, every configuration in
turn, the order rotated from prompt to prompt — so that machine noise hits
all alike; one untimed warm-up request per configuration comes first.
tokens/s = generated tokens ÷ wall time of the requests (client-side for
Outrider, ``generate()`` for Hugging Face), both summed over prompts.

Analytic bound (DESIGN §5). A round that drafts k tokens, each accepted with
probability α, commits in expectation

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

The Hugging Face rows count rounds and drafts with a hook on the target's
forward (each call is one round; its input length and cache length give the
number of drafts it verified and how many were committed), so their
acceptance rate and mean acceptance length are comparable with Outrider's;
they have no time split and no bound.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BASELINE = "hf-generate"
TARGET_ONLY = "outrider-k0"
DEFAULT_DRAFTERS = ("prompt-lookup", "bf16")
REQUIRED_CONFIG_KEYS = (
    "name",
    "tokens_per_s",
    "speedup",
    "acceptance_rate",
    "mean_acceptance_length",
    "bound_speedup",
    "overhead_ms_per_round",
)


def default_prompt_files() -> list[Path]:
    """MT-Bench from the shared data next to the repository, if it is there."""
    mt_bench = Path(__file__).resolve().parents[2] / "shared" / "data" / "mt_bench" / "question.jsonl"
    return [mt_bench] if mt_bench.is_file() else []


# --------------------------------------------------------------------------- prompts


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str
    """Sent as one user message, rendered with the target's chat template."""


def category_of_file(path: Path) -> str:
    """A category for a file's rows that carry none: its stem, lower-cased,
    without a ``_prompts``/``_questions`` suffix (``HumanEval_prompts`` → ``humaneval``)."""
    stem = path.stem.lower()
    return re.sub(r"[_\-.]?(prompts?|questions?)$", "", stem) or stem


def spread(n: int, limit: int | None) -> list[int]:
    """``limit`` indices out of ``n``, evenly spaced from the first (all when ``limit`` is None)."""
    if limit is None or limit >= n:
        return list(range(n))
    return [i * n // limit for i in range(limit)]


def load_prompts(path: Path, limit: int | None = None) -> list[Prompt]:
    """The prompts of one JSONL file; with ``limit``, that many rows spread evenly over it.

    A row's text is ``turns[0]`` or ``prompt``; its category the row's
    ``category``, else :func:`category_of_file`.
    """
    path = Path(path)
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append((number, json.loads(line)))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON ({exc.msg})") from None
    fallback = category_of_file(path)
    prompts = []
    for number, row in (rows[i] for i in spread(len(rows), limit)):
        if isinstance(row.get("turns"), list) and row["turns"]:
            text = row["turns"][0]
        elif isinstance(row.get("prompt"), str):
            text = row["prompt"]
        else:
            raise ValueError(f"{path}:{number}: a row needs `turns` (a non-empty list) or `prompt`")
        ident = row.get("question_id", row.get("task_id", number))
        prompts.append(Prompt(id=f"{path.stem}:{ident}", category=str(row.get("category") or fallback), text=text))
    return prompts


# --------------------------------------------------------------------------- measurements


@dataclass(frozen=True)
class Measurement:
    """One request of one configuration."""

    token_ids: tuple[int, ...]
    prompt_tokens: int
    wall_s: float
    rounds: int
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()
    draft_time_s: float | None = None
    """The worker times are ``None`` where there is no split (Hugging Face)."""
    verify_time_s: float | None = None
    rpc_time_s: float | None = None
    overhead_s: float | None = None
    """Coordinator overhead per round: the server's median (``overhead_s_p50``) or, from a server that does not report it, the mean."""
    adaptive: bool = False

    @property
    def generated_tokens(self) -> int:
        return len(self.token_ids)


def measurement_from_stats(token_ids: Sequence[int], stats: Any, wall_s: float) -> Measurement:
    """From Outrider's statistics: the client's ``GenerationStats`` or the proto's (same field names)."""
    rounds = int(stats.rounds)
    overhead = float(getattr(stats, "overhead_s_p50", 0.0) or 0.0)
    if overhead <= 0.0 and rounds:
        overhead = stats.rpc_time_s / rounds
    return Measurement(
        token_ids=tuple(token_ids),
        prompt_tokens=int(stats.prompt_tokens),
        wall_s=wall_s,
        rounds=rounds,
        draft_tokens=int(stats.draft_tokens),
        accepted_tokens=int(stats.accepted_tokens),
        accepted_per_position=tuple(int(n) for n in stats.accepted_per_position),
        draft_time_s=float(stats.draft_time_s),
        verify_time_s=float(stats.verify_time_s),
        rpc_time_s=float(stats.rpc_time_s),
        overhead_s=overhead if rounds else None,
        adaptive=bool(getattr(stats, "adaptive", False)),
    )


def rounds_from_forward_calls(
    calls: Sequence[tuple[int, int]], prompt_tokens: int, total_tokens: int
) -> tuple[int, int, tuple[int, ...]]:
    """(draft tokens, accepted tokens, accepted per position) of a Hugging Face generation.

    ``calls`` holds (input length, cached length) of each target forward call.
    Call r verifies c_r = cached_r + input_r − L_r drafts, where L_r is the
    committed length before it; after it the cache is cropped to the new
    committed length minus one, so L_(r+1) = cached_(r+1) + 1, and the last
    round ends at ``total_tokens``. A round commits its accepted drafts plus
    one token.
    """
    draft_tokens = accepted_tokens = 0
    per_position: list[int] = []
    committed = prompt_tokens
    for r, (input_len, cached) in enumerate(calls):
        drafts = max(0, cached + input_len - committed)
        after = calls[r + 1][1] + 1 if r + 1 < len(calls) else total_tokens
        accepted = min(drafts, max(0, after - committed - 1))
        draft_tokens += drafts
        accepted_tokens += accepted
        if len(per_position) < accepted:
            per_position += [0] * (accepted - len(per_position))
        for i in range(accepted):
            per_position[i] += 1
        committed = after
    return draft_tokens, accepted_tokens, tuple(per_position)


# --------------------------------------------------------------------------- configurations


@dataclass
class Config:
    """One way of generating: a name and a callable that runs one prompt."""

    name: str
    family: str
    """``"hf"`` or ``"outrider"``."""
    run: Callable[[Prompt, int], Measurement] = field(repr=False)
    """``run(prompt, max_new_tokens)``."""
    drafter: str | None = None
    k: int | None = None
    """Fixed K; ``None`` with ``adaptive`` or for HF's default schedule."""
    adaptive: bool = False


@dataclass(frozen=True)
class Drafter:
    """A drafter of ``--drafters``: its label and the draft worker's flags."""

    label: str
    draft_args: tuple[str, ...]
    hf_peer: str | None
    """``"assistant"`` (the target in bfloat16), ``"prompt-lookup"`` or None (no HF peer)."""


def parse_drafter(spec: str, *, target_model: str | None) -> Drafter:
    """``prompt-lookup``, ``bf16`` (the target itself in bfloat16) or ``early-exit-L``."""
    model = ("--model", target_model) if target_model else ()
    if spec == "prompt-lookup":
        return Drafter(spec, ("--drafter", "prompt-lookup"), "prompt-lookup")
    if spec == "bf16":
        return Drafter(spec, ("--drafter", "model", "--dtype", "bfloat16", *model), "assistant")
    if match := re.fullmatch(r"early-exit-(\d+)", spec):
        layers = match.group(1)
        return Drafter(spec, ("--drafter", "early-exit", "--draft-layers", layers, *model), None)
    raise ValueError(f"unknown drafter {spec!r}: use prompt-lookup, bf16 or early-exit-L (e.g. early-exit-8)")


def parse_k_list(raw: str) -> list[int]:
    try:
        ks = sorted({int(part) for part in raw.split(",") if part.strip()})
    except ValueError:
        raise ValueError(f"--k {raw!r}: give comma-separated integers, e.g. 4,8") from None
    if not ks or any(k < 1 for k in ks):
        raise ValueError(f"--k {raw!r}: give one or more K of at least 1 (K=0 always runs as outrider-k0)")
    return ks


# --------------------------------------------------------------------------- Hugging Face in this process


class HuggingFace:
    """The stock target (and its bfloat16 assistant) in this process."""

    def __init__(self, model_dir: str, dtype: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self._torch = torch
        self.model_dir = model_dir
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        self._assistant = None
        self._calls: list[tuple[int, int]] = []
        self.model.register_forward_pre_hook(self._record_call, with_kwargs=True)
        eos = self.model.generation_config.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)

    def _record_call(self, module, args, kwargs) -> None:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        cache = kwargs.get("past_key_values")
        self._calls.append((int(input_ids.shape[1]), int(cache.get_seq_length()) if cache is not None else 0))

    @property
    def assistant(self):
        """The target's checkpoint in bfloat16, loaded on first use."""
        if self._assistant is None:
            from transformers import AutoModelForCausalLM

            self._assistant = AutoModelForCausalLM.from_pretrained(
                self.model_dir, dtype=self._torch.bfloat16
            ).eval()
            config = self._assistant.generation_config
            self._assistant_defaults = (
                config.num_assistant_tokens,
                config.num_assistant_tokens_schedule,
                config.assistant_confidence_threshold,
            )
        return self._assistant

    def _set_assistant_k(self, k: int | None) -> None:
        """Fixed K (constant schedule, no confidence stop), or transformers' defaults for None.

        Set before every call: a "heuristic" schedule would carry K over from call to call.
        """
        config = self.assistant.generation_config
        if k is None:
            values = self._assistant_defaults
        else:
            values = (k, "constant", 0.0)
        (
            config.num_assistant_tokens,
            config.num_assistant_tokens_schedule,
            config.assistant_confidence_threshold,
        ) = values

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        return list(
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt.text}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
        )

    def generate(self, prompt: Prompt, max_new_tokens: int, **assisted: Any) -> Measurement:
        torch = self._torch
        ids = self.prompt_ids(prompt)
        inputs = torch.tensor([ids])
        self._calls.clear()
        started = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                inputs,
                attention_mask=torch.ones_like(inputs),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                **assisted,
            )
        wall_s = time.perf_counter() - started
        generated = out[0, len(ids) :].tolist()
        draft, accepted, per_position = rounds_from_forward_calls(self._calls, len(ids), len(ids) + len(generated))
        return Measurement(
            token_ids=tuple(self._cut_at_eos(generated)),
            prompt_tokens=len(ids),
            wall_s=wall_s,
            rounds=len(self._calls),
            draft_tokens=draft,
            accepted_tokens=accepted,
            accepted_per_position=per_position,
        )

    def _cut_at_eos(self, tokens: list[int]) -> list[int]:
        """Up to and including the first end-of-sequence token (assisted generation
        can commit drafts past one)."""
        for i, token in enumerate(tokens):
            if token in self.eos_token_ids:
                return tokens[: i + 1]
        return tokens

    def configs(self, drafters: Sequence[Drafter], ks: Sequence[int]) -> list[Config]:
        configs = [Config(BASELINE, "hf", lambda p, n: self.generate(p, n), k=0)]
        for drafter in drafters:
            if drafter.hf_peer == "assistant":
                for k in ks:
                    configs.append(
                        Config(f"hf-assisted-{drafter.label}-k{k}", "hf", self._assisted(k), drafter.label, k)
                    )
                configs.append(Config(f"hf-assisted-{drafter.label}-default", "hf", self._assisted(None), drafter.label))
            elif drafter.hf_peer == "prompt-lookup":
                for k in ks:
                    configs.append(
                        Config(
                            f"hf-assisted-prompt-lookup-k{k}", "hf",
                            lambda p, n, k=k: self.generate(p, n, prompt_lookup_num_tokens=k),
                            drafter.label, k,
                        )  # fmt: skip
                    )
        return configs

    def _assisted(self, k: int | None) -> Callable[[Prompt, int], Measurement]:
        def run(prompt: Prompt, max_new_tokens: int) -> Measurement:
            self._set_assistant_k(k)
            return self.generate(prompt, max_new_tokens, assistant_model=self.assistant)

        return run


# --------------------------------------------------------------------------- Outrider through its services


class OutriderEndpoint:
    """One coordinator, asked through the SDK's blocking client."""

    def __init__(self, address: str) -> None:
        from outrider.client import Client

        self.client = Client(address)

    def generate(self, prompt: Prompt, max_new_tokens: int, *, k: int | None, adaptive: bool = False) -> Measurement:
        """One request: K fixed (0: target only), or adaptive K (``k=None, adaptive=True``)."""
        started = time.perf_counter()
        result = self.client.generate(
            messages=[{"role": "user", "content": prompt.text}],
            max_new_tokens=max_new_tokens,
            temperature=0.0,
            num_speculative_tokens=k,
            adaptive=adaptive,
        )
        wall_s = time.perf_counter() - started
        return measurement_from_stats(result.token_ids, result.stats, wall_s)

    def close(self) -> None:
        self.client.close()


def outrider_configs(
    endpoints: Mapping[str, OutriderEndpoint], ks: Sequence[int], *, adaptive: bool
) -> list[Config]:
    """``outrider-k0`` on the first coordinator, then each drafter's fixed K and adaptive K."""
    first = next(iter(endpoints.values()))
    configs = [Config(TARGET_ONLY, "outrider", lambda p, n: first.generate(p, n, k=0), k=0)]
    for label, endpoint in endpoints.items():
        if label is None:
            continue
        for k in ks:
            configs.append(
                Config(
                    f"outrider-{label}-k{k}", "outrider",
                    lambda p, n, e=endpoint, k=k: e.generate(p, n, k=k), label, k,
                )  # fmt: skip
            )
        if adaptive:
            configs.append(
                Config(
                    f"outrider-{label}-adaptive", "outrider",
                    lambda p, n, e=endpoint: e.generate(p, n, k=None, adaptive=True), label, adaptive=True,
                )  # fmt: skip
            )
    return configs


# --------------------------------------------------------------------------- the interleaved runner


def interleaved_order(configs: Sequence[Config], prompt_index: int) -> list[Config]:
    """Every configuration once, the starting one rotated by the prompt's index."""
    shift = prompt_index % len(configs) if configs else 0
    return [*configs[shift:], *configs[:shift]]


def run_interleaved(
    configs: Sequence[Config],
    prompts: Sequence[Prompt],
    max_new_tokens: int,
    *,
    progress: bool = True,
) -> dict[str, list[Measurement]]:
    """For each prompt, every configuration in turn; the results by configuration, in prompt order."""
    from tqdm import tqdm

    results: dict[str, list[Measurement | None]] = {c.name: [None] * len(prompts) for c in configs}
    with tqdm(total=len(prompts) * len(configs), desc="bench", unit="run", disable=not progress) as bar:
        for i, prompt in enumerate(prompts):
            for config in interleaved_order(configs, i):
                bar.set_postfix_str(f"{prompt.id} {config.name}")
                results[config.name][i] = _run_one(config, prompt, max_new_tokens)
                bar.update()
    return results  # type: ignore[return-value]


def warm_up(configs: Sequence[Config], prompt: Prompt, max_new_tokens: int, *, progress: bool = True) -> dict[str, Measurement]:
    """One untimed request per configuration (first-call costs, connections)."""
    from tqdm import tqdm

    return {
        config.name: _run_one(config, prompt, max_new_tokens)
        for config in tqdm(configs, desc="warm-up", unit="config", disable=not progress, leave=False)
    }


def _run_one(config: Config, prompt: Prompt, max_new_tokens: int) -> Measurement:
    """``config.run``; a failure names the configuration and the prompt."""
    try:
        return config.run(prompt, max_new_tokens)
    except KeyboardInterrupt:
        raise
    except Exception as exc:
        code = getattr(exc, "code", None)
        detail = f"{code().name}: {exc.details()}" if callable(code) and hasattr(exc, "details") else str(exc)
        raise RuntimeError(f"{config.name} failed on {prompt.id}: {detail}") from exc


# --------------------------------------------------------------------------- aggregation (pure)


@dataclass(frozen=True)
class Totals:
    """A set of measurements, summed."""

    prompts: int
    generated_tokens: int
    wall_s: float
    rounds: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: tuple[int, ...]
    draft_time_s: float | None
    verify_time_s: float | None
    rpc_time_s: float | None
    overhead_s_p50: float | None
    """Median over the requests of their per-round overhead."""

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens committed per round, the recovered or bonus token included."""
        return (self.accepted_tokens + self.rounds) / self.rounds if self.rounds else None

    def per_round_ms(self, seconds: float | None) -> float | None:
        return 1000.0 * seconds / self.rounds if seconds is not None and self.rounds else None


def _sum_optional(values: Iterable[float | None]) -> float | None:
    values = list(values)
    return None if not values or any(v is None for v in values) else float(sum(values))


def aggregate(measurements: Sequence[Measurement]) -> Totals:
    """Sums; the per-position histograms are added position by position."""
    width = max((len(m.accepted_per_position) for m in measurements), default=0)
    per_position = [0] * width
    for m in measurements:
        for i, n in enumerate(m.accepted_per_position):
            per_position[i] += n
    overheads = [m.overhead_s for m in measurements if m.overhead_s is not None]
    return Totals(
        prompts=len(measurements),
        generated_tokens=sum(m.generated_tokens for m in measurements),
        wall_s=sum(m.wall_s for m in measurements),
        rounds=sum(m.rounds for m in measurements),
        draft_tokens=sum(m.draft_tokens for m in measurements),
        accepted_tokens=sum(m.accepted_tokens for m in measurements),
        accepted_per_position=tuple(per_position),
        draft_time_s=_sum_optional(m.draft_time_s for m in measurements),
        verify_time_s=_sum_optional(m.verify_time_s for m in measurements),
        rpc_time_s=_sum_optional(m.rpc_time_s for m in measurements),
        overhead_s_p50=statistics.median(overheads) if overheads else None,
    )


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


def find_mismatches(
    results: Mapping[str, Sequence[Measurement]], prompts: Sequence[Prompt], reference: str
) -> list[dict[str, Any]]:
    """Every (configuration, prompt) whose tokens differ from the reference's."""
    found = []
    for name, measurements in results.items():
        if name == reference:
            continue
        for prompt, mine, theirs in zip(prompts, measurements, results[reference]):
            if mine.token_ids == theirs.token_ids:
                continue
            first = next(
                (i for i, (a, b) in enumerate(zip(mine.token_ids, theirs.token_ids)) if a != b),
                min(len(mine.token_ids), len(theirs.token_ids)),
            )
            found.append(
                {
                    "config": name,
                    "prompt": prompt.id,
                    "first_difference_at": first,
                    "tokens": len(mine.token_ids),
                    "reference_tokens": len(theirs.token_ids),
                    "prompt_tokens": mine.prompt_tokens,
                    "reference_prompt_tokens": theirs.prompt_tokens,
                }
            )
    return found


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize_config(config: Config, totals: Totals, baseline: Totals, target_only: Totals | None) -> dict[str, Any]:
    """One entry of the report's ``configs``."""
    bound = analytic_bound(totals, target_only) if config.family == "outrider" and target_only else None
    achieved = _ratio(totals.tokens_per_s, target_only.tokens_per_s) if target_only and config.family == "outrider" else None
    row = {
        "name": config.name,
        "family": config.family,
        "drafter": config.drafter,
        "k": config.k,
        "adaptive": config.adaptive,
        "prompts": totals.prompts,
        "generated_tokens": totals.generated_tokens,
        "wall_s": _round(totals.wall_s),
        "tokens_per_s": _round(totals.tokens_per_s),
        "speedup": _round(_ratio(totals.tokens_per_s, baseline.tokens_per_s)),
        "acceptance_rate": _round(totals.acceptance_rate),
        "mean_acceptance_length": _round(totals.mean_acceptance_length),
        "rounds": totals.rounds,
        "draft_tokens": totals.draft_tokens,
        "accepted_tokens": totals.accepted_tokens,
        "accepted_per_position": list(totals.accepted_per_position),
        "draft_ms_per_round": _round(totals.per_round_ms(totals.draft_time_s), 3),
        "verify_ms_per_round": _round(totals.per_round_ms(totals.verify_time_s), 3),
        "rpc_ms_per_round": _round(totals.per_round_ms(totals.rpc_time_s), 3),
        "overhead_ms_per_round": _round(None if totals.overhead_s_p50 is None else 1000 * totals.overhead_s_p50, 3),
        "expected_tokens_per_round": _round(bound.expected_tokens_per_round if bound else None),
        "mean_draft_tokens_per_round": _round(bound.mean_draft_tokens if bound else None),
        "bound_speedup": _round(bound.speedup if bound else None),
        "achieved_speedup_vs_k0": _round(achieved),
        "achieved_over_bound": _round(_ratio(achieved, bound.speedup if bound else None)),
    }
    return row


def summarize_category(totals: Totals, baseline: Totals) -> dict[str, Any]:
    return {
        "prompts": totals.prompts,
        "tokens_per_s": _round(totals.tokens_per_s),
        "speedup": _round(_ratio(totals.tokens_per_s, baseline.tokens_per_s)),
        "acceptance_rate": _round(totals.acceptance_rate),
        "mean_acceptance_length": _round(totals.mean_acceptance_length),
    }


def headline(rows: Sequence[Mapping[str, Any]], baseline: str) -> dict[str, Any]:
    """Best Outrider vs best HF assisted; outrider-k0 vs hf-generate; achieved/bound; overhead."""
    by_name = {r["name"]: r for r in rows}
    speculative = [r for r in rows if r["family"] == "outrider" and r["name"] != TARGET_ONLY]
    assisted = [r for r in rows if r["name"].startswith("hf-assisted")]
    best_outrider = max(speculative, key=lambda r: r["tokens_per_s"], default=None)
    best_hf = max(assisted, key=lambda r: r["tokens_per_s"], default=None)
    k0, hf = by_name.get(TARGET_ONLY), by_name.get(BASELINE)
    bounds = {r["name"]: r["achieved_over_bound"] for r in rows if r.get("achieved_over_bound") is not None}
    overheads = [r["overhead_ms_per_round"] for r in rows if r["family"] == "outrider" and r["overhead_ms_per_round"] is not None]
    k0_vs_hf = _ratio(k0["tokens_per_s"], hf["tokens_per_s"]) if k0 and hf else None
    return {
        "baseline": baseline,
        "best_outrider": best_outrider["name"] if best_outrider else None,
        "best_hf_assisted": best_hf["name"] if best_hf else None,
        "best_outrider_over_best_hf_assisted": _round(
            _ratio(best_outrider["tokens_per_s"], best_hf["tokens_per_s"]) if best_outrider and best_hf else None
        ),
        "outrider_k0_over_hf_generate": _round(k0_vs_hf),
        "outrider_k0_within_5pct_of_hf_generate": None if k0_vs_hf is None else abs(k0_vs_hf - 1) <= 0.05,
        "achieved_over_bound": bounds,
        "min_achieved_over_bound": min(bounds.values(), default=None),
        "max_overhead_ms_per_round_p50": max(overheads, default=None),
    }


def build_report(
    configs: Sequence[Config],
    prompts: Sequence[Prompt],
    results: Mapping[str, Sequence[Measurement]],
    meta: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The whole report (what ``--json`` writes): pure, from the measurements."""
    names = [c.name for c in configs]
    baseline = BASELINE if BASELINE in results else TARGET_ONLY
    categories = sorted({p.category for p in prompts})

    def totals_of(name: str, category: str | None = None) -> Totals:
        return aggregate([m for p, m in zip(prompts, results[name]) if category is None or p.category == category])

    base = totals_of(baseline)
    target_only = totals_of(TARGET_ONLY) if TARGET_ONLY in results else None
    rows = []
    for config in configs:
        row = summarize_config(config, totals_of(config.name), base, target_only)
        row["by_category"] = {
            c: summarize_category(totals_of(config.name, c), totals_of(baseline, c)) for c in categories
        }
        rows.append(row)
    reference = BASELINE if BASELINE in results else TARGET_ONLY
    mismatches = find_mismatches({n: results[n] for n in names}, prompts, reference) if reference in results else []
    for row in rows:
        row["mismatches"] = sum(1 for m in mismatches if m["config"] == row["name"])
    return {
        **(meta or {}),
        "speedup_definition": f"tokens_per_s / tokens_per_s of {baseline}",
        "baseline": baseline,
        "categories": categories,
        "prompt_counts": {c: sum(1 for p in prompts if p.category == c) for c in categories},
        "configs": rows,
        "mismatch_reference": reference,
        "mismatches": mismatches,
        "headline": headline(rows, baseline),
    }


# --------------------------------------------------------------------------- rendering


def _fmt(value: Any, spec: str = ".2f", suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return f"{value:{spec}}{suffix}"


def _histogram(row: Mapping[str, Any], width: int = 8) -> str:
    """Accepted per position as a fraction of rounds: ``.91 .80 .62 ...``."""
    rounds = row["rounds"]
    if not row["accepted_per_position"] or not rounds:
        return "-"
    shares = [f"{n / rounds:.2f}".lstrip("0") for n in row["accepted_per_position"][:width]]
    more = " …" if len(row["accepted_per_position"]) > width else ""
    return " ".join(shares) + more


def table_rows(report: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    header = [
        "config", "tok/s", "speedup", "accept", "MAL", "E", "draft ms", "verify ms",
        "overhead ms p50", "bound", "achieved/bound", "mismatch", "accepted per position (share of rounds)",
    ]  # fmt: skip
    rows = []
    for r in report["configs"]:
        rows.append(
            [
                r["name"],
                _fmt(r["tokens_per_s"]),
                _fmt(r["speedup"], ".2f", "×"),
                _fmt(r["acceptance_rate"]),
                _fmt(r["mean_acceptance_length"]),
                _fmt(r["expected_tokens_per_round"]),
                _fmt(r["draft_ms_per_round"], ".1f"),
                _fmt(r["verify_ms_per_round"], ".1f"),
                _fmt(r["overhead_ms_per_round"], ".2f"),
                _fmt(r["bound_speedup"], ".2f", "×"),
                _fmt(r["achieved_over_bound"]),
                str(r["mismatches"]),
                _histogram(r),
            ]
        )
    return header, rows


def category_rows(report: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    header = ["config"] + [f"{c} ({report['prompt_counts'][c]})" for c in report["categories"]]
    rows = []
    for r in report["configs"]:
        cells = [r["name"]]
        for c in report["categories"]:
            s = r["by_category"][c]
            cell = f"{_fmt(s['tokens_per_s'], '.1f')} t/s {_fmt(s['speedup'], '.2f', '×')}"
            if s["acceptance_rate"] is not None:
                cell += f" α{_fmt(s['acceptance_rate'])} L{_fmt(s['mean_acceptance_length'])}"
            cells.append(cell)
        rows.append(cells)
    return header, rows


def headline_lines(report: Mapping[str, Any]) -> list[str]:
    h = report["headline"]
    lines = [f"speedup = tokens/s ÷ tokens/s of {report['baseline']}; greedy, same prompts, interleaved."]
    if h["best_outrider"] and h["best_hf_assisted"]:
        lines.append(
            f"best Outrider ({h['best_outrider']}) ÷ best HF assisted ({h['best_hf_assisted']}): "
            f"{_fmt(h['best_outrider_over_best_hf_assisted'], '.2f', '×')}"
        )
    if h["outrider_k0_over_hf_generate"] is not None:
        verdict = "within 5%" if h["outrider_k0_within_5pct_of_hf_generate"] else "NOT within 5%"
        lines.append(f"outrider-k0 ÷ hf-generate: {h['outrider_k0_over_hf_generate']:.3f} ({verdict})")
    if h["achieved_over_bound"]:
        parts = ", ".join(f"{n} {v:.2f}" for n, v in h["achieved_over_bound"].items())
        lines.append(f"achieved/bound (vs outrider-k0): {parts}")
    if h["max_overhead_ms_per_round_p50"] is not None:
        lines.append(f"overhead per round (RPC + coordinator), p50, worst config: {h['max_overhead_ms_per_round_p50']:.2f} ms")
    if report["mismatches"]:
        lines.append(
            f"MISMATCH: {len(report['mismatches'])} (config, prompt) outputs differ from {report['mismatch_reference']}: "
            + "; ".join(f"{m['config']} on {m['prompt']} at token {m['first_difference_at']}" for m in report["mismatches"][:12])
            + (" …" if len(report["mismatches"]) > 12 else "")
        )
    else:
        lines.append(f"outputs: every configuration produced the same tokens as {report['mismatch_reference']} on every prompt.")
    return lines


def render(report: Mapping[str, Any], out=None) -> None:
    """The tables and the headline, with rich when it is installed, else plain text."""
    out = out or sys.stdout
    tables = [("per configuration", *table_rows(report)), ("per category", *category_rows(report))]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        for title, header, rows in tables:
            print(f"\n{title}", file=out)
            print(_plain_table(header, rows), file=out)
        for line in headline_lines(report):
            print(line, file=out)
        return
    console = Console(file=out, width=None if out.isatty() else 220, highlight=False)
    for title, header, rows in tables:
        table = Table(title=title, title_justify="left")
        for i, name in enumerate(header):
            table.add_column(name, justify="left" if i == 0 or name.startswith("accepted") else "right")
        for row in rows:
            mismatch = header[-2] == "mismatch" and row[-2] not in ("0", "-")
            table.add_row(*row, style="bold red" if mismatch else None)
        console.print(table)
    for line in headline_lines(report):
        console.print(line, style="bold red" if line.startswith("MISMATCH") else None)


def _plain_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(line, widths)) for line in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(report: Mapping[str, Any], path: Path) -> None:
    """Two panels: speedup by configuration (bars by category), and acceptance by configuration."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError(
            "--plot needs matplotlib: pip install 'outrider[bench]' (or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["configs"]
    x = list(range(len(rows)))
    groups = [("all prompts", [r["speedup"] for r in rows])] + [
        (f"{c} ({report['prompt_counts'][c]})", [r["by_category"][c]["speedup"] for r in rows])
        for c in report["categories"]
    ]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(11, 0.95 * len(rows) + 4), 10), sharex=True)

    # 1. Speedup, one bar per category, the all-prompts bar first and labelled.
    width = 0.8 / len(groups)
    for g, (label, values) in enumerate(groups):
        offsets = [i - 0.4 + width * (g + 0.5) for i in x]
        heights = [v or 0 for v in values]
        bars = top.bar(offsets, heights, width, label=label, color="0.2" if g == 0 else None)
        if g == 0:
            top.bar_label(bars, labels=[f"{v:.2f}" for v in heights], fontsize=7, padding=2)
    top.axhline(1.0, color="grey", linewidth=1, linestyle="--")
    top.set_ylabel(f"speedup vs {report['baseline']} (tokens/s ratio)")
    top.set_title(f"Speedup by configuration and prompt category — {report.get('title', '')}".rstrip(" —"))
    top.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize="small", title="prompts")
    top.grid(axis="y", alpha=0.3)
    top.set_ylim(0, max([v or 0 for _, values in groups for v in values] + [1.0]) * 1.15)

    # 2. Acceptance rate (left axis) and mean acceptance length (right axis).
    rates = [r["acceptance_rate"] for r in rows]
    lengths = [r["mean_acceptance_length"] or 0 for r in rows]
    rate_bars = bottom.bar([i - 0.2 for i in x], [v or 0 for v in rates], 0.4, color="tab:blue")
    bottom.bar_label(rate_bars, labels=["" if v is None else f"{v:.2f}" for v in rates], fontsize=7, padding=2)
    bottom.set_ylabel("acceptance rate (accepted / drafted)")
    bottom.set_ylim(0, 1.12)
    right = bottom.twinx()
    length_bars = right.bar([i + 0.2 for i in x], lengths, 0.4, color="tab:orange")
    right.bar_label(length_bars, labels=[f"{v:.2f}" for v in lengths], fontsize=7, padding=2)
    right.set_ylabel("mean acceptance length (tokens / round)")
    right.set_ylim(0, max(lengths + [1]) * 1.12)
    bottom.legend(
        [rate_bars, length_bars], ["acceptance rate", "mean acceptance length"],
        loc="upper left", bbox_to_anchor=(1.06, 1.0), fontsize="small",
    )  # fmt: skip
    bottom.set_title("Acceptance by configuration (no bar: nothing drafted)")
    bottom.set_xticks(x)
    bottom.set_xticklabels([r["name"] for r in rows], rotation=35, ha="right")
    for label, row in zip(bottom.get_xticklabels(), rows):
        label.set_color("tab:red" if row["family"] == "hf" else "black")
    bottom.grid(axis="y", alpha=0.3)
    fig.text(0.01, 0.01, "Hugging Face configurations in red, Outrider in black.", fontsize=8, color="0.3")
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- the command


@dataclass(frozen=True)
class BenchOptions:
    prompt_files: tuple[Path, ...]
    limit: int | None = None
    max_new_tokens: int = 64
    ks: tuple[int, ...] = (4,)
    drafters: tuple[str, ...] = DEFAULT_DRAFTERS
    hf: bool = True
    adaptive: bool = True
    target_model: str | None = None
    dtype: str = "float32"
    threads: int = os.cpu_count() or 1
    json_path: Path | None = None
    plot_path: Path | None = None
    progress: bool = True
    log_level: str = "warning"


def _stack_args(options: BenchOptions, drafters: Sequence[Drafter]) -> dict[str, Any]:
    common = ("--log-level", options.log_level)
    workers = (*common, "--threads", str(options.threads))
    max_k = str(max(16, *options.ks))
    target = [*workers, "--dtype", options.dtype]
    coordinator = [*common, "--max-num-speculative-tokens", max_k]
    if options.target_model:
        target += ["--model", options.target_model]
        coordinator += ["--tokenizer", options.target_model]
    drafts = {d.label: [*workers, "--max-draft-tokens", max_k, *d.draft_args] for d in drafters}
    # A model drafter runs in the target's dtype unless its flags say otherwise.
    for label, args in drafts.items():
        if "--dtype" not in args and "prompt-lookup" not in args:
            args += ["--dtype", options.dtype]
    return dict(target_args=target, drafts=drafts, coordinator_args=coordinator)


def run_bench(options: BenchOptions, out=None) -> dict[str, Any]:
    """Start the services, run every configuration on every prompt, write and return the report."""
    import torch
    from transformers.utils import logging as hf_logging

    from outrider import models
    from outrider.stack import start_shared_target_stack

    out = out or sys.stdout
    if options.plot_path is not None:
        try:
            import matplotlib  # noqa: F401  (fail before an hour of measuring, not after)
        except ImportError:
            raise RuntimeError("--plot needs matplotlib: pip install 'outrider[bench]' (or pip install matplotlib)") from None
    started = time.time()
    prompts = [p for path in options.prompt_files for p in load_prompts(path, options.limit)]
    if not prompts:
        raise ValueError("no prompts: give --prompts FILE (JSONL rows with `turns` or `prompt`)")
    drafters = [parse_drafter(d, target_model=options.target_model) for d in options.drafters]
    model_dir = models.resolve(options.target_model)
    torch.set_num_threads(options.threads)
    hf_logging.set_verbosity_error()

    with ExitStack() as cleanup:
        print(f"Starting 1 target worker and {len(drafters)} draft worker + coordinator pairs ...", file=sys.stderr, flush=True)
        stack = cleanup.enter_context(start_shared_target_stack(**_stack_args(options, drafters)))
        endpoints: dict[str | None, OutriderEndpoint] = {}
        for label, service in stack.coordinators.items():
            endpoint = OutriderEndpoint(service.address)
            cleanup.callback(endpoint.close)
            endpoints[label] = endpoint
        configs = outrider_configs(endpoints, options.ks, adaptive=options.adaptive)
        if options.hf:
            generate, *assisted = HuggingFace(model_dir, options.dtype).configs(drafters, options.ks)
            configs = [generate, *configs, *assisted]
        warm = warm_up(configs, prompts[0], min(options.max_new_tokens, 16), progress=options.progress)
        ignored = [c.name for c in configs if c.adaptive and not warm[c.name].adaptive]
        if ignored:
            print(
                f"WARNING: the coordinator ignored `adaptive` (its stats say K was fixed); "
                f"left out: {', '.join(ignored)}",
                file=sys.stderr,
            )
            configs = [c for c in configs if c.name not in ignored]
        results = run_interleaved(configs, prompts, options.max_new_tokens, progress=options.progress)

    meta = {
        "title": f"{Path(model_dir).name}, {len(prompts)} prompts × {options.max_new_tokens} tokens",
        "command": shlex.join(["outrider", *sys.argv[1:]]) if sys.argv[1:2] == ["bench"] else None,
        "target_model": options.target_model or models.DEFAULT_MODEL,
        "dtype": options.dtype,
        "max_new_tokens": options.max_new_tokens,
        "k": list(options.ks),
        "drafters": list(options.drafters),
        "prompt_files": [str(p) for p in options.prompt_files],
        "limit": options.limit,
        "threads": options.threads,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
    }
    report = build_report(configs, prompts, results, meta)
    report["elapsed_s"] = round(time.time() - started, 1)
    render(report, out)
    print(f"{len(prompts)} prompts × {len(configs)} configurations in {report['elapsed_s']:.0f} s", file=out)
    if options.json_path is not None:
        options.json_path.parent.mkdir(parents=True, exist_ok=True)
        options.json_path.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    if options.plot_path is not None:
        plot(report, options.plot_path)
    return report


def options_from_args(args: Any) -> BenchOptions:
    """The CLI's namespace (``outrider bench``) as :class:`BenchOptions`; raises ValueError on bad flags."""
    files = tuple(Path(p) for p in (args.prompts or default_prompt_files()))
    if not files:
        raise ValueError("give --prompts FILE (the default, ../shared/data/mt_bench/question.jsonl, is not here)")
    for path in files:
        if not path.is_file():
            raise ValueError(f"--prompts {path}: no such file")
    if args.limit is not None and args.limit < 1:
        raise ValueError("--limit must be at least 1")
    if args.max_new_tokens < 1:
        raise ValueError("--max-new-tokens must be at least 1")
    drafters = tuple(d.strip() for d in args.drafters.split(",") if d.strip())
    for d in drafters:
        parse_drafter(d, target_model=None)
    return BenchOptions(
        prompt_files=files,
        limit=args.limit,
        max_new_tokens=args.max_new_tokens,
        ks=tuple(parse_k_list(args.k)),
        drafters=drafters,
        hf=not args.no_hf,
        adaptive=not args.no_adaptive,
        target_model=args.target_model,
        dtype=args.dtype,
        threads=args.threads or os.cpu_count() or 1,
        json_path=args.json,
        plot_path=args.plot,
        progress=not args.no_progress,
        log_level=args.log_level,
    )


def main(args: Any) -> int:
    """``outrider bench``: returns the exit status."""

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt  # unwinds through the stack's cleanup: no orphaned services

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        options = options_from_args(args)
        run_bench(options)
    except (ValueError, RuntimeError) as exc:
        print(f"outrider bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("outrider bench: interrupted", file=sys.stderr)
        return 130
    return 0
