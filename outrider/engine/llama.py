"""A compact forward pass of the Llama family over the paged KV cache.

Llama, Mistral, Qwen2, Qwen3 and SmolLM2 (a Llama) are one architecture up
to a few switches: biases on q/k/v (Qwen2), a norm on each query and key
head (Qwen3), a sliding window (Mistral). This is that forward in the
spirit of gpt-fast's ``model.py``: the weights of the transformers model
that :func:`outrider.engine.causal_lm.load_causal_lm` loaded (the same safetensors),
with q/k/v and gate/up fused into one matrix each, run over a *ragged
batch*: every session's tokens of a step flattened into one sequence of
``N`` tokens for the linear layers, and grouped by tokens per row for
attention, each group reading its rows' keys and values through their block
tables. Norms, rotary embedding and activations are computed exactly as
transformers computes them, so a float64 model gives transformers' tokens.

With ``int4_group_size``, every projection is kept in 4 bits and the LM
head in 8 (:mod:`outrider.quantize`; the int4 self-draft), the embedding
and norms in the model's dtype.

Built from a :class:`~outrider.engine.shards.CheckpointShard` instead, it is
one rank of a tensor-parallel group (Megatron-LM's split, read slice by
slice from the safetensors): its heads, MLP features and vocabulary rows;
an all-reduce after the embedding and after each o and down projection
makes every rank's hidden state whole, and rank 0 gathers the logits.

The numbers of one step (:class:`ForwardBatch`) are tensors only, so the
same forward runs eagerly on any device and inside a captured CUDA graph.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from outrider.engine import ops
from outrider.engine.shards import CheckpointShard, Shard
from outrider.quantize import QuantizedWeight, quantize_weight

Weight = torch.Tensor | QuantizedWeight

ARCHITECTURES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
"""Rotary embeddings that depend on the position alone, so a table computed
once holds them (dynamic NTK and longrope depend on the sequence length)."""

# A transformers model's config fields and submodules are reached by name,
# which its types do not declare (``nn.Module.__getattr__`` is typed
# ``Tensor | Module``): they are read as ``Any``, and what the forward keeps
# is typed.


def unsupported(model: nn.Module) -> str | None:
    """Why ``model`` cannot take this forward, or None when it can."""
    config: Any = model.config
    if config.model_type not in ARCHITECTURES:
        return (
            f"architecture {config.model_type!r} is not one of {', '.join(sorted(ARCHITECTURES))}"
        )
    rope = (
        getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    ).get("rope_type", "default")
    if rope not in ROPE_TYPES:
        return f"rotary embedding {rope!r} is not one of {', '.join(sorted(ROPE_TYPES))}"
    if config.hidden_act not in ("silu", "swish"):
        return f"activation {config.hidden_act!r} is not silu"
    if len(set(getattr(config, "layer_types", None) or ["full_attention"])) > 1:
        return "its layers mix attention types"
    decoder: Any = model.model
    for layer in decoder.layers:
        attention, mlp = layer.self_attn, layer.mlp
        if (
            len({p.bias is None for p in (attention.q_proj, attention.k_proj, attention.v_proj)})
            > 1
        ):
            return "its q/k/v projections mix biases and none"
        if any(
            p.bias is not None
            for p in (attention.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        ):
            return "its output or MLP projections have biases"
    return None


@dataclass
class AttentionGroup:
    """Rows of a step that feed the same number of tokens: ``rows`` ×
    ``tokens_per_row`` consecutive tokens of the batch from ``start``, row
    by row; row ``r`` reads its cache through ``block_table[r]`` (padded
    with the null block)."""

    start: int
    rows: int
    tokens_per_row: int
    block_table: torch.Tensor  # [rows, blocks], int64
    span: tuple[int, int] | None = None
    """``(first block, tokens)`` when the group is one row whose blocks
    follow each other in the pool (a session that grew alone): its keys
    and values are then read in place, a view of the cache, not gathered."""


@dataclass
class ForwardBatch:
    """One step's tokens, flattened, on the model's device."""

    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64: each token's position in its sequence
    slots: (
        torch.Tensor
    )  # [N] int64: where each token's key and value are written (block × block size + offset)
    groups: list[AttentionGroup]
    logits_indices: torch.Tensor | None = (
        None  # [M]: the tokens whose next-token logits are wanted; None: all
    )
    hidden: torch.Tensor | None = None
    """An EAGLE head's: each token's feature, ``[N, H]``."""
    feature_indices: torch.Tensor | None = None
    """A target's: the tokens whose hidden states at ``feature_layers`` are wanted."""
    feature_layers: tuple[int, ...] = ()


