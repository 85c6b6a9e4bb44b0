"""`zerojax stats DIR` against LeRobot's own numbers: tests/fixtures/lerobot/tiny is a dataset LeRobot
wrote (its meta/stats.json computed by LeRobot 0.4.4 as it recorded), and
tests/fixtures/lerobot/stats_reference.json is what LeRobot 0.6.1's augment_dataset_quantile_stats
computes of it (scripts/fixtures/make_stats_fixtures.py, run in LeRobot 0.6.1's venv). No torch here.

Tolerance: rtol 1e-7 (float32's spacing is 6e-8) and atol 1e-12. zerojax runs LeRobot's float
operations in the same dtypes and order, so the numbers agree to the bit today; what the tolerance
leaves room for is another numpy's summation (a float32 mean over an episode)."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from zerojax import cli
from zerojax.data.lerobot import stats

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "lerobot"
TINY = FIXTURE / "tiny"
REF = json.loads((FIXTURE / "stats_reference.json").read_text())["stats"]
KEYS = ("min", "max", "mean", "std", "count", "q01", "q10", "q50", "q90", "q99")
CAMERAS = ("observation.images.front", "observation.images.wrist")


def without_stats(tmp_path) -> Path:
    root = tmp_path / "tiny"
    shutil.copytree(TINY, root)
    (root / "meta" / "stats.json").unlink()
    return root


def assert_stats_equal(got: dict, want: dict, features) -> None:
    for key in features:
        assert set(got[key]) == set(KEYS), key
        for name in KEYS:
            np.testing.assert_allclose(np.asarray(got[key][name], np.float64), np.asarray(want[key][name], np.float64),
                                       rtol=1e-7, atol=1e-12, err_msg=f"{key} {name}")


def test_the_command_writes_lerobot_061s_statistics_for_a_dataset_that_lacks_them(tmp_path, capsys):
    root = without_stats(tmp_path)
    assert cli.main(["stats", str(root)]) == 0
    assert "9 features (19 frames)" in capsys.readouterr().out
    got = json.loads((root / "meta" / "stats.json").read_text())
    assert set(got) == set(REF)  # every feature but the strings, the cameras too
    assert_stats_equal(got, REF, REF)
    assert [p.name for p in (root / "meta").iterdir() if p.name.endswith(".tmp")] == []  # renamed into place


def test_the_numbers_equal_those_lerobot_wrote_as_it_recorded_the_dataset(tmp_path):
    """The dataset's own meta/stats.json (LeRobot 0.4.4, from its episode buffers). Its cameras are
    left out: LeRobot computed them from the frames before encoding them (the front camera is AV1,
    lossy) and, for 0.4.4, with another std; stats_reference.json holds 0.6.1's of the decoded frames."""
    written = json.loads((TINY / "meta" / "stats.json").read_text())
    got = stats.compute(without_stats(tmp_path))
    assert_stats_equal(got, written, [k for k in written if k not in CAMERAS])


