"""The container image, built (scripts/build_image.py, as `make image` does)
and run as the Helm chart runs it: the target worker, the draft worker (the
default drafter, gguf: llama.cpp as the image built it) and the coordinator
as three containers on the host's
network, bound to 127.0.0.1, as UID 10001 on a read-only root filesystem.
The host's `outrider generate` and the OpenAI client get from them the
greedy tokens `outrider up` gives on the host; SIGTERM (`podman stop`) drains
a stream in flight and each service exits 0; `outrider up` runs in one
container too. The default model is the host's own fetch, its directory
mounted read-only at /models as the chart's models volume is: the image
tested is the one `make image` builds, and the host and the containers read
the same files; weights the image may not read are named as such. Skipped
without podman or a docker daemon."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path

import pytest

from outrider import model_specs
from tests.e2e.containers import Container, find_engine, free_port
from tests.e2e.stack import outrider_up
from tests.e2e.test_real_model import PROMPTS, outrider_generate

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]  # the first build takes minutes

ROOT = Path(__file__).resolve().parents[2]
MODEL = "/models/smollm2-135m-instruct"
MAX_NEW_TOKENS = 32
KS = (0, 4)
"""Target-only decoding, and four draft tokens a round from the default drafter."""


@pytest.fixture(scope="module")
def engine() -> str:
    return find_engine()


@pytest.fixture(scope="module")
def image(engine) -> str:
    build = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "build_image.py"), "--engine", engine],
        capture_output=True, text=True, timeout=2400, check=False,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    return f"localhost/outrider:{version}"


@pytest.fixture(scope="module")
def models_volume() -> Path:
    """The host's own models directory, as `outrider models fetch` wrote
    it, mounted read-only as it is: UID 10001 reads it because the fetch
    gave its files the usual modes."""
    if not model_specs.is_fetched(model_specs.DEFAULT_MODEL):
        pytest.skip("the default model is not fetched: run `outrider models fetch`")
    return model_specs.model_path(model_specs.DEFAULT_MODEL).parent


def answers(address: str, api_url: str) -> dict:
    """What a stack answers: `outrider generate --json` for each prompt at
    each K, and the OpenAI client's chat completion of the first prompt."""
    from openai import OpenAI

    result: dict = {}
    for index, prompt in enumerate(PROMPTS[:2]):
        for k in KS:
            args = ("--chat", "--k", str(k), "--max-new-tokens", str(MAX_NEW_TOKENS))
            result[index, k] = outrider_generate(address, prompt, *args)
    with OpenAI(base_url=api_url, api_key="unused") as client:
        (model,) = client.models.list().data
        completion = client.chat.completions.create(
            model=model.id,
            messages=[{"role": "user", "content": PROMPTS[0]}],
            max_tokens=MAX_NEW_TOKENS,
            temperature=0,
        )
    result["openai"] = completion.choices[0].message.content
    return result


@pytest.fixture(scope="module")
def host_answers(models_volume, image) -> dict:
    """`outrider up` on the host, its defaults (stopped before the containers start)."""
    with outrider_up() as (address, api_url):
        return answers(address, api_url)


@pytest.fixture(scope="module")
def stack(engine, image, models_volume, host_answers, tmp_path_factory):
    """Target, draft and coordinator containers: ``{name: (container, port)}``
    and the coordinator's OpenAI API port."""
    logs = tmp_path_factory.mktemp("logs")
    names = ("target", "draft", "coordinator")
    ports = {name: free_port() for name in names}
    http_port = free_port()
    containers = {
        name: Container(engine, image, f"outrider-test-{name}-{ports[name]}", models_volume,
                        logs / f"{name}.log")
        for name in names
    }  # fmt: skip
    common = ["--host", "127.0.0.1", "--log-level", "info"]
    try:
        for name, role_args in (
            ("target", ["--model", MODEL]),
            ("draft", ["--model", MODEL, "--drafter", "gguf"]),
        ):
            containers[name].start("serve", name, *common, "--port", str(ports[name]), *role_args)
        for name in ("target", "draft"):
            containers[name].wait_serving(ports[name])
        containers["coordinator"].start(
            "serve", "coordinator", *common, "--port", str(ports["coordinator"]),
            "--http-port", str(http_port), "--tokenizer", MODEL,
            "--target", f"127.0.0.1:{ports['target']}", "--draft", f"127.0.0.1:{ports['draft']}",
        )  # fmt: skip
        containers["coordinator"].wait_serving(ports["coordinator"])
        yield {name: (containers[name], ports[name]) for name in names}, http_port
    finally:
        for container in containers.values():
            container.remove()


@pytest.fixture(scope="module")
def container_answers(stack) -> dict:
    services, http_port = stack
    return answers(f"127.0.0.1:{services['coordinator'][1]}", f"http://127.0.0.1:{http_port}/v1")


