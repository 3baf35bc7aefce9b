"""The llama.cpp runner of the gguf drafter, on a tiny GGUF the tests write
(``tests.tiny.build_tiny_gguf``): a step's rows in one decode give each row
the logits it would get alone; a crop forgets what it dropped, so the next
feed sees what a fresh prefill would; sequences and cells are handed back."""

from __future__ import annotations

import pytest
import torch

from outrider import gguf_files, model_specs
from outrider.engine import gguf_runner
from outrider.engine.gguf_runner import GgufRunner, SequenceCache
from outrider.engine.scheduler import Row
from outrider.errors import ResourceExhausted

pytest.importorskip("llama_cpp", reason="the gguf drafter needs llama-cpp-python")

HISTORY = [5, 40, 77, 100, 3, 250, 17, 9, 311, 64, 128, 200]


@pytest.fixture
def runner(tiny_gguf):
    runner = GgufRunner.load(tiny_gguf, max_sessions=4, max_cached_tokens=256, threads=1)
    yield runner
    runner.close()


def feed(runner: GgufRunner, kv: SequenceCache, tokens: list[int], num_logits: int = 1):
    kv.reserve(len(kv) + len(tokens))
    (out,) = runner.execute([Row(kv, tokens, num_logits)])
    return out


def greedy(runner: GgufRunner, prompt: list[int], n: int) -> list[int]:
    kv = runner.new_kv()
    out = feed(runner, kv, prompt)
    tokens = []
    for _ in range(n):
        tokens.append(out.argmax[-1])
        out = feed(runner, kv, [tokens[-1]])
    kv.free()
    return tokens


def test_the_gguf_decodes_as_the_checkpoint_it_was_written_from(runner, tiny_target_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32)
    expected = model.generate(torch.tensor([HISTORY]), max_new_tokens=24, do_sample=False)
    assert greedy(runner, HISTORY, 24) == expected[0, len(HISTORY) :].tolist()


def test_rows_of_one_step_get_the_logits_each_gets_alone(runner):
    histories = [HISTORY[:5], HISTORY, HISTORY[3:9]]
    alone = []
    for history in histories:
        kv = runner.new_kv()
        alone.append(feed(runner, kv, history, num_logits=2))
        kv.free()
    caches = [runner.new_kv() for _ in histories]
    for kv, history in zip(caches, histories, strict=True):
        kv.reserve(len(history))
    together = runner.execute([Row(kv, h, 2) for kv, h in zip(caches, histories, strict=True)])
    for one, both in zip(alone, together, strict=True):
        assert both is not None and both.values.shape == (2, runner.vocab_size)
        torch.testing.assert_close(both.values, one.values, rtol=1e-4, atol=1e-4)
        assert both.argmax == one.argmax
    assert [len(kv) for kv in caches] == [len(h) for h in histories]


def test_after_a_crop_the_next_feed_sees_what_a_fresh_prefill_would(runner):
    kv = runner.new_kv()
    feed(runner, kv, HISTORY)
    kv.crop(6)  # a rejected draft's rollback: positions 6.. forgotten
    after_crop = feed(runner, kv, [99, 98])
    fresh = runner.new_kv()
    expected = feed(runner, fresh, [*HISTORY[:6], 99, 98])
    torch.testing.assert_close(after_crop.values, expected.values, rtol=1e-4, atol=1e-4)
    assert kv.token_ids == [*HISTORY[:6], 99, 98]


def test_a_step_longer_than_a_decode_runs_in_pieces(runner, monkeypatch):
    kv = runner.new_kv()
    whole = feed(runner, kv, HISTORY, num_logits=3)
    kv.free()
    monkeypatch.setattr(gguf_runner, "MAX_BATCH_TOKENS", 5)  # logits span two pieces
    kv = runner.new_kv()
    pieces = feed(runner, kv, HISTORY, num_logits=3)
    torch.testing.assert_close(pieces.values, whole.values, rtol=1e-4, atol=1e-4)


def test_sequences_and_cells_go_back_when_a_session_is_freed(runner):
    caches = [runner.new_kv() for _ in range(4)]
    for kv in caches:
        kv.reserve(len(HISTORY))
    assert sorted(kv.sequence for kv in caches) == [0, 1, 2, 3]
    with pytest.raises(ResourceExhausted, match="no free sequence"):
        runner.new_kv().reserve(1)
    caches[2].free()
    caches[2].free()  # idempotent
    reused = runner.new_kv()
    reused.reserve(4)
    assert reused.sequence == 2
    for kv in [*caches, reused]:
        kv.free()
    assert runner.pool.used_blocks == 0


def test_a_full_context_refuses_a_reserve(runner):
    kv = runner.new_kv()
    with pytest.raises(ResourceExhausted, match="cache is full"):
        kv.reserve(runner.pool.capacity + 1)


def test_more_sessions_than_llama_cpp_runs_is_refused(tiny_gguf):
    with pytest.raises(ValueError, match="at most 256 sequences"):
        GgufRunner.load(tiny_gguf, max_sessions=257, max_cached_tokens=256, threads=1)


def test_a_file_llama_cpp_cannot_read_is_refused_with_its_reason(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(64))
    with pytest.raises(ValueError, match="llama.cpp does not load it"):
        GgufRunner.load(broken, max_sessions=1, max_cached_tokens=16, threads=1)


# --- which file, and its vocabulary ----------------------------------------------------


def test_the_vocabulary_fingerprint_is_the_tokenizers(
    tiny_gguf, tiny_target_dir, tiny_gguf_other_vocab
):
    assert gguf_files.vocab_fingerprint(tiny_gguf) == model_specs.vocab_fingerprint_of(
        str(tiny_target_dir)
    )
    assert gguf_files.vocab_fingerprint(tiny_gguf_other_vocab) != gguf_files.vocab_fingerprint(
        tiny_gguf
    )


def test_a_gguf_spec_is_a_file_a_directory_holding_one_or_an_embedded_name(
    tiny_gguf, tmp_path, monkeypatch
):
    assert gguf_files.gguf_path(str(tiny_gguf)) == tiny_gguf
    assert gguf_files.gguf_path(str(tiny_gguf.parent)) == tiny_gguf
    with pytest.raises(gguf_files.NotAGguf, match="holding no .gguf file"):
        gguf_files.gguf_path(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(gguf_files.NotAGguf, match="not a GGUF file"):
        gguf_files.gguf_path(str(tmp_path / "weights.bin"))
    with pytest.raises(gguf_files.NotAGguf, match="no such file"):
        gguf_files.gguf_path(str(tmp_path / "missing.gguf"))
    monkeypatch.setenv("OUTRIDER_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(model_specs.ModelNotFetchedError):
        gguf_files.gguf_path(None)
    fetched = model_specs.model_path(model_specs.DEFAULT_MODEL)
    fetched.mkdir(parents=True)
    (fetched / model_specs._MARKER).write_text("{}")
    kept = fetched / model_specs.EMBEDDED_MODELS[model_specs.DEFAULT_MODEL].gguf_name
    kept.write_bytes(b"GGUF")
    assert gguf_files.gguf_path(None) == kept == gguf_files.gguf_path(model_specs.DEFAULT_MODEL)


def test_the_tokenizer_beside_a_fetched_gguf_is_its_checkpoints(tiny_gguf, tiny_target_dir):
    tokenizer, eos = gguf_files.load_tokenizer(tiny_gguf)  # no tokenizer.json beside it
    reference = model_specs.load_tokenizer(str(tiny_target_dir))
    assert tokenizer.get_vocab() == reference.get_vocab()
    assert tokenizer.eos_token_id in eos
