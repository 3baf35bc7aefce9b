"""``outrider bench http``: time to first token and inter-token latency
through the OpenAI-compatible HTTP API against the gRPC API, for the same
requests, in one run (what it starts and sends:
:class:`outrider.bench.options.HttpOptions`).

Three clients take turns on the same services: gRPC
(``outrider.AsyncClient.stream``); httpx on ``POST /v1/completions`` with
``stream: true``, each ``data:`` event parsed as JSON; and :class:`RawHttp`,
a minimal HTTP/1.1 client on asyncio streams (one keep-alive connection per
stream). A request's time to first token runs from its sending to its first
chunk read, its inter-token latencies between consecutive chunks;
percentiles interpolate between order statistics, as the bench's do.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from outrider.bench.concurrency.report import percentile
from outrider.bench.options import HttpOptions

PROMPT = [5, 17, 42, 99, 7, 300, 12, 64, 128, 33]
"""The token ids every request sends."""
K = 4
TINY_LLAMA: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=4096,
)  # fmt: skip
"""The tiny model's shape: its forward pass costs next to nothing beside an API's."""


@dataclass
class Samples:
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Streamed:
    """One request: its text, when it was sent and when each chunk came."""

    text: str
    chunk_times: list[float]
    sent: float

    def record(self, into: Samples) -> None:
        into.ttft_s.append(self.chunk_times[0] - self.sent)
        pairs = zip(self.chunk_times, self.chunk_times[1:], strict=False)
        into.itl_s.extend(b - a for a, b in pairs)


async def via_grpc(client, max_tokens: int) -> Streamed:
    sent, times, text = time.perf_counter(), [], []
    async for chunk in client.stream(
        token_ids=PROMPT, max_new_tokens=max_tokens, ignore_eos=True, num_speculative_tokens=K
    ):
        times.append(time.perf_counter())
        text.append(chunk.text)
    return Streamed("".join(text), times, sent)


def completion_body(model: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "num_speculative_tokens": K,
        "stream": True,
    }


async def via_httpx(client, model: str, max_tokens: int) -> Streamed:
    body = completion_body(model, max_tokens)
    sent, times, text = time.perf_counter(), [], []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return Streamed("".join(text), times, sent)


class RawHttp:
    """A minimal HTTP/1.1 client for one streamed POST at a time on a
    keep-alive connection: the response is chunked, one event a chunk."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def stream(self, model: str, max_tokens: int) -> Streamed:
        body = json.dumps(completion_body(model, max_tokens)).encode()
        request = (
            b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
        ) + body
        sent, reader, writer = await self._send(request)
        times, text = [], []
        while await reader.readline() != b"\r\n":  # headers
            pass
        while size := int((await reader.readline()).strip(), 16):
            chunk = await reader.readexactly(size + 2)  # and its CRLF
            if chunk.startswith(b"data: {"):
                times.append(time.perf_counter())
                text.append(json.loads(chunk[6:])["choices"][0]["text"])
        await reader.readline()  # the CRLF after the last chunk
        self.idle.append((reader, writer))
        return Streamed("".join(text), times, sent)

    async def _send(
        self, request: bytes
    ) -> tuple[float, asyncio.StreamReader, asyncio.StreamWriter]:
        """Sends ``request`` on an idle connection, or a new one where the
        server closed it while idle (keep-alive timeout); when it was sent,
        and the connection, its status line read."""
        while True:
            sent, reused = time.perf_counter(), bool(self.idle)
            reader, writer = (
                self.idle.pop() if reused else await asyncio.open_connection("127.0.0.1", self.port)
            )
            writer.write(request)
            status = await reader.readline()
            if status or not reused:
                break
            writer.close()
        if b" 200 " not in status:
            raise RuntimeError(f"HTTP answered {status!r}")
        return sent, reader, writer


Run = Callable[[], Awaitable[Streamed]]
"""One request through one API."""


async def measure(options: HttpOptions, grpc_address: str, http_url: str, bar) -> dict:
    """Every API's samples at every concurrency, after a warm-up of each
    (connections, caches, the cost model)."""
    import httpx

    from outrider.client import AsyncClient

    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with (
        AsyncClient(grpc_address, timeout=120) as grpc_client,
        httpx.AsyncClient(base_url=http_url, limits=limits, timeout=120) as http_client,
    ):
        model = (await http_client.get("/v1/models")).json()["data"][0]["id"]
        raw = RawHttp(int(http_url.rpartition(":")[2]))
        runs: dict[str, Run] = {
            "grpc": lambda: via_grpc(grpc_client, options.max_tokens),
            "http-httpx": lambda: via_httpx(http_client, model, options.max_tokens),
            "http-raw": lambda: raw.stream(model, options.max_tokens),
        }
        for run in runs.values():
            await asyncio.gather(*(run() for _ in range(4)))
        return {n: await waves(runs, n, options.repeats, bar) for n in options.concurrency}


