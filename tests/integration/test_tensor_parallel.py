"""Tensor-parallel workers (gloo, on the CPU) on tiny float64 models: each
step's logits are one rank's to 1e-12 and transformers'; greedy and seeded
sampled generations through real services equal those of one rank; a
rank's resident weights are its share; a model that does not split, and
the int4 drafter, are refused at start; a rank SIGKILLed mid-stream stops
its worker and the stream finishes on another replica."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from outrider.client import AsyncClient
from outrider.engine import parallel
from outrider.engine.causal_lm import load_causal_lm
from outrider.engine.kv_cache import BlockPool
from outrider.engine.llama import LlamaForward
from outrider.engine.runner import PagedRunner
from outrider.engine.scheduler import Row
from tests.integration.harness import reference_greedy
from tests.stress.cluster import sessions_left, start_stack
from tests.tiny import LLAMA_FAMILY

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown"
MAX_NEW = 40


def start_ranks(checkpoint: Path, size: int = 2) -> parallel.TensorParallelForward:
    """This process as rank 0 of ``size`` over ``checkpoint`` (float64, gloo)."""
    return parallel.start(
        str(checkpoint),
        parallel.meta_model(str(checkpoint)),
        size=size,
        device=torch.device("cpu"),
        dtype=torch.float64,
        num_layers=None,
        timeout_s=30,
        threads=1,
    )


@pytest.mark.parametrize("name", LLAMA_FAMILY)
def test_each_step_of_two_ranks_gives_one_ranks_logits_and_transformers(tmp_path, name):
    torch.manual_seed(0)
    model = LLAMA_FAMILY[name]().to(torch.float64).eval()
    model.save_pretrained(tmp_path)
    one = PagedRunner(
        LlamaForward(load_causal_lm(str(tmp_path), dtype=torch.float64)), BlockPool(64, 4)
    )
    two = PagedRunner(start_ranks(tmp_path), BlockPool(64, 4))
    try:
        torch.manual_seed(1)
        sequences = [torch.randint(0, 97, (n,)).tolist() for n in (5, 9, 23, 40)]
        with torch.inference_mode():
            expected = [model(torch.tensor([s])).logits[0] for s in sequences]
            caches = {r: [r.new_kv() for _ in sequences] for r in (one, two)}
            for kv, s in zip([*caches[one], *caches[two]], sequences * 2, strict=True):
                kv.reserve(len(s) + 5)
            # prefill in two chunks (all logits of the second), then two decode steps
            # and a verify round of 4 drafts, each step compared
            steps = [
                [(s[:3], 0) for s in sequences],
                [(s[3:], len(s) - 3) for s in sequences],
                [([7], 1) for _ in sequences],
                [([11, 13, 17, 19], 4) for _ in sequences],
            ]
            for i, step in enumerate(steps):
                outputs = {
                    r: r.execute(
                        [
                            Row(kv, tokens, n)
                            for kv, (tokens, n) in zip(caches[r], step, strict=True)
                        ]
                    )
                    for r in (one, two)
                }
                for a, b in zip(outputs[one], outputs[two], strict=True):
                    if a is None:
                        assert b is None
                        continue
                    assert b is not None
                    torch.testing.assert_close(b.values, a.values, rtol=0, atol=1e-12)
                    assert b.argmax == a.argmax
                if i == 1:
                    for out, logits in zip(outputs[two], expected, strict=True):
                        assert out is not None
                        torch.testing.assert_close(out.values, logits[3:], rtol=0, atol=1e-12)
    finally:
        two.close()


def test_a_rank_reads_its_share_of_the_weights_and_no_more(tmp_path):
    """Resident memory of the weights, measured in a fresh process per
    rank count: the growth of its RSS over loading its shard."""
    config = LlamaConfig(
        vocab_size=8192, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
    )  # fmt: skip  # 42 M parameters: 168 MB in float32
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    script = (
        "import json, sys, torch\n"
        "from outrider.engine import parallel\n"
        "from outrider.memory import return_freed_memory\n"
        "def rss():\n"
        "    for line in open('/proc/self/status'):\n"
        "        if line.startswith('VmRSS:'): return int(line.split()[1]) * 1024\n"
        "path, rank, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])\n"
        "model = parallel.meta_model(path)\n"
        "spec = parallel.RankSpec(path, rank, size, 'cpu', 'float32', None, 0, '', 30, 1)\n"
        "before = rss()\n"
        "if size == 1:  # a worker's own path: transformers loads, the forward takes over\n"
        "    from outrider.engine.llama import LlamaForward\n"
        "    from outrider.engine.causal_lm import load_causal_lm\n"
        "    forward = LlamaForward(load_causal_lm(path))\n"
        "else:\n"
        "    forward = parallel.load_shard(spec, model)\n"
        "return_freed_memory()  # as every rank does once loaded\n"
        "print(json.dumps(rss() - before))\n"
    )

    def weights_rss(rank: int, size: int) -> int:
        out = subprocess.run(
            [sys.executable, "-c", script, str(tmp_path), str(rank), str(size)],
            capture_output=True,
            text=True,
            check=True,
        )
        return json.loads(out.stdout.strip().splitlines()[-1])

    whole = weights_rss(0, 1)
    shares = [weights_rss(rank, 2) for rank in (0, 1)]
    print(f"\nresident weights: 1 rank {whole / 2**20:.1f} MiB; of 2 ranks "
          f"{', '.join(f'{s / 2**20:.1f}' for s in shares)} MiB")  # fmt: skip
    assert whole > 150 * 2**20
    assert all(share <= 0.6 * whole for share in shares)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--tensor-parallel-size", "3"], "4 attention heads, 2 KV heads and 128 MLP features"),
        (["--tensor-parallel-size", "2", "--drafter", "int4"], "int4 drafter"),
    ],
    ids=["heads that do not divide", "int4 drafter"],
)
def test_a_worker_that_cannot_split_its_model_refuses_to_start_in_one_line(
    tiny_target_dir, args, says
):
    role = "draft" if "--drafter" in args else "target"
    out = subprocess.run(
        [sys.executable, "-m", "outrider", "serve", role, "--model", str(tiny_target_dir), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    (line,) = out.stderr.strip().splitlines()
    assert "--tensor-parallel-size" in line and says in line


# --------------------------------------------------------------------------- services


@pytest.fixture(scope="module")
def prompt_ids(tiny_target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target_dir)(PROMPT)["input_ids"]


@pytest.fixture(scope="module")
def reference(tiny_target_dir, prompt_ids):
    return reference_greedy(tiny_target_dir, prompt_ids, MAX_NEW, eos=None)


TP2 = ["--tensor-parallel-size", "2"]
SAMPLED = [
    dict(temperature=1.0, seed=7, verification="rejection"),
    dict(temperature=0.8, top_p=0.9, seed=11, verification="gumbel"),
]


async def generations(address: str, prompt_ids) -> dict[str, list[int]]:
    """Greedy at K 0, 4 and adaptive, and seeded sampling in both modes at K 4."""
    runs = {
        "greedy k0": dict(num_speculative_tokens=0),
        "greedy k4": dict(num_speculative_tokens=4),
        "greedy adaptive": dict(adaptive=True),
        **{f"sampled {s['verification']}": dict(num_speculative_tokens=4, **s) for s in SAMPLED},
    }
    out = {}
    async with AsyncClient(address, timeout=120) as client:
        for name, options in runs.items():
            result = await client.generate(
                token_ids=prompt_ids, max_new_tokens=MAX_NEW, ignore_eos=True, **options
            )
            out[name] = list(result.token_ids)
    return out


async def test_tensor_parallel_workers_generate_what_one_rank_does(
    cluster, tiny_target_dir, tiny_draft_other_dir, prompt_ids, reference
):
    """A TP=2 target with a TP=1 draft, then both at TP=2, against both at TP=1."""
    results = {}
    for label, target_args, draft_args in [
        ("tp1", [], []),
        ("target tp2", TP2, []),
        ("both tp2", TP2, TP2),
    ]:
        stack = await start_stack(
            cluster,
            tiny_target_dir,
            tiny_draft_other_dir,
            target_args=target_args,
            draft_args=draft_args,
        )
        results[label] = await generations(stack.coordinator.address, prompt_ids)
        assert await sessions_left(stack.workers) == {w.name: (0, 0) for w in stack.workers}
        for service in cluster.services:
            service.signal(signal.SIGTERM)
        for service in cluster.services:
            assert await service.exit_code(30) == 0
        cluster.services.clear()
    for label, runs in results.items():
        for name, tokens in runs.items():
            if name.startswith("greedy"):
                assert tokens == reference, (label, name)
    assert results["target tp2"] == results["tp1"]
    assert results["both tp2"] == results["tp1"]


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (from any of its threads)."""
    return [
        int(child)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for child in (task / "children").read_text().split()
    ]


