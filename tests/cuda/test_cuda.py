"""On a CUDA device (skipped elsewhere): the engine's CUDA path — CUDA
graphs included — gives transformers' greedy tokens in float32, on tiny
models and on the default model, alone and batched; CUDA graph replays equal
eager steps; and a seeded sampled request gives the same tokens on the CPU
and on CUDA."""

from __future__ import annotations

import asyncio
import copy
import random

import pytest
import structlog
import torch

from outrider import model_specs
from outrider.client import AsyncClient
from outrider.config import EngineConfig
from outrider.engine.causal_lm import load_causal_lm
from outrider.engine.kv_cache import BlockPool
from outrider.engine.llama import LlamaForward
from outrider.engine.runner import PagedRunner
from outrider.engine.scheduler import Row
from tests.prompts import mt_bench_chat_ids

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from tests.integration.harness import running_stack  # noqa: E402

NO_EOS = -1
CUDA_FP32 = EngineConfig(device="cuda", dtype="float32")


def prompts(count: int, *, seed: int, vocab: int = 512, lengths=(3, 60)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))] for _ in range(count)]


def hf_greedy(model_dir, prompt_ids: list[int], max_new_tokens: int, *, device="cuda") -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids], device=device),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


async def test_tiny_model_batched_on_cuda_with_graphs_equals_transformers(
    tiny_target_dir, tiny_draft_other_dir
):
    cases = [(p, 10 + 5 * i, (0, 1, 4, 8)[i % 4]) for i, p in enumerate(prompts(8, seed=11))]
    references = [hf_greedy(tiny_target_dir, p, n) for p, n, _ in cases]
    async with running_stack(
        tiny_target_dir, draft_dir=tiny_draft_other_dir, eos_token_ids={NO_EOS}, engine=CUDA_FP32
    ) as stack:
        assert stack.target.runner.graphs is not None and stack.target.runner.graphs.graphs
        assert stack.target.runner.graphed_tokens_per_row == 9  # verifies of K <= 8
        async with AsyncClient(stack.address, timeout=120) as client:
            results = await asyncio.gather(
                *(
                    client.generate(token_ids=p, max_new_tokens=n, num_speculative_tokens=k)
                    for p, n, k in cases
                )
            )
            info = await client.model_info()
    assert [list(r.token_ids) for r in results] == references
    assert (info.target_device, info.target_dtype) == ("cuda:0", "float32")


def test_a_cuda_graph_replay_equals_the_eager_step(tiny_target_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).cuda().eval()
    eager = PagedRunner(LlamaForward(copy.deepcopy(model)), BlockPool(256, 16))
    graphed = PagedRunner(LlamaForward(copy.deepcopy(model)), BlockPool(256, 16), cuda_graphs=True)
    with torch.inference_mode():
        graphed.warm_up(max_rows=8, max_tokens_per_row=5)
        caches = {}
        for runner in (eager, graphed):
            caches[id(runner)] = [runner.new_kv() for _ in range(3)]
            for kv, p in zip(
                caches[id(runner)], prompts(3, seed=12, lengths=(20, 40)), strict=True
            ):
                kv.reserve(len(p) + 5)
                runner.execute([Row(kv, p, 0)])

        def rows(runner):
            return [
                Row(kv, [5, 6, 7, 8, 9][: i + 3], i + 1) for i, kv in enumerate(caches[id(runner)])
            ]

        assert graphed.graphs.bucket(rows(graphed)) is not None  # this step replays a graph
        for a, b in zip(eager.execute(rows(eager)), graphed.execute(rows(graphed)), strict=True):
            torch.testing.assert_close(a.values, b.values, rtol=1e-4, atol=1e-4)
            assert a.argmax == b.argmax


async def test_a_seeded_request_gives_the_same_tokens_on_cpu_and_cuda(
    tiny_target_dir, tiny_draft_other_dir
):
    sampling = dict(temperature=0.8, top_k=40, seed=7, max_new_tokens=24, num_speculative_tokens=3)
    outputs = {}
    for device in ("cpu", "cuda"):
        engine = EngineConfig(device=device, dtype="float32")
        async with running_stack(
            tiny_target_dir, draft_dir=tiny_draft_other_dir, eos_token_ids={NO_EOS}, engine=engine
        ) as stack:
            async with AsyncClient(stack.address, timeout=120) as client:
                outputs[device] = [
                    list(
                        (
                            await client.generate(token_ids=p, verification=mode, **sampling)
                        ).token_ids
                    )
                    for p in prompts(3, seed=13)
                    for mode in ("rejection", "gumbel")
                ]
    assert outputs["cpu"] == outputs["cuda"]


