"""`python -m outrider.probe`, the exec probe the Helm chart uses when a
service serves TLS: exit 0 only for a SERVING service whose certificate checks
out, 1 with a reason otherwise."""

import asyncio

import pytest

from outrider import probe
from outrider.rpc import start_server
from outrider.security import ServerTls
from tests.integration.test_security import make_ca, make_cert


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    directory = tmp_path_factory.mktemp("probe-pki")
    make_ca(directory, "ca")
    make_ca(directory, "rogue-ca")
    make_cert(directory, "server", "ca")  # SANs: IP 127.0.0.1, DNS localhost
    make_cert(directory, "intruder", "rogue-ca")
    return directory


def probe_args(pki, port: int, *extra: str) -> list[str]:
    return ["--port", str(port), "--tls-ca", str(pki / "ca.pem"), "--timeout", "5", *extra]


async def run_probe(args: list[str]) -> int:
    return await asyncio.to_thread(probe.main, args)


async def test_a_serving_mutual_tls_service_passes_only_with_a_client_certificate(pki, capsys):
    tls = ServerTls(pki / "server.pem", pki / "server.key", client_ca_file=pki / "ca.pem")
    running = await start_server(lambda server: None, [], credentials=tls.credentials())
    try:
        client_cert = ["--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key")]
        assert await run_probe(probe_args(pki, running.port, *client_cert)) == 1  # still warming up
        assert "NOT_SERVING" in capsys.readouterr().err
        await running.set_serving(True)
        assert await run_probe(probe_args(pki, running.port, *client_cert)) == 0
        assert await run_probe(probe_args(pki, running.port)) == 1  # no client certificate
        assert "UNAVAILABLE" in capsys.readouterr().err
        rogue = ["--tls-cert", str(pki / "intruder.pem"), "--tls-key", str(pki / "intruder.key")]
        assert await run_probe(probe_args(pki, running.port, *rogue)) == 1
    finally:
        await running.stop(0)


async def test_the_certificate_is_verified_against_the_server_name(pki, capsys):
    tls = ServerTls(pki / "server.pem", pki / "server.key")
    running = await start_server(lambda server: None, [], credentials=tls.credentials())
    try:
        await running.set_serving(True)
        assert await run_probe(probe_args(pki, running.port, "--server-name", "localhost")) == 0
        assert await run_probe(probe_args(pki, running.port, "--server-name", "other.example")) == 1
        assert "UNAVAILABLE" in capsys.readouterr().err
    finally:
        await running.stop(0)


async def test_a_missing_service_or_file_fails_with_a_reason(pki, tmp_path, capsys):
    assert await run_probe(probe_args(pki, 1)) == 1
    assert "probe 127.0.0.1:1: UNAVAILABLE" in capsys.readouterr().err
    assert await run_probe(["--port", "1", "--tls-ca", str(tmp_path / "missing.pem")]) == 1
    assert "missing.pem" in capsys.readouterr().err
