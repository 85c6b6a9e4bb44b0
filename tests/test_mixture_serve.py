"""A mixture run served (zerojax/serve/mixture.py): a tiny π0 trained for a step on two LeRobot
datasets of different cameras and widths (tests/mixture_data.py's second robot: no front camera,
a state of 5 and actions of 4 against the tiny one's 3 and 2, its statistics far from the tiny
one's), served from its run directory and from its safetensors export. Each request names its
dataset; the actions must equal `sample_actions` on the training batch's row of the same frame
(that dataset's statistics, cameras and widths, as training built it), with the same noise, cut
to that dataset's action width and unnormalized by hand with that dataset's statistics."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import one_error_line
from mixture_data import other_robot
from test_family import LEROBOT_TINY
from test_serve import TRAIN
from zerojax import cli, config, data
from zerojax.errors import ConfigError
from zerojax.serve import client, loaders, server
from zerojax.serve.observation import ObservationError
from zerojax.train import export

SEED, STEPS = 3, 3  # the noise's seed; Euler steps


@pytest.fixture(scope="module")
def robot_b(tmp_path_factory):
    return other_robot(tmp_path_factory.mktemp("mixture") / "robot_b")


def keys(robot_b):
    """tests/test_serve.py's π0, on a mixture of the two datasets (either one's action width)."""
    return [k for k in TRAIN if not k.startswith(("data.source=", "model.action.action_dim="))] + [
        "data.source=mixture", f"data.mixture={LEROBOT_TINY}:0.5,{robot_b}:0.5"]


@pytest.fixture(scope="module")
def run_dir(robot_b, tmp_path_factory):
    out = tmp_path_factory.mktemp("mixture_serve") / "run"
    assert cli.main(["train", "--no-progress", *keys(robot_b), f"train.out_dir={out}"]) == 0
    return out


@pytest.fixture(scope="module")
def served(run_dir):
    return loaders.load(run_dir, num_steps=STEPS, seed=SEED)


@pytest.fixture(scope="module")
def frames(robot_b):
    """(each row's observation as its robot sends it, naming its dataset; π0's training batch of
    the same frames; each row's dataset index)."""
    src = data.open_source(config.load(overrides=keys(robot_b)))
    mixture = src.source  # the policy's rows of the mixture (mixture.Masked)
    which, indices = mixture.draw(data.TRAIN, 0)
    observations = []
    for m, index in zip(which, indices):
        member = mixture.sources[m]
        numbers = member.dataset.numbers(int(index), 2)
        observations.append({"observation.state": numbers["observation.state"].astype(np.float64),
                             "prompt": numbers["task"], "dataset": mixture.roots[m],
                             **{c: member.dataset.image(c, int(index), member.video) for c in member.cameras}})
    return observations, src.rows(data.TRAIN, 0, slice(None)), which


def direct(run_dir, batch, row: int, dataset: int, request: int) -> np.ndarray:
    """sample_actions on the training batch's row with request `request`'s noise, cut to the
    row's dataset's action width and unnormalized by hand with its statistics (quantiles)."""
    _, _, model = export.load_model(run_dir)
    graphdef, params = nnx.split(model)
    obs = {k: batch[k][row:row + 1] for k in ("images", "image_masks", "tokens", "token_mask", "state")}
    noise = jax.random.normal(jax.random.fold_in(jax.random.key(SEED), request), (1, 2, 4))
    record = json.loads((run_dir / "mixture.json").read_text())["datasets"][dataset]["lerobot.json"]
    stats = record["normalization"]["action"]
    q01, q99 = np.asarray(stats["q01"], np.float32), np.asarray(stats["q99"], np.float32)
    x = np.asarray(nnx.merge(graphdef, params).sample_actions(obs, noise, STEPS))[0, :, :len(q01)]
    return (x + 1) * (q99 - q01) / 2 + q01


def test_each_dataset_is_served_with_its_own_statistics_cameras_and_widths(run_dir, served, frames, tmp_path):
    observations, batch, which = frames
    assert set(which) == {0, 1}
    rows = [int(np.flatnonzero(which == m)[0]) for m in (0, 1)]
    for m, r in enumerate(rows):  # the row served is the training batch's: its statistics, cameras and widths
        row = served.prepare(observations[r])
        assert row.pop("dataset").tolist() == [m]
        for key in ("images", "image_masks", "tokens", "token_mask", "state"):
            np.testing.assert_allclose(row[key][0], batch[key][r], rtol=1e-6, atol=1e-6, err_msg=key)
    answers = {r: served.infer(observations[r], request=r)["actions"] for r in rows}
    for m, r in enumerate(rows):
        want = direct(run_dir, batch, r, m, request=r)
        assert answers[r].shape == (2, (2, 4)[m])  # the dataset's own action width
        np.testing.assert_allclose(answers[r], want, rtol=1e-4, atol=1e-4)
    # batched, rows of both datasets in one call: the same actions
    together = served.infer_rows([served.prepare(observations[r]) for r in rows], rows)
    for r, answer in zip(rows, together):
        np.testing.assert_allclose(answer["actions"], answers[r], rtol=1e-5, atol=1e-5)
    # the export carries mixture.json: it serves either robot alike
    out = tmp_path / "mixture.safetensors"
    export.export(run_dir, out)
    from_export = loaders.load(out, num_steps=STEPS, seed=SEED)
    for r in rows:
        np.testing.assert_allclose(from_export.infer(observations[r], request=r)["actions"], answers[r], rtol=1e-5,
                                   atol=1e-5)


def test_a_request_names_its_dataset_by_directory_or_name(served, frames, robot_b):
    observations, _, which = frames
    r = int(np.flatnonzero(which == 1)[0])
    by_path = served.infer(observations[r], 0)["actions"]
    np.testing.assert_array_equal(served.infer({**observations[r], "dataset": "robot_b"}, 0)["actions"], by_path)
    meta = served.metadata()
    assert meta["observation"]["dataset"]["names"] == [str(LEROBOT_TINY), str(robot_b), "tiny", "robot_b"]
    assert meta["datasets"][str(robot_b)]["action_dim"] == 4 and meta["datasets"][str(robot_b)]["fps"] == 20
    assert meta["datasets"][str(LEROBOT_TINY)]["observation"]["observation.state"]["shape"] == [3]
    choices = f"one of 'tiny' \\({LEROBOT_TINY}\\), 'robot_b' \\({robot_b}\\)"
    without = {k: v for k, v in observations[r].items() if k != "dataset"}
    with pytest.raises(ObservationError, match=f"under 'dataset': {choices}; it gives no 'dataset'"):
        served.infer(without, 0)
    with pytest.raises(ObservationError, match=f"{choices}; 'dataset'='arm' names none of them"):
        served.infer({**without, "dataset": "arm"}, 0)
    with pytest.raises(ObservationError, match="observation: no 'observation.images.front'; this policy reads "
                                               r"'observation.state' \[3\]"):
        served.infer({**observations[r], "dataset": "tiny"}, 0)  # robot_b's observation sent as the tiny one's


def test_the_client_names_the_dataset_it_reads_from(served, frames, robot_b, capsys, tmp_path):
    sock = server.bind("127.0.0.1", 0)
    srv = server.PolicyServer(served, sock=sock)
    port = str(srv.start())
    try:
        assert cli.main(["client", "--port", port, "--from", f"lerobot:{robot_b}", "--frame", "3", "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        obs, _ = client.dataset_frame(f"lerobot:{robot_b}", 3, served.metadata())
        assert obs["dataset"] == str(robot_b)
        np.testing.assert_array_equal(np.float32(doc["actions"]), served.infer(obs, 0)["actions"])
        client.save({k: v for k, v in obs.items() if k != "dataset"}, tmp_path / "obs.npz")
        assert cli.main(["client", "--port", port, "--observation", str(tmp_path / "obs.npz"), "--dataset", "robot_b",
                         "--json"]) == 0
        np.testing.assert_array_equal(np.float32(json.loads(capsys.readouterr().out)["actions"]),
                                      served.infer(obs, 1)["actions"])
        assert "names its dataset under 'dataset'" in one_error_line(
            ["client", "--port", port, "--observation", str(tmp_path / "obs.npz")], capsys)
    finally:
        srv.stop()
    with pytest.raises(ConfigError, match="is none of them by its directory; give --dataset NAME"):
        client.mixture_name(str(tmp_path), served.metadata())


def test_a_mixture_of_relative_actions_adds_each_rows_own_state_back_on_its_datasets_joints(robot_b, frames,
                                                                                           tmp_path):
    """model.action.relative on a mixture: each dataset's record in mixture.json carries its
    relative_actions, and each row's chunk, unnormalized with its dataset's (relative) statistics,
    gets its own request's state added back on its dataset's joints, rows of both robots (states
    of 3 and 5) batched together alike."""
    run = tmp_path / "run"
    assert cli.main(["train", "--no-progress", *keys(robot_b), "model.action.relative=true",
                     f"train.out_dir={run}"]) == 0
    records = [d["lerobot.json"] for d in json.loads((run / "mixture.json").read_text())["datasets"]]
    masks = [np.asarray(r["relative_actions"]["mask"], bool) for r in records]
    assert [len(m) for m in masks] == [2, 4] and all(m.any() for m in masks)  # each dataset's own action width
    served = loaders.load(run, num_steps=STEPS, seed=SEED)
    observations, batch, which = frames
    rows = [int(np.flatnonzero(which == m)[0]) for m in (0, 1)]
    answers = {}
    for m, r in enumerate(rows):
        state = np.asarray(observations[r]["observation.state"], np.float32)
        want = direct(run, batch, r, m, request=r) + np.where(masks[m], state[:len(masks[m])], 0)
        answers[r] = served.infer(observations[r], request=r)["actions"]
        np.testing.assert_allclose(answers[r], want, rtol=1e-4, atol=1e-4)
        # a real-time chunk's leftover is made relative to the row's state as the actions were
        seen = served.observations.member(observations[r])
        np.testing.assert_allclose(seen.robot_actions(seen.normalized_actions(answers[r], state), state), answers[r],
                                   rtol=1e-4, atol=1e-4)
    together = served.infer_rows([served.prepare(observations[r]) for r in rows], rows)
    for r, answer in zip(rows, together):
        np.testing.assert_allclose(answer["actions"], answers[r], rtol=1e-5, atol=1e-5)
