"""The direction of imports (docs/design.md §3): each part of zerojax imports only parts below it,
and the parts a calculator or a config needs import no jax."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "zerojax"
# Bottom to top. A module may import its own part and the parts before it, never one after.
LAYERS = ("errors", "formats", "precision", "models", "config", "parallel", "data", "schedules", "optim",
          "interop", "train", "analysis", "report", "serve", "sim", "cli")
NO_JAX = ("zerojax", "zerojax.errors", "zerojax.formats", "zerojax.config", "zerojax.models.registry",
          "zerojax.models.flops", "zerojax.analysis.formulas", "zerojax.serve", "zerojax.sim", "zerojax.cli")


def part_of(module: str) -> str | None:
    """The part a zerojax module belongs to: zerojax.schedules.flat -> schedules."""
    names = module.split(".")
    return names[1] if names[0] == "zerojax" and len(names) > 1 else None


def imports_of(path: Path) -> set[str]:
    """Every zerojax module `path` imports, at its top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("zerojax"):
            out |= {f"{node.module}.{a.name}" for a in node.names} if node.module == "zerojax" else {node.module}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("zerojax")}
    return out


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).with_suffix("")
        if relative.parts[0] in ("__init__", "__main__"):
            continue
        yield path, relative.parts[0]


def test_every_part_is_in_the_layers():
    assert {part for _, part in modules()} == set(LAYERS)


@pytest.mark.parametrize("path,part", list(modules()), ids=lambda x: str(x.relative_to(PACKAGE)) if isinstance(x, Path) else x)
def test_imports_point_down(path, part):
    upward = sorted(m for m in imports_of(path)  # (zerojax.__version__ is the package's own)
                    if part_of(m) in LAYERS and LAYERS.index(part_of(m)) > LAYERS.index(part))
    assert not upward, f"{path.relative_to(PACKAGE)} ({part}) imports {upward}, which sit above it in {LAYERS}"


def test_the_layer_test_sees_an_upward_import(tmp_path):
    models_module = tmp_path / "bad.py"
    models_module.write_text("def f():\n    from zerojax.train import step\n")
    assert {part_of(m) for m in imports_of(models_module)} == {"train"}


@pytest.mark.parametrize("module", NO_JAX)
def test_imports_no_jax(module):
    code = (f"import sys, {module}; loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'optax'))"
            "; assert not loaded, loaded[:5]")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
