"""A LeRobot 0.6.1 π0.5 with relative actions fine-tunes and exports back (issue 42, without
LeRobot: scripts/checks/check_lerobot06_relative_export.py runs LeRobot 0.6.1 itself).

The start is tests/fixtures/lerobot06/pi05_relative, made by LeRobot's own `make_policy` and
processors with use_relative_actions=True and a2 excluded
(scripts/fixtures/make_lerobot06_relative_fixture.py). `zerojax train model.init_from=IT
data.source=lerobot:DS` with no relative key takes them from its config.json, and the start line
says so; 2 steps at stage 3 on 8 devices, then `zerojax export --format lerobot`: config.json and
the processors say relative actions as LeRobot 0.6.1 reads them, and the normalizers hold the
statistics of what the run trained on, computed here from the dataset's Parquet: each frame's
chunk minus its state on a0 and a1, a2's absolute chunk."""

import contextlib
import io
import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml
from safetensors.numpy import load_file

from conftest import ROOT
from zerojax.data.lerobot import stats

FIXTURE = ROOT / "tests" / "fixtures" / "lerobot06"
DATASET, START = FIXTURE / "dataset", FIXTURE / "pi05_relative"
NAMES, EXCLUDED, MASK, H = ["a0", "a1", "a2"], ["a2"], np.array([True, True, False]), 4  # the fixture's chunk
STATS_FILES = ("policy_preprocessor_step_3_normalizer_processor.safetensors",
               "policy_postprocessor_step_0_unnormalizer_processor.safetensors")
RUN = ["model.vision.n_heads=2",  # the tiny tower's: LeRobot's config.json has no field for it
       "zero.stage=3", "train.steps=2", "train.report=false"]


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    """(run directory, its export, what `zerojax train` printed), trained from the repository root
    (the fixture's processors name its tokenizer from there)."""
    from zerojax import cli

    out, said = tmp_path_factory.mktemp("relative06"), io.StringIO()
    with contextlib.chdir(ROOT), contextlib.redirect_stdout(said):
        code = cli.main(["train", "--no-progress", f"model.init_from={START}", f"data.source=lerobot:{DATASET}", *RUN,
                         f"train.out_dir={out / 'run'}"])
    assert code == 0, said.getvalue()
    assert cli.main(["export", str(out / "run"), "--format", "lerobot", "--out", str(out / "export")]) == 0
    return out / "run", out / "export", said.getvalue()


def chunks_by_episode(relative: bool) -> list[np.ndarray]:
    """Each episode's [N * H, 3] action chunks from the Parquet (the episode's last action repeated
    past its end, as LeRobot's delta_timestamps pad them), minus the frame's state on a0 and a1
    where `relative`."""
    table = pq.read_table(next((DATASET / "data").rglob("*.parquet"))).to_pydict()
    episode, frame = np.array(table["episode_index"]), np.array(table["frame_index"])
    action, state = np.array(table["action"], np.float32), np.array(table["observation.state"], np.float32)
    out = []
    for e in np.unique(episode):
        rows = np.flatnonzero(episode == e)[np.argsort(frame[episode == e])]
        for_episode = []
        for i, row in enumerate(rows):
            chunk = action[rows[np.minimum(i + np.arange(H), len(rows) - 1)]]
            for_episode.append(chunk - np.where(MASK & relative, state[row, :3], 0).astype(np.float32))
        out.append(np.concatenate(for_episode))
    return out


def test_the_checkpoint_turns_relative_actions_on_and_the_start_line_says_so(finetuned):
    run_dir, _, said = finetuned
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert (saved["model"]["action"]["relative"], saved["model"]["action"]["relative_exclude"]) == (True, EXCLUDED)
    assert saved["zero"]["stage"] == 3 and "8 cpu devices" in said and "stage 3" in said, said
    line = next(x for x in said.splitlines() if "policy settings" in x)
    from_checkpoint = next(g for g in line.split("; ") if "from the checkpoint: " in g)
    assert "relative=True relative_exclude=a2" in from_checkpoint, line
    assert json.loads((run_dir / "lerobot.json").read_text())["relative_actions"] == \
        {"state": "observation.state", "exclude_joints": EXCLUDED, "action_names": NAMES, "mask": MASK.tolist()}


def test_the_export_says_relative_actions_as_lerobot06_reads_them(finetuned):
    """config.json's keys, the relative step on with the joints' names, the absolute step on."""
    _, export, _ = finetuned
    saved = json.loads((export / "config.json").read_text())
    assert (saved["use_relative_actions"], saved["relative_exclude_joints"], saved["action_feature_names"]) == \
        (True, EXCLUDED, NAMES)
    pre, post = (json.loads((export / f"policy_{n}.json").read_text())["steps"] for n in ("preprocessor", "postprocessor"))
    names = [s["registry_name"] for s in pre]
    assert names.index("relative_actions_processor") < names.index("normalizer_processor")  # openpi's order
    relative = next(s for s in pre if s["registry_name"] == "relative_actions_processor")
    assert relative["config"] == {"enabled": True, "exclude_joints": EXCLUDED, "action_names": NAMES}
    assert [s["registry_name"] for s in post][:2] == ["unnormalizer_processor", "absolute_actions_processor"]
    assert post[1]["config"] == {"enabled": True}


def test_the_normalizers_hold_relative_statistics_on_the_joints_and_absolute_on_a2(finetuned):
    """Both processors' action statistics are those of the chunks the run trained on (numpy over
    the Parquet: min, max, mean, std, count; the quantiles LeRobot's per-episode histograms,
    averaged by count): relative on a0 and a1, absolute on a2; not LeRobot's absolute statistics,
    which the start's normalizer held."""
    _, export, _ = finetuned
    relative, absolute = chunks_by_episode(True), chunks_by_episode(False)
    every = np.concatenate(relative)
    np.testing.assert_array_equal(every[:, 2], np.concatenate(absolute)[:, 2])  # a2 stays absolute
    want = {"min": every.min(0), "max": every.max(0), "mean": every.mean(0, dtype=np.float64),
            "std": every.std(0, dtype=np.float64), "count": [len(every)]}
    quantiles = stats.aggregate([stats.vector_stats(c) for c in relative])
    want.update({k: quantiles[k] for k in stats.Q_KEYS})
    start = load_file(START / STATS_FILES[0])
    for name in STATS_FILES:
        got = load_file(export / name)
        for stat, value in want.items():
            np.testing.assert_allclose(got[f"action.{stat}"], np.asarray(value, np.float32), rtol=1e-6, atol=1e-6,
                                       err_msg=f"{name} action.{stat}")
        assert not np.allclose(got["action.q01"][:2], start["action.q01"][:2])  # a0, a1: not the absolute ones
