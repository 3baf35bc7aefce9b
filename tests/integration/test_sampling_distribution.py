"""Speculative sampling leaves the target's distribution unchanged, end to
end through the round loop (after vLLM's rejection-sampler convergence test).

A tiny Llama with a 16-token vocabulary is the target. For each sampling
setting and each verification mode, many seeded generations (seeds
0 .. N-1, every seed an independent draw: all randomness is keyed by
(seed, stream, position)) of 4 new tokens with K = 2 draft tokens run
through ``outrider.coordinator.round_loop.generate`` with the in-process worker clients and
the real target and draft engines. The first token comes from the target's
prefill (a round without drafts); the rounds after it draft. The empirical
distribution of each of the four generated tokens (the marginals at
positions 1 to 4) is
compared with the EXACT target-only distribution, computed by enumerating
every prefix with the target model and ``outrider.sampling.probabilities``
(the very logits processing the workers use): chi-square, cells with an
expected count below 5 pooled, each check asserts p > 0.01 and prints its
p-value. The seeds are fixed, so the checks are deterministic. Tokens the
reference gives no mass (outside top-k / top-p / min-p) must never appear.

Drafts: ``good`` (a copy of the target with a perturbed head: most drafts
accepted, some rejected), ``bad`` (an unrelated model: most rejected),
``gguf`` (``good`` written as a GGUF file and run by llama.cpp, the gguf
drafter: its q comes from llama.cpp's float32 logits), and
``prompt-lookup`` (in the coordinator: a deterministic point-mass draft; the prompt holds every
token, so it always finds a continuation to propose). With 3 tokens left
after the first, a round drafts at most 2 (the loop never drafts past
max_new_tokens), so K = 2 is the largest K that matters here.

Pipelined rounds (the draft drafts round i + 1 while the target verifies
round i, assuming round i is accepted whole plus the draft's guess of the
bonus token) run with the ``good`` draft: 5 new tokens with K = 1, since a
round is only speculated when, accepted whole, it leaves room for another
drafting round. Round 2 drafts token 2 and meanwhile the draft guesses the
bonus (token 3) and drafts token 4; on a hit that draft is verified at once,
so positions 4 and 5 rest on drafts (and q) drafted ahead. All five
marginals are checked.

Speed (the machine has two cores): the engines run their models through
``TableLM``, the tiny Llamas' logits precomputed (one batched forward) for
every sequence a generation can reach, served through the same
``FallbackRunner`` / ``DynamicCache`` interface (the cache holds one
placeholder per token, so the runner's crops and rollbacks decide what the
model sees, as with the real model). A separate check decodes with the real
Hugging Face models and asserts identical tokens.
Engine calls run inline on the event loop instead of on engine threads.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy import stats
from transformers import AutoModelForCausalLM

import outrider.coordinator.round_loop as loop_module
import outrider.target_worker.sessions as target_sessions_module
from outrider.config import Recovery
from outrider.coordinator.requests import GenerationRequest
from outrider.coordinator.round_loop import generate
from outrider.coordinator.served_models import Models
from outrider.coordinator.workers.protocol import WorkerInfo
from outrider.draft_worker.sessions import DraftSessions
from outrider.drafters.gguf import GgufDrafter
from outrider.drafters.lookup import PromptLookup
from outrider.drafters.model import DraftInfo, ModelDrafter
from outrider.drafters.suffix import SuffixDecoding
from outrider.engine import Engine, InlineEngine
from outrider.engine.kv_cache import BlockPool
from outrider.engine.llama import LlamaForward
from outrider.engine.runner import FallbackRunner, PagedRunner
from outrider.sampling import SamplingParams, Stream, Verification, probabilities, sample, uniform
from outrider.session import SessionStore
from outrider.target_worker.sessions import TargetInfo, TargetSessions
from outrider.target_worker.verify import Verdict
from tests.inprocess import InProcessDraftClient, InProcessTargetClient
from tests.tiny import build_tiny_gguf, build_tiny_llama

try:
    import llama_cpp  # noqa: F401  (the gguf drafter's engine)

    from outrider.engine import gguf_runner
except ImportError:
    gguf_runner = None  # type: ignore[assignment]

VOCAB = 16
TARGET_SEED, BAD_DRAFT_SEED, PERTURB_SEED = 11, 12, 13
HIDDEN = 16  # small hidden size: flat enough distributions for the test to have power
# Holds every token id, so prompt lookup always finds the last token earlier.
PROMPT = (3, 7, 1, 12, 5, 0, 9, 14, 2, 11, 6, 15, 8, 4, 13, 10, 7, 3)
NEW_TOKENS = 4
K = 2
# Seeded generations per configuration. (Gumbel coupling with a draft must
# reproduce target-only Gumbel decoding seed for seed, which is checked
# exactly, so those runs need fewer seeds.) Bounded by the test's time budget
# on a two-core machine: about 3 ms per generation.
N = 600
N_GUMBEL_DRAFTED = 300
# Pipelined runs: see the module docstring.
PIPELINE_NEW_TOKENS = 5
PIPELINE_K = 1
ALPHA = 0.01  # every check asserts p > ALPHA (deterministic: the seeds are fixed)
CONTROL_ALPHA = 1e-3  # negative controls assert p < CONTROL_ALPHA

SETTINGS: dict[str, dict] = {
    "T=1.0": dict(temperature=1.0),
    "T=0.7,top_k=5": dict(temperature=0.7, top_k=5),
    "T=1.3,top_p=0.8": dict(temperature=1.3, top_p=0.8),
    "T=1.0,min_p=0.1": dict(temperature=1.0, min_p=0.1),
}
DRAFTED = [
    ("rejection", "good"),
    ("rejection", "bad"),
    ("rejection", "gguf"),
    ("rejection", "prompt-lookup"),
    ("rejection", "suffix"),
    ("rejection", "suffix+bad"),
    ("gumbel", "good"),
    ("gumbel", "bad"),
    ("gumbel", "gguf"),
]
PIPELINED = [("rejection", "good"), ("gumbel", "good")]
TARGET_ONLY = "none (K=0)"
GGUF_VOCABULARY = ["Ċ", *"abcdefghijklmno"]
"""The gguf draft's tokens (byte-level characters; the ids are what counts)."""


