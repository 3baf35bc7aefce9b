"""Builders for tiny, deterministic models and tokenizers used across the test suite.

Nothing here touches the network: the tokenizers are trained with the `tokenizers`
library on a small built-in corpus, and the models are random `LlamaForCausalLM`s
initialised from a seed. The same arguments always produce the same files, so a
"draft" built with the target's seed is an exact copy of it (every draft token is
accepted) and one built with another seed is unrelated (most are rejected).

* `build_tiny_tokenizer` — byte-level BPE like GPT-2 / SmolLM2 (`Ġ` spaces; any
  UTF-8 text round-trips; a CJK character or an emoji spans several tokens), with
  ChatML special tokens and chat template.
* `build_tiny_sentencepiece_tokenizer` — Llama-2-style BPE (`▁` spaces, byte
  fallback, and a decoder that strips the leading space of the decoded text), the
  kind whose first generated token decodes differently alone than after the prompt.
* `build_tiny_llama` — a random Llama whose logits are far from ties.
* `build_tiny_model_dir` — a self-contained model directory (weights + tokenizer).
* `build_tiny_head` — a random EAGLE-3 draft head for a tiny target, saved as published.
* `LLAMA_FAMILY` — one tiny model of each architecture the Llama-family forward runs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

FAMILY_SHAPE = dict(
    vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)  # fmt: skip
"""4 heads over 2 KV heads; a vocabulary of 97, which two ranks split unevenly."""
LLAMA_FAMILY = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**FAMILY_SHAPE)),
    "qwen2 (q/k/v biases)": lambda: Qwen2ForCausalLM(Qwen2Config(**FAMILY_SHAPE)),
    "qwen3 (q/k norms, head_dim 24)": lambda: Qwen3ForCausalLM(
        Qwen3Config(**FAMILY_SHAPE, head_dim=24)
    ),
    "mistral (sliding window 7)": lambda: MistralForCausalLM(
        MistralConfig(**FAMILY_SHAPE, sliding_window=7)
    ),
}
"""The architectures of the Llama-family forward, each in ``FAMILY_SHAPE``
(random weights from torch's current seed)."""

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
EOS_TOKEN_ID = 2

# SmolLM2's template, minus the default system prompt.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS: tuple[str, ...] = (
    "Speculative decoding lets a small draft model propose several tokens at once. "
    "The large target model then verifies all of them in a single forward pass, "
    "accepting the longest prefix it agrees with and adding one token of its own.",
    "The quick brown fox jumps over the lazy dog. The dog does not mind; it is a very "
    "lazy dog, and the fox is a very quick fox. Hello world, hello again, world!",
    "Once upon a time there was a little robot who wanted to write poems. Every morning "
    "it read the news, and every evening it wrote a short verse about the weather.",
    "User: What is the capital of France?\nAssistant: The capital of France is Paris.\n"
    "User: And of Japan?\nAssistant: The capital of Japan is Tokyo.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints 5\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000; punctuation: , . ; : ! ? ( ) [ ] { } \" '",
    # A little non-ASCII so that a few multi-byte characters get merged tokens of their
    # own while most of them stay split across byte tokens.
    "Café, crème brûlée, naïve, résumé, héllo wörld, Straße, Ångström, señor, façade.",
    "日本語のテキスト。東京は日本の首都です。こんにちは世界。",
    "Emoji: 🙂 😀 🚀 ❤️ — «guillemets» and “quotes” … 你好，世界！ Привет, мир!",
)


def _train_bpe(tokenizer: Tokenizer, trainer: trainers.BpeTrainer) -> Tokenizer:
    # Repeat the English part so its merges dominate and the non-ASCII text keeps
    # multi-token characters.
    tokenizer.train_from_iterator([*CORPUS[:6] * 8, *CORPUS], trainer=trainer)
    return tokenizer


def _save(tokenizer: Tokenizer, path: Path) -> PreTrainedTokenizerFast:
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=None,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=None,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t != EOS_TOKEN],
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
    fast.chat_template = CHATML_TEMPLATE
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(path)
    return fast


