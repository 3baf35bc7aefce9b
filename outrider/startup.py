"""Start-up checks: a configuration mistake is found before any work starts
and reported as one line that names the flag — not as a traceback from deep
inside a model load, a bind or a TLS handshake.

Each service runs its checks first (:func:`check_worker`,
:func:`check_coordinator`: cheap, no model is loaded) and raises
:class:`StartupError` for a failure of its own start too (a port taken
meanwhile, a model that does not load, no worker answering). ``outrider
serve`` prints it as argparse prints a usage error — ``outrider serve ROLE:
--flag VALUE: what is wrong and what to do`` — and exits with status 2.
"""

from __future__ import annotations

import errno
import os
import socket
import ssl
from pathlib import Path
from typing import TYPE_CHECKING

from outrider import security

if TYPE_CHECKING:
    from outrider.command_config import StackConfig
    from outrider.config import (
        CoordinatorConfig,
        DraftWorkerConfig,
        ServiceConfig,
        TargetWorkerConfig,
    )


class StartupError(Exception):
    """A service cannot start as configured: ``--flag VALUE: problem``."""

    def __init__(self, flag: str, value: object, problem: str) -> None:
        super().__init__(f"{flag} {value}: {problem}")
        self.flag = flag


def first_line(exc: BaseException) -> str:
    """An exception's message, on one line (its first), or its type's name."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def check_worker(config: TargetWorkerConfig | DraftWorkerConfig) -> None:
    """Its address, TLS files, device and model."""
    check_service(config.service)
    check_device(config.engine.device)
    if getattr(config, "drafter_kind", None) == "gguf":
        check_gguf("--model", config.model)
        return
    check_model("--model", config.model)
    if config.engine.tensor_parallel_size > 1:
        check_tensor_parallel(config)


def check_tensor_parallel(config: TargetWorkerConfig | DraftWorkerConfig) -> None:
    """The model splits into ``--tensor-parallel-size`` ranks (its heads, KV
    heads and MLP features divide by it; not the int4 drafter), and a CUDA
    worker has that many devices."""
    from transformers import AutoConfig

    from outrider import model_specs
    from outrider.device import resolve_device
    from outrider.engine.build import tensor_parallel_problem

    size = config.engine.tensor_parallel_size
    kind = getattr(config, "drafter_kind", "model")
    model_config = AutoConfig.from_pretrained(
        model_specs.resolve(config.model), trust_remote_code=config.trust_remote_code
    )
    problem = tensor_parallel_problem(model_config, size, 32 if kind == "int4" else None)
    if problem is not None:
        raise StartupError("--tensor-parallel-size", size, problem)
    device = resolve_device(config.engine.device)
    if device.type == "cuda" and ":" in config.engine.device:
        raise StartupError(
            "--device",
            config.engine.device,
            "a tensor-parallel worker runs rank r on cuda:r: give --device cuda, and choose "
            "the GPUs with CUDA_VISIBLE_DEVICES",
        )
    if device.type == "cuda":
        import torch

        if torch.cuda.device_count() < size:
            raise StartupError(
                "--tensor-parallel-size",
                size,
                f"needs {size} CUDA devices (cuda:0 .. cuda:{size - 1}), this machine has "
                f"{torch.cuda.device_count()}",
            )


def check_coordinator(config: CoordinatorConfig) -> None:
    """Its address, TLS files (its own and the workers') and tokenizer."""
    check_service(config.service)
    check_model("--tokenizer", config.tokenizer, checkpoint=False)
    check_client_tls(config.worker_tls_ca, config.worker_tls_cert, config.worker_tls_key)


def check_stack(config: StackConfig) -> None:
    """The checks of ``outrider up`` and ``outrider demo``, by their own
    flags: the device, the models, and that the draft model shares the
    target's vocabulary."""
    from outrider import gguf_files, model_specs

    check_device(config.device)
    check_model("--target-model", config.target_model)
    if config.draft_model:
        target = model_specs.vocab_fingerprint_of(config.target_model)
        if config.draft_model.endswith(".gguf") or config.drafter == "gguf":
            draft = gguf_files.vocab_fingerprint(check_gguf("--draft-model", config.draft_model))
        else:
            check_model("--draft-model", config.draft_model)
            draft = model_specs.vocab_fingerprint_of(config.draft_model)
        if target and draft and target != draft:
            raise StartupError(
                "--draft-model",
                config.draft_model,
                "its vocabulary differs from the target's "
                f"({config.target_model or model_specs.DEFAULT_MODEL}): pick a draft model that "
                "shares the target's tokenizer, or --drafter prompt-lookup",
            )


def check_gguf(flag: str, spec: str | None) -> Path:
    """A GGUF file the spec names (``outrider.gguf_files``), and llama.cpp to run it."""
    from outrider import gguf_files, model_specs
    from outrider.engine.gguf_runner import LlamaCppMissing, llama_cpp

    try:
        path = gguf_files.gguf_path(spec)
    except (gguf_files.NotAGguf, model_specs.ModelNotFetchedError) as exc:
        raise StartupError(flag, spec or model_specs.DEFAULT_MODEL, str(exc)) from None
    try:
        llama_cpp()
    except LlamaCppMissing as exc:
        raise StartupError("--drafter", "gguf", str(exc)) from None
    return path


def check_service(service: ServiceConfig) -> None:
    check_port("--port", service.host, service.port)
    if service.metrics_port is not None:
        check_port("--metrics-port", service.host, service.metrics_port)
    check_server_tls(service.tls_cert, service.tls_key, service.tls_client_ca)


def check_device(spec: str, flag: str = "--device") -> None:
    """The device exists here (CUDA present, the index in range)."""
    from outrider.device import resolve_device

    try:
        resolve_device(spec)
    except ValueError as exc:
        raise StartupError(flag, spec, str(exc).removeprefix(f"device {spec!r}: ")) from None


def check_model(flag: str, spec: str | None, *, checkpoint: bool = True) -> None:
    """A model spec that loads (``outrider.model_specs``): an embedded model that
    has been fetched, a directory, or a hub id that the hub (or its local
    cache) has. A ``checkpoint`` (not only a tokenizer) has a config that
    transformers reads and safetensors weights."""
    from outrider import model_specs

    name = spec or model_specs.DEFAULT_MODEL
    try:
        path = model_specs.resolve(spec)
    except model_specs.ModelNotFetchedError as exc:
        raise StartupError(flag, name, str(exc)) from None
    local = Path(path).expanduser()
    if local.is_dir():
        if checkpoint:
            _check_checkpoint(flag, name, local)
        return
    if local.exists():
        raise StartupError(flag, name, "not a directory: a model is a checkpoint's directory")
    # A hub id is NAME or ORG/NAME; anything else is a path.
    if name.startswith(("/", ".", "~")) or name.count("/") > 1:
        raise StartupError(
            flag, name, "no such directory (nor an embedded model: outrider models list)"
        )
    _check_hub_model(flag, name, "config.json" if checkpoint else "tokenizer_config.json")


def _check_checkpoint(flag: str, name: str, directory: Path) -> None:
    from transformers import AutoConfig

    _check_readable(flag, name, directory)
    if not (directory / "config.json").is_file():
        raise StartupError(flag, name, "not a model directory: it holds no config.json")
    try:
        AutoConfig.from_pretrained(directory)
    except (OSError, ValueError) as exc:
        raise StartupError(flag, name, f"its config does not load: {first_line(exc)}") from None
    weights = sorted(directory.glob("*.safetensors"))
    if not weights:
        raise StartupError(
            flag, name, "it holds no .safetensors weights (models load from safetensors only)"
        )
    for path in weights:
        _check_safetensors(flag, name, path)


def _check_readable(flag: str, name: str, directory: Path) -> None:
    """Every file of the model's directory opens for reading: a file this
    process may not read is named as such, not as a missing one."""
    fix = f"make the model readable (chmod -R a+rX {directory}) or run as its owner"
    if not os.access(directory, os.R_OK | os.X_OK):
        raise StartupError(
            flag, name, f"permission denied: this process (uid {os.getuid()}) may not list "
            f"the directory; {fix}"
        )  # fmt: skip
    for path in sorted(directory.iterdir()):
        if not path.is_file():
            continue
        try:
            with path.open("rb") as file:
                file.read(1)
        except PermissionError:
            raise StartupError(
                flag, name, f"permission denied: this process (uid {os.getuid()}) may not read "
                f"{path.name}; {fix}"
            ) from None  # fmt: skip


def _check_safetensors(flag: str, name: str, path: Path) -> None:
    """A weights file whose header safetensors reads (a few kilobytes)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as weights:
            weights.keys()
    except Exception as exc:  # safetensors raises its own SafetensorError
        raise StartupError(
            flag, name, f"{path.name} is not a safetensors file: {first_line(exc)}"
        ) from None


def _check_hub_model(flag: str, repo_id: str, filename: str) -> None:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    not_local = "no such directory, nor an embedded model (outrider models list)"
    try:
        hf_hub_download(repo_id, filename)
    except HFValidationError:
        raise StartupError(flag, repo_id, f"{not_local}, nor a model id of the hub") from None
    except GatedRepoError:
        raise StartupError(
            flag, repo_id, "the model hub gates this model: log in with a token that may read it"
        ) from None
    except RepositoryNotFoundError:
        raise StartupError(flag, repo_id, f"{not_local}, nor a model on the hub") from None
    except LocalEntryNotFoundError:
        raise StartupError(
            flag,
            repo_id,
            f"{not_local}, and the model hub cannot be reached to look for it "
            "(nor is it in the hub's local cache)",
        ) from None
    except OSError as exc:
        raise StartupError(flag, repo_id, f"the model hub does not serve it: {exc}") from None


def check_port(flag: str, host: str, port: int) -> None:
    """``host:port`` can be listened on (port 0: any free port)."""
    try:
        (family, kind, proto, _, address), *_ = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise StartupError("--host", host, f"not an address to listen on: {exc.strerror}") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise StartupError(
                    flag, port, "already in use: stop what listens there, or pick another port"
                ) from None
            if exc.errno == errno.EACCES:
                raise StartupError(
                    flag, port, "needs privileges to listen on: pick a port above 1023"
                ) from None
            raise StartupError(
                "--host", host, f"cannot listen there: {exc.strerror} (is it this machine's?)"
            ) from None


def check_server_tls(cert: Path | None, key: Path | None, client_ca: Path | None) -> None:
    """The certificate and key load and belong together; the client CA loads."""
    if cert is not None and key is not None:
        _check_certificates("--tls-cert", cert)
        _check_key("--tls-key", key, "--tls-cert", cert)
    if client_ca is not None:
        _check_certificates("--tls-client-ca", client_ca)


def check_client_tls(ca: Path | None, cert: Path | None, key: Path | None) -> None:
    """The coordinator's TLS files for reaching its workers load."""
    if ca is not None:
        _check_certificates("--worker-tls-ca", ca)
    if cert is not None and key is not None:
        _check_certificates("--worker-tls-cert", cert)
        _check_key("--worker-tls-key", key, "--worker-tls-cert", cert)


def _read(flag: str, path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise StartupError(flag, path, f"cannot read it: {exc.strerror}") from None


def _check_certificates(flag: str, path: Path) -> None:
    text = _read(flag, path).decode("ascii", errors="replace")
    try:
        ssl.create_default_context(cadata=text)
    except (ssl.SSLError, ValueError):
        raise StartupError(flag, path, "not a PEM certificate") from None


def _check_key(flag: str, key: Path, cert_flag: str, cert: Path) -> None:
    _read(flag, key)
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
    except ssl.SSLError:
        raise StartupError(
            flag, key, f"not a PEM private key, or not the key of {cert_flag} {cert}"
        ) from None


def auth_tokens(path: Path) -> frozenset[str]:
    """The bearer tokens of ``--auth-tokens-file``."""
    try:
        return security.load_tokens(path)
    except OSError as exc:
        raise StartupError("--auth-tokens-file", path, f"cannot read it: {exc.strerror}") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise StartupError("--auth-tokens-file", path, str(exc)) from None