# --- the models ----------------------------------------------------------------


class TableLM(torch.nn.Module):
    """A causal LM whose logits are looked up: ``model``'s logits for every
    prefix of ``prompt + s`` for all ``s`` of ``depth`` tokens, computed in one
    batched forward pass. Called the way ``FallbackRunner`` calls a Hugging Face
    model. The cache's layer 0 holds one placeholder per token, so the
    runner's crops and rollbacks decide what the model sees, as they do for
    the real model."""

    def __init__(self, model: torch.nn.Module, prompt: tuple[int, ...], depth: int) -> None:
        super().__init__()
        self.config = model.config
        self._device_anchor = torch.nn.Parameter(torch.zeros(()), requires_grad=False)
        prompt_rows, *levels = prefix_logits(model, prompt, depth)
        self.table: dict[tuple[int, ...], torch.Tensor] = {
            prompt[: i + 1]: row for i, row in enumerate(prompt_rows)
        }
        for j, rows in enumerate(levels, start=1):
            vocab_j = itertools.product(range(model.config.vocab_size), repeat=j)
            for s, row in zip(vocab_j, rows, strict=True):
                self.table[(*prompt, *s)] = row

    def forward(self, input_ids, past_key_values, use_cache=True, logits_to_keep=0, **_):
        new = input_ids[0].tolist()
        layer = past_key_values.layers[0]
        past_len = layer.keys.shape[-2] if layer.is_initialized else 0
        # The ids ride along on the cache object; its length (after the
        # runner's crops) says how many of them are still cached.
        seq = getattr(past_key_values, "table_ids", [])[:past_len] + new
        past_key_values.table_ids = seq
        slot = torch.zeros(1, 1, len(new), 1)
        past_key_values.update(slot, slot, 0)
        try:
            rows = [self.table[tuple(seq[:i])] for i in range(past_len + 1, len(seq) + 1)]
        except KeyError:
            raise AssertionError(
                f"TableLM has no logits for {seq}: the test asked beyond its table"
            ) from None
        if logits_to_keep == 1:
            rows = rows[-1:]
        return SimpleNamespace(logits=torch.stack(rows).unsqueeze(0))


class Letters:
    """The one tokenizer method the loop needs (stop strings are not used here)."""

    def decode(self, token_ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + t) for t in token_ids)


