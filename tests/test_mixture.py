"""data.source=mixture (zerojax/data/mixture.py): two LeRobot datasets of different cameras and
widths in one run, each normalized with its own statistics, drawn at their weights, the same
batch on any mesh; a mixture trains at stage 3 on 8 devices as on one."""

import json

import numpy as np
import pytest

from conftest import run
from mixture_data import other_robot
from test_family import LEROBOT_TINY, POLICY_KEYS
from zerojax import config, data
from zerojax.data import lerobot
from zerojax.data import mixture as mixture_lib
from zerojax.errors import ConfigError


@pytest.fixture(scope="module")
def robot_b(tmp_path_factory):
    return other_robot(tmp_path_factory.mktemp("mixture") / "robot_b")


def mixture_cfg(robot_b, weights=(0.7, 0.3), *extra):
    return config.load(overrides=[*POLICY_KEYS, "model.family=pi0", "data.source=mixture", "data.val_fraction=0.34",
                                  f"data.mixture={LEROBOT_TINY}:{weights[0]},{robot_b}:{weights[1]}", *extra])


def test_yaml_and_key_value_name_the_same_mixture(robot_b, tmp_path):
    (tmp_path / "mix.yaml").write_text(f"data:\n  source: mixture\n  mixture:\n    {LEROBOT_TINY}: 0.7\n"
                                       f"    {robot_b}: 0.3\n")
    from_yaml = config.load(tmp_path / "mix.yaml")
    from_keys = config.load(overrides=["data.source=mixture", f"data.mixture={LEROBOT_TINY}:0.7,{robot_b}:0.3"])
    assert from_yaml.data == from_keys.data
    assert from_yaml.data.mixture == ((str(LEROBOT_TINY), 0.7), (str(robot_b), 0.3))


@pytest.mark.parametrize("weights", [(0.7, 0.3), (0.5, 0.5), (0.93, 0.07)])
@pytest.mark.parametrize("seed", [0, 1, 17])
def test_realised_frequencies_match_the_weights_within_2_percent_over_2000_draws(robot_b, weights, seed):
    source = mixture_lib.open(mixture_cfg(robot_b, weights, f"train.seed={seed}", "train.global_batch=8"))
    which = np.concatenate([source.draw(data.TRAIN, step)[0] for step in range(250)])  # 2,000 draws
    assert len(which) == 2000
    np.testing.assert_allclose(np.bincount(which, minlength=2) / 2000, weights, atol=0.02)


def test_each_row_is_its_datasets_own_item_padded(robot_b):
    """Rows of either dataset, with that dataset's statistics, widths padded, cameras in their
    slots; held-out episodes of each dataset for evaluation; rows split across processes alike."""
    cfg = mixture_cfg(robot_b, (0.5, 0.5), "train.global_batch=8")
    source = mixture_lib.open(cfg)
    a = lerobot.open(mixture_lib.member_cfg(cfg, str(LEROBOT_TINY)))
    b = lerobot.open(mixture_lib.member_cfg(cfg, str(robot_b)))
    assert source.slots == ["observation.images.front", "observation.images.wrist"]
    which, frames = source.draw(data.TRAIN, 3)
    assert set(which) == {0, 1}
    rows = source.rows(data.TRAIN, 3, slice(0, 8))
    for r, (m, frame) in enumerate(zip(which, frames)):
        own = (a, b)[m].item(frame)
        np.testing.assert_array_equal(rows["observation.state"][r][:own["observation.state"].shape[0]],
                                      own["observation.state"])
        assert not rows["observation.state"][r][own["observation.state"].shape[0]:].any()  # zero-padded to 5
        np.testing.assert_array_equal(rows["action"][r][:, :own["action"].shape[1]], own["action"])
        np.testing.assert_array_equal(rows["observation.images.wrist"][r], own["observation.images.wrist"])
        front = rows["observation.images.front"][r]
        assert (front == -1).all() if m == 1 else np.array_equal(front, own["observation.images.front"])
    # each dataset's own statistics: robot_b's state is far from the tiny one's, yet both normalize near 0
    assert abs(b.dataset.stats["observation.state"]["mean"][0] - a.dataset.stats["observation.state"]["mean"][0]) > 30
    assert np.abs(rows["observation.state"][:, :3]).max() < 3
    doc = json.loads(source.run_files()["mixture.json"])  # the run's record of each dataset's statistics
    assert [(d["dataset"], d["weight"]) for d in doc["datasets"]] == [(str(LEROBOT_TINY), 0.5), (str(robot_b), 0.5)]
    assert [d["lerobot.json"]["fps"] for d in doc["datasets"]] == [10, 20]
    for d, own in zip(doc["datasets"], (a, b)):
        assert d["lerobot.json"]["normalization"]["observation.state"]["mean"] == \
            list(own.dataset.stats["observation.state"]["mean"])
    halves = [source.rows(data.TRAIN, 3, slice(i, i + 4)) for i in (0, 4)]
    for key in rows:
        np.testing.assert_array_equal(np.concatenate([h[key] for h in halves]), rows[key])
    which, frames = source.draw(data.EVAL, 0)
    for m, frame in zip(which, frames):
        assert frame in (a, b)[m].split_frames[1] and frame not in (a, b)[m].split_frames[0]


