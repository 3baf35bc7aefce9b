"""OpenAI's ``logprobs`` objects of the target's log-probabilities, as vLLM
writes them: a token is its own decoded text (and that text's UTF-8 bytes),
and a log-probability of a token the request's structured output forbids
(-inf) is written -9999.0, which JSON can carry."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

from outrider.coordinator.detokenize import Decoder
from outrider.speculation import TokenLogprobs

FLOOR = -9999.0
"""vLLM's stand-in for -inf."""


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else FLOOR


class LogprobsFormat:
    """Writes a choice's log-probabilities in the shape of one endpoint."""

    def __init__(self, tokenizer: Decoder, *, chat: bool) -> None:
        self.chat = chat
        self.text_of = functools.lru_cache(maxsize=65536)(
            lambda token: tokenizer.decode([token], skip_special_tokens=False)
        )

    def write(
        self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs], offset: int = 0
    ) -> dict[str, Any]:
        """Those of ``token_ids``; ``offset``: the text's length before them (completions)."""
        if self.chat:
            return {
                "content": [self.entry(t, lp) for t, lp in zip(token_ids, logprobs, strict=True)]
            }
        texts = [self.text_of(t) for t in token_ids]
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [finite(lp.logprob) for lp in logprobs],
            "top_logprobs": [
                {self.text_of(t): finite(v) for t, v in (*lp.top, (token, lp.logprob))}
                for token, lp in zip(token_ids, logprobs, strict=True)
            ],
            "text_offset": offsets,
        }

    def entry(self, token: int, logprobs: TokenLogprobs) -> dict[str, Any]:
        """Chat's entry of one token, with its most likely alternatives."""
        return {
            **self.token(token, logprobs.logprob),
            "top_logprobs": [self.token(t, v) for t, v in logprobs.top],
        }

    def token(self, token: int, logprob: float) -> dict[str, Any]:
        text = self.text_of(token)
        return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode())}