class QuietLog:
    def info(self, *args, **kwargs):
        pass

    debug = info


def load_llama(path: Path, seed: int) -> torch.nn.Module:
    build_tiny_llama(path, vocab_size=VOCAB, seed=seed, hidden_size=HIDDEN)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()


_LOGITS: weakref.WeakKeyDictionary[
    torch.nn.Module, dict[tuple[tuple[int, ...], int], list[torch.Tensor]]
] = weakref.WeakKeyDictionary()


def prefix_logits(
    model: torch.nn.Module, prompt: tuple[int, ...], depth: int
) -> list[torch.Tensor]:
    """The model's logits after every prefix of ``prompt + s`` for all ``s``
    of ``depth`` tokens, from one batched forward pass (kept per model for
    the module's other tables and references): ``[prompt_rows, level_1, ...,
    level_depth]``, where ``prompt_rows`` (``[len(prompt), V]``) are those
    after each prefix of the prompt and ``level_j`` (``[V**j, V]``) those
    after ``prompt + s`` for each ``s`` of ``j`` tokens, in lexicographic
    order."""
    cached = _LOGITS.setdefault(model, {})
    if (prompt, depth) not in cached:
        vocab = model.config.vocab_size
        seqs = torch.tensor([[*prompt, *s] for s in itertools.product(range(vocab), repeat=depth)])
        with torch.inference_mode():  # in chunks: faster, and the same logits to the bit
            logits = torch.cat([model(input_ids=c).logits for c in seqs.split(4096)])
        # logits: [V**depth, P+depth, V].
        n = len(prompt)
        # The sequences that begin with a j-token ``s`` run from row
        # index(s) * V**(depth - j) on: every V**(depth - j)-th row is one
        # of each (the prompt's rows are alike in every sequence).
        cached[prompt, depth] = [logits[0, :n].clone()] + [
            logits[:: vocab ** (depth - j), n - 1 + j].clone() for j in range(1, depth + 1)
        ]
    return cached[prompt, depth]


def runner(model: torch.nn.Module) -> FallbackRunner:
    """The model's own forward, one session at a time (TableLM is no Llama)."""
    # Ample for 8 sessions of at most 23 tokens; a small pool keeps the
    # free list short (it is sorted each time the pool empties).
    return FallbackRunner(model, BlockPool(1024, 1))


def paged_runner(model: torch.nn.Module) -> PagedRunner:
    """The workers' batched forward of a real tiny Llama (over a copy: it takes the weights)."""
    return PagedRunner(LlamaForward(copy.deepcopy(model)), BlockPool(64, 16))


def target_client(model_runner) -> InProcessTargetClient:
    info = TargetInfo(model_name="target", vocab_size=VOCAB, vocab_fingerprint="", max_context=512)
    store = SessionStore(max_sessions=8, pool=model_runner.pool)
    return InProcessTargetClient(
        TargetSessions(model_runner, store, info), InlineEngine(model_runner)
    )


def draft_client(drafter) -> InProcessDraftClient:
    info = DraftInfo(vocab_fingerprint="", max_context=512, max_draft_tokens=16)
    store = SessionStore(max_sessions=8, pool=drafter.runner.pool)
    return InProcessDraftClient(DraftSessions(drafter, store, info), InlineEngine(drafter.runner))


def exact_marginals(
    model: torch.nn.Module, params: SamplingParams, positions: int = NEW_TOKENS
) -> torch.Tensor:
    """``[positions, V]``: the exact distribution of each of the first
    ``positions`` tokens of target-only sampling, by enumerating every prefix
    (float64)."""
    prompt_rows, *levels = prefix_logits(model, PROMPT, positions - 1)
    prefix_probs = torch.ones(1, dtype=torch.float64)  # [V**i]: each i-token prefix's probability
    marginals = []
    for logits in [prompt_rows[-1:], *levels]:
        # Level i: one row per i-token prefix, in the same order.
        next_probs = probabilities(logits, params)  # [V**i, V]
        marginals.append(prefix_probs @ next_probs)
        prefix_probs = (prefix_probs[:, None] * next_probs).reshape(-1)
    marginals = torch.stack(marginals)
    assert torch.allclose(marginals.sum(-1), torch.ones(positions, dtype=torch.float64))
    return marginals


# --- the chi-square check -----------------------------------------------------------