@dataclass
class _Step:
    """What every layer of one step reads."""

    batch: ForwardBatch
    cos: torch.Tensor
    sin: torch.Tensor
    masks: list[torch.Tensor | None]
    gathered: list[tuple[torch.Tensor, torch.Tensor] | None]


@dataclass
class _Layer:
    qkv: Weight
    qkv_bias: torch.Tensor | None
    o: Weight
    gate_up: Weight
    down: Weight
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qk_norm: tuple[torch.Tensor, torch.Tensor] | None  # Qwen3: a norm on each query and key head


def _shard_layer(
    checkpoint: CheckpointShard,
    name: str,
    heads: tuple[int, int],
    kv_heads: tuple[int, int],
    ffn: tuple[int, int],
) -> _Layer:
    """Layer ``name``'s slices on this rank: q/k/v by rows of its heads (and
    KV heads), gate/up by rows of its ``ffn`` features, o and down by the
    same columns, norms whole."""
    attention, mlp = name + "self_attn.", name + "mlp."
    q, k, v = (f"{attention}{p}_proj." for p in "qkv")
    bounds = (heads, kv_heads, kv_heads)

    def qkv_rows(suffix: str) -> torch.Tensor:
        return torch.cat(
            [checkpoint.rows(p + suffix, *b) for p, b in zip((q, k, v), bounds, strict=True)]
        )

    return _Layer(
        qkv=qkv_rows("weight"),
        qkv_bias=qkv_rows("bias") if q + "bias" in checkpoint else None,
        o=checkpoint.columns(attention + "o_proj.weight", *heads),
        gate_up=torch.cat(
            [
                checkpoint.rows(mlp + "gate_proj.weight", *ffn),
                checkpoint.rows(mlp + "up_proj.weight", *ffn),
            ]
        ),
        down=checkpoint.columns(mlp + "down_proj.weight", *ffn),
        input_norm=checkpoint.whole(name + "input_layernorm.weight"),
        post_norm=checkpoint.whole(name + "post_attention_layernorm.weight"),
        qk_norm=(
            checkpoint.whole(attention + "q_norm.weight"),
            checkpoint.whole(attention + "k_norm.weight"),
        )
        if attention + "q_norm.weight" in checkpoint
        else None,
    )