async def test_rank_1_sigkilled_mid_stream_stops_its_worker_and_the_stream_ends_on_another(
    cluster, tiny_target_dir, tiny_draft_other_dir, prompt_ids, reference
):
    timeout_s = 20
    stack = await start_stack(
        cluster,
        tiny_target_dir,
        tiny_draft_other_dir,
        targets=2,
        target_args=[*TP2, "--tensor-parallel-timeout-s", str(timeout_s)],
    )
    killed: list[tuple[int, float]] = []

    async def kill_rank_1_of_the_busy_target() -> None:
        from tests.stress.cluster import worker_info

        infos = [await worker_info(t) for t in stack.targets]
        (busy,) = [i for i, info in enumerate(infos) if info.active_sessions]
        (rank_1,) = children(stack.targets[busy].pid)
        subprocess.run(["kill", "-KILL", str(rank_1)], check=True)
        killed.append((busy, time.monotonic()))

    ids: list[int] = []
    async with AsyncClient(stack.coordinator.address, timeout=120) as client:
        async for chunk in client.stream(
            token_ids=prompt_ids, max_new_tokens=MAX_NEW, ignore_eos=True, num_speculative_tokens=4
        ):
            ids.extend(chunk.token_ids)
            if not killed and len(ids) >= 8:
                await kill_rank_1_of_the_busy_target()
    ((busy, at),) = killed
    code = await stack.targets[busy].exit_code(timeout_s)
    waited = time.monotonic() - at
    print(f"\nrank 1 SIGKILLed: its worker exited with code {code} after {waited:.1f} s")
    assert code not in (None, 0)
    assert ids == reference
    survivor = stack.targets[1 - busy]
    assert survivor.alive()
    await asyncio.sleep(0)  # (the survivor keeps serving: its sessions are all closed)
    assert await sessions_left([survivor]) == {survivor.name: (0, 0)}
