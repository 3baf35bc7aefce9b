"""TLS on every hop, mutual TLS to the workers, and bearer tokens at the
coordinator: the right credentials work; a missing or wrong certificate or
token is refused with the right status."""

import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from outrider.client import AsyncClient
from outrider.coordinator.workers.replicas import Replicas
from outrider.rpc import start_server
from outrider.security import ClientTls, ServerTls, load_tokens
from outrider.v1 import worker_pb2_grpc
from tests.integration.harness import running_stack

TOKEN = "s3cret-token"


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(directory: Path, name: str) -> None:
    openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "1", "-subj", f"/CN={name}",
        cwd=directory,
    )  # fmt: skip


def make_cert(directory: Path, name: str, ca: str, san: str = "IP:127.0.0.1,DNS:localhost") -> None:
    openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=directory,
    )  # fmt: skip
    (directory / f"{name}.ext").write_text(f"subjectAltName={san}\n")
    openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
        "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext",
        cwd=directory,
    )  # fmt: skip


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("pki")
    make_ca(directory, "ca")
    make_ca(directory, "rogue-ca")
    for name in ("server", "coordinator"):
        make_cert(directory, name, "ca")
    make_cert(directory, "intruder", "rogue-ca")
    make_cert(directory, "pod", "ca", san="DNS:target.llm.svc")  # what a pool's certificate names
    (directory / "tokens").write_text(f"# clients\n{TOKEN}\nanother-token\n")
    return directory


@pytest.fixture
def secure_stack(tiny_target_dir, pki):
    server = ServerTls(pki / "server.pem", pki / "server.key")
    mutual = ServerTls(pki / "server.pem", pki / "server.key", client_ca_file=pki / "ca.pem")
    coordinator_side = ClientTls(pki / "ca.pem", pki / "coordinator.pem", pki / "coordinator.key")
    return running_stack(
        tiny_target_dir,
        drafter="prompt-lookup",
        worker_tls=(mutual, coordinator_side),
        coordinator_tls=server,
        tokens=load_tokens(pki / "tokens"),
    )


def tls(pki: Path, *, cert: str | None = None, ca: str = "ca") -> grpc.ChannelCredentials:
    return ClientTls(
        pki / f"{ca}.pem",
        pki / f"{cert}.pem" if cert else None,
        pki / f"{cert}.key" if cert else None,
    ).credentials()


async def test_the_right_certificate_and_token_work_end_to_end_over_mutual_tls(secure_stack, pki):
    async with secure_stack as stack:
        async with AsyncClient(
            stack.address, credentials=tls(pki), token=TOKEN, timeout=30
        ) as client:
            result = await client.generate(prompt="hello there", max_new_tokens=5, ignore_eos=True)
    assert len(result.token_ids) == 5


@pytest.mark.parametrize("token", [None, "wrong-token", ""])
async def test_a_missing_or_wrong_token_is_unauthenticated(secure_stack, pki, token):
    async with secure_stack as stack:
        async with AsyncClient(
            stack.address, credentials=tls(pki), token=token, timeout=30
        ) as client:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.generate(prompt="hello", max_new_tokens=2)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "bearer token" in info.value.details()


async def test_health_stays_open_without_a_token(secure_stack, pki):
    async with secure_stack as stack:
        async with grpc.aio.secure_channel(stack.address, tls(pki)) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_a_client_that_does_not_trust_the_server_cannot_connect(secure_stack, pki):
    async with secure_stack as stack:
        async with AsyncClient(
            stack.address, credentials=tls(pki, ca="rogue-ca"), token=TOKEN, timeout=5
        ) as client:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.generate(prompt="hello", max_new_tokens=2)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("cert", [None, "intruder"])
async def test_workers_refuse_a_client_without_the_right_certificate(secure_stack, pki, cert):
    async with secure_stack as stack:
        worker = stack.target_servers[0].address
        async with grpc.aio.secure_channel(worker, tls(pki, cert=cert)) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_workers_accept_the_coordinator_certificate(secure_stack, pki):
    async with secure_stack as stack:
        worker = stack.target_servers[0].address
        async with grpc.aio.secure_channel(worker, tls(pki, cert="coordinator")) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_discovered_workers_are_checked_against_their_service_name(pki):
    # A discovered pod is dialled by IP; its certificate names the Service.
    running = await start_server(
        lambda server: None,
        [],
        credentials=ServerTls(pki / "pod.pem", pki / "pod.key").credentials(),
    )
    await running.set_serving(True)
    pod = f"127.0.0.1:{running.port}"
    discovered = Replicas(
        "target",
        ["k8s://target.llm:grpc"],
        worker_pb2_grpc.TargetWorkerStub,
        credentials=tls(pki),
        kube_api=object(),
    )
    static = Replicas("target", [pod], worker_pb2_grpc.TargetWorkerStub, credentials=tls(pki))
    try:
        discovered.update("k8s://target.llm:grpc", {pod: True})
        health = health_pb2_grpc.HealthStub(discovered.members[pod].channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        # Listed by address, the same pod is checked against 127.0.0.1, which
        # its certificate does not name.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await health_pb2_grpc.HealthStub(static.members[pod].channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await discovered.close()
        await static.close()
        await running.server.stop(None)
