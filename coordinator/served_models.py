"""What the coordinator knows of the models it serves: the target's
tokenizer and end-of-sequence ids, and what each worker said it serves."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from coordinator.workers.protocol import WorkerInfo
from outrider.detokenize import Decoder


@dataclass(frozen=True)
class Models:
    """What the loop needs to know about the served models."""

    tokenizer: Decoder
    eos_token_ids: frozenset[int]
    target: WorkerInfo
    draft: WorkerInfo | None = None

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


def eos_token_ids(tokenizer, generation_config: Mapping[str, Any]) -> frozenset[int]:
    """End-of-sequence ids: the generation config's, plus the tokenizer's."""
    ids: set[int] = set()
    eos = generation_config.get("eos_token_id")
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, Sequence):
        ids.update(int(i) for i in eos)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)
