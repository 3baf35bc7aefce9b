"""Constrained sampling under speculation has exactly the target's
constrained distribution (docs/design.md#structured-output).

The χ² machinery, the tiny Llamas and their logit tables are those of
``test_sampling_distribution`` (its docstring says how they work); here
every request carries a structured output, a regular expression over a
16-token tokenizer (``a`` .. ``p``, one letter a token, ``p`` the
end-of-sequence token) that llguidance compiles for both workers:
letters from ``a``-``h`` and ``i``-``o`` alternate, starting with the first
half, and the end-of-sequence token may come at any point (every prefix of
such a string is accepted), after which only it may. So about half the
vocabulary is forbidden at each position, and which half depends on the
tokens before. ``ignore_eos`` keeps every generation NEW_TOKENS long.

The reference is exact: the marginals of constrained target-only sampling,
by enumerating every prefix, each masked by a matcher synced to it (a
prefix the constraint forbids has probability 0) and processed by
``outrider.sampling.constrain`` and ``probabilities`` as the workers do.
Each check asserts χ² p > 0.01 at every position (fixed seeds 0 .. N-1),
that every output follows the regular expression, and that drafted runs
both accepted and rejected drafts. Negative control: the same samples
against the unconstrained reference fail.
"""

from __future__ import annotations

import copy
import itertools
import re
from dataclasses import dataclass, field, replace

import numpy as np
import pytest
import torch
from llguidance.hf import from_tokenizer
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers import models as tokenizer_models
from transformers import PreTrainedTokenizerFast

from outrider.coordinator.served_models import Models
from outrider.coordinator.workers.protocol import WorkerInfo
from outrider.draft_worker.sessions import DraftSessions
from outrider.drafters.lookup import PromptLookup
from outrider.drafters.model import DraftInfo, ModelDrafter
from outrider.engine import InlineEngine
from outrider.errors import InvalidArgument
from outrider.grammar import Grammars
from outrider.sampling import SamplingParams, constrain, probabilities
from outrider.sampling_params import StructuredOutput
from outrider.session import SessionStore
from outrider.target_worker.sessions import TargetInfo, TargetSessions
from tests.inprocess import InProcessDraftClient, InProcessTargetClient
from tests.integration.test_sampling_distribution import (
    ALPHA,
    BAD_DRAFT_SEED,
    CONTROL_ALPHA,
    N_GUMBEL_DRAFTED,
    NEW_TOKENS,
    PERTURB_SEED,
    PIPELINE_K,
    PIPELINE_NEW_TOKENS,
    PROMPT,
    SETTINGS,
    TARGET_ONLY,
    TARGET_SEED,
    VOCAB,
    K,
    Letters,
    N,
    TableLM,
    chi_square_p,
    exact_marginals,
    load_llama,
    one_thread_quiet_loop,  # noqa: F401 (an autouse fixture: one thread, quiet loop, summary)
    prefix_logits,
    report,
    request,
    run_once,
    runner,
)

EOS = VOCAB - 1  # "p"
PATTERN = "(?:[a-h][i-o])*[a-h]?"
OUTPUT = StructuredOutput("regex", PATTERN)


def grammars() -> Grammars:
    """A worker's structured output, for the one-letter-a-token tokenizer."""
    vocab = {chr(ord("a") + i): i for i in range(VOCAB)}
    tokenizer = Tokenizer(tokenizer_models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=chr(ord("a") + EOS))
    return Grammars(lambda: from_tokenizer(hf, n_vocab=VOCAB, eos_token=[EOS]))


def target_client(model: torch.nn.Module, depth: int) -> InProcessTargetClient:
    model_runner = runner(TableLM(model, PROMPT, depth))
    info = TargetInfo(model_name="target", vocab_size=VOCAB, vocab_fingerprint="", max_context=512)
    store = SessionStore(max_sessions=8, pool=model_runner.pool)
    sessions = TargetSessions(model_runner, store, info, grammars())
    return InProcessTargetClient(sessions, InlineEngine(model_runner))


def draft_client(model: torch.nn.Module, depth: int, name: str) -> InProcessDraftClient:
    drafter = ModelDrafter(runner(TableLM(model, PROMPT, depth)), model_name=name)
    info = DraftInfo(vocab_fingerprint="", max_context=512, max_draft_tokens=16)
    store = SessionStore(max_sessions=8, pool=drafter.runner.pool)
    sessions = DraftSessions(drafter, store, info, grammars())
    return InProcessDraftClient(sessions, InlineEngine(drafter.runner))


