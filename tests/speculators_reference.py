"""speculators 0.9.0's own modules for the parity tests, imported without its package's side effects.

`import speculators` runs the whole package's `__init__`, which imports its data-generation client
(openai and others) that the models and losses never use and that `make setup` does not install.
Here `speculators` and `speculators.models` are bare namespace modules over the installed files,
carrying the few names the model modules import from them; every module a test compares with is
the installed file itself. Missing speculators skips the test that asked, naming the install.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

import pytest

INSTALL = 'pip install --no-deps "speculators==0.9.0" (make setup does)'


def speculators_module(name: str) -> types.ModuleType:
    """`speculators.<name>` from the installed speculators (skips the test when it is absent)."""
    try:
        return importlib.import_module(f"speculators.{name}")
    except ImportError as error:
        if getattr(error, "name", "") == "speculators":
            pytest.skip(f"speculators is not installed: {INSTALL}")
        if "speculators" in sys.modules and getattr(sys.modules["speculators"], "__file__", None):
            sys.modules.pop("speculators")  # a failed full import: fall back to the bare modules
    _bare_packages()
    module = importlib.import_module(f"speculators.{name}")
    # What the package's __init__ ends with: the config classes' schemas over what is registered.
    importlib.import_module("speculators.models.dspark")
    sys.modules["speculators.config"].reload_schemas()
    return module


def _bare_packages() -> None:
    spec = importlib.util.find_spec("speculators")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"speculators is not installed: {INSTALL}")
    root = list(spec.submodule_search_locations)[0]
    for name, folder in (("speculators", root), ("speculators.models", f"{root}/models")):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [folder]
            sys.modules[name] = module
    package = sys.modules["speculators"]
    config = importlib.import_module("speculators.config")
    for attribute in ("SpeculatorModelConfig", "SpeculatorsConfig", "VerifierConfig"):
        setattr(package, attribute, getattr(config, attribute))
    package.SpeculatorModel = importlib.import_module("speculators.model").SpeculatorModel
