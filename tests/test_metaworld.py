"""Meta-World in closed loop: `zerojax collect`'s episodes read back through
`data.source=lerobot:DIR` equal what the environment produced, and `zerojax rollout` runs a
tiny π0 (trained one step on them) and the scripted expert through seeded episodes. Skipped,
with the reason, where MuJoCo or its headless OpenGL (OSMesa) cannot be had."""

import contextlib
import io
import json
import re
import sys

import numpy as np
import pytest

from conftest import ROOT, TINY, one_error_line
from zerojax import cli, config, sim
from zerojax.data import sources
from zerojax.errors import ConfigError

TASK = "reach-v3"
SIZE = 32  # the camera (zerojax collect --size)


def mujoco_or_skip():
    try:
        sim.require()
        from zerojax.sim import metaworld

        env = metaworld.Env(TASK, SIZE)
        env.reset(0)
        env.image()
        return metaworld
    except ConfigError as err:
        pytest.skip(f"no Meta-World here: {err}")


@pytest.fixture(scope="module")
def metaworld():
    return mujoco_or_skip()


@pytest.fixture(scope="module")
def collected(metaworld, tmp_path_factory):
    """Two expert episodes of reach-v3 written by `zerojax collect --seed 0`, what it said on
    stderr, and the expert's episodes from seeds 0 and 1 as the environment plays them again here."""
    from zerojax.sim import collect

    out = tmp_path_factory.mktemp("mw") / "data"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):  # a module fixture: no capsys
        code = cli.main(["collect", "--tasks", TASK, "--episodes", "2", "--out", str(out), "--size", str(SIZE),
                         "--seed", "0"])
    assert code == 0, err.getvalue()
    env = metaworld.Env(TASK, SIZE)
    played = [collect.episode(env, seed) for seed in (0, 1)]
    return out, err.getvalue(), played


# a π0 small enough to compile in seconds, reading the collected dataset
PI0 = ["model.family=pi0", "model.vocab_size=256", "model.d_model=32", "model.n_layers=1", "model.n_heads=2",
       "model.n_kv_heads=1", "model.head_dim=8", "model.d_ff=32", "model.expert.d_model=16", "model.expert.d_ff=32",
       "model.vision.image_size=8", "model.vision.patch_size=4", "model.vision.d_model=16", "model.vision.n_layers=1",
       "model.vision.n_heads=2", "model.vision.d_ff=32", "model.action.horizon=4", "model.action.prompt_len=24",
       "model.action.max_state_dim=40", "model.action.max_action_dim=4", "model.action.action_dim=4",
       "data.image_size=8", "data.action_horizon=4", "data.prompt_len=24", "data.val_fraction=0",
       "train.global_batch=8", "train.steps=1", "train.log_every=1", "train.eval_every=0", "train.sample_tokens=0",
       "train.ckpt_every=1", "train.report=false", "zero.min_shard_size=64", "optim.warmup_steps=0"]


