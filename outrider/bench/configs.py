"""Configurations: what each one is called and runs, the drafters, the K list."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from outrider.bench.measurements import Measurement
from outrider.bench.prompts import Prompt
from outrider.drafters import COORDINATOR_DRAFTERS

BASELINE = "hf-generate"
TARGET_ONLY = "outrider-k0"
PIPELINED = "-pipelined"
"""The suffix of a pipelined configuration's name; without it, the name of its synchronous twin."""
SAMPLED = "-t1"
"""The suffix of a sampled twin: the same configuration at temperature 1
with rejection sampling (OpenAI's default, what serving benchmarks send),
each prompt seeded by its index."""
SAMPLED_TEMPERATURE = 1.0
LOOKUP_BESIDE = "suffix+"
"""The prefix of a drafter label that runs suffix decoding beside a model drafter."""


def keeps_outputs(label: str | None) -> bool:
    """Whether a drafter's coordinator drafts from earlier requests' outputs
    (suffix decoding, alone or beside a model): each configuration then gets
    a coordinator of its own, so none drafts from the same prompt's answer
    that the configuration before it wrote."""
    return label is not None and (label == "suffix" or label.startswith(LOOKUP_BESIDE))


def pipelines(label: str) -> bool:
    """Whether a drafter's rounds may be pipelined: not where the coordinator
    looks drafts up (prompt lookup, suffix decoding, alone or beside a
    model), in microseconds, with nothing to overlap."""
    return label not in COORDINATOR_DRAFTERS and not label.startswith(LOOKUP_BESIDE)


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
    pipeline: bool = False
    """Pipelined rounds: the draft drafts round i+1 while the target verifies round i."""
    temperature: float = 0.0
    """0: greedy, its output checked; else sampled (a ``-t1`` twin), unchecked."""


@dataclass(frozen=True)
class Drafter:
    """A drafter of ``--drafters``: its label and the draft worker's flags,
    or the coordinator's for a drafter that runs there (no draft worker)."""

    label: str
    draft_args: tuple[str, ...]
    hf_peer: str | None
    """The Hugging Face peer: ``assistant_model=`` the target in bfloat16
    (``"bf16"``) or with the int4 drafter's weights (``"int4"``),
    ``"prompt-lookup"``, or None (no HF peer)."""
    coordinator_args: tuple[str, ...] = ()
    """The coordinator's flags for a drafter in the coordinator: alone (no
    ``draft_args``, no draft worker) or beside a draft worker's."""


@dataclass(frozen=True)
class OutriderVariant:
    """One Outrider configuration: its name, the coordinator it asks and its K."""

    name: str
    coordinator: str | None
    """The coordinator's name: its drafter's label, or for a drafter that
    keeps outputs across requests (:func:`keeps_outputs`) the configuration's name."""
    drafter: str | None
    k: int | None
    """0: target only; ``None`` with ``adaptive``."""
    adaptive: bool = False
    pipeline: bool = False
    """Sent as ``pipeline=``: True for the ``-pipelined`` configurations,
    False (explicitly) for the others."""
    temperature: float = 0.0
    coordinator_drafter: str | None = None
    """The drafter label whose coordinator flags ``coordinator`` runs with."""


def outrider_variants(
    labels: Sequence[str | None],
    ks: Sequence[int],
    *,
    adaptive: bool,
    pipelined: bool,
    sampled: bool = False,
) -> list[OutriderVariant]:
    """``outrider-k0`` on the first coordinator, then for each drafter its fixed K and adaptive K,
    each followed by its ``-pipelined`` twin when ``pipelined`` (and the drafter pipelines); with
    ``sampled``, last, the ``-t1`` twins of ``outrider-k0`` and of each adaptive configuration.
    A drafter that keeps outputs across requests gets a coordinator per configuration (the one
    ``outrider-k0`` runs on too, when it is the first)."""
    variants = [OutriderVariant(TARGET_ONLY, labels[0], None, 0)]
    for label in labels:
        if label is None:
            continue
        synchronous = [OutriderVariant(f"outrider-{label}-k{k}", label, label, k) for k in ks]
        if adaptive:
            synchronous.append(
                OutriderVariant(f"outrider-{label}-adaptive", label, label, None, adaptive=True)
            )
        for v in synchronous:
            variants.append(v)
            if pipelined and pipelines(label):
                variants.append(replace(v, name=v.name + PIPELINED, pipeline=True))
    if sampled:
        twins = [v for v in variants if v.k == 0 or (v.adaptive and not v.pipeline)]
        variants += [
            replace(v, name=v.name + SAMPLED, temperature=SAMPLED_TEMPERATURE) for v in twins
        ]
    return [
        replace(
            v,
            coordinator=v.name if keeps_outputs(v.coordinator) else v.coordinator,
            coordinator_drafter=v.coordinator,
        )
        for v in variants
    ]


