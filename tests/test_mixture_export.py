"""A mixture run's LeRobot and openpi exports (zerojax/interop/lerobot_export.py, interop/openpi.py;
docs/design.md §5, "Dataset mixtures").

The premise of a per-dataset LeRobot export: in a mixture run a row of a dataset that lacks a
camera has that camera's slot all -1 and masked (data/mixture.py), while the dataset's own LeRobot
policy directory names only the cameras it has, in its order, the rest LeRobot's empty cameras
after them. The two layouts must give the same actions: a masked slot's tokens are no key of any
attention, and the positions are the cumulative sum of the mask (π0, π0.5 and SmolVLA alike), so
a camera that moves to an earlier slot past a masked one keeps its positions.

Then the exports of tests/test_mixture_serve.py's run (a tiny π0 trained for a step on the tiny
dataset and mixture_data's second robot: other cameras, widths and statistics), here with a real
tokenizer (a LeRobot policy directory carries one), each loaded back by `zerojax serve`'s loader,
must answer a row of each dataset as the mixture run itself answers it with
that dataset named: `--format lerobot --dataset NAME` one dataset's policy directory, `--format
openpi` one asset a dataset."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import ROOT, one_error_line
from test_family import LEROBOT_TINY
from test_mixture_serve import STEPS, SEED, keys, robot_b  # noqa: F401 - robot_b: the second dataset's fixture
from zerojax import cli, config, data
from zerojax.errors import ConfigError
from zerojax.interop import lerobot, lerobot_export
from zerojax.serve import loaders

FIXTURES = ROOT / "tests" / "fixtures"
CHECKPOINTS = {"pi0": FIXTURES / "lerobot" / "pi0", "pi05": FIXTURES / "lerobot06" / "pi05",
               "smolvla": FIXTURES / "lerobot06" / "smolvla"}
OBSERVATION = ("tokens", "token_mask", "state")


@pytest.mark.parametrize("family", list(CHECKPOINTS))
def test_a_masked_camera_slot_changes_no_action(family):
    """Row 0 of the family's LeRobot reference batch, its second camera alone: in the mixture's
    layout (slot 0 masked and -1, the camera in slot 1) and in its export's (the camera in slot 0,
    slot 1 LeRobot's empty camera), and with garbage in the masked slot: the same actions from the
    same noise. Control: the -1 slot unmasked changes them."""
    directory = CHECKPOINTS[family]
    reference = load_file(directory.with_name(directory.name + ".reference.safetensors"))
    _, model = lerobot.load(directory, vision_heads=2)
    row = {k: jnp.asarray(reference[k][:1]) for k in OBSERVATION}
    camera, empty = reference["images"][0, 1], np.full_like(reference["images"][0, 1], -1.0)
    garbage = np.random.default_rng(0).uniform(-1, 1, camera.shape).astype(np.float32)
    noise = jnp.asarray(reference["sample_noise"][:1])

    def actions(images, masks):
        batch = {**row, "images": jnp.asarray(np.stack(images)[None]), "image_masks": jnp.asarray([masks])}
        return np.asarray(model.sample_actions(batch, noise))

    mixture = actions([empty, camera], [False, True])
    export = actions([camera, empty], [True, False])
    np.testing.assert_allclose(export, mixture, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(actions([garbage, camera], [False, True]), mixture, rtol=1e-6, atol=1e-6)
    assert np.abs(actions([empty, camera], [True, True]) - mixture).max() > 1e-3


TOKENIZER = FIXTURES / "lerobot06" / "tokenizer"  # 276 tokens
# a real tokenizer, and the norms' epsilon LeRobot's and openpi's π0 compute with (their configs have no field for it)
RUN = [f"data.tokenizer={TOKENIZER}", "model.vocab_size=288", "model.norm_eps=1e-6"]


def mixture_keys(robot_b) -> list[str]:  # noqa: F811
    return [*keys(robot_b), *RUN]


@pytest.fixture(scope="module")
def run_dir(robot_b, tmp_path_factory):  # noqa: F811 - test_mixture_serve's fixture
    out = tmp_path_factory.mktemp("mixture_export") / "run"
    assert cli.main(["train", "--no-progress", *mixture_keys(robot_b), f"train.out_dir={out}"]) == 0
    return out


@pytest.fixture(scope="module")
def rows(run_dir, robot_b):  # noqa: F811
    """{dataset index: (a row of the first training batch of that dataset, its observation as its
    robot sends it naming its dataset, the mixture run's answer to it with that row's noise)}."""
    mixture = data.open_source(config.load(overrides=mixture_keys(robot_b))).source
    which, indices = mixture.draw(data.TRAIN, 0)
    served, out = loaders.load(run_dir, num_steps=STEPS, seed=SEED), {}
    for m in (0, 1):
        r = int(np.flatnonzero(which == m)[0])
        member, index = mixture.sources[m], int(indices[r])
        numbers = member.dataset.numbers(index, 2)
        observation = {"observation.state": numbers["observation.state"].astype(np.float64), "prompt": numbers["task"],
                       "dataset": mixture.roots[m],
                       **{c: member.dataset.image(c, index, member.video) for c in member.cameras}}
        out[m] = (r, observation, served.infer(observation, request=r)["actions"])
    return out


def unnamed(observation: dict) -> dict:
    """A robot's request to a policy of its dataset alone: no "dataset"."""
    return {k: v for k, v in observation.items() if k != "dataset"}