def test_each_container_runs_as_uid_10001_on_a_read_only_root(stack, engine):
    services, _ = stack
    for container, _ in services.values():
        assert container.exec("id", "-u").stdout.strip() == "10001"
        written = container.exec("touch", "/outrider-was-here")
        assert written.returncode != 0 and "Read-only file system" in written.stderr
        assert container.exec("touch", "/var/cache/outrider/ok").returncode == 0
        inspect = subprocess.run(
            [engine, "inspect", "--format", "{{.HostConfig.ReadonlyRootfs}}", container.name],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        assert inspect.stdout.strip() == "true"


@pytest.mark.parametrize("index", [0, 1])
@pytest.mark.parametrize("k", KS)
def test_the_containers_give_the_greedy_tokens_of_outrider_up_on_the_host(
    host_answers, container_answers, index, k
):
    expected, got = host_answers[index, k], container_answers[index, k]
    assert got["token_ids"] == expected["token_ids"]
    assert got["text"] == expected["text"]
    assert got["stats"]["num_speculative_tokens"] == k
    if k:  # the gguf draft worker drafted, and the target accepted most of it
        assert got["stats"]["draft_tokens"] > 0
        assert got["stats"]["accepted_tokens"] >= got["stats"]["draft_tokens"] // 2


def test_the_openai_client_gets_the_host_answer_from_the_coordinator_container(
    host_answers, container_answers
):
    assert container_answers["openai"] == host_answers["openai"]
    assert container_answers["openai"]


def test_sigterm_drains_a_stream_in_flight_and_each_service_exits_0(stack, container_answers):
    """`podman stop` of all three while a stream is in flight (a rollout, or
    `helm uninstall`): the stream completes, each service exits 0, not 137."""
    from outrider.client import Client

    services, _ = stack
    exits: dict[str, int] = {}

    def stop(name: str) -> None:
        exits[name] = services[name][0].stop()

    max_new = 96
    ids: list[int] = []
    finish = None
    address = f"127.0.0.1:{services['coordinator'][1]}"
    with Client(address, timeout=120) as client:
        stream = client.stream(
            messages=[{"role": "user", "content": PROMPTS[2]}],
            max_new_tokens=max_new, ignore_eos=True, num_speculative_tokens=4,
        )  # fmt: skip
        stoppers = [threading.Thread(target=stop, args=(name,)) for name in services]
        for chunk in stream:
            if not ids:
                for stopper in stoppers:
                    stopper.start()
            ids.extend(chunk.token_ids)
            finish = chunk.finish_reason or finish
    for stopper in stoppers:
        stopper.join(timeout=120)
    assert len(ids) == max_new and finish == "length"
    assert exits == dict.fromkeys(services, 0), {
        name: services[name][0].tail(5) for name in services
    }


def test_outrider_up_runs_in_a_container_and_stops_on_sigterm(
    engine, image, models_volume, tmp_path
):
    port = free_port()
    container = Container(engine, image, f"outrider-test-up-{port}", models_volume,
                          tmp_path / "up.log")  # fmt: skip
    try:
        container.start("up", "--port", str(port), "--target-model", MODEL)
        container.wait_serving(port)
        assert container.exec("id", "-u").stdout.strip() == "10001"
        assert container.stop() == 0, container.tail()
    finally:
        container.remove()


def test_a_service_stopped_while_it_starts_exits_at_once(engine, image, models_volume, tmp_path):
    """As a container's PID 1 a process has no default action for SIGTERM:
    without a handler of its own, a service that is still starting (loading
    its model, waiting for its workers) would sit out the stop timeout and be
    killed (137). A coordinator whose target is not there yet waits for it."""
    port = free_port()
    container = Container(engine, image, f"outrider-test-starting-{port}", models_volume,
                          tmp_path / "coordinator.log")  # fmt: skip
    try:
        container.start(
            "serve", "coordinator", "--host", "127.0.0.1", "--port", str(port),
            "--target", f"127.0.0.1:{free_port()}", "--tokenizer", MODEL,
            "--worker-wait-s", "300", "--log-level", "info",
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while "worker joined" not in container.log.read_text(errors="replace"):
            assert container.process and container.process.poll() is None, container.tail()
            assert time.monotonic() < deadline, container.tail()
            time.sleep(0.5)
        started = time.monotonic()
        assert container.stop(timeout_s=60) == 128 + signal.SIGTERM, container.tail()
        assert time.monotonic() - started < 30
    finally:
        container.remove()


def test_weights_the_image_may_not_read_are_named_as_such(engine, image, tmp_path):
    """A model whose weights only their owner may read (a copy made 0600):
    the worker exits 2 with one line naming the file and the permission."""
    volume = tmp_path / "models"
    shutil.copytree(model_specs.model_path(model_specs.DEFAULT_MODEL), volume / Path(MODEL).name)
    weights = volume / Path(MODEL).name / "model.safetensors"
    weights.chmod(0o600)
    port = free_port()
    container = Container(engine, image, f"outrider-test-unreadable-{port}", volume,
                          tmp_path / "target.log")  # fmt: skip
    try:
        container.start("serve", "target", "--host", "127.0.0.1", "--port", str(port),
                        "--model", MODEL)  # fmt: skip
        assert container.process is not None
        assert container.process.wait(timeout=120) == 2, container.tail()
    finally:
        container.remove()
    assert (
        f"outrider serve target: --model {MODEL}: permission denied: this process (uid 10001) "
        f"may not read model.safetensors; make the model readable (chmod -R a+rX {MODEL})"
    ) in container.log.read_text(), container.tail()
