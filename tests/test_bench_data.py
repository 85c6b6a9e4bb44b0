"""scripts/bench/bench_data.py's zerojax side, in a few seconds on the tiny LeRobot fixture (`--smoke`:
no LeRobot venv, no dataset written). The comparison with LeRobot's own loader runs by hand
(BENCHMARKS.md, "Loading LeRobot datasets")."""

import json
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts" / "bench"))
import bench_data  # noqa: E402 - scripts/bench/bench_data.py

TINY = ROOT / "tests" / "fixtures" / "lerobot" / "tiny"  # 19 frames, cameras 24x32 (video) and 16x16 (images)


def test_the_smoke_run_measures_zerojaxs_loader_on_the_fixture(capsys):
    bench_data.main(["--smoke", "--dataset", str(TINY), "--horizon", "4", "--image-size", "20", "--batch", "4",
                     "--seconds", "1"])
    out = json.loads(capsys.readouterr().out)["zerojax"]
    assert out["shapes"] == {"action": [4, 4, 2], "image": [4, 3, 20, 20], "action_is_pad": [4, 4]}
    assert out["batches"] >= 1 and out["seconds"] >= 1
    assert out["samples_per_s"] == pytest.approx(out["batches"] * 4 / out["seconds"])


def test_the_smoke_run_needs_a_dataset():
    with pytest.raises(SystemExit, match="--smoke needs --dataset DIR"):
        bench_data.main(["--smoke"])