@pytest.mark.e2e
async def test_default_model_float32_on_cuda_equals_transformers_alone_and_batched():
    if not model_specs.is_fetched(model_specs.DEFAULT_MODEL):
        pytest.skip("needs the default model (outrider models fetch)")
    from transformers import AutoTokenizer

    model_dir = model_specs.model_path(model_specs.DEFAULT_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chats = mt_bench_chat_ids(tokenizer, 6)
    references = [hf_greedy(model_dir, c, 48) for c in chats]
    async with running_stack(
        model_dir, drafter="prompt-lookup", eos_token_ids={NO_EOS}, engine=CUDA_FP32
    ) as stack:
        async with AsyncClient(stack.address, timeout=300) as client:
            alone = [
                await client.generate(token_ids=c, max_new_tokens=48, num_speculative_tokens=4)
                for c in chats
            ]
            together = await asyncio.gather(
                *(
                    client.generate(token_ids=c, max_new_tokens=48, num_speculative_tokens=k)
                    for c, k in zip(chats, (0, 4) * 3, strict=True)
                )
            )
    assert [list(r.token_ids) for r in alone] == references
    assert [list(r.token_ids) for r in together] == references


@pytest.mark.parametrize(
    "shape", [(48, 64), (10, 40), (1536, 576)], ids=["aligned", "padded", "smollm2 mlp"]
)
def test_tinygemm_int4_and_int8_products_equal_their_levels_on_cuda(shape):
    from outrider.quantize import Int4Weight, Int8Weight

    torch.manual_seed(0)
    weight = torch.randn(shape, device="cuda")
    x = torch.randn(3, shape[1], device="cuda", dtype=torch.bfloat16)
    for quantized in (Int4Weight.quantize(weight), Int8Weight.quantize(weight)):
        expected = x.float() @ quantized.dequantize().T
        actual = quantized.linear(x).float()
        torch.testing.assert_close(
            actual, expected, rtol=0, atol=0.02 * expected.abs().max().item()
        )
    # The same levels as the CPU's packing: one quantizer, two layouts.
    torch.testing.assert_close(
        Int4Weight.quantize(weight).dequantize().cpu(),
        Int4Weight.quantize(weight.cpu()).dequantize(),
        rtol=0,
        atol=0.02,
    )


def test_a_product_of_no_rows_leaves_no_cuda_error_behind():
    """A draft's prefill asks for no logits; its LM head gets no rows, and
    the next operation must not fail (torch's int8 kernel does not check an
    empty grid's launch)."""
    from outrider.quantize import Int4Weight, Int8Weight

    for quantized in (
        Int4Weight.quantize(torch.randn(1536, 576, device="cuda")),
        Int8Weight.quantize(torch.randn(49152, 576, device="cuda")),
    ):
        assert quantized.linear(torch.randn(0, 576, device="cuda")).shape == (0, quantized.shape[0])
        torch.arange(4, device="cuda").index_select(0, torch.tensor([1], device="cuda"))
        torch.cuda.synchronize()


async def test_int4_drafter_on_cuda_with_graphs_keeps_the_output(tiny_target_dir):
    cases = [(p, 12 + 4 * i, (1, 4, 8)[i % 3]) for i, p in enumerate(prompts(6, seed=13))]
    references = [hf_greedy(tiny_target_dir, p, n) for p, n, _ in cases]
    with structlog.testing.capture_logs() as logs:
        async with running_stack(
            tiny_target_dir, drafter="int4", eos_token_ids={NO_EOS}, engine=CUDA_FP32
        ) as stack:
            async with AsyncClient(stack.address, timeout=120) as client:
                results = await asyncio.gather(
                    *(
                        client.generate(token_ids=p, max_new_tokens=n, num_speculative_tokens=k)
                        for p, n, k in cases
                    )
                )
    for result, reference in zip(results, references, strict=True):
        assert list(result.token_ids) == reference
    # A failing draft step loses the draft and the rounds go on at K = 0,
    # the output unchanged: only the logs tell.
    assert [e for e in logs if e["log_level"] in ("error", "warning")] == []
    assert sum(r.stats.accepted_tokens for r in results) >= 0.6 * sum(
        r.stats.draft_tokens for r in results
    )


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism needs 2 GPUs")
def test_nccl_ranks_on_every_gpu_give_one_gpus_logits(tmp_path):
    """TP over as many GPUs as divide the heads (up to 8), NCCL, float32:
    each step's logits equal one GPU's to float32 rounding, and the argmaxes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from outrider.engine import parallel

    size = max(n for n in (2, 4, 8) if n <= torch.cuda.device_count())
    config = LlamaConfig(
        vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    one = PagedRunner(
        LlamaForward(load_causal_lm(str(tmp_path), device="cuda:0")), BlockPool(64, 16)
    )
    ranks = parallel.start(
        str(tmp_path),
        parallel.meta_model(str(tmp_path)),
        size=size,
        device=torch.device("cuda"),
        dtype=torch.float32,
        num_layers=None,
        timeout_s=60,
        threads=1,
    )
    many = PagedRunner(ranks, BlockPool(64, 16))
    try:
        sequences = prompts(4, seed=3, vocab=1000)
        with torch.inference_mode():
            caches = {r: [r.new_kv() for _ in sequences] for r in (one, many)}
            for kv, s in zip([*caches[one], *caches[many]], sequences * 2, strict=True):
                kv.reserve(len(s) + 5)
            for step in ([(s, len(s)) for s in sequences], [([7, 8, 9, 10, 11], 5)] * 4):
                a, b = (
                    r.execute([Row(kv, *feed) for kv, feed in zip(caches[r], step, strict=True)])
                    for r in (one, many)
                )
                for x, y in zip(a, b, strict=True):
                    torch.testing.assert_close(y.values, x.values, rtol=1e-4, atol=1e-4)
                    assert y.argmax == x.argmax
    finally:
        ranks.close()
