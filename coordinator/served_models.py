"""What the coordinator knows of the models it serves: the target's
tokenizer and end-of-sequence ids, and what each worker said it serves."""

from __future__ import annotations

from dataclasses import dataclass, field

from outrider.coordinator.detokenize import Decoder
from outrider.coordinator.workers.protocol import WorkerInfo
from outrider.grammar import Grammars


@dataclass(frozen=True)
class Models:
    """What the loop needs to know about the served models."""

    tokenizer: Decoder
    eos_token_ids: frozenset[int]
    target: WorkerInfo
    draft: WorkerInfo | None = None
    grammars: Grammars = field(init=False, repr=False, compare=False)
    """Structured output's constraints, compiled for the target's tokenizer
    (which reads it at the first request that has one)."""

    def __post_init__(self) -> None:
        grammars = Grammars.of_tokenizer(
            self.tokenizer, self.target.vocab_size, sorted(self.eos_token_ids)
        )
        object.__setattr__(self, "grammars", grammars)

    @property
    def draft_competes(self) -> bool:
        """Whether a draft model's prefill would slow the target's: both
        run on CPUs, which on one host share their cores."""
        draft = self.draft
        return bool(draft and draft.dtype and draft.device == self.target.device == "cpu")

    @property
    def hidden_state_layers(self) -> tuple[int, ...]:
        """The target layers whose hidden states the draft reads (a head's), or none."""
        return self.draft.hidden_state_layers if self.draft else ()

    @property
    def draft_prefills_beside(self) -> bool:
        """Whether a draft session opens beside the target's prefill, so
        that drafting can start at the second round: where it does not slow
        the target's (:attr:`draft_competes`) and does not read the target's
        hidden states, which come with the target's prefill. (Prompt lookup
        opens nothing: it looks its drafts up in the coordinator.)"""
        draft = self.draft
        return (
            bool(draft and draft.dtype) and not self.draft_competes and not self.hidden_state_layers
        )
