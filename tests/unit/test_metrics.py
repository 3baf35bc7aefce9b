"""The metrics endpoint: --metrics-port and OUTRIDER_METRICS_PORT on every
service, its validation, and the HTTP endpoint itself (port 0, the port file
next to the ready file, the process collectors, stopping), and the
coordinator's pipelining counters fed from a request's stats."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from prometheus_client import Counter
from prometheus_client.parser import text_string_to_metric_families

from outrider.cli import build_parser
from outrider.config import ServiceConfig
from outrider.metrics import metrics_port_file, serving_metrics, start_metrics_endpoint

ROLE_ARGS = {"coordinator": ["--target", "127.0.0.1:1"], "draft": [], "target": []}


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
    }


@pytest.mark.parametrize("role", ["coordinator", "draft", "target"])
def test_metrics_port_flag_and_environment_variable(monkeypatch, role):
    parse = build_parser().parse_args
    assert parse(["serve", role, *ROLE_ARGS[role]]).metrics_port is None  # unset: no metrics
    assert parse(["serve", role, *ROLE_ARGS[role], "--metrics-port", "9100"]).metrics_port == 9100
    monkeypatch.setenv("OUTRIDER_METRICS_PORT", "9200")
    assert build_parser().parse_args(["serve", role, *ROLE_ARGS[role]]).metrics_port == 9200
    # A flag on the command line wins over the variable.
    assert (
        build_parser()
        .parse_args(["serve", role, *ROLE_ARGS[role], "--metrics-port", "0"])
        .metrics_port
        == 0
    )


def test_metrics_port_help_names_its_environment_variable(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "target", "--help"])
    assert "OUTRIDER_METRICS_PORT" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [-1, 65536])
def test_metrics_port_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="not a port number"):
        ServiceConfig(port=50051, metrics_port=bad)


def test_metrics_port_equal_to_grpc_port_is_refused():
    with pytest.raises(ValueError, match="must differ from the gRPC port"):
        ServiceConfig(port=50051, metrics_port=50051)


def test_serve_reports_a_bad_metrics_port(capsys):
    from outrider.cli import main

    assert main(["serve", "target", "--port", "7000", "--metrics-port", "7000"]) == 2
    assert "metrics port" in capsys.readouterr().err


def test_endpoint_serves_its_own_registry_on_a_free_port():
    first, second = start_metrics_endpoint("127.0.0.1", 0), start_metrics_endpoint("127.0.0.1", 0)
    try:
        # Separate registries: the same name registers in both without a clash.
        for endpoint, n in ((first, 2), (second, 3)):
            Counter("outrider_test_events", "events", registry=endpoint.registry).inc(n)
        assert first.port != second.port
        assert scrape(first.port)["outrider_test_events_total"] == 2
        samples = scrape(second.port)
        assert samples["outrider_test_events_total"] == 3
        assert "process_resident_memory_bytes" in samples and "python_info" in samples
    finally:
        first.stop()
        second.stop()
    with pytest.raises(urllib.error.URLError):
        scrape(first.port)


def test_serving_metrics_writes_the_bound_port_next_to_the_ready_file(tmp_path):
    ready_file = tmp_path / "target.port"
    with serving_metrics(ServiceConfig(ready_file=ready_file, metrics_port=0)) as endpoint:
        assert int(metrics_port_file(ready_file).read_text()) == endpoint.port
        assert "process_cpu_seconds_total" in scrape(endpoint.port)
    with serving_metrics(ServiceConfig(ready_file=ready_file)) as endpoint:
        assert endpoint is None


async def test_a_finished_request_adds_its_speculation_hits_and_misses():
    import time

    from prometheus_client import CollectorRegistry

    from outrider.coordinator.metrics import CoordinatorMetrics
    from outrider.coordinator.request_stats import Stats
    from outrider.coordinator.round_loop import Delta

    registry = CollectorRegistry()
    metrics = CoordinatorMetrics(registry, model_name="m", max_num_speculative_tokens=4)

    async def deltas(stats: Stats):
        yield Delta("a", [1])
        yield Delta("b", [2], finish_reason="length", stats=stats)

    for hits, misses in [(5, 2), (3, 0)]:
        stats = Stats(
            rounds=hits + misses + 1,
            pipeline=True,
            speculation_hits=hits,
            speculation_misses=misses,
        )
        async for _ in metrics.track(deltas(stats), received=time.perf_counter()):
            pass
    value = registry.get_sample_value
    assert value("outrider_spec_decode_num_speculation_hits_total", {"model_name": "m"}) == 8
    assert value("outrider_spec_decode_num_speculation_misses_total", {"model_name": "m"}) == 2