def chi_square_p(tokens: np.ndarray, probs: torch.Tensor) -> float:
    """p-value of the observed ``tokens`` against ``probs`` (``[V]``); cells with
    an expected count below 5 are pooled. Tokens without mass must not occur."""
    probs = probs.numpy()
    counts = np.bincount(tokens, minlength=len(probs)).astype(np.float64)
    outside = np.flatnonzero((probs == 0) & (counts > 0))
    assert outside.size == 0, (
        f"tokens {outside.tolist()} have no mass in the reference but were sampled"
    )
    expected = probs * len(tokens)
    big = expected >= 5
    obs, exp = list(counts[big]), list(expected[big])
    if (~big).any():
        pooled_obs, pooled_exp = counts[~big].sum(), expected[~big].sum()
        if pooled_exp < 5 and exp:  # still too small: merge it into the smallest big cell
            i = int(np.argmin(exp))
            obs[i] += pooled_obs
            exp[i] += pooled_exp
        else:
            obs.append(pooled_obs)
            exp.append(pooled_exp)
    if len(obs) < 2:
        return 1.0  # a point mass: nothing to test beyond the support check above
    return float(stats.chisquare(obs, exp).pvalue)


# --- the world: models, clients, exact references, samples -----------------------------


Drafters = (
    InProcessDraftClient
    | PromptLookup
    | SuffixDecoding
    | tuple[InProcessDraftClient, SuffixDecoding]
)
"""A drafter, or suffix decoding beside a draft model."""


@dataclass
class World:
    target_model: torch.nn.Module
    good_model: torch.nn.Module
    target: InProcessTargetClient
    drafts: dict[str, Drafters]
    models: Models
    references: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    samples: dict[tuple[str, str, str, int, bool], Samples] = field(default_factory=dict)
    pipelined: tuple[InProcessTargetClient, dict[str, InProcessDraftClient]] | None = None

    def reference(self, setting: str, positions: int = NEW_TOKENS) -> torch.Tensor:
        key = (setting, positions)
        if key not in self.references:
            params = SamplingParams(**SETTINGS[setting])
            self.references[key] = exact_marginals(self.target_model, params, positions)
        return self.references[key]

    def clients(
        self, pipeline: bool
    ) -> tuple[InProcessTargetClient, dict[str, InProcessDraftClient]]:
        """The worker clients; pipelined runs generate one token more, so
        their tables are one token deeper (built on first use)."""
        if not pipeline:
            return self.target, self.drafts
        if self.pipelined is None:
            depth = PIPELINE_NEW_TOKENS - 1
            target = target_client(runner(TableLM(self.target_model, PROMPT, depth)))
            good = draft_client(
                ModelDrafter(runner(TableLM(self.good_model, PROMPT, depth)), model_name="good")
            )
            self.pipelined = target, {"good": good}
        return self.pipelined


@dataclass(frozen=True)
class Samples:
    tokens: np.ndarray  # [n, new tokens]: the generated tokens of seeds 0 .. n-1
    draft_tokens: int
    accepted_tokens: int
    pipelined: bool = False  # every generation's stats say it ran pipelined
    speculation_hits: int = 0
    speculation_misses: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else float("nan")


P_VALUES: list[tuple[str, str, str, int, int, float, str]] = []


def format_p(p: float) -> str:
    return f"{p:.4f}" if p >= 1e-4 else f"{p:.1e}"


def report(
    mode: str, draft: str, setting: str, position: int, n: int, p: float, note: str = ""
) -> None:
    P_VALUES.append((mode, draft, setting, position, n, p, note))
    print(
        f"[sampling-distribution] mode={mode:<9} draft={draft:<13} setting={setting:<16} "
        f"position={position} n={n} p={format_p(p)}{'  ' + note if note else ''}",
        flush=True,
    )


