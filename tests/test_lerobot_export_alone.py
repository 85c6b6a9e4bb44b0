"""A `zerojax export --format lerobot` stands alone (issue 42, fact 6): a tiny π0.5 fine-tuned for
one step from LeRobot 0.6.1's fixture (tests/fixtures/lerobot06/pi05) on the fixture's dataset, with
a tokenizer named relatively to the working directory, exported, then that tokenizer removed: the
export carries its own copy and names it relatively to itself, so `zerojax serve EXPORT` from `/`
with no --tokenizer and no --vision-heads answers as the run does; its metadata keeps the dataset's
fps and action names; every file it writes is world-readable as the run's own files are; and
zerojax.json beside config.json gives `model.init_from` the tower's head count."""

import json
import os
import shutil
import stat

import numpy as np
import pytest

from conftest import ROOT, one_error_line, run
from zerojax.errors import ConfigError

FIXTURE = ROOT / "tests" / "fixtures" / "lerobot06"
DATASET = FIXTURE / "dataset"
SEED, STEPS = 1, 3
DATA = [f"data.source=lerobot:{DATASET}", "data.image_size=28", "data.action_horizon=4", "data.prompt_len=24",
        "data.norm_state=quantiles", "data.norm_action=quantiles", "data.val_fraction=0"]
TRAIN = DATA + ["model.vision.n_heads=2", "data.tokenizer=tok", "train.global_batch=8", "zero.min_shard_size=64",
                "train.log_every=1", "train.eval_every=0", "train.sample_tokens=0", "train.report=false",
                "optim.warmup_steps=0", "optim.lr=1e-3", "model.remat=none", "train.steps=1", "train.ckpt_every=1"]


class chdir:
    """The working directory set for a block (the run names its tokenizer relatively to it)."""

    def __init__(self, where):
        self.where, self.back = where, None

    def __enter__(self):
        self.back = os.getcwd()
        os.chdir(self.where)

    def __exit__(self, *exc):
        os.chdir(self.back)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(run directory, its export, the run served, the export served from `/`, its openpi export
    served from `/`): trained and exported under umask 022 in a directory holding `tok/`
    (data.tokenizer=tok), which is removed before the exports are served."""
    from zerojax import cli
    from zerojax.serve import loaders

    out = tmp_path_factory.mktemp("alone")
    shutil.copytree(FIXTURE / "tokenizer", out / "tok")
    umask = os.umask(0o022)
    try:
        with chdir(out):
            run(TRAIN + [f"model.init_from={FIXTURE / 'pi05'}", "train.out_dir=run"])
            assert cli.main(["export", "run", "--format", "lerobot", "--out", "export"]) == 0
            assert cli.main(["export", "run", "--format", "openpi", "--out", "openpi"]) == 0
            from_run = loaders.load(out / "run", num_steps=STEPS, seed=SEED)
    finally:
        os.umask(umask)
    shutil.rmtree(out / "tok")  # the run's tokenizer is gone: the export must carry its own
    with chdir("/"):
        from_export = loaders.load(out / "export", num_steps=STEPS, seed=SEED)
        from_openpi = loaders.load(out / "openpi", num_steps=STEPS, seed=SEED)
    return out / "run", out / "export", from_run, from_export, from_openpi


def test_the_export_served_from_root_without_flags_answers_as_the_run(exported):
    """Its tokenizer is its own copy (the processors name `tokenizer`, relatively to the export)."""
    _, export, from_run, from_export, _ = exported
    step = next(s for s in json.loads((export / "policy_preprocessor.json").read_text())["steps"]
                if s["registry_name"] == "tokenizer_processor")
    assert step["config"]["tokenizer_name"] == "tokenizer" and (export / "tokenizer" / "tokenizer.json").is_file()
    assert (export / "tokenizer" / "tokenizer.json").read_bytes() == (FIXTURE / "tokenizer" / "tokenizer.json").read_bytes()
    rng = np.random.default_rng(0)
    for request in range(2):
        obs = {"observation.state": rng.standard_normal(from_run.state_dim), "prompt": "pick up the cube",
               **{c: rng.integers(0, 256, from_run.observations.features[c]["shape"], dtype=np.uint8) for c in from_run.cameras}}
        np.testing.assert_allclose(from_export.infer(obs, request)["actions"], from_run.infer(obs, request)["actions"],
                                   atol=1e-5)


def test_the_openpi_export_served_from_root_without_flags_answers_as_the_run(exported):
    """The same through openpi's layout: its zerojax.json carries the tokenizer itself."""
    _, _, from_run, _, from_openpi = exported
    rng = np.random.default_rng(1)
    for request in range(2):
        obs = {"observation.state": rng.standard_normal(from_run.state_dim), "prompt": "pick up the cube",
               **{c: rng.integers(0, 256, from_run.observations.features[c]["shape"], dtype=np.uint8) for c in from_run.cameras}}
        np.testing.assert_allclose(from_openpi.infer(obs, request)["actions"], from_run.infer(obs, request)["actions"],
                                   atol=1e-5)


