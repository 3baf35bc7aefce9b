"""Start-up mistakes through the real command line: every one ends as
argparse ends a usage error — exit status 2 and one line on stderr that
names the flag, says what is wrong and what to do — with no traceback, for
each service and for ``outrider up`` (which says which service did not start,
and why). A mistake found once the service is at work (no worker answers, a
draft of another vocabulary) follows the structured log lines it wrote
until then."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.integration.harness import running_stack
from tests.integration.test_security import make_ca, make_cert
from tests.tiny import build_tiny_model_dir, build_tiny_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]


def outrider(*args: str) -> tuple[int, list[str]]:
    """Runs ``outrider ARGS``; its exit status and the lines it wrote to
    stderr that are not structured log lines (JSON objects)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "outrider", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO_ROOT,
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert not any(_is_log(line) for line in lines[-1:]), lines  # the error comes last
    return done.returncode, [line for line in lines if not _is_log(line)]


def _is_log(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_target_dir) -> dict[str, Path]:
    """Files that are not what their flag needs."""
    root = tmp_path_factory.mktemp("mistakes")
    garbage = root / "garbage.pem"
    garbage.write_text("not a certificate\n")
    make_ca(root, "ca")
    make_cert(root, "server", "ca")
    make_cert(root, "other", "ca")
    corrupt = root / "corrupt-model"
    shutil.copytree(tiny_target_dir, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"not safetensors")
    not_gguf = root / "broken.gguf"  # the suffix of a GGUF, not its contents
    not_gguf.write_bytes(b"GGUF" + bytes(64))
    other_vocab = root / "other-vocab"
    build_tiny_tokenizer(root / "other-tokenizer", vocab_size=300)
    build_tiny_model_dir(other_vocab, root / "other-tokenizer", seed=0)
    return {
        "garbage": garbage,
        "cert": root / "server.pem",
        "other_key": root / "other.key",
        "corrupt": corrupt,
        "other_vocab": other_vocab,
        "not_gguf": not_gguf,
        "missing": root / "missing",
    }


@pytest.fixture(scope="module")
def taken_port() -> Iterator[int]:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


