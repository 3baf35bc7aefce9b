"""`outrider bench http`: its clients, waves and table, on hand-made streams
(the run itself starts three services: run it by hand)."""

from __future__ import annotations

import asyncio
import json

import pytest

from outrider.bench.http_overhead import RawHttp, Samples, Streamed, report, summary, waves
from outrider.cli import build_parser


class Bar:
    def __init__(self) -> None:
        self.updates, self.lines = 0, []

    def update(self) -> None:
        self.updates += 1

    def write(self, line: str) -> None:
        self.lines.append(line)


def test_http_flags_keep_the_script_s_defaults():
    args = build_parser().parse_args(["bench", "http"])
    assert (args.concurrency, args.repeats, args.max_tokens, args.model) == ((1, 16), 30, 64, None)
    assert build_parser().parse_args(["bench", "http", "--concurrency", "16,4"]).concurrency == (
        4, 16
    )  # fmt: skip


async def test_waves_rotate_the_apis_and_check_every_stream_against_the_first():
    order: list[str] = []

    def run(name: str, text: str = "ab"):
        async def one() -> Streamed:
            order.append(name)
            return Streamed(text, [1.0, 1.5, 2.5], sent=0.5)

        return one

    bar = Bar()
    samples = await waves({"grpc": run("grpc"), "http": run("http")}, 2, 2, bar)
    assert order == ["grpc", "grpc", "http", "http", "http", "http", "grpc", "grpc"]
    assert samples["grpc"].ttft_s == [0.5] * 4 and samples["http"].itl_s == [0.5, 1.0] * 4
    assert bar.updates == 4 and bar.lines == ["N=2: 2 x 2 requests per API, 3 chunks each"]
    with pytest.raises(RuntimeError, match="http streamed other chunks than the first request"):
        await waves({"grpc": run("grpc"), "http": run("http", "ax")}, 1, 1, Bar())


def test_the_table_gives_each_http_client_against_grpc_at_p50():
    results = {
        4: {
            "grpc": Samples(ttft_s=[0.010, 0.020, 0.030], itl_s=[0.001, 0.003]),
            "http-raw": Samples(ttft_s=[0.011, 0.021, 0.031], itl_s=[0.002, 0.004]),
        }
    }
    lines = report(results, (1.0, 2.5)).splitlines()
    assert lines[2] == "| 4 | grpc | 20.00 ms | 29.80 ms | 2.00 ms | 2.98 ms | | |"
    assert lines[3] == (
        "| 4 | http-raw | 21.00 ms | 30.80 ms | 3.00 ms | 3.98 ms | +1.00 ms | +1.00 ms |"
    )
    assert lines[-1] == "load average (1 min) at start and end: 1.00, 2.50"
    assert summary(results)["4"]["grpc"]["chunks"] == 5


async def test_the_raw_client_reads_a_chunked_event_stream_on_a_kept_connection():
    connections: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        while line := await reader.readline():  # one request after the other
            length = 0
            while line != b"\r\n":
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
                line = await reader.readline()
            body = json.loads(await reader.readexactly(length))
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            for event in (b'data: {"choices": [{"text": "%d"}]}\n\n' % body["max_tokens"],
                          b"data: [DONE]\n\n"):  # fmt: skip
                writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            writer.write(b"0\r\n\r\n")
            await writer.drain()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    client = RawHttp(server.sockets[0].getsockname()[1])
    first, second = [await client.stream("m", tokens) for tokens in (7, 9)]
    assert (first.text, second.text, len(first.chunk_times)) == ("7", "9", 1)
    assert first.chunk_times[0] >= first.sent and len(connections) == 1
    server.close()
