"""The closed-loop benchmark's smoke version (scripts/bench/closed_loop.py --smoke): every kind of
step the benchmark takes (collecting two datasets with different cameras, training plain, with
augmentation, with training-time RTC and on their mixture, and rolling out under a shift, with a
delay, and a mixture's dataset) runs as the full benchmark runs it, tiny; a second call resumes
with nothing left to do. The benchmark's figures are BENCHMARKS.md's, not the suite's."""

import json
import os
import subprocess
import sys

import pytest

from conftest import CACHE, ROOT, one_error_line
from test_metaworld import mujoco_or_skip
from zerojax import cli

SCRIPT = ROOT / "scripts" / "bench" / "closed_loop.py"


def bench(out, *flags):
    """The script, its zerojax commands sharing the suite's compilation cache (the runs' rollouts
    sample with one program)."""
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(CACHE), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5"}
    return subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *flags], cwd=ROOT, capture_output=True,
                          text=True, timeout=1200, env=env)


@pytest.mark.slow
def test_the_benchmark_runs_every_kind_of_step_and_resumes(tmp_path, capsys):
    mujoco_or_skip()
    out = tmp_path / "bench"
    proc = bench(out, "--smoke")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rollouts = {p.stem: json.loads(p.read_text()) for p in (out / "rollouts").glob("*.json")}
    assert set(rollouts) == {"augment-shift-camera", "plain-delay2-rtc", "train_delay-delay2", "mixture-b"}
    a_tasks = {"reach-v3", "button-press-topdown-v3", "drawer-close-v3"}
    for name, doc in rollouts.items():
        assert set(doc["tasks"]) == ({"button-press-v3", "window-close-v3"} if name == "mixture-b" else a_tasks)
        assert all(t["episodes"] == 1 for t in doc["tasks"].values()) and doc["request_ms"] > 0
    assert rollouts["augment-shift-camera"]["shift"] == "camera moved (0,0,0.04) m"
    assert rollouts["train_delay-delay2"]["shift"] == "none" and rollouts["plain-delay2-rtc"]["seam_jump"] >= 0
    config = (out / "mixture" / "config.yaml").read_text()
    assert "mixture" in config and "topview" in (out / "data" / "b" / "meta" / "info.json").read_text()
    table = proc.stdout
    assert "| augment | camera=0,0,0.04 | 0/1 " in table or "| augment | camera=0,0,0.04 | 1/1 " in table
    assert "| 2 | training-time RTC (D = 4) |" in table and "| mixture A + B | B |" in table

    again = bench(out, "--smoke")
    assert again.returncode == 0 and "$ zerojax" not in again.stderr, again.stderr[-2000:]

    # a mixture run is rolled out as one of its datasets, which --dataset names
    line = one_error_line(["rollout", str(out / "mixture"), "--env", "metaworld:reach-v3", "--episodes", "1"], capsys)
    assert "give --dataset" in line and str(out / "data" / "a") in line
    line = one_error_line(["rollout", str(out / "mixture"), "--env", "metaworld:reach-v3", "--dataset", "c"], capsys)
    assert "--dataset 'c'" in line
    line = one_error_line(["rollout", str(out / "plain"), "--env", "metaworld:reach-v3", "--dataset", "a"], capsys)
    assert "not a mixture" in line
    assert cli.main(["rollout", str(out / "mixture"), "--env", "metaworld:reach-v3", "--dataset", "a",
                     "--episodes", "1", "--max-steps", "3", "--json", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["tasks"]["reach-v3"]["episodes"] == 1