NO_CUDA = not torch.cuda.is_available()
NO_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is None
MISTAKES = [
    # (command, the line it must print, from its start)
    (["serve", "target", "--device", "cuda"], "outrider serve target: --device cuda: this machine"),
    (
        ["serve", "target", "--model", "/nonexistent"],
        "outrider serve target: --model /nonexistent:",
    ),
    (
        ["serve", "target", "--model", "some-name"],
        "outrider serve target: --model some-name: no such",
    ),
    (
        ["serve", "draft", "--model", "/nonexistent"],
        "outrider serve draft: --model /nonexistent: no",
    ),
    (
        ["serve", "target", "--port", "{taken_port}"],
        "outrider serve target: --port {taken_port}: al",
    ),
    (
        ["serve", "target", "--metrics-port", "{taken_port}"],
        "outrider serve target: --metrics-port {taken_port}: already in use",
    ),
    (
        ["serve", "target", "--tls-cert", "{garbage}", "--tls-key", "{garbage}"],
        "outrider serve target: --tls-cert {garbage}: not a PEM certificate",
    ),
    (
        ["serve", "target", "--tls-cert", "{cert}", "--tls-key", "{other_key}"],
        "outrider serve target: --tls-key {other_key}: not a PEM private key, or not the key of",
    ),
    (
        ["serve", "target", "--tls-cert", "{missing}", "--tls-key", "{other_key}"],
        "outrider serve target: --tls-cert {missing}: no such file",
    ),
    (
        ["serve", "coordinator", "--target", "127.0.0.1:1", "--auth-tokens-file", "{missing}"],
        "outrider serve coordinator: --auth-tokens-file {missing}: cannot read it",
    ),
    (
        ["serve", "coordinator", "--target", "127.0.0.1:1", "--worker-tls-ca", "{garbage}"],
        "outrider serve coordinator: --worker-tls-ca {garbage}: not a PEM certificate",
    ),
    (
        ["serve", "coordinator", "--target", "127.0.0.1:1", "--worker-wait-s", "0.5"],
        "outrider serve coordinator: --target 127.0.0.1:1: no target worker answered",
    ),
    (["up", "--device", "cuda"], "outrider up: --device cuda: this machine has no CUDA device"),
    (["up", "--target-model", "/nonexistent"], "outrider up: --target-model /nonexistent: no"),
    (["up", "--port", "{taken_port}"], "outrider up: --port {taken_port}: already in use"),
    (
        ["up", "--target-model", "{tiny_target}", "--draft-model", "{other_vocab}"],
        "outrider up: --draft-model {other_vocab}: its vocabulary differs from the target's",
    ),
    (
        ["serve", "draft", "--drafter", "gguf", "--model", "{garbage}"],
        "outrider serve draft: --model {garbage}: not a GGUF file",
    ),
    (
        ["serve", "draft", "--drafter", "gguf", "--model", "{missing}"],
        "outrider serve draft: --model {missing}: no such file",
    ),
    (
        ["serve", "draft", "--drafter", "gguf", "--model", "{not_gguf}"],
        "outrider serve draft: --model {not_gguf}: llama.cpp does not load it",
    ),
    (
        ["serve", "draft", "--drafter", "gguf", "--model", "{gguf}", "--max-sessions", "300"],
        "outrider serve draft: --max-sessions 300: llama.cpp runs at most 256 sequences",
    ),
    (
        ["up", "--target-model", "{tiny_target}", "--draft-model", "{other_vocab_gguf}"],
        "outrider up: --draft-model {other_vocab_gguf}: its vocabulary differs from the target's",
    ),
    (
        ["up", "--port", "0", "--target-model", "{corrupt}", "--threads", "1"],
        "outrider up: --target-model {corrupt}: model.safetensors is not a safetensors file",
    ),
]


def test_each_start_up_mistake_ends_with_status_2_and_one_line_naming_its_flag(
    files, taken_port, tiny_target_dir, tiny_gguf_other_vocab
):
    values = {
        **{name: str(path) for name, path in files.items()},
        "taken_port": str(taken_port),
        "tiny_target": str(tiny_target_dir),
        "other_vocab_gguf": str(tiny_gguf_other_vocab),
        "gguf": str(tiny_gguf_other_vocab),
    }
    cases = [
        ([arg.format(**values) for arg in command], line.format(**values))
        for command, line in MISTAKES
        if not (NO_CUDA is False and "cuda" in command)
        and not (NO_LLAMA_CPP and any("gguf" in arg for arg in command))
    ]
    # Ports 0 by default, so that no case trips on another's port.
    runs = [
        command if "--port" in command or command[0] == "up" else [*command, "--port", "0"]
        for command, _ in cases
    ]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda command: outrider(*command), runs))
    for (command, line), (status, stderr) in zip(cases, results, strict=True):
        assert (status, len(stderr)) == (2, 1), (command, status, stderr)
        assert stderr[0].startswith(line), (command, stderr[0])
        assert "Traceback" not in stderr[0]


async def test_a_coordinator_whose_draft_serves_another_vocabulary_does_not_start(
    files, tiny_target_dir
):
    async with running_stack(tiny_target_dir, draft_dir=files["other_vocab"]) as stack:
        draft = stack.draft_server.address
        status, stderr = await asyncio.to_thread(
            outrider,
            "serve",
            "coordinator",
            "--port",
            "0",
            "--target",
            stack.target_servers[0].address,
            "--draft",
            draft,
            "--tokenizer",
            str(tiny_target_dir),
        )
    assert (status, len(stderr)) == (2, 1), stderr
    assert stderr[0].startswith(f"outrider serve coordinator: --draft {draft}: the draft worker")
    assert "vocabulary" in stderr[0]