def test_the_export_keeps_the_datasets_fps_and_names(exported):
    """The served export's metadata says the dataset's fps and action names (meta/info.json's), as
    the run's does; the state's names are kept too."""
    _, _, from_run, from_export, _ = exported
    info = json.loads((DATASET / "meta" / "info.json").read_text())
    meta = from_export.metadata()
    assert (meta["fps"], meta["action_names"]) == (info["fps"], info["features"]["action"]["names"]) == \
        (from_run.metadata()["fps"], from_run.metadata()["action_names"])
    assert from_export.observations.features["observation.state"]["names"] == info["features"]["observation.state"]["names"]


def test_every_file_the_export_writes_is_readable_as_the_runs_are(exported):
    run_dir, export, _, _, _ = exported
    want = stat.S_IMODE((run_dir / "config.yaml").stat().st_mode)
    assert want == 0o644
    files = [p for p in export.rglob("*") if p.is_file()]
    assert any(p.name.endswith("_normalizer_processor.safetensors") for p in files)
    assert {str(p.relative_to(export)): oct(stat.S_IMODE(p.stat().st_mode)) for p in files} == \
        {str(p.relative_to(export)): oct(want) for p in files}
    assert not export.with_name("export.tmp").exists()  # written beside it and renamed


def test_the_exports_round_trip_needs_no_vision_head_count(exported, tmp_path):
    """`model.init_from=EXPORT` and `interop.lerobot.load(EXPORT)` take the tower's head count from
    zerojax.json; without that file the count is asked of the user (the fixture's tower is 24 wide:
    the family's usual 16 heads do not divide it)."""
    from zerojax import config
    from zerojax.config import hf_model_keys
    from zerojax.interop import lerobot

    _, export, _, _, _ = exported
    assert json.loads((export / "zerojax.json").read_text())["model"] == {"vision": {"n_heads": 2}}
    cfg = config.load(overrides=DATA + [f"data.tokenizer={export / 'tokenizer'}", f"model.init_from={export}"])
    assert cfg.model.vision.n_heads == 2
    loaded, _ = lerobot.load(export)
    assert loaded.vision.n_heads == 2
    bare = shutil.copytree(export, tmp_path / "bare")
    (bare / "zerojax.json").unlink()
    with pytest.raises(ConfigError, match="model.vision.n_heads="):
        hf_model_keys(str(bare))


@pytest.mark.parametrize("record, message", [
    ({"fps": "ten", "features": {}}, "'fps' must be a number >= 0"),
    ({"fps": 10, "features": {"action": ["a0"]}}, "'features' an object of"),
    ({"model": ["vision"]}, "'model' is a JSON list"),
    ({"model": {"vision": {"n_heads": "two"}}}, "model.vision.n_heads"),
    ({"model": {"vision": {"heads": 2}}}, "'heads' is not a model key"),
])
def test_a_bad_zerojax_json_is_refused_naming_the_file(exported, tmp_path, record, message):
    from zerojax.config import hf_model_keys
    from zerojax.interop import lerobot

    bad = shutil.copytree(exported[1], tmp_path / "bad")
    (bad / "zerojax.json").write_text(json.dumps(record))
    with pytest.raises(ConfigError, match=message) as err:
        lerobot.read_policy(bad)
        hf_model_keys(str(bad))
    assert str(bad) in str(err.value)


def test_an_export_whose_tokenizer_is_gone_is_refused_before_anything_is_written(exported, tmp_path, capsys):
    """The run's data.tokenizer (`tok`, relative to where it trained) is not there: the export
    could not stand alone, so it is refused with one line, and neither it nor its .tmp is made."""
    run_dir = exported[0]
    line = one_error_line(["export", str(run_dir), "--format", "lerobot", "--out", str(tmp_path / "again")], capsys)
    assert "data.tokenizer='tok'" in line and "tokenizer.json" in line
    assert not list(tmp_path.iterdir())
