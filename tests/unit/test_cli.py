"""The command line: every command has --help; flags fall back to OUTRIDER_* variables."""

import subprocess
import sys

import pytest

from outrider.cli import build_parser


@pytest.mark.parametrize(
    "command",
    [
        ["--help"],
        ["up", "--help"],
        ["demo", "--help"],
        ["serve", "--help"],
        ["serve", "coordinator", "--help"],
        ["serve", "draft", "--help"],
        ["serve", "target", "--help"],
        ["generate", "--help"],
        ["models", "--help"],
        ["models", "fetch", "--help"],
        ["models", "path", "--help"],
    ],
)
def test_every_command_has_help(command):
    out = subprocess.run([sys.executable, "-m", "outrider", *command], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "usage: outrider" in out.stdout


def test_flags_default_to_outrider_environment_variables(monkeypatch):
    monkeypatch.setenv("OUTRIDER_PORT", "6001")
    monkeypatch.setenv("OUTRIDER_TARGET", "a:1,b:2")
    monkeypatch.setenv("OUTRIDER_TRUST_REMOTE_CODE", "false")
    args = build_parser().parse_args(["serve", "coordinator"])
    assert args.port == 6001
    assert args.target == ("a:1", "b:2")
    args = build_parser().parse_args(["serve", "target", "--port", "7"])
    assert args.port == 7  # a flag on the command line wins
    assert args.trust_remote_code is False


def test_worker_engine_flags_come_from_the_environment_too(monkeypatch):
    monkeypatch.setenv("OUTRIDER_DEVICE", "cuda:1")
    monkeypatch.setenv("OUTRIDER_MAX_TOKENS_PER_STEP", "512")
    monkeypatch.setenv("OUTRIDER_ENFORCE_EAGER", "true")
    args = build_parser().parse_args(["serve", "target"])
    assert (args.device, args.dtype, args.max_tokens_per_step, args.enforce_eager) == ("cuda:1", "auto", 512, True)


@pytest.mark.parametrize(
    "variable, value, message",
    [
        ("OUTRIDER_MAX_SESSIONS", "abc", "OUTRIDER_MAX_SESSIONS='abc' is not a valid --max-sessions"),
        ("OUTRIDER_DEVICE", "gpu", "device 'gpu': use auto, cpu, cuda or cuda:N"),
    ],
)
def test_a_bad_environment_value_is_a_usage_error_naming_the_variable(monkeypatch, capsys, variable, value, message):
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as exit_:
        build_parser()
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_serve_refuses_an_inconsistent_drafter_configuration(capsys):
    from outrider.cli import main

    assert main(["serve", "draft", "--drafter", "early-exit"]) == 2
    assert "--draft-layers" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, device_type, drafter",
    [
        ([], "cpu", "int4"),
        ([], "cuda", "prompt-lookup"),
        (["--draft-model", "/d"], "cpu", "model"),
        (["--drafter", "prompt-lookup"], "cpu", "prompt-lookup"),
    ],
)
def test_up_picks_the_measured_default_drafter_for_the_device(monkeypatch, flags, device_type, drafter):
    import torch

    from outrider.cli import _stack_args

    monkeypatch.setattr("outrider.device.resolve_device", lambda spec: torch.device(device_type))
    args = build_parser().parse_args(["up", *flags])
    draft = _stack_args(args)["draft_args"]
    assert draft[draft.index("--drafter") + 1] == drafter
    if drafter == "int4":
        assert "--model" not in draft  # the target's own checkpoint


def test_serve_refuses_an_int4_group_size_the_kernels_lack(capsys):
    from outrider.cli import main

    assert main(["serve", "draft", "--drafter", "int4", "--int4-group-size", "48"]) == 2
    assert "--int4-group-size 48: use one of 32, 64, 128, 256" in capsys.readouterr().err
