"""llama.cpp itself as a peer in the bench process: the GGUF the target was
converted from, run by llama.cpp alone (``llama.cpp``), and with llama.cpp's
own prompt-lookup speculation (``llama.cpp-prompt-lookup``), through
``llama-cpp-python``'s ``Llama`` — what a user choosing a CPU server would
compare with.

It is another engine, with other numerics (4-bit weights, 8-bit
activations): its tokens/s stands beside Hugging Face's, its outputs are
not compared with the target's. Each prompt starts from an empty cache, as
the bench's Outrider workers run without a prefix cache. Greedy only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

from outrider.bench.configs import Config
from outrider.bench.measurements import Measurement
from outrider.bench.prompts import Prompt

FAMILY = "llama.cpp"
PLAIN = "llama.cpp"
PROMPT_LOOKUP = "llama.cpp-prompt-lookup"
LOOKUP_TOKENS = 10
"""Tokens llama.cpp's prompt lookup drafts a round (its ``LlamaPromptLookupDecoding``'s default)."""


class LlamaCpp:
    """Two llama.cpp contexts of ``context`` tokens of the GGUF at ``path``
    (one with a prompt-lookup draft), each on ``threads`` threads;
    ``prompt_ids`` gives a prompt's tokens as the target's chat template
    makes them."""

    def __init__(
        self,
        path: Path,
        *,
        context: int,
        threads: int,
        prompt_ids: Callable[[Prompt], list[int]],
        eos_token_ids: Collection[int],
        ignore_eos: bool,
    ) -> None:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.path = path
        self.prompt_ids = prompt_ids
        self.eos_token_ids = frozenset() if ignore_eos else frozenset(eos_token_ids)
        common: dict[str, Any] = dict(
            model_path=str(path),
            n_ctx=context,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )
        self.plain = Llama(**common)
        # A draft verifies on every position's logits: logits_all, which
        # Llama's score buffer is sized by only when it is given.
        self.lookup = Llama(
            **common,
            logits_all=True,
            draft_model=LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS),
        )

    def configs(self) -> list[Config]:
        return [
            Config(PLAIN, FAMILY, lambda prompt, n: self.generate(self.plain, prompt, n), k=0),
            Config(
                PROMPT_LOOKUP,
                FAMILY,
                lambda prompt, n: self.generate(self.lookup, prompt, n),
                drafter="prompt-lookup",
                k=LOOKUP_TOKENS,
            ),
        ]

    def generate(self, llm: Any, prompt: Prompt, max_new_tokens: int) -> Measurement:
        ids = self.prompt_ids(prompt)
        tokens: list[int] = []
        llm.reset()  # an empty cache: no prefix of an earlier prompt reused
        started = time.perf_counter()
        for token in llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            tokens.append(int(token))
            if len(tokens) == max_new_tokens or token in self.eos_token_ids:
                break
        wall_s = time.perf_counter() - started
        return Measurement(
            token_ids=tuple(tokens), prompt_tokens=len(ids), wall_s=wall_s, rounds=len(tokens)
        )


def llama_cpp_peer(
    target_model: str | None,
    *,
    prompts: Sequence[Prompt],
    max_new_tokens: int,
    threads: int,
    prompt_ids: Callable[[Prompt], list[int]],
    eos_token_ids: Collection[int],
    ignore_eos: bool,
) -> LlamaCpp | None:
    """The peer where llama.cpp is installed and the target has a GGUF
    (an embedded model's, or one in its directory), its contexts long
    enough for the longest of ``prompts`` and ``max_new_tokens``; else None."""
    import importlib.util

    from outrider import gguf_files, model_specs

    if importlib.util.find_spec("llama_cpp") is None:
        return None
    try:
        path = gguf_files.gguf_path(target_model)
    except (gguf_files.NotAGguf, model_specs.ModelNotFetchedError):
        return None
    longest = max(len(prompt_ids(prompt)) for prompt in prompts)
    return LlamaCpp(
        path,
        # Room for a round's drafts past the last token: Llama's speculative
        # path writes them into its buffers unchecked near the context's end.
        context=longest + max_new_tokens + 2 * LOOKUP_TOKENS + 16,
        threads=threads,
        prompt_ids=prompt_ids,
        eos_token_ids=eos_token_ids,
        ignore_eos=ignore_eos,
    )
