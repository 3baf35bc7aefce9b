"""Draft models: what proposes the K tokens the target verifies on a draft
worker. (Prompt lookup, which needs no model, drafts in the coordinator:
``coordinator.lookup``.)

A drafter is one class with ``kind``, ``model_name``, ``runner`` and
``propose(session, k)``, an engine job (:mod:`outrider.engine.core`): a model
drafter yields one forward pass per draft token, which the draft worker's
engine batches across every session drafting at that step. It draws its
tokens the way the session's sampling says (``outrider.sampling.draw``):
greedy, sampled from q (rejection mode, returning q), or with the position's
Gumbel noise. The draft worker owns sessions and their caches (and rolls
them back); a drafter only reads the committed history and extends the
session's cache.

* :class:`ModelDrafter` — a small causal LM with the target's vocabulary,
  drawing each token as the session's sampling says.
* :class:`Int4Drafter` — a checkpoint (usually the target's own) with its
  weights in 4 bits (:mod:`outrider.quantize`): the target's own
  predictions at a fraction of its weight bytes.
* :class:`EarlyExitDrafter` — the first L layers of a checkpoint (usually the
  target's own) followed by its final norm and head.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from outrider.engine import Feed, Job
from outrider.sampling import Stream, compact, draw
from outrider.session import Session
from outrider.speculation import CompactProbs, Proposal

if TYPE_CHECKING:
    from outrider.engine.runner import FallbackRunner, PagedRunner


class Drafter(Protocol):
    kind: str
    """"model", "int4" or "early-exit"."""
    model_name: str

    @property
    def runner(self) -> PagedRunner | FallbackRunner:
        """The model runner."""
        ...

    @property
    def vocab_size(self) -> int:
        """Size of the id space the drafter proposes from."""
        ...

    def propose(self, session: Session, history: list[int], k: int) -> Job[Proposal]:
        """An engine job proposing up to ``k`` tokens to follow ``history``:
        the committed history, or during a speculation (a pipelined round)
        the committed history followed by the drafts being verified and a
        guess of the bonus token. The session's cache holds a prefix of it."""
        ...


class ModelDrafter:
    kind = "model"

    def __init__(self, runner, *, model_name: str) -> None:
        self.runner = runner
        self.model_name = model_name
        self.vocab_size = runner.vocab_size

    def propose(self, session: Session, history: list[int], k: int) -> Job[Proposal]:
        # Sync: feed the tokens of the history the cache lacks (at least the
        # last one: the draft has not seen it yet).
        kv, sampling = session.kv, session.sampling
        out = yield Feed(kv, history[len(kv) :])
        position = len(history)
        tokens: list[int] = []
        probs: list[CompactProbs] = []
        # Draft: one token per step, each step batched with the other
        # sessions drafting; the last draft is never fed.
        while True:
            assert out is not None  # each feed asks for one row of logits
            if sampling.is_greedy:
                token, q = out.argmax[-1], None
            else:
                token, q = draw(out.values[-1], sampling, position + len(tokens), Stream.DRAFT)
            tokens.append(token)
            if q is not None:
                probs.append(compact(q))
            if len(tokens) == k:
                return Proposal(tokens, probs, follows_len=len(history))
            out = yield Feed(kv, [token])


class Int4Drafter(ModelDrafter):
    """A model drafter whose model's weights are 4-bit (built by
    ``outrider.engine.build.build_runner(..., int4_group_size=G)``)."""

    kind = "int4"


class EarlyExitDrafter(ModelDrafter):
    """A model drafter whose model is a checkpoint cut after its first L layers
    (built by ``outrider.engine.loading.load_causal_lm(..., num_layers=L)``)."""

    kind = "early-exit"
