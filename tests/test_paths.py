"""Every repository path the pages name exists: README.md, docs/, BENCHMARKS.md, configs/ and
scripts/README.md name files (`zerojax/serve/loaders.py`, `scripts/bench/policy_memory.py`,
`tests/fixtures/chat/sft.jsonl`) that a move or a rename leaves behind unless a test reads them.

A repository path here is a token that starts with one of the repository's top folders (`ROOTS`)
and stands on its own: not the tail of another path (`/work/main/zerojax/...`, openpi's
`src/openpi/...`, a run's `RUN_DIR/...`), and not a pattern (`configs/<name>.yaml`,
`zerojax/models/{family}/`, `docs/*.md`). Run outputs live under runs/, which is not a root, so
`runs/pi0_memory.json` is never checked. A path's `:line` or `::test` suffix is not part of it."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROOTS = ("zerojax", "scripts", "tests", "configs", "docs")
PATH = re.compile(rf"(?<![\w./~$-])((?:{'|'.join(ROOTS)})/[\w./-]*)")
PATTERN_MARKS = "<{*["  # what follows a path's start when it is a pattern, not a file


def pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "scripts" / "README.md",
            *sorted((ROOT / "docs").rglob("*.md")), *sorted(p for p in (ROOT / "configs").rglob("*") if p.is_file())]


def named_paths(text: str) -> list[tuple[int, str]]:
    """(line, path) of each repository path `text` names (module docstring)."""
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in PATH.finditer(line):
            if line[match.end():match.end() + 1] and line[match.end()] in PATTERN_MARKS:
                continue
            out.append((number, match.group(1).rstrip(".-")))
    return out


def missing(text: str, root: Path) -> list[tuple[int, str]]:
    return [(line, path) for line, path in named_paths(text) if not (root / path.rstrip("/")).exists()]


def test_every_path_a_page_names_exists():
    found = [f"{page.relative_to(ROOT)}:{line}: {path}" for page in pages()
             for line, path in missing(page.read_text(), ROOT)]
    assert not found, f"{len(found)} path(s) named but not in the repository:\n" + "\n".join(found)


def test_the_path_test_sees_a_gone_file_but_not_patterns_runs_or_other_repositories(tmp_path):
    (tmp_path / "zerojax" / "serve").mkdir(parents=True)
    (tmp_path / "zerojax" / "serve" / "loaders.py").write_text("")
    text = ("`zerojax/serve/loaders.py`, zerojax/serve/ and zerojax/serve/loaders.py:12.\n"
            "gone: (scripts/bench/pi0_memory.py), `zerojax/quant.py`; tests/test_serve.py::test_x\n"
            "not paths: configs/<name>.yaml, zerojax/models/{family}/, docs/*.md, runs/pi0_memory.json,\n"
            "/work/main/zerojax/quant.py, openpi's src/openpi/scripts/serve_policy.py, zerojax.serve.loaders\n")
    assert named_paths(text)[:3] == [(1, "zerojax/serve/loaders.py"), (1, "zerojax/serve/"),
                                     (1, "zerojax/serve/loaders.py")]
    assert missing(text, tmp_path) == [(2, "scripts/bench/pi0_memory.py"), (2, "zerojax/quant.py"),
                                       (2, "tests/test_serve.py")]
