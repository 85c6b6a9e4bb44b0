"""Relative actions (model.action.relative, `data.lerobot.relative`): a tiny π0.5 trained on the
LeRobot fixture with dx relative to the state and dy excluded (kept absolute). The training targets
are openpi's DeltaActions of the frame's chunk, normalized with the statistics `zerojax stats
--relative-actions` writes; `serve` gives the state back, so its actions are absolute; a LeRobot
checkpoint saved with use_relative_actions=True turns them on; the exports say so as LeRobot 0.6.1
and openpi read it."""

import json
import re
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from conftest import ROOT
from zerojax import cli, config
from zerojax.data import sources
from zerojax.data.lerobot import normalize, unnormalize
from zerojax.errors import ConfigError
from zerojax.serve import loaders
from zerojax.train import export

FIXTURE = ROOT / "tests" / "fixtures" / "lerobot" / "tiny"  # action dx, dy; state [3]
TINY = ["model.family=pi05", "model.vocab_size=256", "model.d_model=32", "model.n_layers=2", "model.n_heads=2",
        "model.n_kv_heads=1", "model.head_dim=8", "model.d_ff=32", "model.expert.d_model=16", "model.expert.d_ff=32",
        "model.vision.image_size=8", "model.vision.patch_size=4", "model.vision.d_model=16", "model.vision.n_layers=1",
        "model.vision.n_heads=2", "model.vision.d_ff=32", "model.action.horizon=2", "model.action.prompt_len=64",
        "model.action.max_state_dim=8", "model.action.max_action_dim=4", "model.action.action_dim=2",
        "model.action.cameras=2", "train.global_batch=8", "data.norm_state=quantiles", "data.norm_action=quantiles",
        "zero.min_shard_size=64", "train.steps=2", "train.log_every=1", "train.eval_every=0", "train.sample_tokens=0",
        "train.ckpt_every=2", "train.report=false", "optim.warmup_steps=0", "model.remat=none",
        "model.action.relative=true", "model.action.relative_exclude=dy",
        "model.norm_eps=1e-6"]  # openpi's eps, for --format openpi
SEED, STEPS = 3, 3  # serve's noise seed and Euler steps


def dataset(directory: Path, with_file: bool) -> Path:
    """A copy of the fixture, with meta/stats_relative.json written by `zerojax stats` or without it."""
    root = directory / "tiny"
    shutil.copytree(FIXTURE, root)
    if with_file:
        assert cli.main(["stats", str(root), "--relative-actions", "--horizon", "2", "--exclude", "dy"]) == 0
    return root


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    """(a dataset with the relative statistics' file, one without)."""
    return (dataset(tmp_path_factory.mktemp("with"), True), dataset(tmp_path_factory.mktemp("without"), False))


def relative_stats(root: Path) -> dict:
    return json.loads((root / "meta" / "stats_relative.json").read_text())["action"]


@pytest.mark.parametrize("which", ["stats_relative.json", "computed at start"])
def test_the_targets_are_the_actions_minus_the_state_normalized_by_relative_statistics(roots, which):
    """Each row's target chunk is (action - state) on dx and the absolute dy, normalized by the
    quantiles of those relative chunks, whether the file is there or the statistics are computed."""
    root = roots[0] if which == "stats_relative.json" else roots[1]
    src = sources.open_source(config.load(overrides=[*TINY, f"data.source=lerobot:{root}"]))
    batch, stats = src.rows(0, 0, slice(None)), relative_stats(roots[0])
    for row, index in enumerate(src.source.frames_of(0, 0)):
        raw = src.source.raw_item(int(index))
        delta = raw["action"] - np.array([raw["observation.state"][0], 0], np.float32)
        want = normalize(delta, stats, "quantiles")
        np.testing.assert_allclose(batch["actions"][row, :, :2], want, rtol=1e-6, atol=1e-6, err_msg=str(index))
        np.testing.assert_array_equal(batch["actions"][row, :, 2:], 0)
    record = json.loads(src.run_files()["lerobot.json"])
    assert record["relative_actions"] == {"state": "observation.state", "exclude_joints": ["dy"],
                                          "action_names": ["dx", "dy"], "mask": [True, False]}
    np.testing.assert_allclose(record["normalization"]["action"]["q01"], stats["q01"], rtol=1e-7)