def test_filter_idle_drops_each_datasets_own_frames_and_counts_them_all(robot_b):
    from zerojax.data import idle

    cfg = mixture_cfg(robot_b, (0.5, 0.5), "data.action_horizon=4", "model.action.horizon=4", "data.filter_idle=0.5")
    source = data.open_source(cfg)
    members = source.source.sources
    for member in members:
        ds = member.dataset
        keep = idle.moving(ds.columns["action"], ds.episode, 4, 0.5, "position")
        unfiltered = ds.split_frames(0.34)[0]
        np.testing.assert_array_equal(member.split_frames[0], unfiltered[keep[np.searchsorted(ds.index, unfiltered)]])
    dropped = sum(m.idle.dropped for m in members)
    assert dropped > 0
    assert f"dropped {dropped} of {sum(m.idle.frames for m in members)} training frames" in idle.start_note(source)


def test_a_policys_batch_masks_the_cameras_a_row_lacks(robot_b):
    cfg = mixture_cfg(robot_b, (0.5, 0.5), "train.global_batch=8")
    batch = data.open_source(cfg).rows(data.TRAIN, 3, slice(0, 8))
    which, _ = mixture_lib.open(cfg).draw(data.TRAIN, 3)
    # slots: front, wrist, and the model's third (empty for both datasets)
    np.testing.assert_array_equal(batch["image_masks"], np.stack([which == 0, np.ones(8, bool), np.zeros(8, bool)], 1))
    assert batch["state"].shape == (8, 8) and batch["actions"].shape == (8, 2, 4)


def test_bad_mixtures(robot_b, tmp_path):
    with pytest.raises(ConfigError, match="data.mixture is set but data.source='stdlib'; set data.source=mixture"):
        config.load(overrides=[f"data.mixture={robot_b}:1"])
    with pytest.raises(ConfigError, match="data.source=mixture names no dataset; give data.mixture="):
        config.load(overrides=["data.source=mixture"])
    with pytest.raises(ConfigError, match=r"data.mixture\['.*robot_b'\]=-0.5 is not valid"):
        config.load(overrides=["data.source=mixture", f"data.mixture={LEROBOT_TINY}:1,{robot_b}:-0.5"])
    with pytest.raises(ConfigError, match=f"data.mixture's dataset {tmp_path / 'nothing'}: data.source=lerobot:"
                                          f"{tmp_path / 'nothing'}: no such directory"):
        mixture_lib.open(mixture_cfg(tmp_path / "nothing"))
    with pytest.raises(ConfigError, match="data.cameras names observation.images.side, which no dataset of "
                                          "data.mixture has; their cameras: observation.images.front, "
                                          "observation.images.wrist"):
        mixture_lib.open(mixture_cfg(robot_b, (0.5, 0.5), "data.cameras=side"))


RUN = ["train.steps=2", "train.log_every=1", "train.eval_every=2", "train.eval_batches=1", "train.sample_tokens=0",
       "train.ckpt_every=0", "zero.min_shard_size=64", "train.global_batch=16"]


@pytest.mark.slow
def test_a_mixture_trains_at_stage_3_on_8_devices_as_on_one(robot_b, tmp_path):
    one = run([*mixture_cfg_keys(robot_b), *RUN, "mesh.data=1", "mesh.replica=1", "zero.stage=0",
               f"train.out_dir={tmp_path / 'one'}"])
    eight = run([*mixture_cfg_keys(robot_b), *RUN, "zero.stage=3", f"train.out_dir={tmp_path / 'eight'}"])
    np.testing.assert_allclose(eight[0], one[0], rtol=1e-5)
    evals = [[line["eval_loss"] for line in r[1].history if "eval_loss" in line] for r in (one, eight)]
    np.testing.assert_allclose(evals[1], evals[0], rtol=1e-5)
    assert (tmp_path / "eight" / "mixture.json").is_file() and not (tmp_path / "eight" / "lerobot.json").exists()


def mixture_cfg_keys(robot_b):
    return [*POLICY_KEYS, "model.family=pi0", "data.source=mixture", "data.val_fraction=0.34",
            f"data.mixture={LEROBOT_TINY}:0.7,{robot_b}:0.3"]


def test_a_mixtures_cameras_are_augmented_by_their_slots(robot_b):
    from zerojax.data import augment

    made = augment.make(mixture_cfg(robot_b, (0.5, 0.5), "data.augment=openpi"))
    assert made.wrist == (False, True)  # front, wrist: the mixture's slots


def test_zerojax_train_refuses_a_missing_dataset_in_one_line_writing_nothing(robot_b, tmp_path, capsys):
    from zerojax import cli

    code = cli.main(["train", "--no-progress", *POLICY_KEYS, "model.family=pi0", "data.source=mixture",
                     f"data.mixture={robot_b}:0.5,{tmp_path / 'gone'}:0.5", "train.global_batch=8",
                     f"train.out_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"zerojax: error: data.mixture's dataset {tmp_path / 'gone'}: data.source=lerobot:"
                          f"{tmp_path / 'gone'}: no such directory")
    assert not (tmp_path / "run").exists()
