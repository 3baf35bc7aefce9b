"""The training data of a draft head: the target's own answers to
:mod:`outrider.eagle.instructions` (self-distillation), and what one
forward pass of the target over each conversation gives — its hidden
states at the head's aux layers and its next-token distribution (top k).

Both are cached on disk (:class:`DataCache`), a conversation or a shard at
a time, so an interrupted or resumed run, or a larger one with the same
settings, generates only what is missing.

Conversation ``i`` is answered greedily unless ``i % SAMPLED_EVERY ==
SAMPLED_EVERY - 1`` (sampled at ``temperature``, for variety); every
``HELD_OUT_EVERY``-th greedy conversation is held out for evaluation
(greedy, so that its tokens are the target's own choices: a draft that
matches them is one the target accepts).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from outrider.logging import get_logger

log = get_logger(__name__)

SAMPLED_EVERY = 4
HELD_OUT_EVERY = 20
SHARD = 32
"""Conversations per feature shard."""
STORED_TOPK = 8
"""The target's most likely next tokens stored per position (training
reads its first ``--label-topk``)."""


def is_sampled(index: int) -> bool:
    return index % SAMPLED_EVERY == SAMPLED_EVERY - 1


def is_held_out(index: int) -> bool:
    return not is_sampled(index) and index % HELD_OUT_EVERY == 0


@dataclass(frozen=True)
class DataSettings:
    """What the cached data depends on (its directory's name is their hash)."""

    target: str
    target_fingerprint: str
    seed: int
    max_new_tokens: int
    temperature: float
    aux_layers: tuple[int, ...]
    label_topk: int = STORED_TOPK

    def key(self) -> str:
        raw = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(raw).hexdigest()[:16]


@dataclass
class Conversation:
    """One conversation's tensors: ``ids`` ``[T]``, ``aux`` ``[T, 3·H]``
    (float16), the target's top-k next-token ids and probabilities at each
    position (``[T, k]``), where the answer starts, whether it is held out."""

    index: int
    ids: torch.Tensor
    aux: torch.Tensor
    top_ids: torch.Tensor
    top_p: torch.Tensor
    answer_start: int

    @property
    def held_out(self) -> bool:
        return is_held_out(self.index)


class DataCache:
    """``conversations.jsonl`` (one generated conversation a line, in any
    order) and ``features-START-COUNT.safetensors`` (conversations START ..
    START + COUNT − 1), under ``root / settings.key()``."""

    def __init__(self, root: Path, settings: DataSettings) -> None:
        self.settings = settings
        self.dir = root / settings.key()
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "settings.json").write_text(json.dumps(asdict(settings), indent=2) + "\n")
        self.conversations_file = self.dir / "conversations.jsonl"

    def generated(self) -> dict[int, dict[str, Any]]:
        if not self.conversations_file.is_file():
            return {}
        out = {}
        for line in self.conversations_file.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a kill
                continue
            out[record["index"]] = record
        return out

    def append(self, records: Sequence[dict[str, Any]]) -> None:
        with self.conversations_file.open("a") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")

    def shard_path(self, start: int, count: int) -> Path:
        return self.dir / f"features-{start:06d}-{count:03d}.safetensors"


def _batches(indices: Sequence[int], size: int) -> Iterator[list[int]]:
    for start in range(0, len(indices), size):
        yield list(indices[start : start + size])


@torch.no_grad()
def _answered(
    batch: Sequence[int],
    texts: Sequence[str],
    encoded: Any,
    out: torch.Tensor,
    eos_ids: set[int],
    sampled: bool,
) -> list[dict[str, Any]]:
    """A generated batch's conversations: each prompt without its padding,
    and its answer up to its first end-of-sequence token."""
    width = encoded["input_ids"].shape[1]
    mask = encoded["attention_mask"].cpu()
    records = []
    for row, i in enumerate(batch):
        prompt = out[row, :width][mask[row].bool()].tolist()
        answer = out[row, width:].tolist()
        for n, token in enumerate(answer):
            if token in eos_ids:
                answer = answer[: n + 1]
                break
        records.append(
            {
                "index": i,
                "instruction": texts[i],
                "sampled": sampled,
                "prompt_len": len(prompt),
                "ids": prompt + answer,
            }
        )
    return records