class LlamaForward:
    """The forward of one Llama-family model. Construction takes the
    weights out of ``model`` (fusing q/k/v and gate/up, releasing the
    originals as it goes): the transformers model is not used afterwards.
    ``int4_group_size`` quantizes the projections (4 bits) and the LM head
    (8), with a progress bar if ``progress``.

    With ``checkpoint``, ``model`` is only its architecture (on the meta
    device) and the weights are the checkpoint's shard: this is one rank of
    a tensor-parallel group, in torch.distributed's default process group."""

    def __init__(
        self,
        model: nn.Module,
        *,
        int4_group_size: int | None = None,
        progress: bool = False,
        checkpoint: CheckpointShard | None = None,
    ) -> None:
        if (reason := unsupported(model)) is not None:
            raise ValueError(f"the Llama-family forward cannot run this model: {reason}")
        config: Any = model.config
        decoder: Any = model.model
        attention = decoder.layers[0].self_attn
        self.shard: Shard | None = None if checkpoint is None else checkpoint.shard
        self.num_heads: int = config.num_attention_heads
        self.num_kv_heads: int = config.num_key_value_heads or self.num_heads
        self.head_dim: int = attention.head_dim
        self.scaling: float = attention.scaling
        self.eps: float = config.rms_norm_eps
        self.vocab_size: int = config.vocab_size
        self.max_positions: int = config.max_position_embeddings
        window = getattr(config, "sliding_window", None)
        use_window = getattr(
            config, "use_sliding_window", True
        )  # Qwen2 has a window it does not use
        self.sliding_window: int | None = (
            window if window and use_window and window < self.max_positions else None
        )
        if checkpoint is not None:
            self._load_shard(model, checkpoint)
        else:
            self._take_weights(model, int4_group_size, progress)

    def _take_weights(self, model: Any, int4_group_size: int | None, progress: bool) -> None:
        """The weights of ``model``, its originals released as they are
        fused (or quantized, with ``int4_group_size``)."""
        decoder: Any = model.model
        self.vocab_start = 0
        self.embed: torch.Tensor = _own(decoder.embed_tokens.weight)
        self.norm: torch.Tensor = _own(decoder.norm.weight)
        self.dtype = self.embed.dtype
        self.device = self.embed.device

        def quantize(weight: torch.Tensor, *, lm_head: bool = False) -> Weight:
            if int4_group_size is None:
                return _own(weight)
            return quantize_weight(weight, int4_group_size, lm_head=lm_head)

        lm_head: Any = model.lm_head
        tied = lm_head.weight is decoder.embed_tokens.weight
        self.lm_head = (
            self.embed
            if tied and int4_group_size is None
            else quantize(lm_head.weight, lm_head=True)
        )
        if int4_group_size is not None:
            lm_head.weight = None  # the embedding keeps its own (tied or not)
        layers = decoder.layers
        if (
            int4_group_size is not None
        ):  # a few seconds for the default model on the CPU, more for large ones
            layers = tqdm(
                layers,
                desc=f"quantize to int4 (groups of {int4_group_size})",
                unit="layer",
                disable=not progress,
            )
        self.layers = [self._take(layer, quantize) for layer in layers]
        self._rotary_table(decoder.rotary_emb)  # transformers' own table

    def _load_shard(self, model: Any, checkpoint: CheckpointShard) -> None:
        """This rank's weights (:mod:`outrider.engine.shards`), and its head counts."""
        config: Any = model.config
        shard = checkpoint.shard
        q_start, q_stop = (i * self.head_dim for i in shard.part(self.num_heads))
        kv_start, kv_stop = (i * self.head_dim for i in shard.part(self.num_kv_heads))
        ffn = shard.part(config.intermediate_size)
        self.num_heads //= shard.size
        self.num_kv_heads //= shard.size
        self.embed, self.vocab_start = checkpoint.vocabulary_rows("model.embed_tokens.weight")
        self.norm = checkpoint.whole("model.norm.weight")
        self.dtype, self.device = checkpoint.dtype, checkpoint.device
        tied = getattr(config, "tie_word_embeddings", False) or "lm_head.weight" not in checkpoint
        self.lm_head = self.embed if tied else checkpoint.vocabulary_rows("lm_head.weight")[0]
        self.layers = [
            _shard_layer(
                checkpoint, f"model.layers.{i}.", (q_start, q_stop), (kv_start, kv_stop), ffn
            )
            for i in range(len(model.model.layers))
        ]
        # transformers' own table, from a rotary module of the model's class built here
        # (the meta model's holds no numbers)
        self._rotary_table(type(model.model.rotary_emb)(config=config).to(self.device))

    def _rotary_table(self, rotary: Any) -> None:
        """The cosines and sines of every position, as ``rotary`` (a
        transformers rotary embedding module) computes them."""
        positions = torch.arange(self.max_positions, device=self.device)[None]
        cos, sin = rotary(self.embed[:1], positions)
        self.cos, self.sin = cos[0], sin[0]

    @staticmethod
    def _take(layer: Any, quantize: Callable[[torch.Tensor], Weight]) -> _Layer:
        attention, mlp = layer.self_attn, layer.mlp
        projections = (attention.q_proj, attention.k_proj, attention.v_proj)
        biases = [p.bias for p in projections]
        fused = _Layer(
            qkv=quantize(torch.cat([p.weight for p in projections])),  # (cat: a copy already)
            qkv_bias=None
            if biases[0] is None
            else torch.cat(biases),  # all or none (unsupported())
            o=quantize(attention.o_proj.weight),
            gate_up=quantize(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
            down=quantize(mlp.down_proj.weight),
            input_norm=_own(layer.input_layernorm.weight),
            post_norm=_own(layer.post_attention_layernorm.weight),
            qk_norm=(_own(attention.q_norm.weight), _own(attention.k_norm.weight))
            if hasattr(attention, "q_norm")
            else None,
        )
        replaced = [*projections, mlp.gate_proj, mlp.up_proj]  # fused copies replace them
        if not isinstance(fused.o, torch.Tensor):
            replaced += [attention.o_proj, mlp.down_proj]  # and 4-bit ones these
        for module in replaced:
            module.weight = None
            module.bias = None
        return fused

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def linear_weights(self) -> list[Weight]:
        """The weights of its linear layers, the LM head's last."""
        layers = [(la.qkv, la.o, la.gate_up, la.down) for la in self.layers]
        return [weight for weights in layers for weight in weights] + [self.lm_head]

    def allocate_cache(self, num_blocks: int, block_size: int) -> torch.Tensor:
        """Keys and values of ``num_blocks`` blocks (and the null block 0),
        ``[layers, 2, num_blocks + 1, block_size, kv heads, head dim]``,
        zeroed so that padding never reads NaN.

        On the CPU the memory is an anonymous mapping: the kernel hands out
        zeroed pages as they are first written, so the pool is reserved at
        start but becomes resident only as sessions fill it."""
        shape = (self.num_layers, 2, num_blocks + 1, block_size, self.num_kv_heads, self.head_dim)
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        nbytes = math.prod(shape) * self.dtype.itemsize
        return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=self.dtype).view(shape)

    def forward(self, batch: ForwardBatch, cache: torch.Tensor) -> torch.Tensor:
        """Writes the batch's keys and values into ``cache`` and returns the
        next-token logits of the tokens ``batch.logits_indices`` names, ``[M, vocab]``."""
        return self.forward_with(batch, cache)[0]

    def forward_with(
        self, batch: ForwardBatch, cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`forward`'s logits, and the hidden states that enter the
        layers ``batch.feature_layers`` at the tokens ``batch.feature_indices``,
        side by side (``[F, layers · H]``; None when none are wanted): what an
        EAGLE-3 head reads (:mod:`outrider.eagle.head`)."""
        step = self._step(batch, cache)
        x = self._embed(batch.input_ids)
        wanted = batch.feature_indices
        features: dict[int, torch.Tensor] = {}
        for i, (layer, layer_cache) in enumerate(zip(self.layers, cache, strict=True)):
            if wanted is not None and i in batch.feature_layers:
                features[i] = x[wanted]
            h = rms_norm(x, layer.input_norm, self.eps)
            x = x + self._reduce(linear(self._attention(h, layer, layer_cache, step), layer.o))
            x = x + self._mlp(x, layer)
        if batch.logits_indices is not None:
            x = x[batch.logits_indices]
        logits = self._gather(linear(rms_norm(x, self.norm, self.eps), self.lm_head))
        if wanted is None:
            return logits, None
        return logits, torch.cat([features[i] for i in batch.feature_layers], dim=-1)

    def _step(self, batch: ForwardBatch, cache: torch.Tensor) -> _Step:
        """What every layer of the step reads: rotations, masks, gather buffers."""
        block_size = cache.shape[3]
        return _Step(
            batch,
            cos=self.cos[batch.positions].unsqueeze(1),
            sin=self.sin[batch.positions].unsqueeze(1),
            masks=[self._mask(batch.positions, group, block_size) for group in batch.groups],
            # Each group's keys and values are gathered into the same two buffers
            # in every layer: one allocation per step, not two per layer (on the
            # CPU a fresh buffer of a long context is a fresh mapping, faulted in
            # page by page).
            gathered=[
                None if group.span else self._gather_buffers(cache, group) for group in batch.groups
            ],
        )

    def _attention(
        self, h: torch.Tensor, layer: _Layer, layer_cache: torch.Tensor, step: _Step
    ) -> torch.Tensor:
        """Attention of the normed tokens ``h``: project, rotate, write this
        step's keys and values into the layer's cache, attend. ``[N, heads ·
        head dim]``, before the output projection."""
        n = h.shape[0]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = linear(h, layer.qkv, layer.qkv_bias).split(
            [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1
        )
        q, k, v = (
            q.view(n, heads, head_dim),
            k.view(n, kv_heads, head_dim),
            v.view(n, kv_heads, head_dim),
        )
        if layer.qk_norm is not None:
            q_norm, k_norm = layer.qk_norm
            q, k = rms_norm(q, q_norm, self.eps), rms_norm(k, k_norm, self.eps)
        q, k = _rotate(q, step.cos, step.sin), _rotate(k, step.cos, step.sin)
        keys, values = layer_cache[0], layer_cache[1]  # [blocks, block size, kv heads, head dim]
        keys.view(-1, kv_heads, head_dim).index_copy_(0, step.batch.slots, k)
        values.view(-1, kv_heads, head_dim).index_copy_(0, step.batch.slots, v)
        attended = [
            self._attend(q, keys, values, group, mask, buffers)
            for group, mask, buffers in zip(
                step.batch.groups, step.masks, step.gathered, strict=True
            )
        ]
        return attended[0] if len(attended) == 1 else torch.cat(attended)

    def _mlp(self, x: torch.Tensor, layer: _Layer) -> torch.Tensor:
        h = rms_norm(x, layer.post_norm, self.eps)
        gate, up = linear(h, layer.gate_up).chunk(2, dim=-1)
        return self._reduce(linear(F.silu(gate) * up, layer.down))

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings; on a rank, each from the rank that holds its row."""
        if self.shard is None:
            return F.embedding(input_ids, self.embed)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.embed.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.embed)
        return self._reduce(x.masked_fill_(outside.unsqueeze(-1), 0))

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x`` (a row-split product's partial sums)."""
        if self.shard is not None:
            dist.all_reduce(x)
        return x

    def _gather(self, logits: torch.Tensor) -> torch.Tensor:
        """Rank 0: every rank's vocabulary columns side by side, ``[M, vocab]``;
        the other ranks: their own (which nobody reads)."""
        if self.shard is None:
            return logits
        if logits.shape[0] == 0:  # (every rank has the same M)
            return logits.new_empty(0, self.vocab_size)
        logits = logits.contiguous()
        if self.shard.rank != 0:
            dist.gather(logits, None, dst=0)
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.shard.size)]
        dist.gather(logits, parts, dst=0)
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]

    def _mask(
        self, positions: torch.Tensor, group: AttentionGroup, block_size: int
    ) -> torch.Tensor | None:
        """``[rows, 1, G·T, keys]``: query ``t`` of row ``r`` sees key ``j``
        when ``j <= position`` (and within the sliding window). Keys past a
        row's length are at later positions, so they are never seen; every
        query sees key 0, so no row of the softmax is empty. None where
        attention needs none: one token over a span read in place (it sees
        every key), or a row's first tokens (a causal pass from key 0)."""
        t = group.tokens_per_row
        if group.span is not None and self.sliding_window is None and (t == 1 or _starts(group)):
            return None
        query = positions[group.start : group.start + group.rows * t].view(group.rows, t, 1)
        width = group.span[1] if group.span else group.block_table.shape[1] * block_size
        key = torch.arange(width, device=positions.device)
        seen = key <= query
        if self.sliding_window is not None:
            seen &= key > query - self.sliding_window
        # Additive (0 or -inf) in the model's dtype, made once per step:
        # attention would otherwise convert a boolean mask in every layer.
        mask = torch.zeros(seen.shape, dtype=self.dtype, device=seen.device)
        mask.masked_fill_(~seen, float("-inf"))
        return mask.unsqueeze(1).repeat(1, 1, self.num_heads // self.num_kv_heads, 1)

    @staticmethod
    def _gather_buffers(
        cache: torch.Tensor, group: AttentionGroup
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Room for one layer's keys and for its values of ``group``'s rows,
        one block per row of the flattened block table."""
        per_block = math.prod(cache.shape[3:])
        size = (group.block_table.numel(), per_block)
        return cache.new_empty(size), cache.new_empty(size)

    def _attend(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        group: AttentionGroup,
        mask: torch.Tensor | None,
        buffers: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """Attention of one group's queries over their rows' cached keys and
        values, ``[rows · T, heads · head dim]``. The query heads that share
        a key head are stacked along the query axis (``[rows, kv heads,
        G·T, head dim]``), so keys and values are read once, never repeated."""
        rows, t, kv_heads, head_dim = (
            group.rows,
            group.tokens_per_row,
            self.num_kv_heads,
            self.head_dim,
        )
        per_kv = self.num_heads // kv_heads
        if group.span is not None:
            first, length = group.span
            blocks = -(-length // keys.shape[1])
            k, v = (
                cached[first : first + blocks].flatten(0, 1)[:length].unsqueeze(0).transpose(1, 2)
                for cached in (keys, values)
            )
        else:
            assert buffers is not None
            width = group.block_table.shape[1] * keys.shape[1]
            table = group.block_table.flatten()
            k, v = (
                torch.index_select(cached.flatten(1), 0, table, out=buffer)
                .view(rows, width, kv_heads, head_dim)
                .transpose(1, 2)
                for cached, buffer in zip((keys, values), buffers, strict=True)
            )
        if t > 1 and mask is None:
            # A row's first tokens: a causal pass from key 0, as transformers
            # prefills a prompt (no mask to build or read).
            q = q[group.start : group.start + t].unsqueeze(0).transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.scaling, enable_gqa=True
            )
            return out.transpose(1, 2).reshape(t, -1)
        q = q[group.start : group.start + rows * t].view(rows, t, kv_heads, per_kv, head_dim)
        q = q.permute(0, 2, 3, 1, 4).reshape(rows, kv_heads, per_kv * t, head_dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling)
        return (
            out.view(rows, kv_heads, per_kv, t, head_dim)
            .permute(0, 3, 1, 2, 4)
            .reshape(rows * t, -1)
        )


def _starts(group: AttentionGroup) -> bool:
    """Whether ``group`` is one row's first tokens, read in place: its keys
    are its own queries', and each query sees those up to its own."""
    return group.span is not None and group.span[1] == group.tokens_per_row


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` of a float or quantized weight."""
    if not isinstance(weight, torch.Tensor):
        return weight.linear(x, bias)
    return ops.linear(x, weight, bias)


def _own(weight: torch.Tensor) -> torch.Tensor:
    """A copy of ``weight`` in memory of the forward's own. A loaded
    checkpoint's tensors are views of its memory-mapped file, and one view
    kept keeps every page of the file that loading touched resident."""
    return weight.detach().clone()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm``, step for step (in float32, whatever the dtype)."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``apply_rotary_pos_emb`` for one of q or k."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