def coordinators_of(variants: Sequence[OutriderVariant]) -> dict[str | None, str | None]:
    """The coordinators the variants ask, each to the drafter label whose flags it takes."""
    return {v.coordinator: v.coordinator_drafter for v in variants}


def parse_drafter(spec: str, *, target_model: str | None) -> Drafter:
    """``prompt-lookup``, ``suffix`` (suffix decoding; Hugging Face has no
    peer), ``bf16`` (the target itself in bfloat16), ``int4`` (the target
    with 4-bit weights), ``gguf`` (the GGUF the target came from, on
    llama.cpp on the CPU; no peer: transformers dequantizes a GGUF) or
    ``gguf:FILE`` (another GGUF, labelled ``gguf-`` and the file's stem),
    ``early-exit-L`` or ``eagle`` (the EAGLE-3 head shipped for the target;
    no peer either), or ``suffix+D``: suffix decoding beside model drafter D
    (no peer)."""
    model = ("--model", target_model) if target_model else ()
    if spec.startswith(LOOKUP_BESIDE):
        beside = parse_drafter(spec.removeprefix(LOOKUP_BESIDE), target_model=target_model)
        if not beside.draft_args:
            raise ValueError(f"drafter {spec!r}: suffix decoding goes beside a model drafter")
        return Drafter(spec, beside.draft_args, None, coordinator_args=("--suffix-decoding",))
    if spec == "prompt-lookup":
        return Drafter(spec, (), "prompt-lookup", coordinator_args=("--prompt-lookup",))
    if spec == "suffix":
        return Drafter(spec, (), None, coordinator_args=("--suffix-decoding",))
    if spec == "bf16":
        return Drafter(spec, ("--drafter", "model", "--dtype", "bfloat16", *model), "bf16")
    if spec == "int4":
        return Drafter(spec, ("--drafter", "int4", *model), "int4")
    if spec == "gguf" or spec.startswith("gguf:"):
        path = spec.partition(":")[2]
        label = f"gguf-{Path(path).stem}" if path else spec
        gguf = ("--model", path) if path else model
        return Drafter(label, ("--drafter", "gguf", "--device", "cpu", *gguf), None)
    if spec == "eagle":
        return Drafter(spec, ("--drafter", "eagle", *model), None)
    if match := re.fullmatch(r"early-exit-(\d+)", spec):
        layers = match.group(1)
        return Drafter(spec, ("--drafter", "early-exit", "--draft-layers", layers, *model), None)
    raise ValueError(
        f"unknown drafter {spec!r}: "
        "use prompt-lookup, suffix, bf16, int4, gguf, gguf:FILE, eagle, early-exit-L "
        "(e.g. early-exit-8) "
        "or suffix+D (e.g. suffix+int4)"
    )


def parse_k_list(raw: str) -> list[int]:
    try:
        ks = sorted({int(part) for part in raw.split(",") if part.strip()})
    except ValueError:
        raise ValueError(f"--k {raw!r}: give comma-separated integers, e.g. 4,8") from None
    if not ks or any(k < 1 for k in ks):
        raise ValueError(
            f"--k {raw!r}: give one or more K of at least 1 (K=0 always runs as outrider-k0)"
        )
    return ks


def parse_config_globs(raw: str) -> tuple[str, ...]:
    """``--configs``: comma-separated names or shell-style globs
    (``outrider-*-adaptive``)."""
    globs = tuple(part.strip() for part in raw.split(",") if part.strip())
    if not globs:
        raise ValueError(
            f"--configs {raw!r}: give configuration names or globs, "
            "comma-separated, e.g. 'outrider-*-adaptive'"
        )
    return globs
