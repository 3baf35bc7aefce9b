"""GGUF files: which one a model spec names, and what is read from one
before llama.cpp loads it (the ``gguf`` drafter, :mod:`outrider.engine.gguf_runner`).

A GGUF spec is what users type after ``--model`` for ``--drafter gguf``:

* nothing — the embedded default model's GGUF, kept beside its converted
  checkpoint by ``outrider models fetch`` (the very file the target's
  weights come from);
* the name of an embedded model — its GGUF, the same way;
* a ``.gguf`` file;
* a directory holding one ``.gguf`` file (a fetched embedded model's
  directory, mounted into a container, is one).

Reading the vocabulary needs only the ``gguf`` package (no llama.cpp, no
torch), so ``outrider up`` checks a draft's vocabulary against its target's
before it starts anything.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

GGUF_SUFFIX = ".gguf"
UNUSED_TOKEN = 5
"""``gguf.TokenType.UNUSED``: padding rows a converter adds to fill the
embedding matrix; no tokenizer has them."""


class NotAGguf(ValueError):
    """A spec that names no GGUF file: the message says what it names instead."""


def gguf_path(spec: str | None) -> Path:
    """The GGUF file ``spec`` names (see the module docstring); raises
    :class:`NotAGguf`, or ``outrider.model_specs.ModelNotFetchedError`` for an
    embedded model not yet fetched."""
    from outrider import model_specs

    name = spec or model_specs.DEFAULT_MODEL
    if name in model_specs.EMBEDDED_MODELS:
        directory = Path(model_specs.resolve(name))
        return directory / model_specs.EMBEDDED_MODELS[name].gguf_name
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix != GGUF_SUFFIX:
            raise NotAGguf(f"not a GGUF file (a {GGUF_SUFFIX} file)")
        return path.resolve()
    if path.is_dir():
        found = sorted(path.glob(f"*{GGUF_SUFFIX}"))
        if len(found) != 1:
            raise NotAGguf(
                f"a directory holding {len(found) or 'no'} {GGUF_SUFFIX} files: name the file"
                if found
                else f"a directory holding no {GGUF_SUFFIX} file: give a {GGUF_SUFFIX} file, or "
                "an embedded model's name (outrider models list)"
            )
        return found[0].resolve()
    raise NotAGguf(
        f"no such file: give a {GGUF_SUFFIX} file, a directory holding one, or an embedded "
        "model's name (outrider models list)"
    )


def vocab_fingerprint(path: Path) -> str:
    """sha256 of the GGUF's vocabulary ordered by id, as
    ``outrider.model_specs.vocab_fingerprint`` takes a tokenizer's: equal to the
    fingerprint of the tokenizer it was converted from (padding rows aside)."""
    import gguf

    reader = gguf.GGUFReader(path)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{path.name} carries no vocabulary (tokenizer.ggml.tokens)")
    types_field = reader.fields.get("tokenizer.ggml.token_type")
    types = [int(types_field.parts[i][0]) for i in types_field.data] if types_field else []
    pairs = [
        (index, bytes(tokens.parts[part]).decode("utf-8"))
        for index, part in enumerate(tokens.data)
        if not (index < len(types) and types[index] == UNUSED_TOKEN)
    ]
    payload = json.dumps(pairs, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def load_tokenizer(path: Path) -> tuple[Any, frozenset[int]]:
    """The GGUF's tokenizer as transformers reads it and its end-of-sequence
    ids (for structured output's grammars): the checkpoint's beside it when
    its directory is one (a fetched embedded model), else transformers'
    conversion of the GGUF's own."""
    from outrider import model_specs

    directory = path.parent
    if (directory / "tokenizer.json").is_file():
        tokenizer = model_specs.load_tokenizer(str(directory))
        return tokenizer, model_specs.eos_token_ids(
            tokenizer, model_specs.generation_config(str(directory))
        )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=path.name)
    return tokenizer, model_specs.eos_token_ids(tokenizer, {})
