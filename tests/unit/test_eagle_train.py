"""``outrider draft train``: the training-time-test unroll against the
head's reference forward, learning, saving, resuming and the command line,
on a tiny random Llama target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig

from outrider.cli import build_parser, main
from outrider.eagle import data as eagle_data
from outrider.eagle.head import EagleHead, HeadConfig, load_head
from outrider.eagle.instructions import instructions
from outrider.eagle.train import CHECKPOINT, TrainOptions, train
from outrider.eagle.ttt import Vocab, batch_loss, collate, draft_vocab, unroll, warm_start
from outrider.engine.causal_lm import load_causal_lm
from tests.tiny import build_tiny_model_dir, build_tiny_tokenizer

DRAFT_VOCAB = 64


@pytest.fixture(autouse=True)
def logging_left_alone(monkeypatch):
    """The command configures structlog to print to stderr, which is the
    test's captured stream: later tests in this process would print to it
    once it is closed."""
    monkeypatch.setattr("outrider.logging.configure_logging", lambda *args, **kwargs: None)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("eagle")
    build_tiny_tokenizer(root / "tokenizer")
    return build_tiny_model_dir(root / "target", root / "tokenizer", seed=3, num_layers=4)


@pytest.fixture(scope="module")
def conversations(target_dir, tmp_path_factory) -> list[eagle_data.Conversation]:
    """40 tiny conversations, generated and featurised through the cache."""
    from outrider.model_specs import load_tokenizer

    config = AutoConfig.from_pretrained(target_dir)
    settings = eagle_data.DataSettings(
        target="tiny", target_fingerprint="", seed=0, max_new_tokens=12, temperature=0.7,
        aux_layers=HeadConfig.for_target(config, draft_vocab_size=1).aux_layers,
    )  # fmt: skip
    cache = eagle_data.DataCache(tmp_path_factory.mktemp("data"), settings)
    model = load_causal_lm(str(target_dir), fast_small_batch=False)
    texts = instructions(40, seed=0)
    generated = eagle_data.generate(
        cache,
        texts,
        model,
        load_tokenizer(str(target_dir)),
        batch_size=16,
        device=torch.device("cpu"),
    )
    eagle_data.extract(cache, generated, 40, model, batch_size=8, device=torch.device("cpu"))
    return eagle_data.load(cache, 40)


def _head(
    target_dir: Path, conversations=None, *, seed: int = 0
) -> tuple[EagleHead, torch.Tensor, object]:
    config = AutoConfig.from_pretrained(target_dir)
    torch.manual_seed(seed)
    head = EagleHead(HeadConfig.for_target(config, draft_vocab_size=DRAFT_VOCAB))
    target = load_causal_lm(str(target_dir), fast_small_batch=False)
    if conversations is not None:
        head.set_draft_vocab(draft_vocab(conversations, DRAFT_VOCAB, config.vocab_size))
    return head, target.model.embed_tokens.weight.detach(), target


def test_ttt_step_zero_is_the_reference_forward(target_dir):
    head, embed, _ = _head(target_dir)
    c = head.config
    ids = torch.randint(0, c.vocab_size, (2, 9))
    aux = torch.randn(2, 9, c.feature_width)
    prenorms = unroll(head, embed, aux, ids, steps=3)
    tokens = torch.cat([ids[:, 1:], torch.zeros(2, 1, dtype=torch.long)], dim=1)
    _, reference = head(F.embedding(tokens, embed), head.fc(aux), torch.arange(9).expand(2, 9))
    torch.testing.assert_close(prenorms[0], reference, atol=1e-5, rtol=1e-5)
    # a later step's padding columns never reach a real row: rows before the end are unchanged
    short = unroll(head, embed, aux[:, :6], ids[:, :6], steps=3)
    for j in range(3):
        torch.testing.assert_close(short[j][:, : 6 - 1 - j], prenorms[j][:, : 6 - 1 - j])


def test_ttt_step_two_attends_to_the_prefix_and_its_own_diagonal(target_dir):
    """Step 2 at row t is one query over step 0's keys at rows ≤ t and
    steps 1 and 2's keys at row t, at positions t + 1 and t + 2."""
    head, embed, _ = _head(target_dir)
    c = head.config
    ids = torch.randint(0, c.vocab_size, (1, 7))
    aux = torch.randn(1, 7, c.feature_width)
    p0, p1, p2 = unroll(head, embed, aux, ids, steps=3)
    t = 3
    positions = torch.arange(7)[None]

    def kv(features, j):
        tokens = torch.cat([ids[:, 1 + j :], torch.zeros(1, 1 + j, dtype=torch.long)], dim=1)
        x, residual = head.attend_inputs(F.embedding(tokens, embed), features)
        q, k, v = head.project(x, positions + j)
        return q, k, v, residual

    _, k0, v0, _ = kv(head.fc(aux), 0)
    _, k1, v1, _ = kv(p0, 1)
    q2, k2, v2, residual2 = kv(p1, 2)
    keys = torch.cat([k0[..., : t + 1, :], k1[..., t : t + 1, :], k2[..., t : t + 1, :]], dim=-2)
    values = torch.cat([v0[..., : t + 1, :], v1[..., t : t + 1, :], v2[..., t : t + 1, :]], dim=-2)
    out = F.scaled_dot_product_attention(
        q2[..., t : t + 1, :], keys, values, enable_gqa=True, scale=c.head_dim**-0.5
    )
    expected = head.finish(out.transpose(-2, -3).flatten(-2), residual2[:, t : t + 1])
    torch.testing.assert_close(p2[:, t : t + 1], expected, atol=1e-5, rtol=1e-5)


