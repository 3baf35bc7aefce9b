"""The ``eagle`` drafter: an EAGLE-3 head on the draft worker, fed the
target's hidden states over the wire (docs/design.md#eagle-3-heads).

A session's head cache holds, at position p, the pair (feature of p, token
p + 1) of its history x_0 .. x_{n−1}. The target sends the features of every
committed position but the last (it has not fed its own last token), so
positions 0 .. n − 2 can be built from the target's own: the *committed
pairs*. Past them the head drafts on its own features: pair p + 1 reads the
head's output at p (before its final norm), and those *chain pairs* are
what the next round's features replace. So a round:

1. if features came since the last round, crops the cache to the committed
   pairs and feeds the new ones, in one feed (a rejected draft's chain pair
   is never kept, accepted or not: the target's feature replaces the head's);
2. otherwise (a speculation, which assumes the drafts under verification)
   keeps the chain while it follows the history, and feeds the rest of the
   history one token a step, each on the output before it;
3. drafts K tokens from the last output, each step fed the previous
   output, the last draft never fed — drawn as the session's sampling says.

A session opened without the features of its early positions (a draft
worker that replaced a lost one) builds those pairs on zero features: the
head then reads only their tokens there, which costs acceptance, never
correctness.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers import AutoConfig

from outrider import model_specs
from outrider.device import resolve_device, resolve_dtype
from outrider.drafters.model import LoadedDrafter, draw_drafts, of_checkpoint
from outrider.eagle.forward import EagleForward, check_head, target_embeddings
from outrider.eagle.head import load_head, shipped_head
from outrider.engine import Feed, Job, Logits
from outrider.engine.hidden_states import unpack
from outrider.engine.kv_cache import BlockPool
from outrider.engine.runner import PagedRunner
from outrider.errors import InvalidArgument
from outrider.hidden_states import HiddenStates
from outrider.prefix import BLOCK_SIZE
from outrider.session import Session
from outrider.speculation import Proposal
from outrider.startup import StartupError, first_line

if TYPE_CHECKING:
    from outrider.config import DraftWorkerConfig


@dataclass
class HeadState:
    """One session's head: what its cache holds beyond the KV."""

    committed: int = 0
    """Cache positions built from the target's features (the committed pairs)."""
    pending: list[torch.Tensor] = field(default_factory=list)
    """Fused features of positions ``committed ..``, not yet fed."""
    committed_out: Logits | None = None
    """The head's output at the last committed pair."""
    chain: list[int] = field(default_factory=list)
    """Tokens of the chain pairs after the committed ones."""
    out: Logits | None = None
    """The head's output at the cache's last position."""

    @property
    def known(self) -> int:
        """Positions whose features the session has had."""
        return self.committed + sum(len(p) for p in self.pending)


