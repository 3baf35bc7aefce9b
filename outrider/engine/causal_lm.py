"""Loading a model spec's causal LM into the engine: eval mode, no gradients,
on the worker's device and dtype, optionally cut to its first decoder layers
(early exit), its linears over 2–16 rows computing as ``W @ x.T`` on the CPU
(:func:`outrider.engine.ops.use_small_batch_linears`).

What a spec names and where its files are is :mod:`outrider.model_specs`, which
imports no torch; this module is where torch and the weights come in.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from outrider.engine.ops import use_small_batch_linears
from outrider.model_specs import resolve


def load_causal_lm(
    spec: str | None,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    num_layers: int | None = None,
    trust_remote_code: bool = False,
    fast_small_batch: bool = True,
) -> PreTrainedModel:
    """Load a causal LM for inference on ``device``: eval mode, no gradients.

    ``dtype`` defaults to float32. ``num_layers=L`` keeps only the first L
    decoder layers (early exit; the final norm and the LM head stay).
    ``fast_small_batch`` applies :func:`outrider.engine.ops.use_small_batch_linears`.
    """
    model = AutoModelForCausalLM.from_pretrained(
        resolve(spec),
        dtype=dtype or torch.float32,
        use_safetensors=True,
        trust_remote_code=trust_remote_code,
    )
    model.eval().requires_grad_(False)
    if num_layers is not None:
        truncate_layers(model, num_layers)
    # PreTrainedModel.to is `@wraps(nn.Module.to)`, which types it as the
    # unbound function (self first): the call is right, its stub is not.
    model.to(device)  # type: ignore[arg-type]
    if fast_small_batch:
        use_small_batch_linears(model)
    return model


def truncate_layers(model: PreTrainedModel, num_layers: int) -> None:
    """Keep only the first ``num_layers`` decoder layers of ``model`` (in place)."""
    layers = _decoder_layers(model)
    total = len(layers)
    if not 1 <= num_layers <= total:
        raise ValueError(
            f"num_layers must be between 1 and {total} (the model's layer count), got {num_layers}"
        )
    del layers[num_layers:]
    config = model.config
    for key, value in vars(config).items():  # per-layer lists such as `layer_types`
        if (
            isinstance(value, (list, tuple))
            and len(value) == total
            and not key.endswith("token_id")
        ):
            setattr(config, key, type(value)(value[:num_layers]))
    config.num_hidden_layers = num_layers


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"{type(model).__name__} has no `model.layers`; early exit is not supported for it"
        )
    return layers