def test_split_over_processes_each_reads_its_share_and_the_result_is_the_same():
    whole = stats.compute_local(TINY)
    shares = [stats.compute_local(TINY, i, 3) for i in range(3)]
    assert [[e for e, _ in s] for s in shares] == [[0], [1], [2]]  # contiguous ranges, one episode each
    assert [e for s in shares for e, _ in s] == [e for e, _ in whole]
    halves = [[e for e, _ in stats.compute_local(TINY, i, 2)] for i in range(2)]
    assert halves == [[0], [1, 2]]  # contiguous: a process reads only the data files of its range
    with pytest.raises(stats.ConfigError, match="3 episodes, fewer than the 4 processes"):
        stats.compute_local(TINY, 0, 4)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_write_the_same_file_as_one(tmp_path):
    """Two real processes (jax.distributed, gloo on CPU): each reduces its episodes, process 0 gathers
    and writes; the file is byte for byte the one process's."""
    root = without_stats(tmp_path)
    assert cli.main(["stats", str(root), "--out", str(tmp_path / "one.json")]) == 0
    port, env = free_port(), {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    procs = [subprocess.Popen([sys.executable, "-m", "zerojax", "stats", str(root), "--out", str(tmp_path / "two.json"),
                               "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "2 processes" in outs[0]
    assert (tmp_path / "two.json").read_bytes() == (tmp_path / "one.json").read_bytes()


def test_a_quantile_is_within_one_histogram_bin_of_its_order_statistic():
    """LeRobot's histogram quantile q (5,000 bins over [min, max], interpolated in the bin holding the
    q * n-th value) lies within one bin of the ceil(q * n)-th smallest value (numpy's linear
    quantile, between the neighbouring order statistics, can be further off in a sparse tail)."""
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(size=(5000, 1)), rng.exponential(size=(5000, 1))], 1).astype(np.float32)
    got = stats.vector_stats(x)
    width = (x.max(0).astype(np.float64) - x.min(0)) / stats.BINS
    ordered = np.sort(x, axis=0)
    for q, key in zip(stats.QUANTILES, stats.Q_KEYS):
        order_statistic = ordered[int(np.ceil(q * len(x))) - 1]
        assert np.all(np.abs(got[key] - order_statistic) <= width * (1 + 1e-6)), (key, got[key], order_statistic)
    np.testing.assert_allclose(got["std"], x.std(0), rtol=1e-4)
    assert got["count"].tolist() == [5000]


def test_quantiles_across_episodes_are_lerobots_count_weighted_mean_not_a_pooled_quantile():
    a, b = stats.vector_stats(np.arange(10, dtype=np.float32)[:, None]), \
        stats.vector_stats(np.arange(100, 130, dtype=np.float32)[:, None])
    both = stats.aggregate([a, b])
    np.testing.assert_allclose(both["q50"], (10 * a["q50"] + 30 * b["q50"]) / 40)
    np.testing.assert_allclose(both["std"], np.concatenate([np.arange(10), np.arange(100, 130)]).std(), rtol=1e-6)
    assert both["count"].tolist() == [40]


def edit_json(path: Path, change) -> None:
    path.write_text(json.dumps(change(json.loads(path.read_text()))))


BAD = {
    "no directory": (lambda root: shutil.rmtree(root), [], "no such directory"),
    "stats.json there": (lambda root: (root / "meta" / "stats.json").write_text("{}"), [],
                         "stats.json exists; give --out PATH to write elsewhere, or --overwrite"),
    "--out in no directory": (lambda root: None, ["--out", "/nonexistent/dir/stats.json"], "no directory"),
    "codebase v2.1": (lambda root: edit_json(root / "meta" / "info.json", lambda d: {**d, "codebase_version": "v2.1"}),
                      [], "zerojax stats reads LeRobot v3.0 datasets"),
    "no episodes": (lambda root: shutil.rmtree(root / "meta" / "episodes"), [], "no episode files"),
    "a data file short of frames": (
        lambda root: __import__("pyarrow.parquet").parquet.write_table(
            __import__("pyarrow.parquet").parquet.read_table(root / "data/chunk-000/file-000.parquet").slice(0, 17),
            root / "data/chunk-000/file-000.parquet"), [], "episode 2 spans dataset indices [15, 19)"),
    "--out a directory": (lambda root: (root / "out").mkdir(), ["--out", "{root}/out"],
                          "is a directory; give a file path, such as"),
    "a NaN in the action": (lambda root: set_value(root, "action", 8, 1, np.nan), [],
                            "action holds nan in episode 1, frame 2 (dimension 1; 1 non-finite values in the episode)"),
    "an infinity in the state": (lambda root: set_value(root, "observation.state", 16, 2, -np.inf), [],
                                 "observation.state holds -inf in episode 2, frame 1 (dimension 2;"),
    "--exclude naming no joint": (lambda root: None, ["--relative-actions", "--horizon", "3", "--exclude", "gripper"],
                                  "--exclude gripper names none of the action's joints (dx, dy)"),
    "relative actions without a horizon": (lambda root: None, ["--relative-actions"],
                                           "--relative-actions needs the chunk's length: --horizon H, or --run"),
    "--exclude without --relative-actions": (lambda root: None, ["--exclude", "dy"],
                                             "--exclude: only with --relative-actions"),
    "--run without a config": (lambda root: None, ["--relative-actions", "--run", "{root}"],
                               "is not a zerojax run directory (no config.yaml)"),
    "two horizons": (lambda root: write_run_config(root, 4), ["--relative-actions", "--horizon", "3", "--run", "{root}"],
                     "the chunk's length: --horizon says 3 but --run {root} says 4; give one"),
    "actions without names": (lambda root: edit_json(root / "meta" / "info.json", lambda d: {
        **d, "features": {**d["features"], "action": {**d["features"]["action"], "names": None}}}),
        ["--relative-actions", "--horizon", "2", "--exclude", "dy"], "names no action joints"),
}


def write_run_config(directory: Path, horizon: int) -> None:
    """DIR/config.yaml as a run writes it (config.dump), with data.action_horizon = `horizon`."""
    from zerojax import config

    config.dump(config.load(overrides=[f"data.action_horizon={horizon}"]), directory / "config.yaml")


def set_value(root: Path, feature: str, row: int, dim: int, value: float) -> None:
    """The dataset's data file with `feature`'s `dim` at dataset row `row` set to `value`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = root / "data/chunk-000/file-000.parquet"
    table = pq.read_table(path)
    column = table.column(feature).combine_chunks()
    x = np.asarray(column.flatten()).reshape(len(column), -1).copy()
    x[row, dim] = value
    cells = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1), column.type.value_type), x.shape[1])
    pq.write_table(table.set_column(table.schema.get_field_index(feature), feature, cells), path)


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_and_exit_2_with_nothing_written(case, tmp_path, capsys):
    root = without_stats(tmp_path)
    damage, extra, message = BAD[case]
    damage(root)
    assert cli.main(["stats", str(root), *[a.format(root=root) for a in extra]]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zerojax: error: ") and err.count("\n") == 1 and message.format(root=root) in err, err
    assert case == "stats.json there" or not (root / "meta" / "stats.json").exists()
    assert not (root / "meta" / "stats_relative.json").exists()
    assert [p.name for p in root.rglob("*.tmp")] == [] and (not (root / "out").is_dir() or not any((root / "out").iterdir()))


@pytest.mark.parametrize("frames, sampled", [(19, 19), (500, 105), (1000, 177), (2000, 299), (5000, 594),
                                             (10000, 1000), (20000, 1681)])
def test_a_cameras_frames_are_sampled_as_lerobot_samples_them(frames, sampled):
    """estimate_num_samples' documented counts (every frame of a short episode; len**0.75 beyond 500)."""
    got = stats.sample_indices(frames)
    assert len(got) == sampled and got[0] == 0 and got[-1] == frames - 1


def test_a_run_normalizes_with_the_written_quantiles_as_lerobot_does(tmp_path):
    """The workflow: a dataset without statistics, `zerojax stats`, then data.norm_*=quantiles reads
    the file; the batch equals what LeRobot's NormalizerProcessorStep made with LeRobot's own
    stats.json (tests/fixtures/lerobot/reference.npz, as tests/test_lerobot.py reads it)."""
    from zerojax import config, data

    ref = dict(np.load(FIXTURE / "reference.npz"))
    root = without_stats(tmp_path)
    assert cli.main(["stats", str(root)]) == 0
    cfg = config.load(overrides=[f"data.source=lerobot:{root}", f"data.action_horizon={int(ref['horizon'])}",
                                 f"data.image_size={int(ref['size'])}", "train.global_batch=8",
                                 "data.norm_state=quantiles", "data.norm_action=quantiles"])
    src = data.open_source(cfg)
    items = [src.item(int(i)) for i in ref["indices"]]
    for key in ("observation.state", "action"):
        np.testing.assert_array_equal(np.stack([it[key] for it in items]), ref[f"quantiles/{key}"], err_msg=key)


def frames_of(root: Path) -> dict:
    """{episode: (actions [N, 2], states [N, 3])} of the dataset, read with pyarrow alone, in frame order."""
    import pyarrow.parquet as pq

    table = pq.read_table(root / "data/chunk-000/file-000.parquet").to_pydict()
    out = {}
    for episode in sorted(set(table["episode_index"])):
        rows = sorted((i for i, e in enumerate(table["episode_index"]) if e == episode), key=lambda i: table["index"][i])
        out[episode] = (np.array([table["action"][i] for i in rows], np.float32),
                        np.array([table["observation.state"][i] for i in rows], np.float32))
    return out


def openpi_chunks(action: np.ndarray, state: np.ndarray, horizon: int, relative: list[bool]) -> np.ndarray:
    """openpi's actions after DeltaActions, element by element: frame t's chunk holds the actions of
    frames t..t+H-1, the episode's last one repeated past its end (LeRobot's delta_timestamps), and
    `actions[..., :D] -= where(mask, state[..., :D], 0)`."""
    rows = []
    for t in range(len(action)):
        for k in range(horizon):
            a = action[min(t + k, len(action) - 1)].copy()
            for d in range(action.shape[1]):
                if relative[d]:
                    a[d] -= state[t, d]
            rows.append(a)
    return np.array(rows, np.float32)


def test_relative_action_statistics_are_those_of_openpis_delta_chunks(tmp_path, capsys):
    """`--relative-actions --horizon 3 --exclude dy`: dx's statistics are those of action - state over
    every frame's 3-action chunk, dy's of its absolute actions over the same chunks; min, max, mean,
    std and count against numpy over all 57 chunk elements, the quantiles against LeRobot's reduction
    (per episode, then the count-weighted mean) of the chunks built here. Every other feature's
    statistics are those `zerojax stats` writes without the flag."""
    root = without_stats(tmp_path)
    assert cli.main(["stats", str(root), "--relative-actions", "--horizon", "3", "--exclude", "dy"]) == 0
    assert "chunks of 3, dy kept absolute" in capsys.readouterr().out
    got = json.loads((root / "meta" / "stats_relative.json").read_text())
    assert got["action"]["relative"] == {"state": "observation.state", "horizon": 3, "exclude_joints": ["dy"],
                                         "joints": ["dx"]}
    per_episode = [openpi_chunks(a, s, 3, [True, False]) for a, s in frames_of(root).values()]
    every = np.concatenate(per_episode).astype(np.float64)
    assert got["action"]["count"] == [57] and every.shape == (57, 2)
    np.testing.assert_array_equal(got["action"]["min"], every.min(0))
    np.testing.assert_array_equal(got["action"]["max"], every.max(0))
    np.testing.assert_allclose(got["action"]["mean"], every.mean(0), rtol=1e-6)
    np.testing.assert_allclose(got["action"]["std"], every.std(0), rtol=1e-5)
    want = stats.aggregate([stats.vector_stats(c) for c in per_episode])
    for key in stats.Q_KEYS:
        np.testing.assert_allclose(got["action"][key], want[key], rtol=1e-7, err_msg=key)
    absolute = stats.compute(root)
    assert not np.allclose(got["action"]["mean"][0], absolute["action"]["mean"][0])  # dx moved by the state
    assert_stats_equal(got, json.loads(stats.to_json(absolute)), [k for k in REF if k != "action"])


def test_an_excluded_joint_keeps_its_absolute_statistics(tmp_path):
    """With chunks of one action, an excluded joint's statistics are exactly the absolute action's
    (the chunks are the frames), and a joint made relative those of action - state; the horizon
    comes from a run's config.yaml (--run)."""
    root = without_stats(tmp_path)
    write_run_config(tmp_path, 1)
    assert cli.main(["stats", str(root), "--relative-actions", "--run", str(tmp_path), "--exclude", "DY",
                     "--out", str(tmp_path / "rel.json")]) == 0
    got = json.loads((tmp_path / "rel.json").read_text())["action"]
    absolute = stats.compute(root)["action"]
    for key in KEYS:
        np.testing.assert_array_equal(np.asarray(got[key])[..., -1], np.asarray(absolute[key])[..., -1], err_msg=key)
    episodes = frames_of(root).values()
    delta = np.concatenate([a[:, 0] - s[:, 0] for a, s in episodes]).astype(np.float64)
    assert got["count"] == [19] and got["min"][0] == delta.min() and got["max"][0] == delta.max()
    np.testing.assert_allclose(got["mean"][0], delta.mean(), rtol=1e-6)
