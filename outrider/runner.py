"""The model runner: the only code that runs a forward pass.

It feeds tokens into a session's :class:`~outrider.session.KVCache` and
returns logits; which tokens to feed, and what to make of the logits, is the
engines' business.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from outrider.session import KVCache


class ModelRunner:
    """Forward passes of one causal LM (batch of one) over KV caches."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.config = model.config
        self.vocab_size: int = model.config.vocab_size
        self.device = next(model.parameters()).device

    def new_kv(self) -> KVCache:
        return KVCache(DynamicCache(config=self.config))

    @torch.inference_mode()
    def feed(self, kv: KVCache, tokens: Sequence[int], *, last_only: bool = False) -> torch.Tensor:
        """Appends ``tokens`` to the cache in one forward pass.

        Returns the logits ``[len(tokens), vocab]`` (``[1, vocab]`` with
        ``last_only``): row ``i`` is the distribution of the token after
        ``tokens[i]``.
        """
        if not tokens:
            raise ValueError("feed needs at least one token")
        input_ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        out = self.model(
            input_ids=input_ids,
            past_key_values=kv.cache,
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
        )
        kv.token_ids.extend(tokens)
        return out.logits[0]

    def extend(self, kv: KVCache, tokens: Sequence[int], *, last_only: bool = False) -> torch.Tensor:
        """Makes the cache hold exactly ``tokens`` and returns the logits of the
        positions it had to compute.

        The cache keeps its longest prefix shared with ``tokens`` (a crop) and
        the rest is fed; at least the last token is always fed, so there are
        logits to return.
        """
        reuse = min(kv.shared_prefix(tokens), len(tokens) - 1)
        kv.crop(reuse)
        return self.feed(kv, tokens[reuse:], last_only=last_only)
