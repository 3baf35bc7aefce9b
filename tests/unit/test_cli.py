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


def test_serve_refuses_an_inconsistent_drafter_configuration(capsys):
    from outrider.cli import main

    assert main(["serve", "draft", "--drafter", "early-exit"]) == 2
    assert "--draft-layers" in capsys.readouterr().err
