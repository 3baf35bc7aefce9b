"""The drafters a draft worker runs, and the model drafters among them.

A draft worker's drafter (:class:`Drafter`) is one class with ``kind``,
``model_name``, ``runner`` and ``propose(session, k)``, an engine job
(:mod:`outrider.engine.core`): a model drafter yields one forward pass per
draft token, which the draft worker's engine batches across every session
drafting at that step. It draws its tokens the way the session's sampling
says (``outrider.sampling.draw``): greedy, sampled from q (rejection mode,
returning q), or with the position's Gumbel noise. The draft worker owns
sessions and their caches (and rolls them back); a drafter only reads the
committed history and extends the session's cache.

* :class:`ModelDrafter` — a small causal LM with the target's vocabulary,
  drawing each token as the session's sampling says.
* :class:`Int4Drafter` — a checkpoint (usually the target's own) with its
  weights in 4 bits (:mod:`outrider.quantize`): the target's own
  predictions at a fraction of its weight bytes.
* :class:`EarlyExitDrafter` — the first L layers of a checkpoint (usually the
  target's own) followed by its final norm and head.

Beside them in this package: ``GgufDrafter`` (:mod:`outrider.drafters.gguf`),
a GGUF file on llama.cpp, and ``EagleDrafter`` (:mod:`outrider.drafters.eagle`),
an EAGLE-3 head that reads the target's hidden states. Each module's
``load(config)`` builds its drafters as a :class:`LoadedDrafter`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from outrider import model_specs
from outrider.engine import Feed, Job, Logits
from outrider.engine.build import build_runner
from outrider.errors import InvalidArgument
from outrider.grammar import Grammars
from outrider.hidden_states import HiddenStates
from outrider.sampling import Stream, compact, constrain, draw, hold_back
from outrider.session import Session
from outrider.speculation import CompactProbs, Proposal
from outrider.worker import checkpoint_of, load_model

if TYPE_CHECKING:
    from outrider.config import DraftWorkerConfig
    from outrider.engine.gguf_runner import GgufRunner
    from outrider.engine.kv_cache import KVCache
    from outrider.engine.runner import FallbackRunner, PagedRunner


class Drafter(Protocol):
    kind: str
    """"model", "int4", "gguf", "early-exit" or "eagle"."""
    model_name: str
    hidden_state_layers: tuple[int, ...]
    """The target layers whose input hidden states it reads (none but an EAGLE head)."""

    @property
    def runner(self) -> PagedRunner | FallbackRunner | GgufRunner:
        """The model runner."""
        ...

    @property
    def vocab_size(self) -> int:
        """Size of the id space the drafter proposes from."""
        ...

    def open(self, session: Session, features: HiddenStates | None) -> Job[None]:
        """An engine job caching what the session's first round builds on,
        from its history (and the target's ``features`` of it)."""
        ...

    def receive(self, session: Session, new_tokens: int, features: HiddenStates | None) -> None:
        """Takes the target's features that came with ``new_tokens`` committed tokens."""
        ...

    def rollback(self, session: Session, history: list[int], agreed: int) -> None:
        """Crops the session's cache to what the next proposal builds on: its
        first ``agreed`` tokens held the committed history as the last round
        knew it."""
        ...

    def propose(self, session: Session, history: list[int], k: int) -> Job[Proposal]:
        """An engine job proposing up to ``k`` tokens to follow ``history``:
        the committed history, or during a speculation (a pipelined round)
        the committed history followed by the drafts being verified and a
        guess of the bonus token. The session's cache holds a prefix of it."""
        ...


class ModelDrafter:
    kind = "model"
    hidden_state_layers: tuple[int, ...] = ()

    def __init__(self, runner, *, model_name: str) -> None:
        self.runner = runner
        self.model_name = model_name
        self.vocab_size = runner.vocab_size

    def open(self, session: Session, features: HiddenStates | None) -> Job[None]:
        """Prefills all of the history but its last token, after the prefix
        the cache holds already."""
        self.receive(session, 0, features)
        kv = session.kv
        if len(session.tokens) - 1 > len(kv):
            yield Feed(kv, list(session.tokens[len(kv) : -1]), num_logits=0)
        kv.seal(len(kv))

    def receive(self, session: Session, new_tokens: int, features: HiddenStates | None) -> None:
        if features is not None and features.rows:
            raise InvalidArgument(
                f"the {self.kind} drafter reads no hidden states: send none, or serve a drafter "
                "that reads them (--drafter eagle)"
            )

    def rollback(self, session: Session, history: list[int], agreed: int) -> None:
        """Keeps the longest prefix the cache shares with ``history``, never
        its last token (the draft feeds it)."""
        kv = session.kv
        kv.crop(min(kv.shared_prefix(history, agreed), len(history) - 1))
        # What is left of the committed history, but its last token, no
        # later rollback crops: it is shared (where the pool caches).
        kv.seal(min(len(kv), session.committed_len - 1))

    def propose(self, session: Session, history: list[int], k: int) -> Job[Proposal]:
        # Sync: feed the tokens of the history the cache lacks (at least the
        # last one: the draft has not seen it yet).
        kv = session.kv
        out = yield Feed(kv, history[len(kv) :])
        assert out is not None  # the sync asks for one row of logits
        # Draft: one token per step, each step batched with the other
        # sessions drafting; the last draft is never fed.
        return (yield from draw_drafts(out, session, history, k, _feed_of(kv)))


def _feed_of(kv: KVCache) -> Callable[[int, Logits], Feed]:
    """How a model drafter feeds a drawn token: alone."""
    return lambda token, out: Feed(kv, [token])


def draw_drafts(
    out: Logits,
    session: Session,
    history: Sequence[int],
    k: int,
    feed: Callable[[int, Logits], Feed],
    on_output: Callable[[int, Logits], None] = lambda token, out: None,
) -> Job[Proposal]:
    """Draws ``k`` drafts after ``history``, the first from ``out``, each
    next from the logits of ``feed(token, out)`` (the drawn token appended;
    the last draft is never fed), as the session's sampling says: the
    argmax, a draw from q (returning q), or the position's Gumbel draw —
    among the tokens its structured output allows, if it has one (so q
    gives no mass to a token the target's mask forbids). ``on_output`` is
    told of each fed token's output."""
    sampling, grammar, position = session.sampling, session.grammar, len(history)
    if grammar is not None:
        grammar.sync(history[sampling.start :])
    tokens: list[int] = []
    probs: list[CompactProbs] = []
    while True:
        raw = out.values[-1:]
        logits = raw if grammar is None else constrain(raw, grammar.mask()[None])
        logits = hold_back(logits, sampling, position + len(tokens))
        if sampling.is_greedy:
            token = out.argmax[-1] if logits is raw else int(logits[0].argmax())
            q = None
        else:
            token, q = draw(logits[0], sampling, position + len(tokens), Stream.DRAFT)
        if grammar is not None:
            grammar.extend([token])
        tokens.append(token)
        if q is not None:
            probs.append(compact(q))
        if len(tokens) == k:
            return Proposal(tokens, probs, follows_len=position)
        fed = yield feed(token, out)
        assert fed is not None  # a draft step asks for one row of logits
        on_output(token, fed)
        out = fed


class Int4Drafter(ModelDrafter):
    """A model drafter whose model's weights are 4-bit (built by
    ``outrider.engine.build.build_runner(..., int4_group_size=G)``)."""

    kind = "int4"


class EarlyExitDrafter(ModelDrafter):
    """A model drafter whose model is a checkpoint cut after its first L layers
    (built by ``outrider.engine.causal_lm.load_causal_lm(..., num_layers=L)``)."""

    kind = "early-exit"


@dataclass(frozen=True)
class DraftInfo:
    """What a draft worker says of its drafter to the coordinator."""

    vocab_fingerprint: str
    """sha256 of the drafter's tokenizer vocabulary: the target's must match."""
    max_context: int
    max_draft_tokens: int
    device: str = "cpu"
    dtype: str = ""


@dataclass(frozen=True)
class LoadedDrafter:
    """A drafter as its module's ``load`` built it."""

    drafter: Drafter
    info: DraftInfo
    grammars: Grammars
    """Structured output's, for its tokenizer."""


def load(config: DraftWorkerConfig) -> LoadedDrafter:
    """The ``model``, ``int4`` or ``early-exit`` drafter of ``--model``, on
    the worker's engine."""
    kind, name = config.drafter_kind, config.model or model_specs.DEFAULT_MODEL
    model, device, dtype = load_model(config, num_layers=config.draft_layers)
    max_context = model_specs.context_length(model)
    runner = build_runner(
        model,
        limits=config.limits,
        engine=config.engine,
        max_context=max_context,
        int4_group_size=config.int4_group_size if kind == "int4" else None,
        checkpoint=checkpoint_of(config),
        num_layers=config.draft_layers,
        trust_remote_code=config.trust_remote_code,
    )
    drafter: ModelDrafter
    if kind == "early-exit":
        drafter = EarlyExitDrafter(runner, model_name=f"{name}[:{config.draft_layers}]")
    elif kind == "int4":
        drafter = Int4Drafter(runner, model_name=f"{name}[int4-g{config.int4_group_size}]")
    else:
        drafter = ModelDrafter(runner, model_name=name)
    return of_checkpoint(config, drafter, max_context=max_context, device=device, dtype=dtype)


def of_checkpoint(
    config: DraftWorkerConfig, drafter: Drafter, *, max_context: int, device: str, dtype: str
) -> LoadedDrafter:
    """A drafter whose tokenizer is ``--model``'s checkpoint's."""
    fingerprint = model_specs.vocab_fingerprint_of(
        config.model, trust_remote_code=config.trust_remote_code
    )
    grammars = Grammars.of_checkpoint(
        config.model, drafter.vocab_size, trust_remote_code=config.trust_remote_code
    )
    info = DraftInfo(fingerprint, max_context, config.max_draft_tokens, device, dtype)
    return LoadedDrafter(drafter, info, grammars)
