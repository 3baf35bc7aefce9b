"""How a request samples: its parameters, validated once, and the ways the
target checks drafts. Plain data (no tensors), so the coordinator, which
runs no model, imports no torch; the math that uses them is
``outrider.sampling`` and ``outrider.target_worker.verify``."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

UINT64_MAX = 2**64 - 1
MAX_LOGPROBS = 20
"""The most alternatives a request's ``logprobs`` may ask for (OpenAI's limit)."""


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_integer(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class Verification(enum.StrEnum):
    """How the target checks the draft's tokens (docs/design.md#verification)."""

    GREEDY = "greedy"
    REJECTION = "rejection"
    GUMBEL = "gumbel"

    @staticmethod
    def of_request(requested: Verification | None, temperature: float) -> Verification:
        """The mode a request runs with: greedy at temperature 0 whatever it
        asked, else what it asked, rejection when it asked nothing."""
        if temperature == 0:
            return Verification.GREEDY
        return requested or Verification.REJECTION


STRUCTURED_OUTPUT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on what a request may generate (docs/design.md#structured-output).

    ``kind`` says what ``spec`` holds: ``"json_schema"`` a JSON schema (as
    JSON text), ``"json_object"`` nothing (any JSON object), ``"regex"`` a
    regular expression, ``"choice"`` a JSON list of the strings allowed,
    ``"grammar"`` a Lark or GBNF grammar. ``outrider.grammar`` compiles it."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_OUTPUT_KINDS:
            raise ValueError(
                f"structured output kind must be one of {', '.join(STRUCTURED_OUTPUT_KINDS)}, "
                f"got {self.kind!r}"
            )


@dataclass(frozen=True)
class SamplingParams:
    """How a request samples; validated once, on construction."""

    temperature: float = 0.0
    """0 means greedy: verification is then GREEDY whatever was asked."""
    top_k: int = 0
    """Keep the ``top_k`` most likely tokens; 0 turns it off."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose mass is at least
    ``top_p`` (nucleus); 1.0 turns it off."""
    min_p: float = 0.0
    """Drop tokens less likely than ``min_p`` times the most likely; 0 turns it off."""
    seed: int = 0
    """The request's seed, a 64-bit unsigned integer."""
    verification: Verification = Verification.GREEDY
    logprobs: int | None = None
    """Report the target's log-probability of each generated token and of
    this many most likely tokens at its position; None: none."""
    structured_output: StructuredOutput | None = None
    """What the generated tokens must follow; None: anything."""
    min_tokens: int = 0
    """The first ``min_tokens`` generated tokens are none of ``stop_token_ids``:
    the target gives those no mass there (vLLM's min_tokens)."""
    stop_token_ids: frozenset[int] = frozenset()
    """The ids ``min_tokens`` holds back: those that end the generation
    (its end-of-sequence and stop token ids); empty without ``min_tokens``."""
    start: int = 0
    """The history's position where generation began (the prompt's
    length): where ``structured_output`` and ``min_tokens`` apply from."""

    def __post_init__(self) -> None:
        if not isinstance(self.verification, Verification):
            allowed = ", ".join(v.value for v in Verification)
            try:
                object.__setattr__(self, "verification", Verification(self.verification))
            except ValueError:
                raise ValueError(
                    f"verification must be one of {allowed}, got {self.verification!r}"
                ) from None
        if not (
            _is_number(self.temperature)
            and math.isfinite(self.temperature)
            and self.temperature >= 0
        ):
            raise ValueError(
                "temperature must be a finite number >= 0 (0 means greedy), "
                f"got {self.temperature!r}"
            )
        if not (_is_integer(self.top_k) and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0 (0 turns it off), got {self.top_k!r}")
        if not (_is_number(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (1 turns it off), got {self.top_p!r}")
        if not (_is_number(self.min_p) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1] (0 turns it off), got {self.min_p!r}")
        if not (_is_integer(self.seed) and 0 <= self.seed <= UINT64_MAX):
            raise ValueError(f"seed must be an integer in [0, 2**64 - 1], got {self.seed!r}")
        if not (_is_integer(self.min_tokens) and self.min_tokens >= 0):
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if not (_is_integer(self.start) and self.start >= 0):
            raise ValueError(f"start must be an integer >= 0, got {self.start!r}")
        if self.logprobs is not None and not (
            _is_integer(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.verification is Verification.GREEDY
