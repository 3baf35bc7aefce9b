"""The ``gguf`` drafter: a GGUF file (usually the one the target was
converted from) run by llama.cpp on the CPU, its weights in their own
quantized formats (:class:`outrider.engine.gguf_runner.GgufRunner`): each
session a sequence of one llama.cpp context, every draft step of every
session one ``llama_decode``, rollback a sequence removal."""

from __future__ import annotations

from typing import TYPE_CHECKING

from outrider import gguf_files
from outrider.drafters.model import DraftInfo, LoadedDrafter, ModelDrafter
from outrider.grammar import Grammars
from outrider.startup import StartupError, check_gguf

if TYPE_CHECKING:
    from outrider.config import DraftWorkerConfig


class GgufDrafter(ModelDrafter):
    """A model drafter whose model is llama.cpp's."""

    kind = "gguf"


def load(config: DraftWorkerConfig) -> LoadedDrafter:
    """The GGUF of ``--model`` (the file, a directory holding one, or an
    embedded model, whose GGUF the fetch kept): one llama.cpp context of
    ``--max-sessions`` sequences over ``--max-cached-tokens`` cells, run on
    ``--threads`` threads."""
    from outrider.engine.gguf_runner import GgufRunner, LlamaCppMissing, llama_cpp

    path = check_gguf("--model", config.model)
    limits = config.limits
    try:
        most = llama_cpp().llama_max_parallel_sequences()
        if limits.max_sessions > most:
            raise StartupError(
                "--max-sessions",
                limits.max_sessions,
                f"llama.cpp runs at most {most} sequences in one context: give {most} or fewer",
            )
        runner = GgufRunner.load(
            path,
            max_sessions=limits.max_sessions,
            max_cached_tokens=limits.max_cached_tokens,
            threads=config.engine.threads,
        )
    except LlamaCppMissing as exc:
        raise StartupError("--drafter", "gguf", str(exc)) from None
    except ValueError as exc:
        raise StartupError("--model", str(path), str(exc)) from None
    grammars = Grammars.loading(lambda: gguf_files.load_tokenizer(path), runner.vocab_size)
    info = DraftInfo(
        vocab_fingerprint=gguf_files.vocab_fingerprint(path),
        max_context=runner.info.context_length,
        max_draft_tokens=config.max_draft_tokens,
        device="cpu",
        dtype=runner.info.description.rsplit(" ", 1)[-1],
    )
    return LoadedDrafter(GgufDrafter(runner, model_name=path.name), info, grammars)