def build_tiny_tokenizer(path: Path, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer (GPT-2 / SmolLM2 style), save it to `path` and return it.

    Ids 0, 1, 2 are `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`; eos is `<|im_end|>`, no bos.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    return _save(_train_bpe(tokenizer, trainer), path)


def build_tiny_sentencepiece_tokenizer(
    path: Path, vocab_size: int = 512
) -> PreTrainedTokenizerFast:
    """Train a Llama-2-style BPE tokenizer (`▁` spaces, byte fallback), save
    it to `path` and return it.

    Its decoder drops the leading space of the decoded text, so `decode([▁world])` is
    "world" while `decode([▁hello, ▁world])` is "hello world".
    """
    tokenizer = Tokenizer(models.BPE(byte_fallback=True, fuse_unk=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first", split=True
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 256,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        # The whole alphabet, given up front: with `limit_alphabet` the trainer breaks ties
        # between equally rare characters differently on every run.
        initial_alphabet=sorted(set("".join(CORPUS).replace(" ", "▁")) | {"▁"}),
        show_progress=False,
    )
    trained = json.loads(_train_bpe(tokenizer, trainer).to_str())
    # Insert the 256 byte-fallback tokens <0x00>..<0xFF> right after the special tokens.
    old_vocab: dict[str, int] = trained["model"]["vocab"]
    ordered = sorted(old_vocab, key=old_vocab.__getitem__)
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    n_special = len(SPECIAL_TOKENS)
    new_order = (
        ordered[:n_special] + byte_tokens + [t for t in ordered[n_special:] if t not in byte_tokens]
    )
    trained["model"]["vocab"] = {token: i for i, token in enumerate(new_order)}
    trained["model"]["byte_fallback"] = True
    trained["model"]["unk_token"] = None
    trained["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    return _save(Tokenizer.from_str(json.dumps(trained)), path)


def tiny_llama(dtype: torch.dtype = torch.float32, num_layers: int = 2) -> LlamaForCausalLM:
    """A random Llama in memory (seed 0), small enough for unit tests of loading and layers."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    return LlamaForCausalLM(config).to(dtype).eval()


def build_tiny_llama(
    path: Path,
    *,
    vocab_size: int,
    seed: int,
    num_layers: int = 2,
    hidden_size: int = 64,
    dtype: torch.dtype = torch.float64,
    eos_token_id: int = EOS_TOKEN_ID,
    max_position_embeddings: int = 512,
) -> Path:
    """Save a random `LlamaForCausalLM` (initialised from `seed`) to `path` and return `path`.

    Embeddings and lm_head are drawn with std 0.5 (instead of 0.02) so that logits are
    spread out: argmaxes are stable and greedy generation does not collapse into one token.
    """
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):  # seed the init without touching the caller's RNG
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in (model.model.embed_tokens.weight, model.lm_head.weight):
            weight.copy_(torch.randn(weight.shape, generator=generator) * 0.5)
    model = model.to(dtype)
    model.config.dtype = dtype
    model.generation_config = GenerationConfig(
        bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=eos_token_id, do_sample=False
    )
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    return path


def build_tiny_model_dir(
    path: Path, tokenizer_dir: Path, *, seed: int, **llama_kwargs: Any
) -> Path:
    """A self-contained model directory: a tiny Llama sized to the tokenizer,
    plus the tokenizer files."""
    tokenizer_files = [f for f in sorted(tokenizer_dir.iterdir()) if f.is_file()]
    vocab_size = len(AutoTokenizer.from_pretrained(tokenizer_dir))
    build_tiny_llama(path, vocab_size=vocab_size, seed=seed, **llama_kwargs)
    for file in tokenizer_files:
        shutil.copyfile(file, path / file.name)
    return path


def build_tiny_head(path: Path, target_dir: Path, *, seed: int, draft_vocab_size: int = 0) -> Path:
    """Save a random EAGLE-3 head for the target in ``target_dir`` to ``path``
    (its draft vocabulary: a random ``draft_vocab_size`` of the target's ids,
    by default half of them) and return ``path``."""
    from transformers import AutoConfig

    from outrider.eagle.head import EagleHead, HeadConfig

    target = AutoConfig.from_pretrained(target_dir)
    size = draft_vocab_size or target.vocab_size // 2
    generator = torch.Generator().manual_seed(seed)
    head = EagleHead(HeadConfig.for_target(target, draft_vocab_size=size))
    with torch.no_grad():
        for name, parameter in head.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5, generator=generator)
            else:
                parameter.normal_(0.0, 0.5, generator=generator)
        head.set_draft_vocab(torch.randperm(target.vocab_size, generator=generator)[:size])
    head.save(path)
    return path


def build_tiny_gguf(
    model_dir: Path,
    path: Path,
    *,
    tokenizer_dir: Path | None = None,
    vocabulary: list[str] | None = None,
) -> Path:
    """Write the tiny Llama in ``model_dir`` as a GGUF file at ``path`` (float32
    weights, a byte-level BPE vocabulary) that llama.cpp runs as a draft: the
    same model, so nearly every draft is accepted. Its vocabulary is the
    tokenizer's in ``tokenizer_dir`` (default: the model's own), so a
    tokenizer other than the target's makes a GGUF the draft worker refuses;
    or ``vocabulary``, tokens in id order (for a model without a tokenizer;
    llama.cpp wants merges: it gets one, of its first two tokens).

    The q and k projections are permuted as llama.cpp's ``convert_hf_to_gguf.py``
    permutes them (llama.cpp's rotary embedding pairs neighbouring dimensions,
    transformers' the two halves of each head)."""
    import gguf
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if vocabulary is None:
        tokenizer = json.loads(((tokenizer_dir or model_dir) / "tokenizer.json").read_text())
        vocab = dict(tokenizer["model"]["vocab"])
        vocab.update({added["content"]: added["id"] for added in tokenizer["added_tokens"]})
        special = {added["id"] for added in tokenizer["added_tokens"] if added["special"]}
        merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    else:
        vocab, special = {token: i for i, token in enumerate(vocabulary)}, set()
        merges = [f"{vocabulary[0]} {vocabulary[1]}"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    tokens += [f"[PAD{i}]" for i in range(len(tokens), config.vocab_size)]

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [
            gguf.TokenType.CONTROL
            if i in special
            else gguf.TokenType.UNUSED
            if i >= len(vocab)
            else gguf.TokenType.NORMAL
            for i in range(len(tokens))
        ]
    )
    writer.add_token_merges(merges)
    writer.add_eos_token_id(min(EOS_TOKEN_ID, len(tokens) - 1))
    writer.add_add_bos_token(False)

    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads

    def permute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
        return (
            weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
            .swapaxes(1, 2)
            .reshape(weight.shape)
        )

    state = model.state_dict()
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for i in range(config.num_hidden_layers):
        for hf, ours in per_layer.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{ours}.weight"
    for hf_name, gguf_name in names.items():
        tensor = state[hf_name]
        if gguf_name.endswith("attn_q.weight"):
            tensor = permute(tensor, heads)
        elif gguf_name.endswith("attn_k.weight"):
            tensor = permute(tensor, kv_heads)
        writer.add_tensor(gguf_name, tensor.contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