@pytest.mark.parametrize("name", ["tiny", "robot_b"])
def test_each_datasets_lerobot_export_answers_as_the_mixture_run_naming_it(run_dir, rows, name, tmp_path):  # noqa: F811
    """The dataset's own policy directory: its cameras alone (robot_b's wrist in slot 0, the front
    slot the mixture masked for it gone), its widths and statistics; served, the mixture's answer."""
    m, out = {"tiny": 0, "robot_b": 1}[name], tmp_path / name
    assert cli.main(["export", str(run_dir), "--format", "lerobot", "--dataset", name, "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    doc = json.loads((run_dir / "mixture.json").read_text())
    own = [c for c in doc["datasets"][m]["lerobot.json"]["features"] if c.startswith("observation.images.")]
    assert own == (["observation.images.front", "observation.images.wrist"], ["observation.images.wrist"])[m]
    assert [k for k in config["input_features"] if k.startswith("observation.images.")] == own
    assert config["empty_cameras"] == 3 - len(own)
    assert config["input_features"]["observation.state"]["shape"] == [(3, 5)[m]]
    assert config["output_features"]["action"]["shape"] == [(2, 4)[m]]
    r, observation, want = rows[m]
    got = loaders.load(out, num_steps=STEPS, seed=SEED).infer(unnamed(observation), request=r)["actions"]
    assert got.shape == want.shape == (2, (2, 4)[m])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_openpi_export_holds_one_asset_a_dataset_and_serves_each_by_its_name(run_dir, rows, tmp_path):
    """assets/<name>/norm_stats.json a dataset (openpi's layout: one asset a robot, its asset_id
    picked by the TrainConfig), each that dataset's statistics; served by zerojax, a request naming
    its dataset gets the mixture run's answer, with the statistics its asset holds."""
    out = tmp_path / "openpi"
    assert cli.main(["export", str(run_dir), "--format", "openpi", "--out", str(out)]) == 0
    datasets = json.loads((run_dir / "mixture.json").read_text())["datasets"]
    assert sorted(p.name for p in (out / "assets").iterdir()) == ["robot_b", "tiny"]
    for name, d in zip(("tiny", "robot_b"), datasets):
        stats = json.loads((out / "assets" / name / "norm_stats.json").read_text())["norm_stats"]
        kept = d["lerobot.json"]["normalization"]
        np.testing.assert_allclose(stats["state"]["mean"], kept["observation.state"]["mean"], rtol=1e-6)
        np.testing.assert_allclose(stats["actions"]["q99"], kept["action"]["q99"], rtol=1e-6)
    served = loaders.load(out, num_steps=STEPS, seed=SEED)
    for m, name in enumerate(("tiny", "robot_b")):
        r, observation, want = rows[m]
        got = served.infer({**observation, "dataset": name}, request=r)["actions"]
        assert got.shape == want.shape == (2, (2, 4)[m])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # the statistics served are the assets': robot_b's action range doubled there doubles its spread
    norm = json.loads((out / "assets" / "robot_b" / "norm_stats.json").read_text())
    q01, q99 = (np.asarray(norm["norm_stats"]["actions"][s]) for s in ("q01", "q99"))
    norm["norm_stats"]["actions"]["q99"] = (q01 + 2 * (q99 - q01)).tolist()
    (out / "assets" / "robot_b" / "norm_stats.json").write_text(json.dumps(norm))
    r, observation, want = rows[1]
    got = loaders.load(out, num_steps=STEPS, seed=SEED).infer(observation, request=r)["actions"]
    np.testing.assert_allclose(got, q01 + 2 * (want - q01), rtol=1e-4, atol=1e-4)


def test_an_openpi_directory_without_zerojax_json_is_refused_naming_what_it_lacks(run_dir, tmp_path, capsys):
    out = tmp_path / "openpi"
    assert cli.main(["export", str(run_dir), "--format", "openpi", "--out", str(out)]) == 0
    (out / "zerojax.json").unlink()  # as openpi's own checkpoints are: params/ and assets/ alone
    assert "openpi checkpoint without zerojax.json: openpi keeps a policy's features" in one_error_line(
        ["serve", str(out)], capsys)


def test_a_mixture_runs_lerobot_export_names_its_datasets_without_or_with_an_unknown_one(run_dir, robot_b,  # noqa: F811
                                                                                         tmp_path, capsys):
    choices = f"'tiny' ({LEROBOT_TINY}), 'robot_b' ({robot_b})"
    line = one_error_line(["export", str(run_dir), "--format", "lerobot", "--out", str(tmp_path / "a")], capsys)
    assert line.endswith(f"(data.source=mixture): {choices}; LeRobot's policy directory holds one dataset's "
                         "normalization: give --dataset NAME")
    line = one_error_line(["export", str(run_dir), "--format", "lerobot", "--dataset", "arm", "--out",
                           str(tmp_path / "b")], capsys)
    assert line.endswith(f"{choices}; --dataset 'arm' names none of them")
    assert "--format openpi carries every dataset's: drop --dataset" in one_error_line(
        ["export", str(run_dir), "--format", "openpi", "--dataset", "tiny", "--out", str(tmp_path / "c")], capsys)
    assert not list(tmp_path.iterdir())  # refused before anything is written
    one = tmp_path / "one"  # a run of one dataset: its lerobot.json alone is what --dataset is checked against
    one.mkdir()
    (one / "lerobot.json").write_text((json.dumps(json.loads((run_dir / "mixture.json").read_text())["datasets"][0]
                                                  ["lerobot.json"])))
    with pytest.raises(ConfigError, match="trained on one dataset: drop --dataset"):
        lerobot_export._run_policy(one, "tiny")