def test_an_exclusion_the_dataset_cannot_name_is_one_error(roots):
    with pytest.raises(ConfigError, match=r"model.action.relative_exclude=gripper names none of the action's joints"):
        sources.open_source(config.load(overrides=[*TINY, f"data.source=lerobot:{roots[1]}",
                                                   "model.action.relative_exclude=gripper"]))


@pytest.mark.parametrize("overrides, message", [
    (["model.action.relative=true"], "model.family=gpt is not a policy"),
    ([*TINY, "model.action.relative=false"], "model.action.relative_exclude=['dy'] names joints to keep absolute"),
])
def test_relative_actions_outside_a_policy_or_without_relative_are_refused(roots, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        config.load(overrides=[f"data.source=lerobot:{roots[1]}", *overrides])


@pytest.fixture(scope="module")
def run_dir(roots, tmp_path_factory):
    out = tmp_path_factory.mktemp("relative") / "run"
    assert cli.main(["train", "--no-progress", *TINY, f"data.source=lerobot:{roots[0]}", f"train.out_dir={out}"]) == 0
    return out


def observation(root: Path, index: int) -> dict:
    """Frame `index` of the dataset as a robot sends it (state, cameras as uint8 HWC, prompt)."""
    src = sources.open_source(config.load(overrides=[*TINY, f"data.source=lerobot:{root}"])).source
    numbers = src.dataset.numbers(index, 2)
    return {"observation.state": numbers["observation.state"], "prompt": numbers["task"],
            **{c: src.dataset.image(c, index, src.video) for c in src.cameras}}


def by_hand(run_dir: Path, served, obs: dict, request: int) -> np.ndarray:
    """sample_actions of the run's model on the served row, unnormalized with the run's relative
    statistics, and the state added to dx."""
    _, _, model = export.load_model(run_dir)
    row = served.observations.row(served.observations.check(obs))
    noise = jax.random.normal(jax.random.fold_in(jax.random.key(SEED), request), (1, 2, 4))
    x = np.asarray(model.sample_actions(row, noise, STEPS))[0, :, :2]
    norm = json.loads((run_dir / "lerobot.json").read_text())["normalization"]["action"]
    return unnormalize(x, norm, "quantiles") + np.array([obs["observation.state"][0], 0], np.float32)


@pytest.fixture(scope="module")
def served(run_dir):
    return loaders.load(run_dir, num_steps=STEPS, seed=SEED)


def test_served_actions_are_absolute(run_dir, served, roots, tmp_path):
    """serve (a run directory and its safetensors export) unnormalizes with the relative statistics
    and adds the state back on dx: the actions equal the model's, made absolute by hand."""
    obs = observation(roots[0], 7)
    got = served.infer(obs, 0)["actions"]
    np.testing.assert_allclose(got, by_hand(run_dir, served, obs, 0), rtol=1e-5, atol=1e-5)
    out = tmp_path / "policy.safetensors"
    assert cli.main(["export", str(run_dir), "--out", str(out)]) == 0
    np.testing.assert_array_equal(loaders.load(out, num_steps=STEPS, seed=SEED).infer(obs, 0)["actions"], got)


def test_a_real_time_chunks_leftover_is_made_relative_as_the_targets_were(served, run_dir):
    """prev_actions come in the robot's units; the row's leftover is them minus the state on dx,
    normalized with the relative statistics, as training normalized its targets."""
    state, leftover = np.array([4.0, 5.0, 6.0], np.float32), np.array([[5.0, 1.0], [6.0, 2.0]], np.float32)
    got = served.observations.normalized_actions(leftover, state)
    norm = json.loads((run_dir / "lerobot.json").read_text())["normalization"]["action"]
    np.testing.assert_allclose(got, normalize(leftover - np.array([4.0, 0], np.float32), norm, "quantiles"), rtol=1e-6)


def test_stats_takes_the_exclusion_from_a_runs_config(run_dir, roots, tmp_path):
    """`zerojax stats --relative-actions --run RUN_DIR` takes H and the excluded joints from the run:
    the file the run's own statistics equal."""
    out = tmp_path / "rel.json"
    assert cli.main(["stats", str(roots[1]), "--relative-actions", "--run", str(run_dir), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["action"] == relative_stats(roots[0])


LEROBOT06 = ROOT / "tests" / "fixtures" / "lerobot06"  # LeRobot 0.6.1's π0.5; its dataset's action a0, a1, a2


def relative_checkpoint(directory: Path) -> Path:
    """LeRobot 0.6.1's π0.5 fixture as saved with use_relative_actions=True, a2 excluded."""
    out = directory / "pi05"
    shutil.copytree(LEROBOT06 / "pi05", out)
    saved = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**saved, "use_relative_actions": True,
                                                 "relative_exclude_joints": ["a2"]}))
    return out