@pytest.fixture(scope="module", autouse=True)
def one_thread_quiet_loop():
    # Tiny tensors: a thread pool only adds overhead; and one log line per
    # generation would drown the p-values.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loop_module, "log", QuietLog())
        yield
    torch.set_num_threads(threads)
    if P_VALUES:
        print(
            f"\n[sampling-distribution] summary (check: p > {ALPHA:g}; "
            f"negative controls: p < {CONTROL_ALPHA:g})"
        )
        print(f"  {'mode':<9} {'draft':<13} {'setting':<16} {'pos':>3} {'n':>5}  {'p':>8}")
        for mode, draft, setting, position, n, p, note in P_VALUES:
            print(
                f"  {mode:<9} {draft:<13} {setting:<16} {position:>3} {n:>5}  "
                f"{format_p(p):>8}  {note}"
            )
        P_VALUES.clear()


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    root = tmp_path_factory.mktemp("sampling-distribution")
    target = load_llama(root / "target", TARGET_SEED)
    bad = load_llama(root / "bad-draft", BAD_DRAFT_SEED)
    good = copy.deepcopy(target)
    generator = torch.Generator().manual_seed(PERTURB_SEED)
    with torch.no_grad():
        head = good.lm_head.weight
        head.add_(0.15 * torch.randn(head.shape, generator=generator, dtype=head.dtype))
    depth = NEW_TOKENS - 1  # the logits of prompt + up to 3 tokens are all a 4-token run reads
    target_client_ = target_client(runner(TableLM(target, PROMPT, depth)))
    drafts = {
        "good": draft_client(ModelDrafter(runner(TableLM(good, PROMPT, depth)), model_name="good")),
        "bad": draft_client(ModelDrafter(runner(TableLM(bad, PROMPT, depth)), model_name="bad")),
        "prompt-lookup": PromptLookup(),
        "suffix": SuffixDecoding(),
    }
    drafts["suffix+bad"] = (drafts["bad"], SuffixDecoding())  # (each round: whichever pays)
    if gguf_runner is not None:
        good.save_pretrained(root / "good")
        path = build_tiny_gguf(root / "good", root / "good.gguf", vocabulary=GGUF_VOCABULARY)
        runner_ = gguf_runner.GgufRunner.load(
            path, max_sessions=8, max_cached_tokens=512, threads=1
        )
        drafts["gguf"] = draft_client(GgufDrafter(runner_, model_name="good.gguf"))
    info = WorkerInfo(
        model="target", drafter="", vocab_size=VOCAB, vocab_fingerprint="", max_context=512
    )
    return World(target, good, target_client_, drafts, Models(Letters(), frozenset(), info))


def request(
    setting: str, mode: str, seed: int, k: int, pipeline: bool = False
) -> GenerationRequest:
    return GenerationRequest(
        prompt_ids=PROMPT,
        max_new_tokens=PIPELINE_NEW_TOKENS if pipeline else NEW_TOKENS,
        num_speculative_tokens=k,
        ignore_eos=True,
        sampling=SamplingParams(**SETTINGS[setting], seed=seed, verification=Verification(mode)),
        pipeline=pipeline,
    )


async def run_once(models, target, draft: Drafters, req) -> tuple[list[int], object]:
    draft, lookup = draft if isinstance(draft, tuple) else (draft, None)
    deltas = [
        delta async for delta in generate(req, models, target, draft, None, Recovery(), lookup)
    ]
    tokens = [t for d in deltas for t in d.token_ids]
    assert len(tokens) == req.max_new_tokens and deltas[-1].finish_reason == "length"
    return tokens, deltas[-1].stats


async def samples(
    world: World, mode: str, draft: str, setting: str, n: int = N, pipeline: bool = False
) -> Samples:
    """The generations of seeds 0 .. n-1 (memoised per module)."""
    key = (mode, draft, setting, n, pipeline)
    if key not in world.samples:
        target, drafts = world.clients(pipeline)
        draft_client_ = drafts.get(draft)
        k = (PIPELINE_K if pipeline else K) if draft_client_ is not None else 0
        out = np.empty((n, PIPELINE_NEW_TOKENS if pipeline else NEW_TOKENS), dtype=np.int64)
        drafted = accepted = hits = misses = 0
        pipelined = True
        for seed in range(n):
            tokens, st = await run_once(
                world.models, target, draft_client_, request(setting, mode, seed, k, pipeline)
            )
            out[seed] = tokens
            drafted += st.draft_tokens
            accepted += st.accepted_tokens
            pipelined &= st.pipeline
            hits += st.speculation_hits
            misses += st.speculation_misses
        world.samples[key] = Samples(out, drafted, accepted, pipelined, hits, misses)
    return world.samples[key]


