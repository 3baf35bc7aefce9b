"""The command line: every command has --help; flags fall back to OUTRIDER_* variables."""

import dataclasses
import os
import subprocess
import sys

import pytest

from outrider.cli import build_parser


def serve_flags_of(argv):
    """What ``outrider up``/``demo`` with ``argv`` passes to each service."""
    from outrider import flags
    from outrider.command_config import StackConfig
    from outrider.stack import serve_flags

    return serve_flags(flags.build(StackConfig, build_parser().parse_args(argv)))


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
    out = subprocess.run(
        [sys.executable, "-m", "outrider", *command], capture_output=True, text=True, timeout=60
    )
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
    assert (args.device, args.dtype, args.max_tokens_per_step, args.enforce_eager) == (
        "cuda:1",
        "auto",
        512,
        True,
    )


@pytest.mark.parametrize(
    "variable, value, message",
    [
        (
            "OUTRIDER_MAX_SESSIONS",
            "abc",
            "OUTRIDER_MAX_SESSIONS='abc' is not a valid --max-sessions",
        ),
        ("OUTRIDER_DEVICE", "gpu", "device 'gpu': use auto, cpu, cuda or cuda:N"),
    ],
)
def test_a_bad_environment_value_is_a_usage_error_naming_the_variable(
    monkeypatch, capsys, variable, value, message
):
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as exit_:
        build_parser()
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_serve_refuses_an_inconsistent_drafter_configuration(capsys):
    from outrider.cli import main

    assert main(["serve", "draft", "--drafter", "early-exit"]) == 2
    assert "--draft-layers" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, device_type, gguf_runs, drafter",
    [
        ([], "cpu", True, "gguf"),
        ([], "cpu", False, "int4"),  # no llama.cpp here, or a target without a GGUF
        ([], "cuda", True, "prompt-lookup"),
        (["--draft-model", "/d"], "cpu", True, "model"),
        (["--draft-model", "/d/draft.Q4_0.gguf"], "cpu", True, "gguf"),
        (["--drafter", "prompt-lookup"], "cpu", True, "prompt-lookup"),
        (["--drafter", "gguf"], "cuda", True, "gguf"),
    ],
)
def test_up_picks_the_measured_default_drafter_for_the_device(
    monkeypatch, flags, device_type, gguf_runs, drafter
):
    import torch

    monkeypatch.setattr("outrider.device.resolve_device", lambda spec: torch.device(device_type))
    monkeypatch.setattr("outrider.command_config._gguf_runs", lambda target_model: gguf_runs)
    stack = serve_flags_of(["up", *flags])
    if drafter == "prompt-lookup":  # in the coordinator, no draft worker
        assert stack["with_draft"] is False and "--prompt-lookup" in stack["coordinator_args"]
        return
    draft = stack["draft_args"]
    assert draft[draft.index("--drafter") + 1] == drafter
    assert "--prompt-lookup" not in stack["coordinator_args"]
    if drafter in ("int4", "gguf") and "--draft-model" not in flags:
        assert "--model" not in draft  # the target's own checkpoint, or its GGUF
    if drafter == "gguf":  # llama.cpp on the CPU, beside a target on any device
        assert draft[draft.index("--device") + 1] == "cpu"


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_up_runs_suffix_decoding_beside_the_model_drafter(monkeypatch, device_type):
    import torch

    monkeypatch.setattr("outrider.device.resolve_device", lambda spec: torch.device(device_type))
    stack = serve_flags_of(["up", "--suffix-decoding"])
    assert "--suffix-decoding" in stack["coordinator_args"]
    if device_type == "cpu":  # beside the int4 draft worker
        assert stack.get("with_draft", True) and "--drafter" in stack["draft_args"]
    else:  # the default drafter runs in the coordinator: suffix decoding alone
        assert stack["with_draft"] is False
        assert "--prompt-lookup" not in stack["coordinator_args"]


