"""The training-time test of EAGLE-3 (SpecForge's ``OnlineEagle3Model``,
the EAGLE repository's ``traineagle3``): the unrolled drafting a head learns
from, its batches, its loss, held-out acceptance, the draft vocabulary and
the head's warm start. :mod:`outrider.eagle.train` runs it.

The words of :mod:`outrider.eagle.head`: at row t the head reads the fused
target feature ``f_t = fc(aux_t)`` and the embedding of token ``x_{t+1}``
(the target's, frozen), at rotary position t, and predicts ``x_{t+2}``.

**Training-time test** (TTT) unrolls drafting beyond the committed tokens:

* step 0 at row t: feature ``f_t``, token ``x_{t+1}``, position t; it
  attends causally over the step-0 keys of rows ≤ t — :meth:`EagleHead.forward`.
* step j ≥ 1 at row t: feature = step j − 1's ``prenorm`` at row t, token
  ``x_{t+1+j}``, position t + j; it attends over the step-0 keys of rows ≤ t
  and the keys of steps 1..j at row t itself (the diagonal), one softmax
  over both (SpecForge concatenates the diagonal scores to the causal ones).

Step j at row t predicts ``x_{t+2+j}``; its label is the target's own
distribution at position t + 1 + j (its top k, restricted to the draft
vocabulary and renormalised), counted where token t + 2 + j is part of the
answer and whose most likely token is in the draft vocabulary. Step j's
loss weighs ``STEP_DECAY ** j``.

**Acceptance** on the held-out (greedy) conversations: the draft of step j
at row t is accepted when it and the drafts of steps 0..j − 1 all equal the
target's choice; acceptance at position j is the share of rows whose first
j drafts are accepted, and the mean acceptance length 1 + their sum (the
bonus token counted, as vLLM counts it).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from outrider.eagle import data as eagle_data
from outrider.eagle.head import EagleHead

STEP_DECAY = 0.8
"""Weight of TTT step j's loss: ``STEP_DECAY ** j`` (EAGLE-3's 0.8)."""


# --------------------------------------------------------------------------- the unroll


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    diagonal: Sequence[tuple[torch.Tensor, torch.Tensor]],
    scale: float,
) -> torch.Tensor:
    """Attention of ``q`` ``[B, heads, T, D]`` over the causal step-0 keys
    and values ``[B, kv heads, T, D]`` and, at each row, the keys and values
    of the later steps at that row (``diagonal``), in one softmax."""
    repeat = q.shape[-3] // keys.shape[-3]
    keys, values = keys.repeat_interleave(repeat, -3), values.repeat_interleave(repeat, -3)
    length = q.shape[-2]
    scores = (q @ keys.transpose(-1, -2)).float() * scale
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    diag = [(k.repeat_interleave(repeat, -3), v.repeat_interleave(repeat, -3)) for k, v in diagonal]
    if diag:
        extra = torch.stack([(q * k).sum(-1).float() * scale for k, _ in diag], dim=-1)
        scores = torch.cat([scores, extra], dim=-1)
    p = scores.softmax(-1).to(q.dtype)
    out = p[..., :length] @ values
    for i, (_, v) in enumerate(diag):
        out = out + p[..., length + i, None] * v
    return out


def unroll(
    head: EagleHead, embed: torch.Tensor, aux: torch.Tensor, ids: torch.Tensor, steps: int
) -> list[torch.Tensor]:
    """The training-time test: each step's ``prenorm`` ``[B, T, H]`` over
    ``ids`` ``[B, T]`` with the target's ``aux`` features ``[B, T, 3·H_t]``
    (rows past a sequence's end read token 0 and are to be masked)."""
    batch, length = ids.shape
    positions = torch.arange(length, device=ids.device).expand(batch, length)
    scale = head.config.head_dim**-0.5
    features = head.fc(aux)
    keys = values = None
    diagonal: list[tuple[torch.Tensor, torch.Tensor]] = []
    out = []
    for j in range(steps):
        tokens = _shift(ids, 1 + j)
        x, residual = head.attend_inputs(F.embedding(tokens, embed), features)
        q, k, v = head.project(x, positions + j)
        if keys is None:
            keys, values = k, v
        else:
            diagonal.append((k, v))
        assert values is not None
        attended = _attend(q, keys, values, diagonal, scale)
        prenorm = head.finish(attended.transpose(-2, -3).flatten(-2), residual)
        out.append(prenorm)
        features = prenorm
    return out


def _shift(x: torch.Tensor, n: int, fill: int | bool = 0) -> torch.Tensor:
    """``x[:, t + n]`` at column t, ``fill`` past the end."""
    pad = torch.full((x.shape[0], n, *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
    return torch.cat([x[:, n:], pad], dim=1)[:, : x.shape[1]]


# --------------------------------------------------------------------------- batches


@dataclass
class Batch:
    ids: torch.Tensor
    """``[B, T]``, right-padded with 0."""
    aux: torch.Tensor
    top_ids: torch.Tensor
    top_p: torch.Tensor
    answer: torch.Tensor
    """``[B, T]``: token t is part of an answer."""

    def to(self, device: torch.device) -> Batch:
        return Batch(
            *(getattr(self, f).to(device) for f in ("ids", "aux", "top_ids", "top_p", "answer"))
        )

    @property
    def tokens(self) -> int:
        return int((self.ids != 0).sum()) if self.ids.numel() else 0


def collate(conversations: Sequence[eagle_data.Conversation]) -> Batch:
    length = max(len(c.ids) for c in conversations)
    n, k, width = (
        len(conversations),
        conversations[0].top_ids.shape[1],
        conversations[0].aux.shape[1],
    )
    ids = torch.zeros(n, length, dtype=torch.long)
    aux = torch.zeros(n, length, width, dtype=conversations[0].aux.dtype)
    top_ids = torch.zeros(n, length, k, dtype=torch.long)
    top_p = torch.zeros(n, length, k, dtype=conversations[0].top_p.dtype)
    answer = torch.zeros(n, length, dtype=torch.bool)
    for row, c in enumerate(conversations):
        m = len(c.ids)
        ids[row, :m], aux[row, :m], top_ids[row, :m], top_p[row, :m] = (
            c.ids,
            c.aux,
            c.top_ids,
            c.top_p,
        )
        answer[row, c.answer_start : m] = True
    return Batch(ids, aux, top_ids, top_p, answer)


def batches(
    conversations: Sequence[eagle_data.Conversation], size: int, *, seed: int
) -> list[list[int]]:
    """An epoch's batches (indices into ``conversations``): shuffled by
    ``seed``, sorted by length within groups of 8 batches (less padding)."""
    order = list(range(len(conversations)))
    random.Random(seed).shuffle(order)
    out: list[list[int]] = []
    group = 8 * size
    for start in range(0, len(order), group):
        chunk = sorted(order[start : start + group], key=lambda i: len(conversations[i].ids))
        out.extend(chunk[s : s + size] for s in range(0, len(chunk), size))
    random.Random(seed + 1).shuffle(out)
    return out


# --------------------------------------------------------------------------- loss


class Vocab:
    """The draft vocabulary's map from target ids (−1 outside it)."""

    def __init__(self, head: EagleHead) -> None:
        self.to_draft = torch.full(
            (head.config.vocab_size,), -1, dtype=torch.long, device=head.d2t.device
        )
        self.to_draft[head.draft_to_target] = torch.arange(
            head.config.draft_vocab_size, device=head.d2t.device
        )


def step_outputs(
    head: EagleHead, vocab: Vocab, batch: Batch, prenorm: torch.Tensor, j: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step j's soft-label loss (summed), its loss rows, and per counted row
    whether its draft equals the target's choice, with the count of rows.

    Counted rows: token t + 2 + j is in an answer. Loss rows: also the
    target's choice there is in the draft vocabulary (a choice outside it
    counts as a miss)."""
    counted = _shift(batch.answer, 2 + j, False)
    top_ids = _shift(batch.top_ids, 1 + j)[counted]
    top_p = _shift(batch.top_p, 1 + j)[counted].float()
    draft_ids = vocab.to_draft[top_ids]
    inside = draft_ids >= 0
    learnable = inside[:, 0]
    logits = head.logits(prenorm[counted]).float()
    logp = logits.log_softmax(-1).gather(-1, draft_ids.clamp(min=0))
    p = top_p * inside
    p = p / p.sum(-1, keepdim=True).clamp(min=1e-9)
    loss = -(p * logp).sum(-1)[learnable].sum()
    correct = (logits.argmax(-1) == draft_ids[:, 0]) & learnable
    return loss, learnable.sum(), correct, counted.sum()


def batch_loss(
    head: EagleHead, vocab: Vocab, embed: torch.Tensor, batch: Batch, steps: int
) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """The weighted loss (mean over loss rows per step) and per step
    ``(correct, counted)``."""
    total = torch.zeros((), device=embed.device)
    stats = []
    for j, prenorm in enumerate(unroll(head, embed, batch.aux.to(embed.dtype), batch.ids, steps)):
        loss, rows, correct, counted = step_outputs(head, vocab, batch, prenorm, j)
        total = total + STEP_DECAY**j * loss / rows.clamp(min=1)
        stats.append((int(correct.sum()), int(counted)))
    return total, stats


@torch.no_grad()
def acceptance(
    head: EagleHead,
    vocab: Vocab,
    embed: torch.Tensor,
    conversations: Sequence[eagle_data.Conversation],
    steps: int,
    *,
    batch_size: int = 8,
) -> dict[str, Any]:
    """Acceptance by position of chained greedy drafts over held-out
    greedy conversations: rows whose K = ``steps`` drafts all predict
    answer tokens."""
    head.eval()
    accepted = torch.zeros(steps, dtype=torch.float64)
    rows = 0
    step_correct = torch.zeros(steps, dtype=torch.float64)
    for start in range(0, len(conversations), batch_size):
        batch = collate(conversations[start : start + batch_size]).to(embed.device)
        rows_mask = _shift(batch.answer, 1 + steps, False) & _shift(batch.answer, 2, False)
        alive = rows_mask.clone()
        for j, prenorm in enumerate(
            unroll(head, embed, batch.aux.to(embed.dtype), batch.ids, steps)
        ):
            draft_ids = vocab.to_draft[_shift(batch.top_ids, 1 + j)[..., 0]]
            guess = head.logits(prenorm).argmax(-1)
            hit = (guess == draft_ids) & (draft_ids >= 0)
            step_correct[j] += float((hit & rows_mask).sum())
            alive &= hit
            accepted[j] += float(alive.sum())
        rows += int(rows_mask.sum())
    head.train()
    by_position = (accepted / max(rows, 1)).tolist()
    return {
        "rows": rows,
        "acceptance_by_position": [round(a, 4) for a in by_position],
        "mean_acceptance_length": round(1 + sum(by_position), 4),
        "step_accuracy": [round(a, 4) for a in (step_correct / max(rows, 1)).tolist()],
    }


# --------------------------------------------------------------------------- the head


def draft_vocab(
    conversations: Sequence[eagle_data.Conversation], size: int, vocab_size: int
) -> torch.Tensor:
    """The ``size`` target ids the target chooses most often in the answers
    (then those most often in its top k, then the lowest ids), ascending."""
    first: Counter[int] = Counter()
    rest: Counter[int] = Counter()
    for c in conversations:
        predicts = torch.zeros(len(c.ids), dtype=torch.bool)
        predicts[max(c.answer_start - 1, 0) : len(c.ids) - 1] = True
        first.update(c.top_ids[predicts, 0].tolist())
        rest.update(c.top_ids[predicts, 1:].flatten().tolist())
    chosen = [t for t, _ in first.most_common(size)]
    taken = set(chosen)
    for t, _ in rest.most_common():
        if len(chosen) >= size:
            break
        if t not in taken:
            chosen.append(t)
            taken.add(t)
    fill = iter(t for t in range(vocab_size) if t not in taken)
    while len(chosen) < size:
        chosen.append(next(fill))
    return torch.tensor(sorted(chosen), dtype=torch.long)


def coverage(
    conversations: Sequence[eagle_data.Conversation], ids: torch.Tensor, vocab_size: int
) -> float:
    """Share of the target's answer choices inside the draft vocabulary."""
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[ids] = True
    hit = total = 0
    for c in conversations:
        labels = c.top_ids[max(c.answer_start - 1, 0) : len(c.ids) - 1, 0]
        hit += int(inside[labels].sum())
        total += len(labels)
    return hit / max(total, 1)


@torch.no_grad()
def warm_start_output(head: EagleHead, target: Any) -> None:
    """The final norm and the LM head (the draft vocabulary's rows) the
    target's; the rest as initialised."""
    head.norm.weight.copy_(target.model.norm.weight)
    head.lm_head.weight.copy_(target.lm_head.weight[head.draft_to_target.cpu()])


@torch.no_grad()
def warm_start(head: EagleHead, target: Any) -> None:
    """The head as the target's last decoder layer reading the highest aux
    layer: ``fc`` picks that layer; the decoder layer's MLP, norms, o_proj
    and the feature half of q/k/v are the last layer's (the embedding half
    zero); final norm and LM head (the draft vocabulary's rows) the target's."""
    c = head.config
    hidden = c.hidden_size
    layer = target.model.layers[-1]
    fc = torch.zeros_like(head.fc.weight)
    fc[:, -c.target_hidden_size :] = torch.eye(hidden)
    head.fc.weight.copy_(fc)
    attention = head.midlayer.self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        weight = getattr(attention, name).weight
        weight.zero_()
        weight[:, hidden:] = getattr(layer.self_attn, name).weight
    attention.o_proj.weight.copy_(layer.self_attn.o_proj.weight)
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(head.midlayer.mlp, name).weight.copy_(getattr(layer.mlp, name).weight)
    head.midlayer.hidden_norm.weight.copy_(layer.input_layernorm.weight)
    head.midlayer.post_attention_layernorm.weight.copy_(layer.post_attention_layernorm.weight)
    warm_start_output(head, target)
