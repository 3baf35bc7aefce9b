"""Drafters: what proposes the tokens the target verifies. Each is one
module of this package and one row of :data:`DRAFTERS`.

Where a drafter runs decides its interface:

* **On the draft worker** — a model (or llama.cpp, or an EAGLE-3 head) with
  a cache per session: a :class:`~outrider.drafters.model.Drafter`, whose
  ``open``, ``rollback`` and ``propose`` are engine jobs batched across the
  sessions drafting at a step. Its module's ``load(config)`` builds it from
  the draft worker's :class:`~outrider.config.DraftWorkerConfig`, as a
  :class:`~outrider.drafters.model.LoadedDrafter`.
* **In the coordinator** — no model: each session's next draft is looked up
  after every round in what the coordinator holds anyway. A
  :class:`~outrider.drafters.lookup.Lookup`, built by its module's
  ``load(config)`` from the coordinator's
  :class:`~outrider.config.CoordinatorConfig`; the setting in its row
  (``--prompt-lookup``, ``--suffix-decoding``) selects it.

Adding a drafter is a module here and a row below (a coordinator drafter
also its setting in ``CoordinatorConfig``). The table imports nothing
heavy: a row names its loader, imported when a service starts it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Literal

from outrider.flags import flag_name


@dataclass(frozen=True)
class DrafterKind:
    runs_in: Literal["draft worker", "coordinator"]
    loader: str
    """``module:function``: builds the drafter from its service's config."""
    setting: str = ""
    """A coordinator drafter's setting of :class:`~outrider.config.CoordinatorConfig`,
    which turns it on."""

    def load(self, config: Any) -> Any:
        module, _, function = self.loader.partition(":")
        return getattr(importlib.import_module(module), function)(config)


DRAFTERS: dict[str, DrafterKind] = {
    # a small model with the target's vocabulary
    "model": DrafterKind("draft worker", "outrider.drafters.model:load"),
    # the target's checkpoint with its weights in 4 bits (outrider.quantize)
    "int4": DrafterKind("draft worker", "outrider.drafters.model:load"),
    # a GGUF file (by default the one the target was converted from) on llama.cpp
    "gguf": DrafterKind("draft worker", "outrider.drafters.gguf:load"),
    # the target's first L layers, then its final norm and head
    "early-exit": DrafterKind("draft worker", "outrider.drafters.model:load"),
    # an EAGLE-3 head reading the target's hidden states (outrider.eagle)
    "eagle": DrafterKind("draft worker", "outrider.drafters.eagle:load"),
    # the continuation of the history's last n-gram where it occurred before
    "prompt-lookup": DrafterKind(
        "coordinator", "outrider.drafters.lookup:load", setting="prompt_lookup"
    ),
    # the history and the deployment's earlier outputs (suffix decoding)
    "suffix": DrafterKind(
        "coordinator", "outrider.drafters.suffix:load", setting="suffix_decoding"
    ),
}
"""Every drafter, by the name ``--drafter`` takes."""

MODEL_DRAFTERS = tuple(name for name, kind in DRAFTERS.items() if kind.runs_in == "draft worker")
"""What a draft worker runs."""
COORDINATOR_DRAFTERS = {
    name: flag_name(kind.setting)
    for name, kind in DRAFTERS.items()
    if kind.runs_in == "coordinator"
}
"""The drafters that run in the coordinator, and its flag for each."""
