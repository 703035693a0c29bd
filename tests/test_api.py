"""The public API: every name of ``__all__`` resolves, and parts that need no torch do not import it."""

from __future__ import annotations

import importlib
import subprocess
import sys

import lightning_hooks


def test_every_public_name_resolves_from_the_module_that_defines_it():
    assert sorted(lightning_hooks.__all__) == sorted(lightning_hooks._WHERE)
    for name in lightning_hooks.__all__:
        module = importlib.import_module(f"lightning_hooks.{lightning_hooks._WHERE[name]}")
        assert getattr(lightning_hooks, name) is getattr(module, name), name
    assert set(lightning_hooks.__all__) <= set(dir(lightning_hooks))


def test_an_unknown_name_is_an_attribute_error():
    try:
        lightning_hooks.ActivationMonitr  # noqa: B018
    except AttributeError as err:
        assert "ActivationMonitr" in str(err)
    else:
        raise AssertionError("no AttributeError")


def test_the_layers_tab_loads_without_torch_or_lightning():
    """TensorBoard imports the plugin at start-up: that must not cost an import of torch (about 6 s)."""
    code = ("import sys, lightning_hooks.tensorboard_plugin.plugin as p; "
            "print(sorted(m for m in ('torch', 'lightning', 'pytorch_lightning') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_star_import_gives_the_callbacks():
    scope: dict = {}
    exec("from lightning_hooks import *", scope)
    assert scope["ActivationMonitor"] is lightning_hooks.ActivationMonitor
    assert scope["GradientAnomalyStopping"].__name__ == "GradientAnomalyStopping"
