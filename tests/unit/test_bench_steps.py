"""`outrider bench steps`: what one forward step costs, on random weights in a tiny shape."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import LlamaConfig

from outrider.bench.options import Shape, parse_config_override, parse_shapes
from outrider.cli import build_parser, main


def test_shapes_parse_in_the_order_given():
    assert parse_shapes("8x5, 1x1") == (Shape(8, 5), Shape(1, 1))
    assert ",".join(map(str, parse_shapes("1x1,1x5"))) == "1x1,1x5"
    for bad in ("", "8", "8x", "0x1", "1x2x3", "axb"):
        with pytest.raises(ValueError, match="give ROWSxTOKENS"):
            parse_shapes(bad)


def test_config_overrides_take_json_values():
    assert parse_config_override("hidden_size=2048") == ("hidden_size", 2048)
    assert parse_config_override('hidden_act="gelu"') == ("hidden_act", "gelu")
    for bad in ("hidden_size", "=1", "hidden_act=gelu"):
        with pytest.raises(ValueError, match="give KEY=VALUE"):
            parse_config_override(bad)


def test_steps_flags_keep_the_script_s_defaults():
    args = build_parser().parse_args(["bench", "steps", "--shape", "a=1", "--shape", "b=[2]"])
    assert args.bench_command == "steps"
    assert (args.model, args.device, args.dtype, args.context, args.repeats) == (
        None, "auto", "auto", 512, 20
    )  # fmt: skip
    assert args.shapes == parse_shapes("1x1,1x5,8x1,8x5")
    assert args.shape == (("a", 1), ("b", [2]))


def test_every_shape_is_timed_against_transformers_one_token_step(tmp_path, capsys):
    config = tmp_path / "config"  # a directory holding only a config: random weights
    LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
    ).save_pretrained(config)  # fmt: skip
    flags = ["--model", str(config), "--shapes", "1x1,2x3", "--context", "8", "--repeats", "1"]
    out = tmp_path / "steps.json"
    assert main(["bench", "steps", *flags, "--threads", "1", "--json", str(out), "--no-hf"]) == 0
    report = json.loads(out.read_text())
    assert (report["model"], report["context"], report["device"]) == (str(config), 8, "cpu")
    rows = {row["shape"]: row for row in report["rows"]}
    assert list(rows) == ["1x1", "2x3"]
    assert rows["1x1"]["hf_ms"] == report["hf_unit_ms"] and rows["2x3"]["hf_ms"] is None
    assert all(row["engine_ms"] > 0 and row["graph_ms"] is None for row in rows.values())
    assert all(row["head_ms"] > 0 for row in rows.values())  # a random head of the model's shape
    out = capsys.readouterr().out
    table = out[out.index(f"\n{config} on cpu") + 1 :].splitlines()
    assert table[0].startswith(f"{config} on cpu in float32, context 8; transformers' 1-token")
    assert table[2].split() == [
        "rows×tokens", "hf", "(rows", "calls)", "engine", "engine", "graph", "EAGLE-3", "head"
    ]  # fmt: skip
    assert table[3].split()[:3] == ["1x1", f"{report['hf_unit_ms']:.2f}", "ms"]


def test_a_model_beside_its_gguf_is_timed_on_llama_cpp_too(tmp_path, tiny_target_dir, tiny_gguf):
    pytest.importorskip("llama_cpp", reason="the gguf column needs llama-cpp-python")
    model = tmp_path / "model"
    shutil.copytree(tiny_target_dir, model)
    shutil.copyfile(tiny_gguf, model / tiny_gguf.name)
    flags = ["--model", str(model), "--shapes", "1x1,2x3", "--context", "8", "--repeats", "1"]
    out = tmp_path / "steps.json"
    assert main(["bench", "steps", *flags, "--threads", "1", "--json", str(out), "--no-hf"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert all(row["gguf_ms"] > 0 for row in rows)