def test_collected_episodes_read_back_as_the_environment_produced_them(collected):
    out, said, played = collected
    assert f"zerojax: {TASK}: 2 of 2 expert episodes succeeded" in said  # so the seeds were 0 and 1
    frames = sum(len(e["action"]) for e in played)
    assert re.search(rf"zerojax: wrote {re.escape(str(out))}: 2 episodes, {frames} frames in ", said), said
    src = sources.open_source(config.load(overrides=[f"data.source=lerobot:{out}", *PI0]))
    ds = src.source.dataset
    assert ds.fps == 80 and ds.tasks == {0: "Reach a goal position"}
    assert sorted(ds.episodes) == [0, 1] and len(ds.index) == sum(len(e["action"]) for e in played)
    start = 0
    for ep, episode in enumerate(played):
        n = len(episode["action"])
        assert ds.episodes[ep].stop - ds.episodes[ep].start == n
        for t in sorted({0, 1, n // 2, n - 2, n - 1}):
            item = ds.numbers(start + t, 4)
            np.testing.assert_array_equal(item["observation.state"], episode["state"][t])
            want = episode["action"][np.minimum(np.arange(t, t + 4), n - 1)]
            np.testing.assert_array_equal(item["action"], want)
            assert item["action_is_pad"].tolist() == [t + k >= n for k in range(4)]
            assert item["task"] == "Reach a goal position"
            pixels = ds.image("observation.images.corner2", start + t, src.source.video).astype(np.float64)
            error = np.abs(pixels - episode["image"][t]).mean()
            assert error < 6.0, (ep, t, error)  # AV1 at crf 30 (LeRobot's settings): lossy, a few levels a pixel
        start += n


@pytest.fixture(scope="module")
def run_dir(collected, tmp_path_factory):
    out = tmp_path_factory.mktemp("mw") / "run"
    assert cli.main(["train", "--no-progress", f"data.source=lerobot:{collected[0]}", *PI0,
                     f"train.out_dir={out}"]) == 0
    return out


def travel_needed(metaworld, task: str, seed: int) -> tuple[float, float]:
    """(the least distance the hand must travel for `task` to succeed from episode seed `seed`'s
    initial state, the most it can travel in one step), from Meta-World's own numbers
    (`evaluate_state`, `set_xyz_action`): the mocap moves by the action, clipped to [-1, 1] per
    axis, times action_scale (1/100); reach-v3 succeeds with the hand within 0.05 of the goal,
    drawer-close-v3 with the handle within TARGET_RADIUS + 0.015 of its goal, and the handle moves
    only as far as the hand pushes it, once the hand is at it (within 0.05: the gripper's reach)."""
    env = metaworld.Env(task, SIZE)
    obs = env.reset(seed)["observation.state"]
    hand, handle, goal = obs[:3], obs[4:7], obs[-3:]  # Meta-World's observation (sim/metaworld.py)
    step = float(np.sqrt(3) * env.env.action_scale)
    if task == "reach-v3":
        return float(np.linalg.norm(hand - goal)) - 0.05, step
    assert task == "drawer-close-v3", task
    to_handle = max(float(np.linalg.norm(hand - handle)) - 0.05, 0.0)
    return to_handle + float(np.linalg.norm(handle - goal)) - (env.env.TARGET_RADIUS + 0.015), step


def out_of_reach(metaworld, task: str, steps: int, seeds=(100000, 100001)) -> bool:
    """No policy can succeed at `task` in `steps` steps from these episodes' initial states, with
    2 cm to spare (`travel_needed`; the seeds: rollout's --seed default, episode e from seed + e)."""
    return all(needed > steps * step + 0.02 for needed, step in (travel_needed(metaworld, task, s) for s in seeds))


def rollout_json(argv, capsys) -> dict:
    assert cli.main(["rollout", *argv, "--json", "--no-progress"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_a_rollout_of_a_tiny_pi0_counts_its_episodes_and_its_failures(run_dir, metaworld, capsys, tmp_path):
    """Two tasks of two episodes, six steps each: too few for any policy to succeed from these
    initial states (`travel_needed`), so every episode is counted, as a failure."""
    argv = [str(run_dir), "--env", f"metaworld:{TASK},drawer-close-v3", "--episodes", "2", "--max-steps", "6",
            "--n-action-steps", "3", "--num-steps", "2"]
    assert out_of_reach(metaworld, TASK, 6) and out_of_reach(metaworld, "drawer-close-v3", 6)
    doc = rollout_json([*argv, "--video", str(tmp_path / "videos"), "--videos", "1"], capsys)
    assert set(doc) == {"tasks", "mean_success_rate", "seam_jump", "inner_jump", "shift", "request_ms"}
    assert doc["shift"] == "none" and doc["request_ms"] > 0
    assert set(doc["tasks"]) == {TASK, "drawer-close-v3"} and doc["seam_jump"] >= 0 and doc["inner_jump"] >= 0
    for r in doc["tasks"].values():
        assert set(r) == {"episodes", "successes", "success_rate", "seam_jump", "inner_jump"}
        assert (r["episodes"], r["successes"], r["success_rate"]) == (2, 0, 0.0)
    assert doc["mean_success_rate"] == 0.0
    assert sorted(p.name for p in (tmp_path / "videos").iterdir()) == ["drawer-close-v3-0.mp4", f"{TASK}-0.mp4"]


@pytest.mark.slow
def test_the_same_seed_gives_the_same_episodes_and_another_seed_others(run_dir):
    from zerojax.serve import loaders
    from zerojax.sim import rollout

    served = loaders.load(run_dir, num_steps=2, seed=0)

    def episodes(seed):
        seen = []

        def policy(obs, request, env):
            actions = served.infer({k: obs[k] for k in served.expected_keys}, request)["actions"]
            seen.append((request, obs["observation.state"].copy(), actions))
            return actions

        rollout.run(policy, [TASK], 2, seed, 2, SIZE, max_steps=4, progress=False)
        return seen

    first, again, other = episodes(7), episodes(7), episodes(8)
    assert [r for r, _, _ in first] == [0, 1, 100000, 100001]  # each episode's requests from e * 100000
    for (_, s1, a1), (_, s2, a2) in zip(first, again):
        np.testing.assert_array_equal(s1, s2)
        np.testing.assert_array_equal(a1, a2)
    assert not np.array_equal(first[0][1], other[0][1])  # another seed: other initial states


# a SmolVLA as small, π0's keys but these: 16 px images of 4 px patches, pixel-shuffled by 2 to 4 image tokens
SMOLVLA_KEYS = ["model.family=smolvla", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1",
                "model.expert.d_model=24", "model.expert.d_ff=48", "model.vision.image_size=16", "data.image_size=16"]
SMOLVLA = [x for x in PI0 if not x.startswith(tuple(k.split("=")[0] + "=" for k in SMOLVLA_KEYS))] + SMOLVLA_KEYS


@pytest.mark.slow
def test_a_rollout_of_a_tiny_smolvla_runs_through_its_family_declaration(collected, metaworld, capsys, tmp_path):
    """`zerojax rollout` of a SmolVLA run (trained one step on the collected episodes): the episodes
    are counted, and a second rollout with the same seed plays the same episodes."""
    assert cli.main(["train", "--no-progress", f"data.source=lerobot:{collected[0]}", *SMOLVLA,
                     f"train.out_dir={tmp_path / 'run'}"]) == 0
    capsys.readouterr()  # training's lines
    argv = [str(tmp_path / "run"), "--env", f"metaworld:{TASK}", "--episodes", "2", "--max-steps", "6",
            "--n-action-steps", "3", "--num-steps", "2"]
    doc = rollout_json(argv, capsys)
    assert out_of_reach(metaworld, TASK, 6)  # so every episode fails, whatever the policy
    assert (doc["tasks"][TASK]["episodes"], doc["tasks"][TASK]["successes"]) == (2, 0)
    assert doc["seam_jump"] > 0 and doc["inner_jump"] > 0  # actions that moved the arm, chunk after chunk
    again = rollout_json(argv, capsys)
    assert again.pop("request_ms") > 0 and doc.pop("request_ms") > 0  # a time: the rest repeats exactly
    assert again == doc


def test_the_scripted_expert_succeeds_through_the_same_loop(metaworld, capsys):
    doc = rollout_json(["--policy", "expert", "--env", f"metaworld:{TASK}", "--episodes", "2"], capsys)
    r = doc["tasks"][TASK]
    assert (r["episodes"], r["successes"], r["success_rate"], doc["mean_success_rate"]) == (2, 2, 1.0, 1.0)
    assert r["inner_jump"] is None and r["seam_jump"] > 0  # one action a chunk: every step is a seam


def test_every_episode_of_every_task_sees_a_rendered_camera(metaworld):
    """A policy that reads the camera, over two tasks of two episodes each: no frame it is given is
    black (an earlier task's environment, freed once the next one had rendered, once took MuJoCo's
    OSMesa context with it and blacked out every later frame)."""
    from zerojax.sim import rollout

    seen = []

    def policy(obs, request, env, **_):
        seen.append((request, float(obs[metaworld.IMAGE_KEY].mean())))
        return np.zeros((2, 4), np.float32)

    rollout.run(policy, [TASK, "drawer-close-v3"], 2, 0, 2, SIZE, max_steps=4, progress=False)
    assert len(seen) == 2 * 2 * 2 and all(mean > 10 for _, mean in seen), seen


def shifted_image(metaworld, *items: str, camera: str = "corner2") -> np.ndarray:
    env = metaworld.Env(TASK, SIZE, camera, metaworld.Shift.parse(list(items)))
    env.reset(100000)
    image = env.image().astype(np.float32)
    env.close()
    return image


def test_a_shift_changes_the_rendering_as_it_says_and_nothing_the_state_says(metaworld):
    """brightness=0.5 darkens the frame, a red cast raises red against blue, the camera moved 4 cm
    sees another frame; no shift renders the trained scene exactly, and the state (the expert's
    whole episode) is the same under every shift."""
    plain = shifted_image(metaworld)
    assert np.array_equal(plain, shifted_image(metaworld, "brightness=1", "colour=1,1,1", "camera=0,0,0"))
    assert shifted_image(metaworld, "brightness=0.5").mean() < 0.8 * plain.mean()
    red = shifted_image(metaworld, "colour=1.3,1,0.6")
    assert red[..., 0].mean() / red[..., 2].mean() > 1.2 * plain[..., 0].mean() / plain[..., 2].mean()
    assert np.abs(shifted_image(metaworld, "camera=0,0,0.04") - plain).mean() > 5
    states = []
    for items in ([], ["brightness=0.5", "colour=1.3,1,0.6", "camera=0,0,0.04"]):
        env = metaworld.Env(TASK, SIZE, shift=metaworld.Shift.parse(items))
        obs = [env.reset(100000)[metaworld.STATE_KEY]]
        for _ in range(20):
            obs.append(env.step(env.expert_action())[0][metaworld.STATE_KEY])
        states.append(np.stack(obs))
        env.close()
    assert np.array_equal(*states)


def test_a_shift_or_camera_that_is_not_one_is_refused_before_the_sim_is_looked_for(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "metaworld", None)  # bad input is named first, with or without the extra
    for item, named in (("brightness=-1", "brightness=F"), ("colour=1,1", "colour=R,G,B"), ("tilt=3", "camera=DX")):
        line = one_error_line(["rollout", "--policy", "expert", "--env", f"metaworld:{TASK}", "--shift", item], capsys)
        assert repr(item) in line and named in line
    line = one_error_line(["rollout", "--policy", "expert", "--env", f"metaworld:{TASK}", "--camera", "top"], capsys)
    assert "'top'" in line and "topview" in line


def test_collect_records_the_camera_it_is_given(metaworld, tmp_path, capsys):
    """--camera topview: the dataset's camera is observation.images.topview, read back as the
    environment renders it from that camera (within the video codec's error)."""
    out = tmp_path / "top"
    assert cli.main(["collect", "--tasks", TASK, "--episodes", "1", "--out", str(out), "--size", str(SIZE),
                     "--camera", "topview"]) == 0
    capsys.readouterr()
    info = json.loads((out / "meta" / "info.json").read_text())
    assert [k for k in info["features"] if k.startswith("observation.images.")] == ["observation.images.topview"]
    src = sources.open_source(config.load(overrides=[f"data.source=lerobot:{out}", *PI0]))
    env = metaworld.Env(TASK, SIZE, "topview")
    env.reset(0)
    first = src.source.dataset.image("observation.images.topview", 0, src.source.video).astype(np.float64)
    assert np.abs(first - env.image()).mean() < 6.0  # AV1's error, as above
    assert np.abs(first - shifted_image(metaworld)).mean() > 20  # corner2's frame is another
    assert "no camera 'top'" in one_error_line(["collect", "--tasks", TASK, "--episodes", "1", "--camera", "top",
                                                "--out", str(tmp_path / "bad")], capsys)
    assert not (tmp_path / "bad").exists()


def test_the_expert_fails_where_its_episodes_are_cut_short(metaworld, capsys):
    doc = rollout_json(["--policy", "expert", "--env", f"metaworld:{TASK}", "--episodes", "1", "--max-steps", "3"],
                       capsys)
    assert {k: doc["tasks"][TASK][k] for k in ("episodes", "successes", "success_rate")} == \
        {"episodes": 1, "successes": 0, "success_rate": 0.0}


# -- bad input: one line, exit 2 ------------------------------------------------------------------

def test_an_unknown_env_kind_or_task_is_refused(metaworld, capsys):
    line = one_error_line(["rollout", "--policy", "expert", "--env", "libero:spatial"], capsys)
    assert "'libero:spatial'" in line and "metaworld" in line
    line = one_error_line(["rollout", "--policy", "expert", "--env", "metaworld:reach-v9"], capsys)
    assert "unknown task 'reach-v9'" in line and "reach-v3" in line
    assert "RUN_DIR" in one_error_line(["rollout", "--env", f"metaworld:{TASK}"], capsys)


def test_no_mujoco_is_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "metaworld", None)  # as if the sim extra were not installed
    line = one_error_line(["rollout", "--policy", "expert", "--env", f"metaworld:{TASK}"], capsys)
    assert "zerojax rollout needs" in line and "pip install 'zerojax[sim]'" in line
    line = one_error_line(["collect", "--tasks", TASK, "--episodes", "1", "--out", str(tmp_path / "mw")], capsys)
    assert "zerojax collect needs" in line and "pip install 'zerojax[sim]'" in line and list(tmp_path.iterdir()) == []


def test_collect_refuses_bad_input_before_writing(metaworld, tmp_path, capsys):
    out = tmp_path / "mw"
    assert "unknown task 'reach-v9'" in one_error_line(["collect", "--tasks", "reach-v9", "--episodes", "1",
                                                          "--out", str(out)], capsys)
    assert "--episodes 0: at least 1" in one_error_line(["collect", "--tasks", TASK, "--episodes", "0",
                                                           "--out", str(out)], capsys)
    assert not out.exists()
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert "not empty" in one_error_line(["collect", "--tasks", TASK, "--episodes", "1", "--out", str(out)], capsys)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_a_run_that_is_not_pi0_or_not_of_metaworld_is_refused(metaworld, tmp_path, capsys):
    out = tmp_path / "gpt"
    assert cli.main(["train", "--no-progress", *TINY, "model.n_layers=1", "model.seq_len=8", "train.steps=1",
                     "train.ckpt_every=1", "train.report=false", "train.global_batch=8", "mesh.data=1",
                     "zero.stage=0", f"train.out_dir={out}"]) == 0
    capsys.readouterr()
    line = one_error_line(["rollout", str(out), "--env", f"metaworld:{TASK}"], capsys)
    assert "is a gpt run (model.family=gpt)" in line
    fixture = json.loads((ROOT / "tests" / "fixtures" / "lerobot" / "tiny" / "meta" / "info.json").read_text())
    with pytest.raises(ConfigError, match="not trained on Meta-World's features"):
        metaworld.check_features(fixture["features"], "a run")