def test_up_refuses_suffix_decoding_beside_a_coordinator_drafter(capsys):
    from outrider.cli import main

    assert main(["up", "--drafter", "prompt-lookup", "--suffix-decoding"]) == 2
    err = capsys.readouterr().err
    assert "--suffix-decoding goes beside a drafter that runs a model" in err
    assert len(err.strip().splitlines()) == 1


def test_a_draft_worker_refuses_prompt_lookup_and_names_the_coordinator_s_flag(capsys):
    from outrider.cli import main

    assert main(["serve", "draft", "--drafter", "prompt-lookup"]) == 2
    err = capsys.readouterr().err
    assert "--prompt-lookup" in err and "Traceback" not in err and len(err.splitlines()) == 1


def test_a_coordinator_refuses_prompt_lookup_beside_draft_workers(capsys):
    from outrider.cli import main

    assert (
        main(["serve", "coordinator", "--target", "a:1", "--draft", "b:2", "--prompt-lookup"]) == 2
    )
    assert "drop --draft" in capsys.readouterr().err


def test_a_coordinator_takes_suffix_decoding_beside_draft_workers():
    from outrider.config import CoordinatorConfig

    config = CoordinatorConfig(target=("a:1",), draft=("b:2",), suffix_decoding=True)
    assert config.suffix_decoding and config.draft == ("b:2",)


def test_serve_refuses_an_int4_group_size_the_kernels_lack(capsys):
    from outrider.cli import main

    assert main(["serve", "draft", "--drafter", "int4", "--int4-group-size", "48"]) == 2
    assert "--int4-group-size 48: use one of 32, 64, 128, 256" in capsys.readouterr().err


def test_pipeline_is_a_coordinator_default_flag_and_variable(monkeypatch):
    parse = build_parser().parse_args
    assert parse(["serve", "coordinator", "--target", "a:1"]).pipeline is False
    assert parse(["serve", "coordinator", "--target", "a:1", "--pipeline"]).pipeline is True
    monkeypatch.setenv("OUTRIDER_PIPELINE", "true")
    assert build_parser().parse_args(["serve", "coordinator", "--target", "a:1"]).pipeline is True


def test_serve_coordinator_puts_pipeline_into_its_config(monkeypatch):
    from outrider.cli import main

    configs = []
    monkeypatch.setattr("outrider.coordinator.main.main", configs.append)
    monkeypatch.setattr("outrider.logging.configure_logging", lambda level: None)
    assert (
        main(
            [
                "serve",
                "coordinator",
                "--target",
                "a:1",
                "--pipeline",
                "--num-speculative-tokens",
                "auto",
            ]
        )
        == 0
    )
    assert configs[0].pipeline and configs[0].adaptive


@pytest.mark.parametrize("command", ["up", "demo"])
def test_up_and_demo_pass_pipeline_to_the_coordinator(command):
    stack = serve_flags_of([command, "--drafter", "prompt-lookup", "--pipeline"])
    assert "--pipeline" in stack["coordinator_args"]
    stack = serve_flags_of([command, "--drafter", "prompt-lookup"])
    assert "--pipeline" not in stack["coordinator_args"]


