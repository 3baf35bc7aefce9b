"""An EAGLE-3 head's forward over the draft worker's paged cache.

The head is one Llama decoder layer, so its forward is the Llama family's
(:class:`~outrider.engine.llama.LlamaForward`: the same ragged batch, block
tables, attention groups and CPU linears) with EAGLE-3's three changes:
each token comes with a feature (``ForwardBatch.hidden``: the fused target
hidden states of the position before it, or the head's own output there),
the layer's attention reads the normed embedding and the normed feature side
by side, and the logits over the draft vocabulary are scattered to the
target's ids (−inf elsewhere), so sampling, q on the wire and Gumbel noise
see the target's vocabulary. Beside the logits it returns its output before
the final norm at the same positions: the feature the next draft step reads.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors import safe_open

from outrider.eagle.head import EagleHead, HeadConfig
from outrider.engine.llama import ForwardBatch, LlamaForward, linear, rms_norm


class EagleForward(LlamaForward):
    """The forward of ``head`` reading token embeddings from ``embed`` (the
    target's, unless the head brings its own), in ``dtype`` on ``device``:
    the Llama forward of the head's one decoder layer (:func:`as_llama`),
    with the weights of EAGLE-3's changes beside it."""

    def __init__(
        self,
        head: EagleHead,
        embed: torch.Tensor,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        head = copy.deepcopy(head).to(dtype=dtype, device=device)  # (taking its weights empties it)
        own = head.embed_tokens.weight if head.embed_tokens is not None else embed
        super().__init__(as_llama(head, own.detach().to(dtype=dtype, device=device)))
        self.config = head.config
        self.fc = head.fc.weight.detach()
        self.hidden_norm = head.midlayer.hidden_norm.weight.detach()
        self.norm_before_residual = head.config.norm_before_residual
        self.draft_to_target = head.draft_to_target.to(device)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def feature_width(self) -> int:
        """Values per position of the target's features this head fuses."""
        return self.config.feature_width

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's hidden states at the aux layers, ``[T, feature width]``,
        fused into the head's features ``[T, H]``."""
        return linear(features.to(device=self.device, dtype=self.dtype), self.fc)

    def linear_weights(self) -> list:
        return [*super().linear_weights(), self.fc]

    def forward_with(
        self, batch: ForwardBatch, cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits over the target's vocabulary (−inf off the draft
        vocabulary) and the output before the final norm, both at
        ``batch.logits_indices``."""
        assert batch.hidden is not None, "an EAGLE head's tokens come with features"
        step = self._step(batch, cache)
        (layer,) = self.layers
        features = batch.hidden.to(self.dtype)
        normed = rms_norm(features, self.hidden_norm, self.eps)
        residual = normed if self.norm_before_residual else features
        embeds = rms_norm(self._embed(batch.input_ids), layer.input_norm, self.eps)
        attended = self._attention(torch.cat([embeds, normed], dim=-1), layer, cache[0], step)
        x = residual + linear(attended, layer.o)
        x = x + self._mlp(x, layer)
        if batch.logits_indices is not None:
            x = x[batch.logits_indices]
        draft_logits = linear(rms_norm(x, self.norm, self.eps), self.lm_head)
        logits = draft_logits.new_full((x.shape[0], self.vocab_size), float("-inf"))
        logits[:, self.draft_to_target] = draft_logits
        return logits, x


def as_llama(head: EagleHead, embed: torch.Tensor) -> Any:
    """``head`` as the one-layer Llama model :class:`LlamaForward` reads:
    its decoder layer (whose attention reads twice the hidden size), final
    norm, LM head over the draft vocabulary and rotary embedding, with
    ``embed`` as its token embedding, under a Llama config of the target's
    vocabulary."""
    decoder = SimpleNamespace(
        layers=[head.midlayer],
        embed_tokens=SimpleNamespace(weight=embed),
        norm=head.norm,
        rotary_emb=head.rotary,
    )
    return SimpleNamespace(config=head.config.llama_config(), model=decoder, lm_head=head.lm_head)


EMBEDDING_NAMES = ("model.embed_tokens.weight", "embed_tokens.weight")


def target_embeddings(checkpoint: str | Path) -> torch.Tensor:
    """The token embeddings of the target checkpoint in ``checkpoint`` (a
    directory of safetensors), read alone: a head needs no other weight of
    its target."""
    directory = Path(checkpoint)
    index = directory / "model.safetensors.index.json"
    files = (
        [
            directory / json.loads(index.read_text())["weight_map"][name]
            for name in EMBEDDING_NAMES[:1]
        ]
        if index.is_file()
        else sorted(directory.glob("*.safetensors"))
    )
    for file in files:
        with safe_open(str(file), framework="pt") as weights:
            for name in EMBEDDING_NAMES:
                if name in weights.keys():
                    return weights.get_tensor(name)
    raise ValueError(f"{directory} holds no token embeddings ({EMBEDDING_NAMES[0]})")


def check_head(head: HeadConfig, target: Any) -> None:
    """Refuses a head that cannot read this target (a transformers config)."""
    if head.vocab_size != target.vocab_size:
        raise ValueError(
            f"the head drafts over a vocabulary of {head.vocab_size} tokens, the target has "
            f"{target.vocab_size}: train a head for this target (outrider draft train)"
        )
    if head.target_hidden_size != target.hidden_size:
        raise ValueError(
            f"the head reads hidden states {head.target_hidden_size} wide, the target's are "
            f"{target.hidden_size}: train a head for this target (outrider draft train)"
        )
    if bad := [la for la in head.aux_layers if not 0 <= la < target.num_hidden_layers]:
        raise ValueError(f"the head reads layers {bad}, the target has {target.num_hidden_layers}")