def test_training_a_few_dozen_steps_lowers_the_loss(target_dir, conversations):
    head, embed, target = _head(target_dir, conversations)
    warm_start(head, target)
    vocab = Vocab(head)
    batch = collate(conversations[:8])
    optimizer = torch.optim.AdamW(head.parameters(), lr=2e-3)
    losses = []
    for _ in range(30):
        loss, stats = batch_loss(head, vocab, embed, batch, steps=3)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert len(stats) == 3 and all(n > 0 for _, n in stats)
    assert losses[-1] < 0.5 * losses[0]


def test_a_saved_head_loads_back_with_the_same_logits(target_dir, conversations, tmp_path):
    head, embed, target = _head(target_dir, conversations)
    warm_start(head, target)
    head.save(tmp_path / "head")
    loaded = load_head(tmp_path / "head")
    assert torch.equal(loaded.draft_to_target, head.draft_to_target)
    assert loaded.config == head.config
    batch = collate(conversations[:2])
    aux = batch.aux.float()
    with torch.no_grad():
        a = [head.logits(p) for p in unroll(head, embed, aux, batch.ids, steps=2)]
        b = [loaded.logits(p) for p in unroll(loaded, embed, aux, batch.ids, steps=2)]
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y)


def _options(target_dir: Path, tmp_path: Path, **overrides) -> TrainOptions:
    fields = dict(
        target=str(target_dir), out=tmp_path / "out", instructions=40, max_new_tokens=12,
        draft_vocab_size=DRAFT_VOCAB, ttt_steps=2, epochs=1, batch_size=8, lr=2e-3,
        label_topk=4, threads=1, data_dir=tmp_path / "data", generate_batch_size=16,
    )  # fmt: skip
    return TrainOptions(**{**fields, **overrides})


def test_a_run_writes_the_head_and_resume_continues_from_its_checkpoint(target_dir, tmp_path):
    first = train(_options(target_dir, tmp_path))
    out = tmp_path / "out"
    assert {"config.json", "model.safetensors", "training.json", "training.png"} <= {
        p.name for p in out.iterdir()
    }
    steps = first["training"]["steps"]
    assert steps > 0
    report = json.loads((out / "training.json").read_text())
    assert len(report["held_out"]["acceptance_by_position"]) == 2
    load_head(out)
    checkpoint = torch.load(out / "checkpoints" / CHECKPOINT, weights_only=False)
    assert checkpoint["progress"]["step"] == steps and checkpoint["optimizer"]["state"]

    second = train(_options(target_dir, tmp_path, epochs=2, resume=True))
    assert second["training"]["steps"] == 2 * steps
    resumed = torch.load(out / "checkpoints" / CHECKPOINT, weights_only=False)
    assert resumed["progress"]["epoch"] == 2
    assert resumed["progress"]["history"][:steps] == checkpoint["progress"]["history"]
    # the optimizer's state carried on: Adam's step counts every step
    assert all(s["step"] == 2 * steps for s in resumed["optimizer"]["state"].values())


def test_the_command_parses_and_describes_its_flags(capsys):
    args = build_parser().parse_args(["draft", "train", "--out", "/tmp/x", "--ttt-steps", "3"])
    assert (args.command, args.draft_command, args.ttt_steps) == ("draft", "train", 3)
    with pytest.raises(SystemExit) as exit_:
        main(["draft", "train", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--target", "--out", "--draft-vocab-size", "--ttt-steps", "--resume", "--device"):
        assert flag in text


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--target", "{tmp}"], "not a model checkpoint"),
        (["--target", "{qwen}"], "Llama family"),
        (["--target", "{tiny}", "--out", "{file}"], "is a file"),
        (["--target", "{tiny}", "--epochs", "0"], "--epochs must be at least 1"),
        (["--target", "{tiny}", "--resume"], "no checkpoint"),
    ],
)
def test_a_bad_flag_is_a_one_line_error(flags, message, target_dir, tmp_path, capsys):
    from transformers import GPT2Config

    (tmp_path / "file").write_text("")
    GPT2Config(n_layer=2).save_pretrained(tmp_path / "gpt2")
    values = {
        "tmp": tmp_path,
        "qwen": tmp_path / "gpt2",
        "tiny": target_dir,
        "file": tmp_path / "file",
    }
    argv = ["draft", "train", "--out", str(tmp_path / "out")] + [f.format(**values) for f in flags]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_run_on_cuda(target_dir, tmp_path):
    report = train(_options(target_dir, tmp_path, device="cuda"))
    assert report["training"]["steps"] > 0
