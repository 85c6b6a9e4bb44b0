"""The shape of zerojax (docs/design.md §3, STYLE.md 10 and 11): each part imports only parts below
it, the parts a calculator or a config needs import no jax, no import circle, one form of
`__init__`, and no model family named outside zerojax/models/. The sizes of files and functions
are a report (scripts/checks/code_shape.py), not a test."""

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "zerojax"
# Bottom to top. A module may import its own part and the parts before it, never one after.
LAYERS = ("errors", "formats", "checkpoints", "precision", "models", "config", "parallel", "data", "schedules", "optim",
          "interop", "train", "analysis", "report", "serve", "sim", "cli")
NO_JAX = ("zerojax", "zerojax.errors", "zerojax.formats", "zerojax.checkpoints.format", "zerojax.config", "zerojax.models.registry",
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


# The structure checks (STYLE.md 10 and 11): each builds its list of violations from the source, and
# each has a companion test that plants a violation and shows the check names it. Sizes are not
# among them: scripts/checks/code_shape.py reports them, to be read at review.

def module_name(path: Path, root: Path) -> str:
    """zerojax/config/__init__.py -> zerojax.config; zerojax/train/step.py -> zerojax.train.step."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """module -> {module it imports: the line of the first such import}, over the package at `root`.

    Every import statement counts, wherever it stands: at the top, inside a function, under
    `if TYPE_CHECKING:`. `from P import name` imports P.name where that is a module, else P;
    `import P.Q` imports P.Q. A package's `__init__` importing its own modules counts like any other
    import (it runs them when the package is imported); what Python imports implicitly, a module's
    parent packages, does not (it would make every package that re-exports a name a circle)."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges = graph.setdefault(module, {})
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # from . import x, from ..p import x
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in files:  # import zerojax.x.Name -> zerojax.x
                    target = target.rpartition(".")[0]
                if target:
                    edges.setdefault(target, node.lineno)
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with a circle in them (Tarjan), each sorted, in order."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1 or v in graph.get(v, {}):
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def circle_lines(graph, root: Path) -> list[str]:
    """One line per circle: its modules, then each import inside it (file:line -> module)."""
    out = []
    for component in circles(graph):
        inside = [f"{m.replace('.', '/')}{'/__init__' if (root.parent / m.replace('.', '/')).is_dir() else ''}.py:"
                  f"{line} -> {t}" for m in component for t, line in sorted(graph[m].items()) if t in component]
        out.append(f"{', '.join(component)}: " + "; ".join(inside))
    return out


def test_no_import_circle():
    """No circle between zerojax modules, counting every import (import_graph says which)."""
    found = circle_lines(import_graph(PACKAGE), PACKAGE)
    assert not found, f"{len(found)} import circle(s):\n" + "\n".join(found)


def test_the_circle_test_sees_a_circle_through_a_function_and_type_checking(tmp_path):
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "sub" / "__init__.py").write_text("from pkg.sub.a import f\n")  # an __init__ importing its module
    (root / "sub" / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import b\n"
                                       "def f():\n    pass\n")
    (root / "b.py").write_text("def g():\n    from pkg.sub import f\n")  # a name, not a module: pkg.sub
    (root / "c.py").write_text("import pkg.b\nfrom . import b\n")  # into the circle, not part of it
    graph = import_graph(root)
    assert graph["pkg.c"] == {"pkg.b": 1}
    assert circles(graph) == [["pkg.b", "pkg.sub", "pkg.sub.a"]]
    assert circle_lines(graph, root) == ["pkg.b, pkg.sub, pkg.sub.a: pkg/b.py:2 -> pkg.sub; "
                                         "pkg/sub/__init__.py:1 -> pkg.sub.a; pkg/sub/a.py:3 -> pkg.b"]
    (root / "b.py").write_text("def g():\n    pass\n")
    assert circles(import_graph(root)) == []