def constrained_marginals(
    model: torch.nn.Module, params: SamplingParams, positions: int
) -> torch.Tensor:
    """``[positions, V]``: the exact marginals of constrained target-only
    sampling, by enumerating every prefix (float64)."""
    matcher = grammars().matcher(OUTPUT)
    everything = np.full(matcher.words, -1, dtype=np.int32)
    masks: dict[tuple[int, ...], np.ndarray | None] = {}  # None: the prefix is forbidden

    def mask(prefix: tuple[int, ...]) -> np.ndarray:
        if prefix and masks[prefix[:-1]] is None:
            masks[prefix] = None
        else:
            try:
                matcher.sync(list(prefix))
                masks[prefix] = matcher.mask()
            except InvalidArgument:
                masks[prefix] = None
        # A forbidden prefix has probability 0: any row will do.
        return everything if masks[prefix] is None else masks[prefix]

    prompt_rows, *levels = prefix_logits(model, PROMPT, positions - 1)
    prefix_probs = torch.ones(1, dtype=torch.float64)
    marginals = []
    for i, logits in enumerate([prompt_rows[-1:], *levels]):
        rows = np.stack([mask(s) for s in itertools.product(range(VOCAB), repeat=i)])
        next_probs = probabilities(constrain(logits, rows), params)
        marginals.append(prefix_probs @ next_probs)
        prefix_probs = (prefix_probs[:, None] * next_probs).reshape(-1)
    marginals = torch.stack(marginals)
    assert torch.allclose(marginals.sum(-1), torch.ones(positions, dtype=torch.float64))
    return marginals


def follows(tokens: np.ndarray) -> bool:
    """Whether a generation follows the constraint: the pattern, then
    (from the first end-of-sequence token on) nothing but end-of-sequence tokens."""
    text = "".join(chr(ord("a") + t) for t in tokens)
    body, _, tail = text.partition(chr(ord("a") + EOS))
    return re.fullmatch(PATTERN, body) is not None and set(tail) <= {chr(ord("a") + EOS)}


@dataclass
class World:
    target_model: torch.nn.Module
    target: InProcessTargetClient
    drafts: dict[str, InProcessDraftClient | PromptLookup]
    pipelined: tuple[InProcessTargetClient, InProcessDraftClient]
    models: Models
    references: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    samples: dict[tuple[str, str, str, int, bool], Samples] = field(default_factory=dict)

    def reference(self, setting: str, positions: int = NEW_TOKENS) -> torch.Tensor:
        key = (setting, positions)
        if key not in self.references:
            params = SamplingParams(**SETTINGS[setting])
            self.references[key] = constrained_marginals(self.target_model, params, positions)
        return self.references[key]


@dataclass(frozen=True)
class Samples:
    tokens: np.ndarray  # [n, new tokens]: the generated tokens of seeds 0 .. n-1
    draft_tokens: int
    accepted_tokens: int
    speculation_hits: int = 0
    speculation_misses: int = 0


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    root = tmp_path_factory.mktemp("structured-sampling")
    target = load_llama(root / "target", TARGET_SEED)
    bad = load_llama(root / "bad-draft", BAD_DRAFT_SEED)
    good = copy.deepcopy(target)  # a perturbed head: most drafts accepted, some rejected
    generator = torch.Generator().manual_seed(PERTURB_SEED)
    with torch.no_grad():
        head = good.lm_head.weight
        head.add_(0.15 * torch.randn(head.shape, generator=generator, dtype=head.dtype))
    depth, pipeline_depth = NEW_TOKENS - 1, PIPELINE_NEW_TOKENS - 1
    drafts = {
        "good": draft_client(good, depth, "good"),
        "bad": draft_client(bad, depth, "bad"),
        "prompt-lookup": PromptLookup(),
    }
    pipelined = target_client(target, pipeline_depth), draft_client(good, pipeline_depth, "good")
    info = WorkerInfo(
        model="target", drafter="", vocab_size=VOCAB, vocab_fingerprint="", max_context=512
    )
    models = Models(Letters(), frozenset({EOS}), info)
    return World(target, target_client(target, depth), drafts, pipelined, models)


async def samples(
    world: World, mode: str, draft: str, setting: str, n: int = N, pipeline: bool = False
) -> Samples:
    """The constrained generations of seeds 0 .. n-1 (memoised per module)."""
    key = (mode, draft, setting, n, pipeline)
    if key not in world.samples:
        if pipeline:
            assert draft == "good"
            target, draft_client_ = world.pipelined
        else:
            target, draft_client_ = world.target, world.drafts.get(draft)
        k = (PIPELINE_K if pipeline else K) if draft_client_ is not None else 0
        out = np.empty((n, PIPELINE_NEW_TOKENS if pipeline else NEW_TOKENS), dtype=np.int64)
        drafted = accepted = hits = misses = 0
        for seed in range(n):
            req = request(setting, mode, seed, k, pipeline)
            req = replace(
                req, sampling=replace(req.sampling, structured_output=OUTPUT, start=len(PROMPT))
            )
            tokens, st = await run_once(world.models, target, draft_client_, req)
            out[seed] = tokens
            drafted += st.draft_tokens
            accepted += st.accepted_tokens
            assert st.pipeline == pipeline
            hits += st.speculation_hits
            misses += st.speculation_misses
        world.samples[key] = Samples(out, drafted, accepted, hits, misses)
    return world.samples[key]


