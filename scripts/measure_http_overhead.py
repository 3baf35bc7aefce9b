"""Time to first token and inter-token latency through the OpenAI-compatible
HTTP API against the gRPC API, for the same requests, in one run.

Starts the three services as processes (``outrider.stack``, the coordinator
with ``--http-port 0``) on tiny random float32 Llamas built as the tests build
theirs, the draft an exact copy of the target (every draft is accepted, so
every round streams K + 1 tokens) and ``--threads 1``. For each concurrency N
it runs ``--repeats`` waves of N requests at once, each wave through gRPC
(``outrider.AsyncClient.stream``) and through HTTP (``POST /v1/completions``,
``stream: true``, each ``data:`` event parsed as JSON) with two clients:
httpx, which the ``openai`` package rides on, and a minimal HTTP/1.1 client
on asyncio streams (one keep-alive connection per stream), which shows what
the server adds without httpx's own cost. The APIs take turns, in an order
that rotates from wave to wave. Every request sends the same token ids, greedy, K = 4,
``ignore_eos`` and ``--max-tokens`` tokens, so both APIs stream the same
chunks (one a round); the script checks that they do and that the texts
agree.

Reported per API and N: time to first token (request sent → first chunk
read) and inter-token latency (between consecutive chunks) at p50 and p99,
and HTTP − gRPC at p50.

    .venv/bin/python scripts/measure_http_overhead.py --concurrency 1,16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from outrider.client import AsyncClient  # noqa: E402
from outrider.stack import start_stack  # noqa: E402
from tests.tiny import build_tiny_model_dir, build_tiny_tokenizer  # noqa: E402

PROMPT = [5, 17, 42, 99, 7, 300, 12, 64, 128, 33]
K = 4


@dataclass
class Samples:
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)


@dataclass
class Streamed:
    text: str
    chunk_times: list[float]
    sent: float

    def record(self, into: Samples) -> None:
        into.ttft_s.append(self.chunk_times[0] - self.sent)
        pairs = zip(self.chunk_times, self.chunk_times[1:], strict=False)
        into.itl_s.extend(b - a for a, b in pairs)


async def via_grpc(client: AsyncClient, max_tokens: int) -> Streamed:
    sent, times, text = time.perf_counter(), [], []
    async for chunk in client.stream(
        token_ids=PROMPT, max_new_tokens=max_tokens, ignore_eos=True, num_speculative_tokens=K
    ):
        times.append(time.perf_counter())
        text.append(chunk.text)
    return Streamed("".join(text), times, sent)


def completion_body(model: str, max_tokens: int) -> dict:
    return {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "num_speculative_tokens": K,
        "stream": True,
    }


async def via_httpx(client: httpx.AsyncClient, model: str, max_tokens: int) -> Streamed:
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
        sent, times, text = time.perf_counter(), [], []
        while True:
            reused = bool(self.idle)
            reader, writer = (
                self.idle.pop() if reused else await asyncio.open_connection("127.0.0.1", self.port)
            )
            writer.write(request)
            status = await reader.readline()
            if status or not reused:
                break
            writer.close()  # the server closed it while idle (keep-alive timeout): anew
            sent = time.perf_counter()
        if b" 200 " not in status:
            raise SystemExit(f"HTTP answered {status!r}")
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


def quantiles(values: list[float]) -> tuple[float, float]:
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return statistics.median(values), cuts[98]


async def measure(args: argparse.Namespace, grpc_address: str, http_url: str) -> dict:
    results: dict = {}
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with (
        AsyncClient(grpc_address, timeout=120) as grpc_client,
        httpx.AsyncClient(base_url=http_url, limits=limits, timeout=120) as http_client,
    ):
        model = (await http_client.get("/v1/models")).json()["data"][0]["id"]
        raw = RawHttp(int(http_url.rpartition(":")[2]))
        runs = {
            "grpc": lambda: via_grpc(grpc_client, args.max_tokens),
            "http-httpx": lambda: via_httpx(http_client, model, args.max_tokens),
            "http-raw": lambda: raw.stream(model, args.max_tokens),
        }
        # Warm up both paths (connections, caches, the cost model).
        for run in runs.values():
            await asyncio.gather(*(run() for _ in range(4)))
        for n in args.concurrency:
            samples = {name: Samples() for name in runs}
            reference: Streamed | None = None
            for repeat in range(args.repeats):
                names = list(runs)
                order = names[repeat % len(names) :] + names[: repeat % len(names)]
                for name in order:
                    for streamed in await asyncio.gather(*(runs[name]() for _ in range(n))):
                        reference = reference or streamed
                        if (streamed.text, len(streamed.chunk_times)) != (
                            reference.text,
                            len(reference.chunk_times),
                        ):
                            raise SystemExit(f"{name} streamed other chunks than the first request")
                        streamed.record(samples[name])
            results[n] = {name: s for name, s in samples.items()}
            print(f"N={n}: {args.repeats} x {n} requests per API, "
                  f"{len(reference.chunk_times)} chunks each", flush=True)  # fmt: skip
    return results


def report(results: dict, load: tuple[float, float]) -> str:
    lines = [
        "| N | API (client) | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 "
        "| − gRPC, TTFT p50 | − gRPC, ITL p50 |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for n, by_api in results.items():
        stats = {name: (quantiles(s.ttft_s), quantiles(s.itl_s)) for name, s in by_api.items()}
        for name, ((ttft50, ttft99), (itl50, itl99)) in stats.items():
            extra = ""
            if name != "grpc":
                d_ttft = (ttft50 - stats["grpc"][0][0]) * 1e3
                d_itl = (itl50 - stats["grpc"][1][0]) * 1e3
                extra = f" {d_ttft:+.2f} ms | {d_itl:+.2f} ms |"
            else:
                extra = " | |"
            lines.append(
                f"| {n} | {name} | {ttft50 * 1e3:.2f} ms | {ttft99 * 1e3:.2f} ms | "
                f"{itl50 * 1e3:.2f} ms | {itl99 * 1e3:.2f} ms |{extra}"
            )
    lines.append(f"\nload average (1 min) at start and end: {load[0]:.2f}, {load[1]:.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,16", help="comma-separated N (default 1,16)")
    parser.add_argument("--repeats", type=int, default=30, help="waves of N requests per API")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    parser.add_argument("--json", type=Path, help="also write the samples' quantiles as JSON")
    args = parser.parse_args()
    args.concurrency = [int(n) for n in args.concurrency.split(",")]

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build_tiny_tokenizer(root / "tokenizer")
        model = build_tiny_model_dir(root / "target", root / "tokenizer", seed=0)
        draft = build_tiny_model_dir(root / "draft", root / "tokenizer", seed=0)
        workers = ["--threads", "1", "--dtype", "float32", "--log-level", "warning"]
        with start_stack(
            target_args=[*workers, "--model", str(model)],
            draft_args=[*workers, "--drafter", "model", "--model", str(draft)],
            coordinator_args=["--tokenizer", str(model), "--log-level", "warning"],
            http_port=0,
        ) as stack:
            coordinator = stack.coordinator
            start_load = os.getloadavg()[0]
            results = uvloop.run(
                measure(args, coordinator.address, f"http://127.0.0.1:{coordinator.http_port}")
            )
            load = (start_load, os.getloadavg()[0])
    print(report(results, load))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    str(n): {
                        name: {
                            "ttft_s_p50_p99": quantiles(s.ttft_s),
                            "itl_s_p50_p99": quantiles(s.itl_s),
                            "chunks": len(s.itl_s) + len(s.ttft_s),
                        }
                        for name, s in by_api.items()
                    }
                    for n, by_api in results.items()
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