def check(
    world: World, tokens: np.ndarray, mode: str, draft: str, setting: str, note: str = ""
) -> list[float]:
    positions = tokens.shape[1]
    reference = world.reference(setting, positions)
    p_values = []
    for position in range(positions):
        p = chi_square_p(tokens[:, position], reference[position])
        report(mode, draft, setting, position + 1, len(tokens), p, note)
        p_values.append(p)
    return p_values


# --- the checks ---------------------------------------------------------------------


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("mode", ["rejection", "gumbel"])
async def test_target_only_matches_the_exact_distribution(world, mode, setting):
    """K = 0 (no draft): the reference itself is right."""
    result = await samples(world, mode, TARGET_ONLY, setting)
    assert result.draft_tokens == 0
    p_values = check(world, result.tokens, mode, TARGET_ONLY, setting)
    assert min(p_values) > ALPHA, p_values


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize(
    ("mode", "draft", "pipeline"),
    [pytest.param(mode, draft, False, id=f"{mode}-{draft}") for mode, draft in DRAFTED]
    + [
        pytest.param(mode, draft, True, id=f"{mode}-{draft}-pipelined") for mode, draft in PIPELINED
    ],
)
async def test_speculative_sampling_matches_the_target_distribution(
    world, mode, draft, pipeline, setting
):
    if draft == "gguf" and "gguf" not in world.drafts:
        pytest.skip("the gguf drafter needs llama-cpp-python")
    n = N if mode == "rejection" else N_GUMBEL_DRAFTED
    result = await samples(world, mode, draft, setting, n, pipeline)
    acceptance = result.acceptance_rate
    note = f"(acceptance rate {acceptance:.3f})"
    if pipeline:
        hits, misses = result.speculation_hits, result.speculation_misses
        note = f"(acceptance rate {acceptance:.3f}; speculations: {hits} hits, {misses} misses)"
    p_values = check(
        world, result.tokens, mode, f"{draft}+pipeline" if pipeline else draft, setting, note=note
    )
    assert min(p_values) > ALPHA, p_values
    # The drafts do what their names say, so the accept paths (accepted
    # drafts, bonus tokens) and the reject paths (recovered tokens) all ran.
    assert result.draft_tokens > 0
    assert 0 < result.accepted_tokens < result.draft_tokens
    if draft in ("good", "gguf"):
        assert acceptance > 0.5
    elif draft == "bad":
        assert acceptance < 0.5
    if mode == "gumbel":
        # Gumbel coupling: for a seed the output does not depend on the draft.
        # Pipelined runs generate one token more: their first four must match.
        target_only = await samples(world, mode, TARGET_ONLY, setting)
        assert np.array_equal(
            result.tokens[:, :NEW_TOKENS], target_only.tokens[: len(result.tokens)]
        )
    if pipeline:
        # It really pipelined: round 2 was speculated in every generation, and
        # both outcomes happened (on a hit, tokens 4 and 5 rest on drafts
        # drafted while round 2 was verified).
        assert result.pipelined
        assert result.speculation_hits + result.speculation_misses == n
        assert result.speculation_hits > 0 and result.speculation_misses > 0


async def test_negative_control_a_wrong_temperature_is_detected(world):
    """Power: the same samples against the reference at another temperature fail."""
    tokens = (await samples(world, "rejection", "good", "T=1.0")).tokens
    wrong = exact_marginals(world.target_model, SamplingParams(temperature=0.8))
    p_values = [chi_square_p(tokens[:, i], wrong[i]) for i in range(NEW_TOKENS)]
    for i, p in enumerate(p_values):
        report(
            "rejection",
            "good",
            "T=1.0 vs T=0.8",
            i + 1,
            len(tokens),
            p,
            f"negative control: expect p < {CONTROL_ALPHA:g}",
        )
    assert max(p_values) < CONTROL_ALPHA, p_values


async def test_negative_control_a_broken_acceptance_rule_is_detected(world):
    """Power: a verifier that accepts every draft token (no rejection test)
    commits the draft's distribution, and the check catches it."""

    def accept_everything(draft_tokens, draft_probs, target_logits, params, start_position):
        k = len(draft_tokens)
        bonus = probabilities(target_logits[k], params)
        return Verdict(k, sample(bonus, uniform(params.seed, Stream.TARGET, start_position + k)))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(target_sessions_module, "verify", accept_everything)
        out = np.empty((N, NEW_TOKENS), dtype=np.int64)
        for seed in range(N):
            out[seed], _ = await run_once(
                world.models,
                world.target,
                world.drafts["bad"],
                request("T=1.0", "rejection", seed, K),
            )
    p_values = check(
        world, out, "BROKEN", "bad", "T=1.0", note=f"negative control: expect p < {CONTROL_ALPHA:g}"
    )
    assert p_values[1] < CONTROL_ALPHA, p_values  # token 2: the first a draft fills


