"""``outrider draft train``: its flags and its run. Building the parser
imports no torch; the run imports :mod:`outrider.eagle.train`."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

DESCRIPTION = """\
Trains an EAGLE-3 draft head for TARGET by self-distillation: the target
answers a few hundred instructions written in code (outrider.eagle.instructions,
the project's own text; never the benchmark prompts), one forward pass over
each conversation gives its hidden states and next-token choices, and the
head learns to predict them, unrolled over --ttt-steps drafts (EAGLE-3's
training-time test). Writes the head (config.json, model.safetensors),
training.json and training.png into --out; the dataset is cached under
--data-dir and checkpoints under --checkpoint-dir, so --resume picks up an
interrupted run."""


def add_draft_parser(commands) -> None:
    """``outrider draft`` and its ``train`` subcommand."""
    draft = commands.add_parser("draft", help="draft heads: train an EAGLE-3 head for a target")
    subcommands = draft.add_subparsers(dest="draft_command", required=True, metavar="SUBCOMMAND")
    train = subcommands.add_parser(
        "train",
        help="train an EAGLE-3 head for a target model (self-distillation)",
        description=DESCRIPTION,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = train.add_argument
    add("--target", default=None, metavar="M",
        help="the target: an embedded model's name, a local directory or a hub id "
        "(default: smollm2-135m-instruct)")  # fmt: skip
    add("--out", type=Path, required=True, metavar="DIR", help="directory the head is written to")
    add("--instructions", type=int, default=600, metavar="N",
        help="instructions the target answers (1 in 20 greedy answers is held out)")  # fmt: skip
    add("--max-new-tokens", type=int, default=192, metavar="N", help="longest answer, in tokens")
    add("--temperature", type=float, default=0.7,
        help="temperature of the sampled answers (1 in 4; the rest are greedy)")  # fmt: skip
    add("--draft-vocab-size", type=int, default=8192, metavar="N",
        help="the head's vocabulary: the target's N most frequent choices")  # fmt: skip
    add("--ttt-steps", type=int, default=4, metavar="N",
        help="drafts unrolled per position in training (the training-time test)")  # fmt: skip
    add("--epochs", type=int, default=2, metavar="N", help="passes over the training conversations")
    add("--batch-size", type=int, default=8, metavar="N", help="conversations per training step")
    add("--lr", type=float, default=5e-4, metavar="X",
        help="peak learning rate of AdamW (linear warm-up, then cosine to a tenth)")  # fmt: skip
    add("--warmup", type=float, default=0.05, metavar="X", help="share of the steps warming up")
    add("--init", choices=("target", "lm-head", "random"), default="target",
        help="'target': start from the target's last decoder layer, final norm and LM head "
        "rows; 'lm-head': from its final norm and LM head rows only; 'random': torch's "
        "default initialisation")  # fmt: skip
    add("--label-topk", type=int, default=8, metavar="K",
        help="the target's top K next tokens kept as soft labels (1: hard labels)")  # fmt: skip
    add("--device", choices=("cpu", "cuda"), default="cpu",
        help="where the target and the head run (cuda: bf16 autocast)")  # fmt: skip
    add(
        "--threads", type=int, default=0, metavar="N", help="torch CPU threads (0: torch's default)"
    )
    add(
        "--seed",
        type=int,
        default=0,
        metavar="N",
        help="seed of the instructions, sampling and init",
    )
    add("--resume", action="store_true", help="continue from the last checkpoint")
    add(
        "--data-dir", type=Path, default=None, metavar="DIR",
        help="where the generated dataset is cached (default: ~/.cache/outrider/eagle-data)"
    )  # fmt: skip
    add("--checkpoint-dir", type=Path, default=None, metavar="DIR",
        help="checkpoints, with the optimizer's state (default: OUT/checkpoints)")  # fmt: skip
    add("--checkpoint-every", type=int, default=200, metavar="N",
        help="steps between checkpoints (one is written after every epoch too)")  # fmt: skip
    add("--generate-batch-size", type=int, default=32, metavar="N",
        help="instructions the target answers at once")  # fmt: skip
    add("--save-dtype", choices=("float16", "bfloat16", "float32"), default="float16",
        help="dtype of the saved weights")  # fmt: skip


def main(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    from outrider.eagle.train import TrainError, TrainOptions, train
    from outrider.logging import configure_logging

    configure_logging()
    options = TrainOptions(
        target=args.target,
        out=args.out,
        instructions=args.instructions,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        draft_vocab_size=args.draft_vocab_size,
        ttt_steps=args.ttt_steps,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup=args.warmup,
        init=args.init,
        label_topk=args.label_topk,
        device=args.device,
        threads=args.threads,
        seed=args.seed,
        resume=args.resume,
        data_dir=args.data_dir,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        generate_batch_size=args.generate_batch_size,
        save_dtype=args.save_dtype,
        command=shlex.join(["outrider", *(sys.argv[1:] if argv is None else argv)]),
    )
    try:
        train(options)
    except TrainError as exc:
        print(f"outrider draft train: {exc}", file=sys.stderr)
        return 2
    return 0