@pytest.mark.parametrize("given, relative, exclude, said", [
    ([], True, ("a2",), "from the checkpoint: .* relative=True relative_exclude=a2"),
    (["model.action.relative=false"], False, (), "from the config: relative=False"),
    (["model.action.relative_exclude=a1"], True, ("a1",), r"relative=True( \S+)*; from the config: relative_exclude=a1"),
])
def test_a_lerobot_checkpoint_saved_with_relative_actions_turns_them_on(tmp_path, given, relative, exclude, said):
    """model.init_from of a LeRobot π0.5 saved with use_relative_actions=True carries it and its
    excluded joints into model.action.relative and relative_exclude, said on the start line; a key
    the user sets wins."""
    from zerojax.config import policy_keys

    cfg, origins = config.load_with_origins(overrides=[f"model.init_from={relative_checkpoint(tmp_path)}",
                                                       f"data.source=lerobot:{LEROBOT06 / 'dataset'}",
                                                       "model.vision.n_heads=2", *given])
    assert (cfg.model.action.relative, cfg.model.action.relative_exclude) == (relative, exclude)
    assert re.search(said, policy_keys.describe(origins, cfg)), policy_keys.describe(origins, cfg)


def test_the_exports_say_relative_actions_as_lerobot_and_openpi_read_them(run_dir, roots, tmp_path):
    """--format lerobot: config.json's use_relative_actions and excluded joints, the relative step on
    with the joints' names, the absolute step on, and the normalizer's statistics those of the
    relative actions (dy's: its absolute actions over the same chunks), which a LeRobot directory
    read back gives the same mask. --format openpi: norm_stats of the relative actions."""
    from safetensors.numpy import load_file

    from zerojax.interop import lerobot as lerobot_io

    out = tmp_path / "lerobot"
    assert cli.main(["export", str(run_dir), "--format", "lerobot", "--out", str(out)]) == 0
    saved = json.loads((out / "config.json").read_text())
    assert (saved["use_relative_actions"], saved["relative_exclude_joints"], saved["action_feature_names"]) == \
        (True, ["dy"], ["dx", "dy"])
    pre, post = (json.loads((out / f"policy_{n}.json").read_text())["steps"] for n in ("preprocessor", "postprocessor"))
    relative = next(s for s in pre if s["registry_name"] == "relative_actions_processor")
    assert relative["config"] == {"enabled": True, "exclude_joints": ["dy"], "action_names": ["dx", "dy"]}
    assert next(s for s in post if s["registry_name"] == "absolute_actions_processor")["config"] == {"enabled": True}
    stats, absolute = relative_stats(roots[0]), json.loads((roots[0] / "meta" / "stats.json").read_text())["action"]
    for step in (next(s for s in pre if s["registry_name"] == "normalizer_processor"), post[0]):
        tensors = load_file(out / step["state_file"])
        for stat in ("q01", "q99", "mean", "std"):
            np.testing.assert_allclose(tensors[f"action.{stat}"], stats[stat], rtol=1e-6, err_msg=stat)
        assert not np.isclose(tensors["action.q01"][0], absolute["q01"][0])  # dx: relative, not the dataset's
    assert lerobot_io.read_policy(out).relative["mask"] == [True, False]
    openpi = tmp_path / "openpi"
    assert cli.main(["export", str(run_dir), "--format", "openpi", "--out", str(openpi)]) == 0
    norm = json.loads(next(openpi.glob("assets/*/norm_stats.json")).read_text())["norm_stats"]["actions"]
    for stat in ("q01", "q99", "mean", "std"):
        np.testing.assert_allclose(norm[stat], stats[stat], rtol=1e-6, err_msg=stat)


def test_the_guides_command_loads():
    """docs/guides/data.md's relative-actions command: its keys load as written."""
    import shlex

    text = (ROOT / "docs" / "guides" / "data.md").read_text()
    line = next(row for row in text.splitlines()
                if row.startswith("zerojax train") and "model.action.relative=true" in row)
    cfg = config.load(overrides=shlex.split(line)[2:])
    assert (cfg.model.action.relative, cfg.model.action.relative_exclude) == (True, ("gripper",))