def generate(
    cache: DataCache,
    texts: Sequence[str],
    model: Any,
    tokenizer: Any,
    *,
    batch_size: int,
    device: torch.device,
) -> dict[int, dict[str, Any]]:
    """The target's answers to ``texts`` through its chat template (batched,
    left-padded), cached; returns every conversation by index."""
    settings = cache.settings
    done = cache.generated()
    todo = [i for i in range(len(texts)) if i not in done]
    if not todo:
        return done
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    eos_ids.add(tokenizer.eos_token_id)
    prompts = {
        i: tokenizer.apply_chat_template(
            [{"role": "user", "content": texts[i]}], tokenize=False, add_generation_prompt=True
        )
        for i in todo
    }
    # greedy and sampled apart; similar prompt lengths together
    todo.sort(key=lambda i: (is_sampled(i), len(prompts[i])))
    bar = tqdm(total=len(todo), desc="generating answers", unit="conv", dynamic_ncols=True)
    for batch in _batches(todo, batch_size):
        encoded = tokenizer(
            [prompts[i] for i in batch], return_tensors="pt", padding=True, add_special_tokens=False
        ).to(device)
        sampled = is_sampled(batch[0])
        if sampled:
            torch.manual_seed(settings.seed * 1_000_003 + batch[0])
        out = model.generate(
            **encoded,
            max_new_tokens=settings.max_new_tokens,
            do_sample=sampled,
            temperature=settings.temperature if sampled else None,
            top_p=0.95 if sampled else None,
            top_k=None,
            pad_token_id=tokenizer.pad_token_id,
        ).cpu()
        records = _answered(batch, texts, encoded, out, eos_ids, sampled)
        cache.append(records)
        done.update({r["index"]: r for r in records})
        bar.update(len(batch))
    bar.close()
    return done


@torch.no_grad()
def extract(
    cache: DataCache,
    conversations: dict[int, dict[str, Any]],
    count: int,
    model: Any,
    *,
    batch_size: int,
    device: torch.device,
) -> None:
    """Writes every missing feature shard of conversations 0 .. count − 1:
    one forward pass of the target over each, with its hidden states."""
    settings = cache.settings
    shards = [(s, min(SHARD, count - s)) for s in range(0, count, SHARD)]
    todo = [(s, n) for s, n in shards if not cache.shard_path(s, n).is_file()]
    if not todo:
        return
    total = sum(n for _, n in todo)
    bar = tqdm(total=total, desc="target features", unit="conv", dynamic_ncols=True)
    k = settings.label_topk
    for start, n in todo:
        parts: dict[str, list[torch.Tensor]] = {
            "ids": [], "aux": [], "top_ids": [], "top_p": [],
        }  # fmt: skip
        meta = []
        indices = list(range(start, start + n))
        for batch in _batches(
            sorted(indices, key=lambda i: len(conversations[i]["ids"])), batch_size
        ):
            lengths = [len(conversations[i]["ids"]) for i in batch]
            ids = torch.zeros(len(batch), max(lengths), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, i in enumerate(batch):
                ids[row, : lengths[row]] = torch.tensor(conversations[i]["ids"])
                mask[row, : lengths[row]] = 1
            out = model(
                input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True
            )
            aux = torch.cat([out.hidden_states[a] for a in settings.aux_layers], dim=-1)
            probs, top = out.logits.float().softmax(-1).topk(k, dim=-1)
            for row, i in enumerate(batch):
                length = lengths[row]
                parts["ids"].append(ids[row, :length].to(torch.int32))
                parts["aux"].append(aux[row, :length].to(torch.float16).cpu())
                parts["top_ids"].append(top[row, :length].to(torch.int32).cpu())
                parts["top_p"].append(probs[row, :length].to(torch.float16).cpu())
                meta.append((i, length, conversations[i]["prompt_len"]))
            bar.update(len(batch))
        order = sorted(range(len(meta)), key=lambda m: meta[m][0])
        tensors = {name: torch.cat([p[m] for m in order]) for name, p in parts.items()}
        tensors["meta"] = torch.tensor([meta[m] for m in order], dtype=torch.long)
        path = cache.shard_path(start, n)
        save_file(tensors, str(path.with_suffix(".tmp")))
        path.with_suffix(".tmp").rename(path)
    bar.close()


def load(cache: DataCache, count: int) -> list[Conversation]:
    """Conversations 0 .. count − 1 from the feature shards."""
    out = []
    for start in range(0, count, SHARD):
        n = min(SHARD, count - start)
        tensors = load_file(str(cache.shard_path(start, n)))
        offset = 0
        for index, length, prompt_len in tensors["meta"].tolist():
            end = offset + length
            out.append(
                Conversation(
                    index=index,
                    ids=tensors["ids"][offset:end].long(),
                    aux=tensors["aux"][offset:end],
                    top_ids=tensors["top_ids"][offset:end].long(),
                    top_p=tensors["top_p"][offset:end],
                    answer_start=prompt_len,
                )
            )
            offset = end
    return out
