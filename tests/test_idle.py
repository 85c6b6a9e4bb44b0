"""data.filter_idle (zerojax/data/idle.py): openpi's DROID rule, frame by frame; the training
split loses exactly those frames, evaluation none, and `zerojax train` counts them."""

import numpy as np
import pytest

from test_family import LEROBOT_TINY, POLICY_KEYS
from zerojax import config
from zerojax.data import idle
from zerojax.data import lerobot
from zerojax.errors import ConfigError


def openpi_keeps(actions_ND, episode_N, horizon, threshold, kind):
    """openpi's filter_idle written per frame: the chunk (the next H steps, the episode's last
    action repeated past its end), its first half against its first action (or zero)."""
    keep = []
    for t in range(len(actions_ND)):
        end = np.flatnonzero(episode_N == episode_N[t]).max()
        chunk = actions_ND[np.minimum(t + np.arange(horizon), end)][:horizon // 2]
        base = chunk[:1] if kind == "position" else 0.0
        keep.append(bool(np.any(np.abs(chunk - base) > threshold)))
    return np.array(keep)


def test_a_small_case_by_hand():
    actions = np.array([[0.0], [0.0], [0.0], [0.01], [0.01], [5.0], [5.002]])
    episode = np.array([0, 0, 0, 0, 0, 1, 1])
    # H = 4: a frame looks one step ahead; an episode's last frame (its chunk repeats it) never moves
    assert idle.moving(actions, episode, 4, 1e-3, "position").tolist() == [False, False, True, False, False,
                                                                           True, False]
    assert idle.moving(actions, episode, 4, 1e-3, "velocity").tolist() == [False, False, True, True, True, True, True]
    assert openpi_keeps(actions, episode, 4, 1e-3, "position").tolist() == [False, False, True, False, False,
                                                                            True, False]


@pytest.mark.parametrize("kind", ["position", "velocity"])
@pytest.mark.parametrize("horizon", [2, 5, 16])
def test_moving_is_openpis_rule_frame_by_frame(kind, horizon):
    gen = np.random.default_rng(horizon)
    episode = np.repeat(np.arange(4), [3, 9, 1, 14])
    actions = gen.normal(0, 1, (len(episode), 3)) * (gen.uniform(size=(len(episode), 1)) > 0.5)  # idle stretches
    actions = np.cumsum(actions, axis=0) * 1e-3 if kind == "position" else actions * 1e-3
    for threshold in (1e-4, 1e-3, 3e-3):
        np.testing.assert_array_equal(idle.moving(actions, episode, horizon, threshold, kind),
                                      openpi_keeps(actions, episode, horizon, threshold, kind))


def tiny(*extra):
    return config.load(overrides=[*POLICY_KEYS, "model.family=pi0", "data.action_horizon=4", "model.action.horizon=4",
                                  "data.val_fraction=0.34", *extra])


def test_the_training_split_loses_its_idle_frames_and_evaluation_none():
    plain, filtered = lerobot.open(tiny()), lerobot.open(tiny("data.filter_idle=0.5"))
    ds = plain.dataset
    keep = openpi_keeps(ds.columns["action"], ds.episode, 4, 0.5, "position")
    train = plain.split_frames[0]
    expected = train[keep[np.searchsorted(ds.index, train)]]
    assert 0 < len(expected) < len(train)
    np.testing.assert_array_equal(filtered.split_frames[0], expected)
    np.testing.assert_array_equal(filtered.split_frames[1], plain.split_frames[1])  # held out: evaluated whole
    assert set(filtered.frames_of(0, 3)) <= set(expected)
    assert (filtered.idle.dropped, filtered.idle.frames) == (len(train) - len(expected), len(train))
    note = idle.start_note(type("Adapted", (), {"source": filtered})())  # through an adapter's `.source`
    assert note == (f", data.filter_idle=0.5 dropped {len(train) - len(expected)} of {len(train)} training frames "
                    f"({(len(train) - len(expected)) / len(train):.1%})")
    assert idle.start_note(plain) == ""


def test_bad_filter_idle_settings():
    with pytest.raises(ConfigError, match="data.filter_idle=0.001 drops a robot dataset's idle frames: it needs "
                                          "data.source=lerobot:DIR"):
        config.load(overrides=["data.filter_idle=1e-3"])
    with pytest.raises(ConfigError, match="data.filter_idle=-1.0 is not valid"):
        tiny("data.filter_idle=-1")
    with pytest.raises(ConfigError, match="data.filter_idle_actions='joint' is not valid; choose one of position, "
                                          "velocity"):
        tiny("data.filter_idle_actions=joint")
    with pytest.raises(ConfigError, match=f"data.filter_idle=100.0 drops every one of the 15 training frames of "
                                          f"{LEROBOT_TINY}"):
        lerobot.open(tiny("data.filter_idle=100"))


@pytest.mark.slow
def test_zerojax_train_counts_the_dropped_frames_on_its_start_line(tmp_path, capsys):
    from zerojax import cli

    common = ["train", "--no-progress", *POLICY_KEYS, "model.family=pi0", "data.action_horizon=4",
              "model.action.horizon=4", "train.steps=1", "train.eval_every=0", "train.sample_tokens=0",
              "train.ckpt_every=0", "train.report=false", "data.val_fraction=0", "train.global_batch=8"]
    assert cli.main([*common, "data.filter_idle=100", f"train.out_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zerojax: error: data.filter_idle=100.0 drops every one of the 19") and err.count("\n") == 1
    assert not (tmp_path / "r").exists()
    assert cli.main([*common, "data.filter_idle=0.5", f"train.out_dir={tmp_path / 'run'}"]) == 0
    start = capsys.readouterr().out.splitlines()[0]
    assert start.startswith("zerojax: training") and "data.filter_idle=0.5 dropped " in start
    assert start.endswith(" of 19 training frames (" + start.split("(")[-1]), start