@pytest.mark.parametrize("mode", ["rejection", "gumbel"])
async def test_table_models_decode_as_the_real_models(world, mode):
    """The lookup models stand for the real tiny Llamas: the same seeds give
    the same tokens with the real models behind the workers' paged runners."""
    real_target = target_client(paged_runner(world.target_model))
    real_good = draft_client(ModelDrafter(paged_runner(world.good_model), model_name="good"))
    for seed in range(12):
        for setting in ("T=1.0", "T=1.3,top_p=0.8"):
            req = request(setting, mode, seed, K)
            table, _ = await run_once(world.models, world.target, world.drafts["good"], req)
            real, _ = await run_once(world.models, real_target, real_good, req)
            assert table == real, (seed, setting)


# --- a target that verifies only a prefix of the drafts (its step is full) ---


TRIMMED = {1: 2, 8: 2}
"""Concurrency → the target's token budget per step. A round of x_n and two
drafts never fits 2 tokens, so every round runs as x_n and one draft,
alone or with seven others queued for the steps. (A budget that fits some
rounds whole trims only when rounds happen to meet in a step: whether any
is trimmed would depend on timing.)"""


async def trimmed_samples(
    world: World, mode: str, setting: str, concurrency: int, n: int
) -> tuple[np.ndarray, int, int]:
    """Seeds 0 .. n-1 through a target engine that trims rounds to its
    budget, ``concurrency`` generations at a time: their tokens, and the
    draft tokens proposed and verified."""
    target_runner = runner(TableLM(world.target_model, PROMPT, NEW_TOKENS - 1))
    info = TargetInfo(model_name="target", vocab_size=VOCAB, vocab_fingerprint="", max_context=512)
    store = SessionStore(max_sessions=8, pool=target_runner.pool)
    engine = Engine(
        target_runner, max_tokens_per_step=TRIMMED[concurrency], max_rows=8, torch_threads=1
    )
    target = InProcessTargetClient(TargetSessions(target_runner, store, info), engine)
    out = np.empty((n, NEW_TOKENS), dtype=np.int64)
    proposed = verified = 0
    # As served where the draft model shares the target's CPU cores.
    on_cpu = replace(world.models.target, device="cpu", dtype="float64")
    models = replace(world.models, target=on_cpu, draft=replace(on_cpu, model="good"))
    assert models.draft_competes
    try:
        for start in range(0, n, concurrency):
            seeds = range(start, min(n, start + concurrency))
            results = await asyncio.gather(
                *(
                    run_once(models, target, world.drafts["good"], request(setting, mode, s, K))
                    for s in seeds
                )
            )
            for seed, (tokens, st) in zip(seeds, results, strict=True):
                out[seed] = tokens
                proposed += st.proposed_tokens
                verified += st.draft_tokens
    finally:
        engine.shutdown()
    return out, proposed, verified


@pytest.mark.parametrize("concurrency", sorted(TRIMMED))
@pytest.mark.parametrize("mode", ["rejection", "gumbel"])
async def test_trimmed_rounds_keep_the_target_distribution(world, mode, concurrency):
    setting = "T=1.0"
    n = N if mode == "rejection" else N_GUMBEL_DRAFTED
    tokens, proposed, verified = await trimmed_samples(world, mode, setting, concurrency, n)
    note = f"(trimmed: {verified} of {proposed} draft tokens verified, {concurrency} at once)"
    p_values = check(world, tokens, mode, f"good+trimmed@{concurrency}", setting, note=note)
    assert min(p_values) > ALPHA, p_values
    assert 0 < verified < proposed  # rounds really were trimmed, and still drafted
    if mode == "gumbel":
        # Drafter-invariance holds for a prefix too: seed for seed, target-only's tokens.
        target_only = await samples(world, mode, TARGET_ONLY, setting)
        assert np.array_equal(tokens, target_only.tokens[:n])