def code_shape():
    """scripts/checks/code_shape.py, the size report (STYLE.md 10: sizes are read at review, not gated)."""
    spec = importlib.util.spec_from_file_location("code_shape", PACKAGE.parent / "scripts" / "checks" / "code_shape.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_size_report_names_a_long_file_and_a_long_decorated_function(tmp_path):
    shape = code_shape()
    body = "\n".join(f"    x{i} = {i}" for i in range(shape.MAX_FUNCTION_LINES - 3))
    ok = f"@decorator\ndef f():\n    '''Doc.'''\n{body}\n"  # exactly 60 lines
    assert shape.function_lengths(ok) == [(1, "f", shape.MAX_FUNCTION_LINES)]
    long = f"@decorator\n\ndef f():\n    '''Doc.'''\n{body}\n" + "\n" * 340  # 401 lines, f 61
    lines = shape.report({"zerojax/ok.py": ok, "zerojax/long.py": long})
    assert lines[0] == "2 files, 461 lines, 2 functions"
    assert lines[1:3] == ["  longest function: zerojax/long.py:1: f (61 lines)", "  largest file: zerojax/long.py (401 lines)"]
    assert lines[-4:] == ["  files over 400 lines: 1", "    zerojax/long.py: 401 lines",
                          "  functions over 60 lines: 1", "    zerojax/long.py:1: f (61 lines)"]
    assert shape.report({"zerojax/ok.py": ok})[-2:] == ["  files over 400 lines: 0", "  functions over 60 lines: 0"]
    (tmp_path / "zerojax").mkdir()
    (tmp_path / "zerojax" / "long.py").write_text(long)
    assert shape.sources(None, tmp_path) == {"zerojax/long.py": long}


def words(identifier: str) -> tuple[str, set[int], set[int]]:
    """An identifier lowercased, and where its words start and end: `PaliGemmaProcessor` has the
    words pali, gemma, processor; `pi0_rows` has pi, 0, rows; `GPT2LMHead` gpt, 2, lm, head."""
    parts = list(re.finditer(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|\d+", identifier))
    text, starts, ends = "", set(), set()
    for part in parts:
        starts.add(len(text))
        text += part.group().lower()
        ends.add(len(text))
    return text, starts, ends


def family_in(identifier: str, families) -> str | None:
    """The longest family whose name is whole words of `identifier` (`paligemma_rows` -> paligemma,
    `PaliGemma` -> paligemma, `gpt2` -> gpt; `chatgpt`, `api0`, `llamas` -> None)."""
    text, starts, ends = words(identifier)
    for family in sorted(families, key=len, reverse=True):
        name = words(family)[0]
        at = text.find(name)
        while at >= 0:
            if at in starts and at + len(name) in ends:
                return family
            at = text.find(name, at + 1)
    return None


def docstrings(tree) -> set[int]:
    """The ids of the module's, classes' and functions' docstring nodes (prose)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                out.add(id(first.value))
    return out


def family_names(source: str, families) -> list[tuple[int, str]]:
    """(line, what) for each model family named as code: an identifier (name, attribute, def,
    class, argument, keyword, imported module or alias) with the family among its words, or a
    string without whitespace with the family among its words ("pi0", "zerojax.models.pi0",
    "pi0_rows"). Prose, strings with spaces (docstrings, messages, help texts), is fine."""
    tree, out = ast.parse(source), []
    prose = docstrings(tree)

    def check(node, identifier, kind):
        family = family_in(identifier, families) if identifier else None
        if family:
            out.append((node.lineno, f"{kind} {identifier!r} ({family})"))

    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            check(node, node.id, "name")
        elif isinstance(node, ast.Attribute):
            check(node, node.attr, "attribute")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            check(node, node.name, "def" if not isinstance(node, ast.ClassDef) else "class")
        elif isinstance(node, ast.arg):
            check(node, node.arg, "argument")
        elif isinstance(node, ast.keyword):
            check(node.value, node.arg, "keyword")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for module in [getattr(node, "module", None)] + [a.name for a in node.names] + [a.asname for a in node.names]:
                for part in (module or "").split("."):
                    check(node, part, "import")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            if not re.search(r"\s", node.value):  # a family's name, a module path, a key: code, not prose
                for family in {family_in(w, families) for w in re.split(r"\W+", node.value)} - {None}:
                    out.append((node.lineno, f"string {node.value!r} ({family})"))
    return sorted(set(out))


def family_violations(root: Path, families) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] == "models":
            continue
        out += [f"{path.relative_to(root.parent)}:{line}: {what}" for line, what in family_names(path.read_text(), families)]
    return out


def test_a_family_is_named_only_in_models():
    """STYLE.md 11: a family is one room. Outside zerojax/models/, no code names a family of
    `registry.FAMILIES` (see family_names); adding a family touches its module and the registry."""
    from zerojax.models.registry import FAMILIES

    found = family_violations(PACKAGE, FAMILIES)
    assert not found, f"{len(found)} family name(s) outside zerojax/models/:\n" + "\n".join(found)


def test_the_family_test_sees_names_and_strings_but_not_prose(tmp_path):
    families = ("gpt", "gemma", "paligemma", "pi0", "llama")
    source = '''"""pi0 and PaliGemma, in prose."""
from zerojax.models import pi0
import zerojax.models.gemma as g
POLICY_FAMILIES = ("pi0",)
def pi0_rows(batch, *, gemma_cfg=None):
    """The pi0 rows."""
    if cfg.family == "paligemma" or PaliGemmaProcessor or load(gpt2=1):
        raise ValueError("not a pi0 run")
    return batch.encrypt, chatgpt, api0, llamas, "gpt-2 weights", "pi0 rows", importlib.import_module("zerojax.models.gemma")
'''
    assert family_names(source, families) == [
        (2, "import 'pi0' (pi0)"), (3, "import 'gemma' (gemma)"), (4, "string 'pi0' (pi0)"),
        (5, "argument 'gemma_cfg' (gemma)"), (5, "def 'pi0_rows' (pi0)"),
        (7, "keyword 'gpt2' (gpt)"), (7, "name 'PaliGemmaProcessor' (paligemma)"),
        (7, "string 'paligemma' (paligemma)"), (9, "string 'zerojax.models.gemma' (gemma)")]
    root = tmp_path / "zerojax"
    (root / "models").mkdir(parents=True)
    (root / "models" / "pi0.py").write_text(source)  # a family's own room
    (root / "train.py").write_text("rows = pi0_rows(batch)\n")
    assert family_violations(root, families) == ["zerojax/train.py:1: name 'pi0_rows' (pi0)"]


def init_faults(source: str) -> list[tuple[int, str]]:
    """(line, fault) where a package's `__init__` leaves its one form (docs/design.md §3): a
    docstring first, names imported by name, no star import, no `__getattr__` / `__dir__` table."""
    tree, out = ast.parse(source), []
    if not (tree.body and isinstance(tree.body[0], ast.Expr) and isinstance(tree.body[0].value, ast.Constant)):
        out.append((1, "no docstring of what lives in each module"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
            out.append((node.lineno, f"from {node.module} import *"))
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in ("__getattr__", "__dir__"):
            out.append((node.lineno, f"def {node.name} (names imported on first use)"))
    return out


def test_every_init_has_one_form():
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: {fault}" for path in sorted(PACKAGE.rglob("__init__.py"))
             for line, fault in init_faults(path.read_text())]
    assert not found, "\n".join(found)


# Packages whose docstring does not list its modules, and why (STYLE.md 10 asks every other one to)
INDEX_ELSEWHERE = {
    "zerojax": "its parts are docs/design.md §3's table",
    "zerojax.cli": "one module per subcommand, as `zerojax --help` lists them",
}


def index_gaps(root: Path, elsewhere=()) -> list[str]:
    """`pkg/__init__.py: module.py` for each module (or `sub/` package) of a package that its
    `__init__`'s docstring does not name."""
    out = []
    for init in sorted(root.rglob("__init__.py")):
        package = init.parent
        if module_name(init, root) in elsewhere:
            continue
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        names = sorted(p.name for p in package.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
        names += sorted(f"{p.name}/" for p in package.iterdir() if (p / "__init__.py").is_file())
        out += [f"{init.relative_to(root.parent)}: {name}" for name in names
                if not re.search(rf"(?<![\w/]){re.escape(name)}", doc)]
    return out


def test_every_init_lists_its_modules():
    found = index_gaps(PACKAGE, INDEX_ELSEWHERE)
    assert not found, "modules an __init__ docstring leaves out (STYLE.md 10):\n" + "\n".join(found)


def test_the_index_test_sees_a_module_left_out(tmp_path):
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text('"""The package.\n\n    a.py   what a holds\n    sub/   the rest\n"""\n')
    (root / "a.py").write_text("")
    (root / "sub" / "__init__.py").write_text('"""Its own index: b.py."""\n')
    (root / "sub" / "b.py").write_text("")
    assert index_gaps(root) == []
    (root / "ab.py").write_text("")  # `a.py` names a, not ab
    (root / "sub" / "c.py").write_text("")
    assert index_gaps(root) == ["pkg/__init__.py: ab.py", "pkg/sub/__init__.py: c.py"]
    assert index_gaps(root, {"pkg.sub"}) == ["pkg/__init__.py: ab.py"]


def test_the_init_test_sees_star_imports_and_lazy_tables():
    assert init_faults('"""Doc."""\nfrom zerojax.x import a\n__all__ = ["a"]\n') == []
    assert init_faults("from zerojax.x import *\ndef __getattr__(name):\n    pass\n") == [
        (1, "no docstring of what lives in each module"), (1, "from zerojax.x import *"),
        (2, "def __getattr__ (names imported on first use)")]


def family_imports(models: Path, families) -> list[str]:
    """file:line: import, where a family's package (models/<family>/) imports another family's
    package: siblings share `vla/`, `paligemma_expert/` and the decoder, never one another."""
    out = []
    packages = {name for name in families if (models / name).is_dir()}
    for family in sorted(packages):
        for path in sorted((models / family).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                    [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.module == "zerojax.models":
                    modules = [f"zerojax.models.{a.name}" for a in node.names]
                for module in modules:
                    parts = module.split(".")
                    other = parts[2] if parts[:2] == ["zerojax", "models"] and len(parts) > 2 else None
                    if other in packages and other != family:
                        out.append(f"{path.relative_to(models.parent.parent)}:{node.lineno}: imports {module}")
    return out


def test_no_policy_family_is_built_on_another():
    """STYLE.md 11: π0, π0.5 and SmolVLA are siblings: no family's package imports another's (so
    none subclasses another's model); what they share lives in vla/, paligemma_expert/, decoder.py."""
    from zerojax.models.registry import FAMILIES, is_policy

    policies = [name for name in FAMILIES if is_policy(name)]
    assert len(policies) >= 3 and all((PACKAGE / "models" / name).is_dir() for name in policies)
    found = family_imports(PACKAGE / "models", FAMILIES)
    assert not found, "\n".join(found)


def test_the_sibling_test_sees_a_family_importing_another(tmp_path):
    models = tmp_path / "zerojax" / "models"
    for name in ("a", "b", "shared"):
        (models / name).mkdir(parents=True)
    (models / "a" / "model.py").write_text("from zerojax.models.shared import base\nimport zerojax.models.a.x\n")
    (models / "b" / "model.py").write_text("from zerojax.models import a\nfrom zerojax.models.a.model import A\n")
    assert family_imports(models, ("a", "b")) == ["zerojax/models/b/model.py:1: imports zerojax.models.a",
                                                   "zerojax/models/b/model.py:2: imports zerojax.models.a.model"]