@pytest.mark.parametrize(
    "flags, pipeline", [([], None), (["--pipeline"], True), (["--no-pipeline"], False)]
)
def test_generate_sends_pipeline_only_when_given(monkeypatch, flags, pipeline):
    from outrider.cli import main

    calls = []

    class FakeClient:
        def __init__(self, address, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def stream(self, **options):
            calls.append(options)
            return iter(())

    monkeypatch.setattr("outrider.client.Client", FakeClient)
    assert main(["generate", "hello", *flags]) == 0
    assert calls[0]["pipeline"] is pipeline


def test_stats_show_speculation_hits_and_misses_when_pipelined(capsys):
    from outrider.cli import _print_stats
    from outrider.client import GenerationStats

    stats = GenerationStats(
        prompt_tokens=5, generated_tokens=12, rounds=4, draft_tokens=16, accepted_tokens=8,
        accepted_per_position=(3, 2, 2, 1), mean_acceptance_length=3.0, acceptance_rate=0.5,
        draft_time_s=0.1, verify_time_s=0.2, overhead_time_s=0.01, time_to_first_token_s=0.05,
        total_time_s=0.4, num_speculative_tokens=4,
    )  # fmt: skip
    _print_stats(stats)
    assert "speculation hits" not in capsys.readouterr().out
    _print_stats(
        dataclasses.replace(stats, pipeline=True, speculation_hits=2, speculation_misses=1)
    )
    assert "speculation hits / misses  2 / 1" in capsys.readouterr().out


def test_adaptive_stats_show_the_k_chosen_and_say_when_drafting_did_not_pay(capsys):
    from outrider.cli import _print_stats
    from outrider.client import GenerationStats

    stats = GenerationStats(
        prompt_tokens=5, generated_tokens=12, rounds=12, draft_tokens=0, accepted_tokens=0,
        accepted_per_position=(), mean_acceptance_length=1.0, acceptance_rate=0.0,
        draft_time_s=0.0, verify_time_s=0.2, overhead_time_s=0.01, time_to_first_token_s=0.05,
        total_time_s=0.4, num_speculative_tokens=0, adaptive=True, rounds_by_k=(12,),
    )  # fmt: skip
    _print_stats(stats)
    out = capsys.readouterr().out
    assert "K chosen per round         K=0 ×12" in out
    assert "Drafting did not pay here" in out
    _print_stats(dataclasses.replace(stats, draft_tokens=9, rounds_by_k=(3, 0, 0, 9)))
    out = capsys.readouterr().out
    assert "K=3 ×9, K=0 ×3" in out and "did not pay" not in out


def test_the_stack_says_what_its_drafting_will_do_on_this_machine():
    from outrider.cli import _drafting
    from outrider.client import ModelInfo

    info = ModelInfo(
        target_model="t", draft_model="t[int4]", drafter="int4", vocab_size=10,
        max_context_length=64, default_num_speculative_tokens=0, max_num_speculative_tokens=16,
        default_max_new_tokens=8, default_adaptive=True, target_device="cpu", draft_device="cpu",
    )  # fmt: skip
    line = _drafting(info)
    assert "int4 on the CPU, beside the target's steps on the same cores" in line
    assert "target-only speed where it does not" in line
    fixed = dataclasses.replace(info, default_adaptive=False, default_num_speculative_tokens=4)
    assert _drafting(fixed).endswith("K=4 a round")
    assert "same cores" not in _drafting(dataclasses.replace(info, draft_device="cuda:0"))
    assert _drafting(dataclasses.replace(info, drafter="")) == "drafting: none (target-only)"


@pytest.mark.parametrize("role", ["coordinator", "target", "draft"])
def test_every_serve_flag_defaults_to_its_config_field_and_says_what_it_does(role):
    import argparse

    from outrider import flags
    from outrider.cli import ROLE_CONFIGS

    config = ROLE_CONFIGS[role]
    required = ["--target", "a:1"] if role == "coordinator" else []
    args = build_parser().parse_args(["serve", role, *required])
    defaults = flags.flag_defaults(config)
    assert {"port", "log_level", "tls_cert"} <= defaults.keys()
    for name, default in defaults.items():
        if name != "target":
            assert getattr(args, name) == default, name
    expected = config(target=("a:1",)) if role == "coordinator" else config()
    assert flags.build(config, args) == expected

    parser = argparse.ArgumentParser()
    flags.add_flags(parser, config)
    for action in parser._actions:
        if action.dest != "help":
            assert action.help and action.help[0].isalpha(), f"{action.dest} has no help"


def test_nested_config_fields_are_flags_and_variables_too(monkeypatch):
    from outrider import flags
    from outrider.config import CoordinatorConfig

    monkeypatch.setenv("OUTRIDER_DRAFT_DEADLINE_S", "1.5")
    args = build_parser().parse_args(
        ["serve", "coordinator", "--target", "a:1", "--verify-deadline-floor-s", "3"]
    )
    config = flags.build(CoordinatorConfig, args)
    assert config.recovery.draft_deadline_s == 1.5
    assert config.recovery.verify_deadline_floor_s == 3.0
    assert config.service.port == 50051


@pytest.mark.parametrize(
    "role, env, expected",
    [
        ("target", None, "10000"),
        ("draft", None, "10000"),
        ("target", "5", "5"),
        ("coordinator", None, "None"),
    ],
)
def test_a_worker_sets_a_short_openmp_spin_before_torch_loads(role, env, expected):
    # The role's main is replaced by one that reports the variable it runs with.
    package = "outrider." + {"target": "target_worker", "draft": "draft_worker"}.get(role, role)
    argv = ["serve", role] + (["--target", "127.0.0.1:1"] if role == "coordinator" else [])
    script = f"""
import os, sys, types
fake = types.ModuleType("{package}.main")
fake.main = lambda config: print(os.environ.get("GOMP_SPINCOUNT"))
sys.modules["{package}.main"] = fake
from outrider.cli import main
assert "torch" not in sys.modules
main({argv!r})
"""
    environ = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    if env is not None:
        environ["GOMP_SPINCOUNT"] = env
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=environ
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected


@pytest.mark.parametrize("command", ["up", "demo", "generate"])
def test_every_command_flag_defaults_to_its_config_field_and_says_what_it_does(command):
    import argparse

    from outrider import flags
    from outrider.cli import COMMAND_CONFIGS

    config = COMMAND_CONFIGS[command]
    required = ["hello"] if command == "generate" else []
    args = build_parser().parse_args([command, *required])
    for name, default in flags.flag_defaults(config).items():
        if (command, name) != ("generate", "prompt"):
            assert getattr(args, name) == default, name
    values = {"prompt": "hello"} if command == "generate" else {}
    assert flags.build(config, args) == config(**values)

    parser = argparse.ArgumentParser()
    flags.add_flags(parser, config, env=False)
    for action in parser._actions:
        if action.dest != "help":
            assert action.help and action.help[0].isalpha(), f"{action.dest} has no help"


def test_up_reads_the_workers_device_variable_and_no_other(monkeypatch):
    monkeypatch.setenv("OUTRIDER_DEVICE", "cpu")
    monkeypatch.setenv("OUTRIDER_PORT", "6001")
    monkeypatch.setenv("OUTRIDER_LOG_LEVEL", "debug")
    monkeypatch.setenv("OUTRIDER_TEMPERATURE", "0.5")
    args = build_parser().parse_args(["up"])
    assert (args.device, args.port, args.log_level) == ("cpu", 50051, "warning")
    assert build_parser().parse_args(["generate", "hello"]).temperature == 0.0


def test_generate_takes_one_stop_string_per_flag():
    args = build_parser().parse_args(["generate", "hello", "--stop", "a,b", "--stop", "c"])
    assert args.stop == ("a,b", "c")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["up", "--port", "70000"], "--port 70000: not a port number (0 to 65535)"),
        (["up", "--target-tp", "0"], "--target-tp 0: must be at least 1"),
        (["demo", "--drafter", "early-exit"], "--drafter early-exit needs --draft-layers L"),
        (["demo", "--max-new-tokens", "-1"], "--max-new-tokens -1: must be at least 0"),
        (["generate", "hi", "--top-k", "-1"], "--top-k -1: must be at least 0"),
        (["generate", "hi", "--seed", "-1"], "--seed -1: must lie in [0, 2^64)"),
        (["generate", "hi", "--tls-ca", "/no/ca.pem"], "--tls-ca /no/ca.pem: no such file"),
    ],
)
def test_a_bad_command_flag_is_one_line_naming_it(capsys, argv, message):
    from outrider.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"outrider {argv[0]}: {message}\n"
