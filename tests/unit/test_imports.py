"""What each service loads: the coordinator runs no model, so it imports no torch."""

import subprocess
import sys


def test_the_coordinator_tokenizes_and_builds_its_service_without_torch(tiny_target_dir):
    code = f"""
import sys
import outrider.coordinator.main
from outrider import model_specs

tokenizer = model_specs.load_tokenizer({str(tiny_target_dir)!r})
assert model_specs.eos_token_ids(tokenizer, model_specs.generation_config({str(tiny_target_dir)!r}))
tokenizer("Hello")["input_ids"]
assert "torch" not in sys.modules, "the coordinator imported torch"
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
