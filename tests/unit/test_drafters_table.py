"""The table of drafters (outrider/drafters/__init__.py) names what exists."""

import dataclasses
import importlib

from outrider.config import CoordinatorConfig
from outrider.drafters import COORDINATOR_DRAFTERS, DRAFTERS, MODEL_DRAFTERS


def test_every_row_names_a_loader_in_the_drafters_package():
    for kind in DRAFTERS.values():
        module, _, function = kind.loader.partition(":")
        assert module.startswith("outrider.drafters."), kind
        assert callable(getattr(importlib.import_module(module), function)), kind


def test_each_coordinator_drafter_is_selected_by_a_setting_of_the_coordinator():
    settings = {field.name for field in dataclasses.fields(CoordinatorConfig)}
    for name, flag in COORDINATOR_DRAFTERS.items():
        assert DRAFTERS[name].setting in settings
        assert flag in ("--prompt-lookup", "--suffix-decoding")
    assert set(MODEL_DRAFTERS) | set(COORDINATOR_DRAFTERS) == set(DRAFTERS)