async def waves(runs: Mapping[str, Run], n: int, repeats: int, bar) -> dict[str, Samples]:
    """``repeats`` waves of ``n`` requests at once through each API, the
    APIs' order rotating from wave to wave; every request must stream the
    chunks of the first."""
    samples = {name: Samples() for name in runs}
    reference: Streamed | None = None
    for repeat in range(repeats):
        names = list(runs)
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            for streamed in await asyncio.gather(*(runs[name]() for _ in range(n))):
                reference = reference or streamed
                if (streamed.text, len(streamed.chunk_times)) != (
                    reference.text,
                    len(reference.chunk_times),
                ):
                    raise RuntimeError(f"{name} streamed other chunks than the first request")
                streamed.record(samples[name])
            bar.update()
    chunks = len(reference.chunk_times) if reference else 0
    bar.write(f"N={n}: {repeats} x {n} requests per API, {chunks} chunks each")
    return samples


def quantiles(values: Sequence[float]) -> tuple[float, float]:
    """p50 and p99."""
    return percentile(values, 50) or 0.0, percentile(values, 99) or 0.0


def report(results: Mapping[int, Mapping[str, Samples]], load: tuple[float, float]) -> str:
    """A Markdown table: each API's TTFT and ITL at p50 and p99 by N, and HTTP − gRPC at p50."""
    lines = [
        "| N | API (client) | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 "
        "| − gRPC, TTFT p50 | − gRPC, ITL p50 |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for n, by_api in results.items():
        stats = {name: (quantiles(s.ttft_s), quantiles(s.itl_s)) for name, s in by_api.items()}
        for name, ((ttft50, ttft99), (itl50, itl99)) in stats.items():
            extra = " | |"
            if name != "grpc":
                d_ttft = (ttft50 - stats["grpc"][0][0]) * 1e3
                d_itl = (itl50 - stats["grpc"][1][0]) * 1e3
                extra = f" {d_ttft:+.2f} ms | {d_itl:+.2f} ms |"
            lines.append(
                f"| {n} | {name} | {ttft50 * 1e3:.2f} ms | {ttft99 * 1e3:.2f} ms | "
                f"{itl50 * 1e3:.2f} ms | {itl99 * 1e3:.2f} ms |{extra}"
            )
    lines.append(f"\nload average (1 min) at start and end: {load[0]:.2f}, {load[1]:.2f}")
    return "\n".join(lines)


def summary(results: Mapping[int, Mapping[str, Samples]]) -> dict[str, Any]:
    """``--json``: each API's quantiles and chunk count by N."""
    return {
        str(n): {
            name: {
                "ttft_s_p50_p99": quantiles(s.ttft_s),
                "itl_s_p50_p99": quantiles(s.itl_s),
                "chunks": len(s.itl_s) + len(s.ttft_s),
            }
            for name, s in by_api.items()
        }
        for n, by_api in results.items()
    }


def tiny_model(directory: Path) -> Path:
    """A random float32 Llama in :data:`TINY_LLAMA`'s shape on the default
    model's tokenizer, saved to ``directory``. Its embeddings and LM head are
    drawn wide (std 0.5), so that logits are far from ties and greedy decoding
    is the same in any batch."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from outrider import model_specs

    tokenizer = model_specs.load_tokenizer(None)
    eos = tokenizer.eos_token_id
    config = LlamaConfig(
        vocab_size=len(tokenizer), eos_token_id=eos, pad_token_id=eos, bos_token_id=None,
        tie_word_embeddings=False, **TINY_LLAMA,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in (model.model.embed_tokens.weight, model.lm_head.weight):
            weight.copy_(torch.randn(weight.shape, generator=generator) * 0.5)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def main(options: HttpOptions) -> int:
    """Starts the services, measures every API at every N, prints the table (and the JSON)."""
    from tqdm import tqdm

    from outrider.stack import start_stack

    try:
        import httpx  # noqa: F401
    except ImportError:
        raise RuntimeError("it needs httpx: pip install httpx") from None
    with tempfile.TemporaryDirectory() as tmp:
        model = options.model or str(tiny_model(Path(tmp) / "tiny"))
        workers = ["--threads", "1", "--dtype", "float32", "--log-level", "warning"]
        with start_stack(
            target_args=[*workers, "--model", model],
            draft_args=[*workers, "--drafter", "model", "--model", model],
            coordinator_args=["--tokenizer", model, "--log-level", "warning"],
            http_port=0,
        ) as stack:
            address, http_port = stack.coordinator.address, stack.coordinator.http_port
            start_load = os.getloadavg()[0]
            total = len(options.concurrency) * options.repeats * 3
            with tqdm(total=total, desc="waves", unit="wave", disable=options.no_progress) as bar:
                measured = _run(measure(options, address, f"http://127.0.0.1:{http_port}", bar))
            load = (start_load, os.getloadavg()[0])
    print(report(measured, load))
    if options.json is not None:
        options.json.write_text(json.dumps(summary(measured), indent=2))
    return 0


def _run(main: Coroutine[Any, Any, dict]) -> dict:
    """``main`` on uvloop where it is installed, else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
