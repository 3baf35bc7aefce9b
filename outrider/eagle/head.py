"""An EAGLE-3 draft head (Li et al. 2025, arXiv 2503.01840): its config,
its weights in the layout the EAGLE and speculators repositories publish,
and a dense reference forward.

The head reads the target's hidden states at three of its layers (low,
middle, high: the inputs of decoder layers ``aux_layers``), fuses them
(``fc``: 3·H_target → H) and runs one Llama decoder layer whose attention
reads the token's embedding and the feature side by side (2·H wide), then
a final norm and an LM head over a *draft vocabulary*: the most frequent
target tokens, mapped back by ``d2t`` (target id = draft id + d2t[draft id]).

At position t the head reads the pair (feature of position t, token t + 1)
and predicts token t + 2. The feature of a committed position is the
target's (fused by ``fc``); past the committed tokens, while drafting, it
is the head's own output at the position before, before the final norm
(``prenorm``) — which training teaches it to read (EAGLE-3's training-time
test, :mod:`outrider.eagle.train`).

The checkpoint is a directory: ``config.json`` (a Llama config of one
layer with ``draft_vocab_size``, ``target_hidden_size`` and, when not the
default, ``eagle_config.eagle_aux_hidden_state_layer_ids``; or the
speculators format, whose ``transformer_layer_config`` holds it) and
``model.safetensors`` (or ``pytorch_model.bin``) holding ``fc``,
``midlayer.*``, ``norm``, ``lm_head``, ``d2t`` and ``t2d``; a head that
brings its own ``embed_tokens`` uses it, else it shares the target's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
SHIPPED = Path(__file__).parent / "heads"
"""Heads shipped in the package, one directory per embedded target."""


def shipped_head(target: str | None) -> Path | None:
    """The head shipped for ``target`` (None: the default model), when it
    names an embedded model or its converted directory and a head ships for
    it; else None."""
    from outrider.model_specs import DEFAULT_MODEL, EMBEDDED_MODELS, model_path

    name = target or DEFAULT_MODEL
    if name not in EMBEDDED_MODELS:
        here = Path(name).expanduser().resolve()
        name = next((n for n in EMBEDDED_MODELS if model_path(n).resolve() == here), "")
    directory = SHIPPED / name if name else None
    return directory if directory is not None and (directory / CONFIG).is_file() else None


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's choice: the inputs of decoder layers 2, L/2 and L − 3 (as
    vLLM and SpecForge take them), kept inside a shallow model."""
    last = num_layers - 1
    return (min(2, last), min(num_layers // 2, last), max(min(num_layers - 3, last), 0))


@dataclass(frozen=True)
class HeadConfig:
    """What a head is: its decoder layer's shape, the target it reads."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    """The target's vocabulary."""
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...]
    max_position_embeddings: int
    rope: dict[str, Any] = field(default_factory=dict)
    """The Llama config's rotary fields (rope_theta, rope_scaling)."""
    norm_before_residual: bool = False
    target_num_layers: int = 0
    """The target's decoder layers, when known (for checking a pairing)."""

    @property
    def feature_width(self) -> int:
        """Values per position the target sends: its hidden states at the
        aux layers side by side."""
        return len(self.aux_layers) * self.target_hidden_size

    def llama_config(self) -> LlamaConfig:
        return LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            vocab_size=self.vocab_size,
            num_hidden_layers=1,
            max_position_embeddings=self.max_position_embeddings,
            **self.rope,
        )

    @classmethod
    def for_target(
        cls, target: Any, *, draft_vocab_size: int, aux_layers: tuple[int, ...] | None = None
    ) -> HeadConfig:
        """A head shaped like one decoder layer of ``target`` (a transformers
        config of the Llama family)."""
        heads = target.num_attention_heads
        return cls(
            hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=target.num_key_value_heads or heads,
            head_dim=getattr(target, "head_dim", None) or target.hidden_size // heads,
            rms_norm_eps=target.rms_norm_eps,
            vocab_size=target.vocab_size,
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=target.hidden_size,
            aux_layers=aux_layers or default_aux_layers(target.num_hidden_layers),
            max_position_embeddings=target.max_position_embeddings,
            rope=_rope_fields(target.to_dict()),
            target_num_layers=target.num_hidden_layers,
        )

    def to_json(self) -> dict[str, Any]:
        """``config.json`` in EAGLE's layout (as vLLM reads it)."""
        return {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": "silu",
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "max_position_embeddings": self.max_position_embeddings,
            "norm_before_residual": self.norm_before_residual,
            "eagle_config": {
                "use_aux_hidden_state": True,
                "eagle_aux_hidden_state_layer_ids": list(self.aux_layers),
                "target_num_hidden_layers": self.target_num_layers,
            },
            **self.rope,
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any], *, target_num_layers: int = 0) -> HeadConfig:
        """EAGLE's ``config.json``, or the speculators format's (its layer in
        ``transformer_layer_config``). The aux layers default to EAGLE-3's
        for the target's depth, which ``target_num_layers`` gives when the
        config does not."""
        layer = raw.get("transformer_layer_config", raw)
        speculators = "transformer_layer_config" in raw
        eagle = raw.get("eagle_config") or {}
        if eagle.get("use_aux_hidden_state") is False:
            raise ValueError("this is an EAGLE-1/2 head (no aux hidden states); EAGLE-3 is needed")
        depth = eagle.get("target_num_hidden_layers") or target_num_layers
        aux = eagle.get("eagle_aux_hidden_state_layer_ids") or raw.get(
            "eagle_aux_hidden_state_layer_ids"
        )
        if not aux:
            if not depth:
                raise ValueError(
                    "the head's config names no aux layers, and the target's depth is unknown"
                )
            aux = default_aux_layers(depth)
        heads = layer["num_attention_heads"]
        hidden = layer["hidden_size"]
        return cls(
            hidden_size=hidden,
            intermediate_size=layer["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=layer.get("num_key_value_heads") or heads,
            head_dim=layer.get("head_dim") or hidden // heads,
            rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
            vocab_size=layer["vocab_size"],
            draft_vocab_size=raw.get("draft_vocab_size")
            or layer.get("draft_vocab_size")
            or layer["vocab_size"],
            target_hidden_size=raw.get("target_hidden_size")
            or layer.get("target_hidden_size")
            or hidden,
            aux_layers=tuple(aux),
            max_position_embeddings=layer.get("max_position_embeddings", 2048),
            rope=_rope_fields(layer),
            # (speculators' heads put the norm before the residual unless they say not, as
            # vLLM reads them)
            norm_before_residual=bool(raw.get("norm_before_residual", speculators)),
            target_num_layers=depth,
        )


def _rope_fields(config: dict[str, Any]) -> dict[str, Any]:
    return {
        key: config[key]
        for key in ("rope_theta", "rope_scaling", "rope_parameters")
        if config.get(key) is not None
    }


class _Attention(nn.Module):
    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        width = 2 * config.hidden_size  # the token's embedding and the feature
        heads, kv_heads, head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.head_dim, self.scaling = head_dim, head_dim**-0.5
        self.q_proj = nn.Linear(width, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(width, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(width, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, config.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=eps)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=eps)
        self.self_attn = _Attention(config)
        self.mlp = _MLP(config)


class EagleHead(nn.Module):
    """The head's weights under the published names, and its dense forward
    (:meth:`forward`): the reference the paged forward of the draft worker
    (:mod:`outrider.eagle.forward`) is tested against, and what training
    runs."""

    d2t: torch.Tensor
    t2d: torch.Tensor

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(config.feature_width, config.hidden_size, bias=False)
        self.midlayer = _MidLayer(config)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
        self.embed_tokens: nn.Embedding | None = None
        """The head's own embedding, when its checkpoint brings one."""
        self.rotary = LlamaRotaryEmbedding(config=config.llama_config())

    @property
    def draft_to_target(self) -> torch.Tensor:
        """Target id of each draft id."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """Makes ``target_ids`` (ascending, distinct) the draft vocabulary."""
        ids = target_ids.to(torch.long).sort().values
        self.d2t.copy_(ids - torch.arange(len(ids)))
        self.t2d.zero_()
        self.t2d[ids] = True

    def attend_inputs(
        self, embeds: torch.Tensor, features: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layer's attention input, ``cat(norm(embedding),
        norm(feature))``, and its residual."""
        layer = self.midlayer
        normed = layer.hidden_norm(features)
        residual = normed if self.config.norm_before_residual else features
        return torch.cat([layer.input_layernorm(embeds), normed], dim=-1), residual

    def project(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of ``x`` ``[..., T, 2H]`` at ``positions`` ``[..., T]``,
        rotated: ``[..., heads, T, head dim]``."""
        attention, c = self.midlayer.self_attn, self.config
        shape = x.shape[:-1]
        q = attention.q_proj(x).view(*shape, c.num_attention_heads, c.head_dim).transpose(-2, -3)
        k = attention.k_proj(x).view(*shape, c.num_key_value_heads, c.head_dim).transpose(-2, -3)
        v = attention.v_proj(x).view(*shape, c.num_key_value_heads, c.head_dim).transpose(-2, -3)
        cos, sin = self.rotary(x, positions.reshape(-1, shape[-1]))
        cos, sin = cos.view(*shape, -1).unsqueeze(-3), sin.view(*shape, -1).unsqueeze(-3)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def finish(self, attended: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The rest of the layer after attention (``[..., T, heads · head
        dim]``): o_proj, residual, MLP; the output before the final norm."""
        layer = self.midlayer
        x = layer.self_attn.o_proj(attended) + residual
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary."""
        return self.lm_head(self.norm(prenorm))

    def forward(
        self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One causal pass over ``[B, T]`` pairs: ``embeds`` of tokens t + 1
        and fused ``features`` of positions t (``[B, T, H]`` each). Returns
        the draft-vocabulary logits and the output before the final norm."""
        x, residual = self.attend_inputs(embeds, features)
        q, k, v = self.project(x, positions)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True, scale=self.config.head_dim**-0.5
        )
        prenorm = self.finish(out.transpose(-2, -3).flatten(-2), residual)
        return self.logits(prenorm), prenorm

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / CONFIG).write_text(json.dumps(self.config.to_json(), indent=2) + "\n")
        state = {
            k: v.contiguous() for k, v in self.state_dict().items() if not k.startswith("rotary.")
        }
        save_file(state, str(directory / WEIGHTS))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


SPECULATORS_NAMES = {"layers.0.": "midlayer."}
"""The speculators format's names for the EAGLE layout's."""


def load_head(
    directory: str | Path, *, target_num_layers: int = 0, dtype: torch.dtype = torch.float32
) -> EagleHead:
    """A head from its directory, in EAGLE's or the speculators layout."""
    directory = Path(directory)
    if not (directory / CONFIG).is_file():
        raise FileNotFoundError(f"{directory} holds no {CONFIG}: not an EAGLE-3 head")
    config = HeadConfig.from_json(
        json.loads((directory / CONFIG).read_text()), target_num_layers=target_num_layers
    )
    state = _read_weights(directory)
    for old, new in SPECULATORS_NAMES.items():
        state = {k.replace(old, new, 1) if k.startswith(old) else k: v for k, v in state.items()}
    state = {k.removeprefix("model."): v for k, v in state.items()}
    head = EagleHead(config)
    embed = state.pop("embed_tokens.weight", None)
    if "t2d" not in state:  # vLLM does not read it; derive it from d2t
        state["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool)
        state["t2d"][torch.arange(config.draft_vocab_size) + state["d2t"]] = True
    if "d2t" not in state and config.draft_vocab_size == config.vocab_size:
        state["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
    missing, unexpected = head.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.startswith("rotary.")]
    if missing or unexpected:
        raise ValueError(
            f"{directory} is not an EAGLE-3 head of its config: "
            + "; ".join(
                part
                for part in (
                    f"missing {', '.join(missing)}" if missing else "",
                    f"unexpected {', '.join(unexpected)}" if unexpected else "",
                )
                if part
            )
        )
    if embed is not None:
        head.embed_tokens = nn.Embedding.from_pretrained(embed, freeze=True)
    return head.to(dtype).eval().requires_grad_(False)


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    if files:
        state: dict[str, torch.Tensor] = {}
        for file in files:
            state.update(load_file(str(file)))
        return state
    if (directory / "pytorch_model.bin").is_file():
        return torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{directory} holds no weights (*.safetensors or pytorch_model.bin)")
