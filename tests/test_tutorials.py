"""The tutorials' commands, run as the pages write them: each page's ```bash blocks up to its
"The tiny overlay" (what follows is reading, not the journey) become one shell script (a line
ending in `\\` continues on the next), run from a directory where the repository's tests/,
configs/ and README.md are where the page expects them. The page's tiny overlay (its ```text
block under "The tiny overlay") is added to the `zerojax train` and `zerojax plan` lines, and
`--max-compiles 1` to `plan`, as the page says; `zerojax serve` runs in the background until it
listens. Nothing else is changed: a page cannot rot."""

import os
import re
import socket
import subprocess
import sys

import pytest

from conftest import ROOT

TUTORIALS = ROOT / "docs" / "tutorials"


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def commands(page: str) -> list[str]:
    """The journey's shell lines (the page up to its tiny overlay; what follows is reading),
    continuations joined, comments and blank lines dropped."""
    joined = "\n".join(blocks(page[:page.index("## The tiny overlay")], "bash")).replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def overlay(page: str) -> str:
    section = page[page.index("## The tiny overlay"):]
    (keys,) = blocks(section, "text")
    return " ".join(keys.split())


def script(page: str) -> str:
    """The page as one bash script: `zerojax` is this interpreter's zerojax, serve is backgrounded."""
    tiny = overlay(page)
    out = ["set -euo pipefail", f'zerojax() {{ "{sys.executable}" -m zerojax "$@"; }}',
           "trap 'kill $SERVE 2>/dev/null || true' EXIT", "SERVE="]
    for line in commands(page):
        if line.startswith(("zerojax train", "zerojax plan")):
            line = f"{line} {tiny}" + (" --max-compiles 1" if line.startswith("zerojax plan") else "")
        if line.startswith("zerojax serve"):
            out += [f"{line} > serve.log 2>&1 &", "SERVE=$!",
                    "for _ in $(seq 600); do grep -q 'listening on' serve.log && break; "
                    "kill -0 $SERVE || { cat serve.log; exit 1; }; sleep 0.5; done",
                    "grep -q 'listening on' serve.log || { cat serve.log; exit 1; }"]
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


POLICY_STEPS = ["stats", "plan", "train", "export", "serve", "client"]
# page -> (its zerojax commands in order, files it leaves, the family the served policy names or None)
JOURNEYS = {"pi05-lerobot.md": (POLICY_STEPS, ["runs/pi05-mine/checkpoints", "pi05-mine/model.safetensors"], "pi05"),
            "smolvla-one-card.md": (POLICY_STEPS[1:], ["runs/smolvla-mine/checkpoints",
                                                       "smolvla-mine/model.safetensors"], "smolvla"),
            "lora-llama.md": (["train", "export", "export", "generate"],
                              ["my_adapter/adapter_model.safetensors", "my_llama/config.json"], None),
            "zero-from-scratch.md": (["memory", "train", "analyze", "report"],
                                     ["runs/stage3/checkpoints/10", "report.html"], None),
            "chat-sft.md": (["train", "generate", "export"], ["runs/sft-mine/checkpoints",
                                                              "my_chat_model/config.json"], None)}


@pytest.mark.parametrize("name", JOURNEYS)
def test_the_page_is_parsed_as_written(name):
    page = (TUTORIALS / name).read_text()
    steps, _, family = JOURNEYS[name]
    assert [line.split()[1] for line in commands(page) if line.startswith("zerojax ")] == steps
    journey = " ".join(commands(page))
    assert "zero.min_shard_size" not in journey and "model.remat=none" not in journey  # no test-only keys
    text = script(page)
    assert text.count(overlay(page)) == sum(step in ("train", "plan") for step in steps)
    assert ("--max-compiles 1" in text) == ("plan" in steps)
    assert ("serve.log 2>&1 &" in text) == (family is not None)


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name, (_, _, family) in JOURNEYS.items() if family is not None])
def test_the_tutorial_runs(name, tmp_path):
    """The policy journeys; tests/test_tutorials_llm.py runs the others (two files: two workers)."""
    run_journey(name, tmp_path)


def run_journey(name: str, tmp_path) -> None:
    """The page's journey on the repository's tiny checkpoints and datasets."""
    _, files, family = JOURNEYS[name]
    for link in ("tests", "configs", "README.md"):
        (tmp_path / link).symlink_to(ROOT / link)
    page = (TUTORIALS / name).read_text()
    done = subprocess.run(["bash", "-c", script(page)], cwd=tmp_path, capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "PORT": str(free_port())})
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    assert all((tmp_path / f).exists() for f in files), [f for f in files if not (tmp_path / f).exists()]
    if "zerojax plan" in page:
        config_file = re.search(r"--config (\S+)", page).group(1)
        assert f"train with: zerojax train --config {config_file}" in done.stdout
    if family is None:
        assert "zerojax: done" in done.stdout
        assert ("new tokens after" in done.stderr) == ("zerojax generate" in page)
        return
    answer = done.stdout[done.stdout.index("ws://127.0.0.1:"):].splitlines()
    assert f"(zerojax {family})" in answer[0] and "ms (one round trip)" in answer[0], answer
    assert answer[1] == "step  served  |  dataset" and answer[-1].startswith("mean |served - dataset| over")
    assert len(answer) == 2 + 4 + 1  # the heading, the tiny chunk's 4 steps, the gap
