"""Start-up checks: each configuration mistake is one StartupError that
names the flag, its value, what is wrong and what to do."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch

from outrider import startup
from outrider.coordinator.main import check_pairing
from outrider.coordinator.workers.protocol import WorkerInfo
from outrider.startup import StartupError


def test_a_cuda_device_on_a_machine_without_one_names_the_flag_and_the_way_out():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(StartupError) as error:
        startup.check_device("cuda")
    assert str(error.value).startswith("--device cuda: this machine has no CUDA device")
    assert str(error.value).endswith("use --device cpu")


def test_a_port_in_use_is_named_and_a_host_of_another_machine_too():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(StartupError, match=rf"^--port {port}: already in use: "):
            startup.check_port("--port", "127.0.0.1", port)
        with pytest.raises(StartupError, match=rf"^--metrics-port {port}: already in use: "):
            startup.check_port("--metrics-port", "127.0.0.1", port)
    startup.check_port("--port", "127.0.0.1", 0)
    with pytest.raises(StartupError, match=r"^--host 192\.0\.2\.1: cannot listen there: "):
        startup.check_port("--port", "192.0.2.1", 0)  # TEST-NET-1: no machine's address


@pytest.fixture
def offline_hub(monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.mark.parametrize(
    "spec, problem",
    [
        ("/nonexistent", "no such directory (nor an embedded model: outrider models list)"),
        ("./models/x", "no such directory (nor an embedded model: outrider models list)"),
        ("a b", "no such directory, nor an embedded model (outrider models list), nor a model id"),
        (
            "some-name",
            "no such directory, nor an embedded model (outrider models list), and the model hub "
            "cannot be reached",
        ),
    ],
)
def test_a_model_that_is_nowhere_says_where_it_was_looked_for(offline_hub, spec, problem):
    with pytest.raises(StartupError) as error:
        startup.check_model("--model", spec)
    assert str(error.value).startswith(f"--model {spec}: {problem}")


def test_a_directory_or_file_that_holds_no_checkpoint_is_not_a_model(tmp_path, tiny_target_dir):
    with pytest.raises(StartupError, match="not a model directory: it holds no config.json"):
        startup.check_model("--model", str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(StartupError, match="not a directory"):
        startup.check_model("--model", str(tmp_path / "weights.bin"))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(StartupError, match="its config does not load: Unrecognized model"):
        startup.check_model("--model", str(tmp_path))
    shutil.copy(tiny_target_dir / "config.json", tmp_path)
    with pytest.raises(StartupError, match="it holds no .safetensors weights"):
        startup.check_model("--model", str(tmp_path))
    startup.check_model("--model", str(tiny_target_dir))
    startup.check_model("--tokenizer", str(tmp_path), checkpoint=False)


def test_an_embedded_model_not_yet_fetched_says_how_to_fetch_it(tmp_path, monkeypatch):
    monkeypatch.setenv("OUTRIDER_CACHE_DIR", str(tmp_path))
    with pytest.raises(StartupError) as error:
        startup.check_model("--target-model", None)
    assert str(error.value).startswith("--target-model smollm2-135m-instruct: embedded model")
    assert "run `outrider models fetch`" in str(error.value)


def test_tls_files_that_are_not_pem_or_not_there_are_named(tmp_path):
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(StartupError, match=r"^--tls-cert .*garbage.pem: not a PEM certificate$"):
        startup.check_server_tls(garbage, garbage, None)
    with pytest.raises(StartupError, match=r"^--tls-client-ca .*garbage.pem: not a PEM"):
        startup.check_server_tls(None, None, garbage)
    with pytest.raises(StartupError, match=r"^--worker-tls-ca .*: cannot read it: "):
        startup.check_client_tls(tmp_path / "missing.pem", None, None)


def test_a_tokens_file_that_cannot_be_read_or_holds_no_token_is_named(tmp_path):
    with pytest.raises(StartupError, match=r"^--auth-tokens-file .*missing: cannot read it: "):
        startup.auth_tokens(tmp_path / "missing")
    empty = tmp_path / "tokens"
    empty.write_text("# no token yet\n\n")
    with pytest.raises(StartupError, match=r"^--auth-tokens-file .*tokens: it holds no token"):
        startup.auth_tokens(empty)
    empty.write_text("s3cret\n")
    assert startup.auth_tokens(empty) == frozenset({"s3cret"})


def worker(model: str, vocab_size: int, fingerprint: str) -> WorkerInfo:
    return WorkerInfo(model, "", vocab_size, fingerprint, max_context=512)


def test_a_draft_of_another_vocabulary_than_the_target_is_refused_at_start():
    target = worker("t", 512, "abc")
    check_pairing(target, worker("d", 512, "abc"), ("d:1",))
    check_pairing(target, worker("prompt-lookup", 0, ""), ("d:1",))  # any vocabulary
    with pytest.raises(StartupError, match=r"^--draft d:1: the draft worker serves 'd', a vocab"):
        check_pairing(target, worker("d", 512, "xyz"), ("d:1",))
    with pytest.raises(StartupError, match=r"^--draft d:1,d:2: .* 300 tokens, the target 512"):
        check_pairing(target, worker("d", 300, ""), ("d:1", "d:2"))


def test_a_model_file_this_process_may_not_read_is_named_as_such(
    tmp_path, tiny_target_dir, monkeypatch
):
    model = tmp_path / "model"
    shutil.copytree(tiny_target_dir, model)
    weights = next(model.glob("*.safetensors"))
    opened = Path.open

    def refusing(path, *args, **kwargs):  # (the tests run as root, who may read anything)
        if path == weights:
            raise PermissionError(13, "Permission denied", str(path))
        return opened(path, *args, **kwargs)

    monkeypatch.setattr(Path, "open", refusing)
    with pytest.raises(StartupError) as error:
        startup.check_model("--model", str(model))
    message = str(error.value)
    assert message.startswith(f"--model {model}: permission denied: this process (uid ")
    assert (
        f"may not read {weights.name}; make the model readable (chmod -R a+rX {model})" in message
    )


def test_a_weights_file_that_is_not_safetensors_says_so(tmp_path, tiny_target_dir):
    model = tmp_path / "model"
    shutil.copytree(tiny_target_dir, model)
    weights = next(model.glob("*.safetensors"))
    weights.write_bytes(b"not a safetensors file")
    with pytest.raises(StartupError) as error:
        startup.check_model("--model", str(model))
    assert str(error.value).startswith(
        f"--model {model}: {weights.name} is not a safetensors file: "
    )