def check(world: World, result: Samples, mode: str, draft: str, setting: str) -> None:
    """Every output follows the constraint, and every position's marginal
    is the constrained reference's (χ² p > ALPHA)."""
    tokens = result.tokens
    assert all(follows(row) for row in tokens), [row for row in tokens if not follows(row)][:3]
    reference = world.reference(setting, tokens.shape[1])
    note = ""
    if result.draft_tokens:
        note = f"(constrained; acceptance rate {result.accepted_tokens / result.draft_tokens:.3f})"
    p_values = []
    for position in range(tokens.shape[1]):
        p = chi_square_p(tokens[:, position], reference[position])
        report(mode, draft, f"{setting} regex", position + 1, len(tokens), p, note)
        p_values.append(p)
    assert min(p_values) > ALPHA, p_values


# --- the checks ---------------------------------------------------------------------


async def test_constrained_target_only_matches_the_exact_distribution(world):
    """K = 0: the constrained reference itself is right."""
    result = await samples(world, "rejection", TARGET_ONLY, "T=1.0")
    assert result.draft_tokens == 0
    check(world, result, "rejection", TARGET_ONLY, "T=1.0")


@pytest.mark.parametrize(
    ("draft", "setting", "pipeline"),
    [
        ("good", "T=1.0", False),
        ("bad", "T=1.0", False),
        ("prompt-lookup", "T=1.0", False),
        ("good", "T=0.7,top_k=5", False),
        ("good", "T=1.3,top_p=0.8", False),
        ("good", "T=1.0,min_p=0.1", False),
        ("good", "T=1.0", True),
    ],
)
async def test_constrained_rejection_sampling_matches_the_target(world, draft, setting, pipeline):
    result = await samples(world, "rejection", draft, setting, pipeline=pipeline)
    check(world, result, "rejection", f"{draft}+pipeline" if pipeline else draft, setting)
    # Both the accept paths and the reject paths (recovered tokens) ran.
    assert 0 < result.accepted_tokens < result.draft_tokens
    if pipeline:  # both outcomes of the speculation happened
        assert result.speculation_hits > 0 and result.speculation_misses > 0


@pytest.mark.parametrize("draft", ["good", "bad"])
async def test_constrained_gumbel_coupling_is_target_only_decoding(world, draft):
    """With a draft, seed for seed the tokens of constrained target-only Gumbel decoding."""
    result = await samples(world, "gumbel", draft, "T=1.0", N_GUMBEL_DRAFTED)
    target_only = await samples(world, "gumbel", TARGET_ONLY, "T=1.0", N_GUMBEL_DRAFTED)
    check(world, result, "gumbel", draft, "T=1.0")
    assert 0 < result.accepted_tokens < result.draft_tokens
    assert np.array_equal(result.tokens, target_only.tokens)


@pytest.mark.parametrize("draft", [TARGET_ONLY, "good"])
async def test_negative_control_the_unconstrained_reference_is_rejected(world, draft):
    """Power: constrained samples fail against the unconstrained distribution."""
    tokens = (await samples(world, "rejection", draft, "T=1.0")).tokens
    unconstrained = exact_marginals(world.target_model, SamplingParams(temperature=1.0))
    p_values = [chi_square_p(tokens[:, i], unconstrained[i]) for i in range(NEW_TOKENS)]
    for i, p in enumerate(p_values):
        note = f"negative control: expect p < {CONTROL_ALPHA:g}"
        report("rejection", draft, "T=1.0 vs unconstrained", i + 1, len(tokens), p, note)
    assert max(p_values) < CONTROL_ALPHA, p_values


async def test_negative_control_a_wrong_temperature_under_the_constraint_is_detected(world):
    """Power within the constraint's support: the same samples against the
    constrained reference at another temperature fail."""
    tokens = (await samples(world, "rejection", "good", "T=1.0")).tokens
    wrong = constrained_marginals(world.target_model, SamplingParams(temperature=0.8), NEW_TOKENS)
    p_values = [chi_square_p(tokens[:, i], wrong[i]) for i in range(NEW_TOKENS)]
    for i, p in enumerate(p_values):
        note = f"negative control: expect p < {CONTROL_ALPHA:g}"
        report("rejection", "good", "T=1.0 vs T=0.8 regex", i + 1, len(tokens), p, note)
    assert max(p_values) < CONTROL_ALPHA, p_values