class EagleDrafter:
    kind = "eagle"

    def __init__(self, runner: PagedRunner, *, model_name: str) -> None:
        assert isinstance(runner.forward, EagleForward)
        self.runner = runner
        self.head: EagleForward = runner.forward
        self.model_name = model_name
        self.vocab_size = runner.vocab_size
        self.hidden_state_layers: tuple[int, ...] = self.head.config.aux_layers

    def feature_rows(self, states: HiddenStates | None, rows: int) -> torch.Tensor:
        """``rows`` fused features from the target's ``states`` of the last
        of those positions (zeros before them)."""
        width = self.head.hidden_size
        if states is None or not states.rows:
            return torch.zeros(rows, width, dtype=self.head.dtype, device=self.head.device)
        if states.rows > rows:
            raise InvalidArgument(
                f"{states.rows} rows of hidden states for {rows} positions: send one per "
                "committed token but the last"
            )
        fused = self.head.fuse(unpack(states, self.head.feature_width))
        if states.rows == rows:
            return fused
        return torch.cat([fused.new_zeros(rows - states.rows, width), fused])

    def open(self, session: Session, features: HiddenStates | None) -> Job[None]:
        """Builds the committed pairs of the history but the last (the first
        round feeds it, for its logits)."""
        state = session.drafter_state = HeadState()
        rows = len(session.tokens) - 1
        if rows <= 0:
            return
        fused = self.feature_rows(features, rows)
        if rows > 1:
            yield Feed(session.kv, session.tokens[1:rows], num_logits=0, hidden=fused[:-1])
            state.committed = rows - 1
        state.pending = [fused[-1:]]

    def receive(self, session: Session, new_tokens: int, features: HiddenStates | None) -> None:
        """The features of the positions that ``new_tokens`` committed tokens
        made committed pairs (one each)."""
        state = session.drafter_state
        assert isinstance(state, HeadState)
        if new_tokens:
            state.pending.append(self.feature_rows(features, new_tokens))
        elif features is not None and features.rows:
            raise InvalidArgument(
                "hidden states came with no new tokens: send them with the tokens"
            )

    def rollback(self, session: Session, history: list[int], agreed: int) -> None:
        """Nothing: the head's crop depends on its features (:meth:`propose`)."""

    def propose(self, session: Session, history: list[int], k: int) -> Job[Proposal]:
        state = session.drafter_state
        assert isinstance(state, HeadState)
        kv = session.kv
        if state.pending:
            kv.crop(state.committed)
            fused = torch.cat(state.pending)
            start = state.committed
            state.pending, state.chain = [], []
            built = yield Feed(kv, session.tokens[start + 1 : start + 1 + len(fused)], hidden=fused)
            state.committed += len(fused)
            state.committed_out = state.out = built
        elif state.chain != history[state.committed + 1 : state.committed + 1 + len(state.chain)]:
            kv.crop(state.committed)
            state.chain, state.out = [], state.committed_out
        # Feed the rest of the history (a speculation's assumed tokens and guess), each pair
        # on the output before it.
        while len(kv) + 1 < len(history) and state.out is not None:
            token = history[len(kv) + 1]
            state.out = yield Feed(kv, [token], hidden=_last(state.out))
            state.chain.append(token)
        if state.out is None or len(kv) + 1 != len(history):
            return Proposal([], follows_len=len(history))  # no committed pair yet

        def fed(token: int, out: Logits) -> None:
            state.out = out
            state.chain.append(token)

        def feed(token: int, out: Logits) -> Feed:
            return Feed(kv, [token], hidden=_last(out))

        return (yield from draw_drafts(state.out, session, history, k, feed, fed))


def _last(out: Logits) -> torch.Tensor:
    assert out.hidden is not None  # the head's forward returns its outputs
    return out.hidden[-1:]


def load(config: DraftWorkerConfig) -> LoadedDrafter:
    """An EAGLE-3 head (``--head``, else the one shipped for the target)
    over a paged cache of its one layer, reading the target's embeddings
    from its checkpoint."""
    target = model_specs.checkpoint_dir(config.model)
    target_config = AutoConfig.from_pretrained(target)
    head_dir = config.head or shipped_head(config.model)
    if head_dir is None:
        raise StartupError(
            "--head",
            "(none)",
            f"no EAGLE-3 head is shipped for {config.model or model_specs.DEFAULT_MODEL}: "
            "train one (outrider draft train) and pass its directory",
        )
    device = resolve_device(config.engine.device)
    dtype = resolve_dtype(config.engine.dtype, device)
    try:
        head = load_head(head_dir, target_num_layers=target_config.num_hidden_layers)
        check_head(head.config, target_config)
        embed = target_embeddings(target)
    except (OSError, ValueError, KeyError) as exc:
        raise StartupError("--head", str(head_dir), first_line(exc)) from None
    forward = EagleForward(head, embed, dtype=dtype, device=device)
    max_context = min(model_specs.context_length(target_config), forward.max_positions)
    tokens = config.limits.max_cached_tokens or config.limits.max_sessions * max_context
    # No prefix cache: a head's KV at a position depends on the target's
    # features of it, and an EAGLE session is opened on those of every position.
    runner = PagedRunner(forward, BlockPool(max(1, tokens // BLOCK_SIZE), BLOCK_SIZE))
    drafter = EagleDrafter(
        runner, model_name=f"{config.model or model_specs.DEFAULT_MODEL}[eagle3]"
    )
    return of_checkpoint(
        config,
        drafter,
        max_context=max_context,
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
    )
