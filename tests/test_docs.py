"""The documentation: README.md and the docs/ site. The site builds with `mkdocs build --strict`
(a broken link or a missing included file fails it), every relative link of README.md and docs/
names a file that is there, the generated reference is what the code generates now, and the help
texts of the commands that take a policy name every policy family."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from zerojax import cli, config
from zerojax.models import registry

sys.path.insert(0, str(ROOT / "scripts" / "docs"))
import gen_reference  # noqa: E402  (scripts/docs/gen_reference.py)

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")  # [text](target) and ![alt](image)
POLICY_NAMES = {"pi0": "π0", "pi05": "π0.5", "smolvla": "SmolVLA"}  # a new policy family: add its name here


def relative_links(page: Path) -> list[str]:
    """The targets of the page's links that are paths (no scheme, no bare #anchor), outside code."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, len(lines)
    for step in ("make install", "source .venv/bin/activate", "make train", "make test", "make docs"):
        assert any(step in line for line in lines), step


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    missing = [t for t in relative_links(page) if not (page.parent / t.split("#")[0]).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to files that are not there: {missing}"


def test_the_link_check_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("[ok](page.md) [gone](nowhere.md#x) `[code](nope.md)` [web](https://example.com) [a](#b)\n")
    assert relative_links(page) == ["page.md", "nowhere.md#x"]


def test_the_site_builds_strict(tmp_path):
    """CI's build: any warning (a link to a missing page or anchor, a missing snippet) fails it."""
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f",
                           str(ROOT / "mkdocs.yml"), "-d", str(tmp_path / "site")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    log = (tmp_path / "site" / "benchmarks" / "log" / "index.html").read_text()
    first = next(line for line in (ROOT / "BENCHMARKS.md").read_text().splitlines() if line.startswith("## "))
    assert first[3:].split(" (")[0] in log  # BENCHMARKS.md is included, not linked out of the site
    nav = (ROOT / "mkdocs.yml").read_text()
    unlisted = [p for p in (ROOT / "docs").rglob("*.md") if str(p.relative_to(ROOT / "docs")) not in nav]
    assert not unlisted, f"pages missing from mkdocs.yml's nav: {unlisted}"


def test_the_reference_is_what_the_code_generates():
    assert gen_reference.stale() == [], "run: python scripts/docs/gen_reference.py"
    config_page = (ROOT / "docs" / "reference" / "config.md").read_text()
    from zerojax.config.load import valid_keys

    assert all(f"| `{key}` |" in config_page for key in valid_keys())
    cli_page = (ROOT / "docs" / "reference" / "cli.md").read_text()
    assert all(f"## `zerojax {name}`" in cli_page for name in cli.COMMANDS)


def test_the_commands_that_take_a_policy_name_every_policy_family():
    """`zerojax --help`, and each command's --help (its HELP is the description) where a policy
    run, its dataset or its server is what the command takes."""
    policies = registry.of_kind(registry.POLICY)
    assert set(policies) == set(POLICY_NAMES), "name the new policy family in POLICY_NAMES"
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if hasattr(a, "choices") and isinstance(a.choices, dict))
    for command, text in [("zerojax", parser.format_help())] + [
            (c, sub.choices[c].format_help()) for c in ("serve", "rollout", "collect", "export", "client", "stats", "plan")]:
        text = " ".join(text.split())  # argparse wraps lines
        assert all(POLICY_NAMES[f] in text for f in policies), (command, text)
        assert "a π0 run" not in text, command
    family_row = next(line for line in (ROOT / "docs" / "reference" / "config.md").read_text().splitlines()
                      if line.startswith("| `model.family` |"))  # model.family's comment in the code
    assert all(f" {family} " in family_row for family in registry.FAMILIES), family_row


def test_the_readmes_commands_parse_and_their_keys_load(monkeypatch):
    """Every `zerojax` line of README.md is a command with valid flags, and its config (file and
    KEY=VALUE overrides) loads: a renamed key, flag or config file fails here. ($CKPT: the tiny π0.5
    the tutorial stands in with, and its tower's head count; the data and model files the user
    brings are left out, a LeRobot dataset stood in for by the tiny fixture.)"""
    monkeypatch.chdir(ROOT)
    text = (ROOT / "README.md").read_text()
    lines = [line.split("  #")[0].strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S)
             for line in block.replace("\\\n", " ").splitlines()]
    lines = [line.replace("$CKPT", "tests/fixtures/lerobot06/pi05") for line in lines if line.startswith("zerojax ")]
    assert len(lines) >= 12, lines
    parser = cli.build_parser()
    for line in lines:
        args = parser.parse_args(shlex.split(line)[1:])
        if hasattr(args, "overrides"):
            # the user's LeRobot dataset: the tiny fixture (a recipe that augments images needs one)
            fixture = f"data.source=lerobot:{ROOT / 'tests/fixtures/lerobot/tiny'}"
            overrides = [fixture if o.startswith("data.source=lerobot:") else o for o in args.overrides
                         if not o.startswith("model.init_from=PATH")
                         and (o.startswith("data.source=lerobot:") or not o.startswith("data.source="))]
            tiny = ["model.vision.n_heads=2"] if "lerobot06/pi05" in line else []  # the tutorial's overlay key
            config.load(args.config, overrides + tiny)


MODEL_PAGES = sorted((ROOT / "docs" / "models").glob("*.md"))
EVIDENCE = re.compile(r"within \d(\.\d+)?e-\d|this (2-core )?(CPU )?machine")  # a tolerance met, a machine's log


@pytest.mark.parametrize("page", MODEL_PAGES, ids=lambda p: p.name)
def test_a_model_page_is_how_to_with_its_evidence_linked(page):
    """LeRobot's policy pages: a fine-tune command block first, then the recipes and the memory per
    card; the checks and measurements are in docs/benchmarks/, linked, not told again."""
    text = page.read_text()
    sections = re.findall(r"^## (.+)$", text, re.M)
    assert sections[0].startswith("Fine-tune on your"), sections
    assert "```bash" in text.split("\n## ")[1], "the first section is a command block"
    assert any("recipes" in s.lower() for s in sections) and "Memory per card" in sections, sections
    assert "../benchmarks/" in text, "link the page's evidence"
    assert not EVIDENCE.search(text), EVIDENCE.search(text).group(0)


HOW_TO_PAGES = [ROOT / "README.md", ROOT / "docs" / "index.md", ROOT / "docs" / "development.md",
                *sorted((ROOT / "docs" / "guides").glob("*.md")), *sorted((ROOT / "docs" / "tutorials").glob("*.md"))]
LOGGED = re.compile(r"20\d\d-\d\d-\d\d|this (2-core )?(CPU )?(machine|box)|this CPU")  # a date, a machine's log


@pytest.mark.parametrize("page", HOW_TO_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_how_to_page_links_its_measurements(page):
    """One number per claim: a measurement (its date, the machine it ran on) is an entry of
    docs/benchmarks/, which the README, guides and tutorials link to and do not tell again."""
    text = re.sub(r"\]\([^)]*\)", "]", page.read_text())  # a link's target may name an entry's date
    found = LOGGED.search(text)
    assert not found, f"{page.relative_to(ROOT)}: {found.group(0)!r}: move the measurement to docs/benchmarks/"
