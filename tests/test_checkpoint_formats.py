"""A checkpoint format is one record (`zerojax.checkpoints`): a format planted as a module of the
test's plus its line in the registry reaches `zerojax export --format`, `model.init_from` (its
model keys and its reader, in a training run) and `zerojax serve`, with nothing else changed.
Its files: a directory holding `weights.bin` (zerojax's own export file, renamed) and
`keys.json` (the model keys)."""

import dataclasses
import json
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import one_error_line
from test_serve import SEED, STEPS, TRAIN
from zerojax import cli
from zerojax.checkpoints import format as checkpoints
from zerojax.config import ModelConfig, hf_model_keys
from zerojax.data import sources
from zerojax import config
from zerojax.interop import hf
from zerojax.serve import loaders
from zerojax.train import export

PLANTED = '''
import dataclasses, json
from pathlib import Path
from zerojax.checkpoints.format import KEPT, CheckpointFormat

CALLS = []


def detect(path):
    return path.is_dir() and (path / "weights.bin").is_file()


def model_keys(directory, given):
    CALLS.append("model_keys")
    return json.loads((Path(directory) / "keys.json").read_text())


def read(init_from, plan, family, stacked):
    from zerojax.interop import hf
    CALLS.append("read")
    return hf.read_export(str(Path(init_from) / "weights.bin"), plan, family, stacked)


def write(job):
    from zerojax.train import export
    CALLS.append("write")
    job.out.mkdir()
    model = {k: v for k, v in job.config["model"].items() if k != "init_from"}
    (job.out / "keys.json").write_text(json.dumps(model))
    return export.write_safetensors(dataclasses.replace(job, out=job.out / "weights.bin"))


def serve(target, step, num_steps, seed, tokenizer, vision_heads):
    from zerojax.serve import loaders
    CALLS.append("serve")
    return loaders.export_policy(Path(target) / "weights.bin", step, num_steps, seed, tokenizer, vision_heads)


FORMAT = CheckpointFormat(name="planted", what="the test's planted directory (weights.bin, keys.json)",
                          detect=detect, model_keys="planted_format:model_keys", read="planted_format:read",
                          write="planted_format:write", adapters=KEPT, serve="planted_format:serve")
'''


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("formats") / "run"
    assert cli.main(["train", "--no-progress", *TRAIN, f"train.out_dir={out}"]) == 0
    return out


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """The format's module on the path, and its one line in the registry."""
    (tmp_path / "planted_format.py").write_text(PLANTED)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(checkpoints.FORMATS, "planted", "planted_format:FORMAT")
    yield sys.modules.get("planted_format") or __import__("planted_format")
    sys.modules.pop("planted_format", None)


def params_of(model) -> dict:
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def test_a_planted_format_reaches_export_init_from_and_serve(planted, run_dir, tmp_path, capsys):
    out = tmp_path / "planted"
    assert cli.main(["export", str(run_dir), "--format", "planted", "--out", str(out)]) == 0
    assert (out / "weights.bin").is_file() and planted.CALLS == ["write"]

    # model.init_from: its keys and weights through its record, equal to the run's
    cfg = ModelConfig(**hf_model_keys(str(out)), init_from=str(out))
    assert planted.CALLS[-1] == "model_keys" and cfg.family == "pi0"
    _, _, trained = export.load_model(run_dir)
    jax.tree.map(np.testing.assert_array_equal, params_of(hf.one_device(cfg)), params_of(trained))
    assert planted.CALLS[-1] == "read"
    # ... and a training run starts from it
    fine = tmp_path / "fine"
    planted.CALLS.clear()
    assert cli.main(["train", "--no-progress", *TRAIN, f"model.init_from={out}", f"train.out_dir={fine}"]) == 0
    assert {"model_keys", "read"} <= set(planted.CALLS), planted.CALLS

    # serve: the format's server answers as the run itself does
    from_format, from_run = loaders.load(out, num_steps=STEPS, seed=SEED), loaders.load(run_dir, num_steps=STEPS,
                                                                                          seed=SEED)
    assert planted.CALLS[-1] == "serve"
    src = sources.open_source(config.load(overrides=TRAIN))
    ds, index = src.source.dataset, int(next(iter(src.source.frames_of(0, 0))))
    numbers = ds.numbers(index, 2)
    obs = {"observation.state": numbers["observation.state"].astype(np.float64), "prompt": numbers["task"],
           **{c: ds.image(c, index, src.source.video) for c in ("observation.images.front", "observation.images.wrist")}}
    np.testing.assert_array_equal(from_format.infer(obs, 0)["actions"], from_run.infer(obs, 0)["actions"])


def test_a_format_without_a_part_is_refused_where_that_part_is_asked_for(planted, run_dir, tmp_path, monkeypatch,
                                                                         capsys):
    out = tmp_path / "planted"
    assert cli.main(["export", str(run_dir), "--format", "planted", "--out", str(out)]) == 0
    monkeypatch.setattr(planted, "FORMAT", dataclasses.replace(planted.FORMAT, serve="", read=""))
    with pytest.raises(config.ConfigError, match="the test's planted directory .*which zerojax serve does not take"):
        loaders.load(out)
    err = one_error_line(["train", "--no-progress", *TRAIN, f"model.init_from={out}",
                          f"train.out_dir={tmp_path / 'fine'}"], capsys)
    assert "is the test's planted directory (weights.bin, keys.json), which holds no model to start from" in err
    assert not (tmp_path / "fine").exists()
    monkeypatch.delitem(checkpoints.FORMATS, "planted")  # its line taken out: the format is gone everywhere
    assert "planted" not in checkpoints.writable()
    assert json.loads((out / "keys.json").read_text())["family"] == "pi0"
    with pytest.raises(config.ConfigError, match="is a directory without config.json"):
        hf_model_keys(str(out))
