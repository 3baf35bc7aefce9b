"""The flags of ``outrider bench`` (its run: :mod:`outrider.bench.command`).

Kept apart from the run so that building the CLI's parser imports none of
the benchmark's modules.
"""

from __future__ import annotations

from pathlib import Path

from outrider import flags
from outrider.device import check_device

DEVICE = flags.argparse_type(check_device)


def add_bench_parser(commands) -> None:
    """``outrider bench`` and its flags, on the CLI's subcommands
    (``outrider.bench.command`` reads them)."""
    bench = commands.add_parser(
        "bench",
        help="benchmark Outrider against Hugging Face generate and assisted generation, in one run",
        description=(
            "Runs a prompt set through every configuration in one run, interleaved (for each "
            "prompt, every configuration in turn): plain Hugging Face generate (hf-generate, the "
            "baseline), Outrider target-only (outrider-k0), Outrider with each drafter and K and "
            "with adaptive K, each synchronous and pipelined (prompt lookup: synchronous only), "
            "and Hugging Face assisted generation on the same models. Greedy decoding; outputs "
            "are checked to be identical. Reports tokens/s, speedup (tokens/s ÷ hf-generate's), "
            "acceptance rate, mean acceptance length, accepted per position, the per-round time "
            "split and the analytic bound E·t_target/T (docs/design.md#cost-model), per "
            "configuration and per prompt category. Starts its own services (one target worker, "
            "and a coordinator per drafter, with a draft worker for each drafter but prompt "
            "lookup, which drafts in the coordinator). With --concurrency it measures throughput "
            "and latency with N streams at once instead."
        ),
    )
    bench.add_argument(
        "--prompts", action="append", metavar="SET|FILE",
        help="a shipped prompt set (mt-bench: the 80 MT-Bench questions; humaneval: the 164 "
        "HumanEval prompts; long-context: 8 prompts of ~1k and ~3k tokens built from those) or a "
        "JSONL file, rows with `turns` (the first is used) or `prompt`, and optionally `category` "
        "(else the file stem); each is sent as one user chat message "
        "(repeatable; default: mt-bench)",
    )  # fmt: skip
    bench.add_argument(
        "--limit", type=int, help="prompts per file, spread evenly over the file (default: all)"
    )
    bench.add_argument(
        "--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (default: 64)"
    )
    bench.add_argument(
        "--k",
        default="4",
        metavar="LIST",
        help="fixed K values, comma-separated (default: 4); K=0 always runs",
    )
    bench.add_argument(
        "--drafters", default="prompt-lookup,int4", metavar="LIST",
        help="drafters, comma-separated: prompt-lookup, int4 (the target with 4-bit weights), bf16 "
        "(the target itself in bfloat16), early-exit-L (the target's first L layers; no HF peer) "
        "(default: prompt-lookup,int4)",
    )  # fmt: skip
    bench.add_argument(
        "--no-hf",
        action="store_true",
        help="skip the Hugging Face configurations (speedup is then vs outrider-k0)",
    )
    bench.add_argument(
        "--no-adaptive", action="store_true", help="skip the adaptive-K configurations"
    )
    bench.add_argument(
        "--no-pipelined", action="store_true",
        help="skip the pipelined configurations (outrider-<drafter>-k<K>-pipelined, "
        "outrider-<drafter>-adaptive-pipelined: the draft drafts the next round while the target "
        "verifies this one); the others always run synchronous",
    )  # fmt: skip
    bench.add_argument(
        "--target-model",
        help="target model: embedded name, directory or hub id (default: smollm2-135m-instruct)",
    )
    bench.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"],
        help="dtype of the target, in the target worker and for Hugging Face (default: float32)",
    )  # fmt: skip
    bench.add_argument(
        "--device", type=DEVICE, default="auto",
        help="where both workers and the Hugging Face configurations run: auto (the first CUDA "
        "device if there is one, else the CPU), cpu, cuda or cuda:N (default: auto)",
    )  # fmt: skip
    bench.add_argument(
        "--ignore-eos", action="store_true",
        help="fixed-length runs: every request generates exactly --max-new-tokens, past "
        "end-of-sequence tokens (Outrider's ignore_eos; Hugging Face with no end-of-sequence "
        "token, which does the same without masking it, so the outputs stay comparable)",
    )  # fmt: skip
    bench.add_argument(
        "--concurrency", metavar="LIST",
        help="throughput mode: for each N in the comma-separated list (e.g. 1,8,32,64; 1 always "
        "runs, as the reference for outputs and speedup: one batch, unless listed, then --repeat "
        "like the others), N streams at once, max(N, prompts) requests, taken in order from one "
        "queue, each stream sending its next as soon as its previous has ended. Reports per "
        "configuration and N total tokens/s, speedup over N=1, TTFT and "
        "inter-token latency p50/p99 (per chunk: Outrider streams a chunk per round; and per "
        "token). Peers: hf-generate on left-padded batches of N and transformers' continuous "
        "batching (hf-generate-batch); no assisted generation (it takes one sequence at a time)",
    )  # fmt: skip
    bench.add_argument(
        "--configs", metavar="GLOBS",
        help="run only the configurations whose names match one of these comma-separated "
        "shell-style globs (e.g. 'outrider-*-adaptive'), and the references hf-generate (unless "
        "--no-hf) and outrider-k0 (default: all); with --concurrency 8 --repeat R, a check of "
        "one configuration against outrider-k0 in pairs of batches, the order alternating "
        "(ABBA)",
    )  # fmt: skip
    bench.add_argument(
        "--repeat", type=int, default=1, metavar="R",
        help="run every configuration R times on each prompt (with --concurrency: R batches at "
        "each N), the order rotated or reversed each time, and report the median: of each "
        "prompt, the request of median wall time; with --concurrency, the batch of median "
        "tokens/s, and the median ratio to outrider-k0's batch of the same rotation. Every "
        "output is checked; ratios between configurations then hold against the machine's "
        "drift (default: 1)",
    )  # fmt: skip
    bench.add_argument(
        "--coordinators", type=int, default=1, metavar="N",
        help="with --concurrency: N coordinator replicas per drafter, sharing the same workers, "
        "the streams spread round-robin over them (to see how many a load needs when one "
        "coordinator's CPU is the limit) (default: 1)",
    )  # fmt: skip
    bench.add_argument(
        "--threads",
        type=int,
        help="torch threads of this process and of each worker (default: all cores)",
    )
    flags.add_tensor_parallel_flags(bench)
    bench.add_argument(
        "--json",
        type=Path,
        metavar="FILE",
        help="write the report as JSON (one object with a `configs` list; with --concurrency each "
        "has a `runs` list, one per N)",
    )
    bench.add_argument(
        "--plot", type=Path, metavar="FILE.png",
        help="plot speedup and acceptance by configuration and category; with --concurrency, "
        "tokens/s, TTFT and inter-token latency against N (needs matplotlib: outrider[bench])",
    )  # fmt: skip
    bench.add_argument("--no-progress", action="store_true", help="no progress bars")
    bench.add_argument(
        "--log-level", default="warning", help="log level of the services (default: warning)"
    )
