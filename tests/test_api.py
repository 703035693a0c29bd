"""The public API: every name of ``__all__`` resolves, parts that need no torch do not import it, no import cycle."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import lightning_hooks


def test_every_public_name_resolves_from_the_module_that_defines_it():
    assert sorted(lightning_hooks.__all__) == sorted(lightning_hooks._WHERE)
    for name in lightning_hooks.__all__:
        module = importlib.import_module(f"lightning_hooks.{lightning_hooks._WHERE[name]}")
        assert getattr(lightning_hooks, name) is getattr(module, name), name
    assert dir(lightning_hooks) == sorted([*lightning_hooks.__all__, "__version__"])  # no `Any`, no `importlib`


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


def package_imports() -> dict[str, set[str]]:
    """Each module of the package (``__init__`` aside: its names load lazily) and the package modules it imports.

    Every import counts: at the top, inside a function, under ``TYPE_CHECKING``.
    """
    root = Path(lightning_hooks.__file__).parent
    modules = {".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): path
               for path in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found |= {f"{node.module}.{alias.name}" for alias in node.names} | {node.module}
            elif isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
        graph[name] = {m for m in found & modules.keys() if m not in (name, "lightning_hooks")}
    return graph


def test_no_module_of_the_package_takes_part_in_an_import_cycle():
    graph, done, path = package_imports(), set(), []

    def visit(module: str) -> None:
        if module in path:
            raise AssertionError(f"import cycle: {' -> '.join(path[path.index(module):] + [module])}")
        if module not in done:
            path.append(module)
            for imported in sorted(graph[module]):
                visit(imported)
            path.pop()
            done.add(module)

    for module in sorted(graph):
        visit(module)


_CONFIGURED_AFTER = """
import logging, sys
import lightning_hooks
report = logging.getLogger("lightning_hooks.callbacks.stopping")
report.info("before basicConfig")
logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="APP %(name)s: %(message)s")
report.info("after basicConfig")
"""


def test_logging_configured_after_the_import_gets_the_reports_and_they_print_once():
    done = subprocess.run([sys.executable, "-c", _CONFIGURED_AFTER], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "before basicConfig\n"  # no handler of the application's yet: ours, on stderr
    assert done.stdout == "APP lightning_hooks.callbacks.stopping: after basicConfig\n"  # theirs only
