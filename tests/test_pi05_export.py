"""A π0.5 fine-tune exports back to LeRobot 0.6.1 (issue 33's acceptance, without LeRobot: the
suite cannot run it; scripts/checks/check_lerobot06_pi05_export.py runs LeRobot 0.6.1 itself).

A 2-step ZeRO-3 run on 8 devices from LeRobot 0.6.1's tiny π0.5 (tests/fixtures/lerobot06/pi05)
on the LeRobot v3.0 dataset LeRobot 0.6.1 wrote (tests/fixtures/lerobot06/dataset, quantiles, the
fixture's tokenizer directory), exported with `zerojax export --format lerobot`: its files are
what LeRobot 0.6.1 wrote for the fixture but for what the dataset changes, its normalizers hold
the dataset's q01/q99, and zerojax reading its own export samples the run's actions."""

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import ROOT, run

FIXTURE = ROOT / "tests" / "fixtures" / "lerobot06"
DATASET, TOKENIZER = FIXTURE / "dataset", FIXTURE / "tokenizer"
STATE, ACTION = "observation.state", "action"
EMBED = "model.paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"
LM_HEAD, EXPERT_LM_HEAD = ("model.paligemma_with_expert.paligemma.lm_head.weight",
                           "model.paligemma_with_expert.gemma_expert.lm_head.weight")
PROCESSORS = ("policy_preprocessor.json", "policy_postprocessor.json")
STATS_FILES = ("policy_preprocessor_step_3_normalizer_processor.safetensors",
               "policy_postprocessor_step_0_unnormalizer_processor.safetensors")
# the run: its data keys are the fixture's sizes (28 px images, H = 4, prompts of 24 tokens)
OVERRIDES = ["model.vision.n_heads=2", f"data.source=lerobot:{DATASET}", f"data.tokenizer={TOKENIZER}",
             "data.image_size=28", "data.action_horizon=4", "data.prompt_len=24", "data.norm_state=quantiles",
             "data.norm_action=quantiles", "data.val_fraction=0", "train.global_batch=8", "zero.min_shard_size=64",
             "train.log_every=1", "train.eval_every=0", "train.sample_tokens=0", "train.report=false",
             "optim.warmup_steps=0", "optim.lr=1e-3", "model.remat=none", "zero.stage=3", "mesh.data=8",
             "train.steps=2", "train.ckpt_every=2"]


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """A copy of LeRobot's π0.5 to start from: one test takes it away."""
    return shutil.copytree(FIXTURE / "pi05", tmp_path_factory.mktemp("start05") / "pi05")


@pytest.fixture(scope="module")
def finetuned(start, tmp_path_factory):
    """(run directory, its export): 2 steps at stage 3 on 8 devices, then --format lerobot."""
    from zerojax import cli

    out = tmp_path_factory.mktemp("finetune05")
    run(OVERRIDES + [f"model.init_from={start}", f"train.out_dir={out / 'run'}"])
    assert cli.main(["export", str(out / "run"), "--format", "lerobot", "--out", str(out / "export")]) == 0
    return out / "run", out / "export"


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def dataset_stats() -> dict:
    return read_json(DATASET / "meta" / "stats.json")


def as_fixture_writes(export_config: dict) -> dict:
    """The export's config.json with what the dataset legitimately changes set back to the
    fixture's: its one camera (the fixture had two: the model's second slot is an empty camera)."""
    fixture = read_json(FIXTURE / "pi05" / "config.json")
    assert export_config["input_features"] == {STATE: {"type": "STATE", "shape": [5]},
                                               "observation.images.cam0": {"type": "VISUAL", "shape": [3, 28, 28]}}
    assert export_config["empty_cameras"] == 1
    return {**export_config, "input_features": fixture["input_features"], "empty_cameras": 0}


def as_fixture_steps(steps: list) -> list:
    """Processor steps with the normalizers' features of the fixture's two cameras, and the
    tokenizer's directory as the fixture names it (from the repository root) where the export
    names its own copy (`tokenizer`, relatively to itself)."""
    fixture_features = read_json(FIXTURE / "pi05" / "config.json")["input_features"]
    out = []
    for step in json.loads(json.dumps(steps)):
        config = step["config"]
        if step["registry_name"] == "normalizer_processor":
            config["features"] = {**fixture_features, ACTION: config["features"][ACTION]}
        if step["registry_name"] == "tokenizer_processor" and config["tokenizer_name"] == "tokenizer":
            config["tokenizer_name"] = str(TOKENIZER.relative_to(ROOT))
        out.append(step)
    return out


@pytest.mark.slow
def test_the_export_is_what_lerobot06_wrote_for_the_fixture(finetuned):
    """config.json, the processor files and model.safetensors' tensor names, shapes and dtypes
    equal LeRobot 0.6.1's files for the fixture, but for the dataset's camera; the prompt's
    embedding, trained, is under both embed_tokens and lm_head."""
    _, export = finetuned
    assert as_fixture_writes(read_json(export / "config.json")) == read_json(FIXTURE / "pi05" / "config.json")
    for name in PROCESSORS:
        got, want = read_json(export / name), read_json(FIXTURE / "pi05" / name)
        assert {**got, "steps": as_fixture_steps(got["steps"])} == want
    out, fixture = load_file(export / "model.safetensors"), load_file(FIXTURE / "pi05" / "model.safetensors")
    assert {k: (v.shape, v.dtype) for k, v in out.items()} == {k: (v.shape, v.dtype) for k, v in fixture.items()}
    np.testing.assert_array_equal(out[LM_HEAD], out[EMBED])
    assert not np.array_equal(out[EMBED], fixture[EMBED])  # the fine-tune moved it
    assert sorted(p.name for p in export.iterdir()) == \
        sorted([p.name for p in (FIXTURE / "pi05").iterdir()] + ["tokenizer", "zerojax.json"])  # zerojax's own two


@pytest.mark.slow
def test_the_normalizers_hold_the_datasets_quantiles(finetuned):
    """Both processors' statistics are the dataset's q01/q99 (meta/stats.json, as float32), the
    statistics the run normalized with: not the starting checkpoint's."""
    _, export = finetuned
    stats = dataset_stats()
    for name in STATS_FILES:  # LeRobot's unnormalizer keeps the state's too
        got = load_file(export / name)
        assert sorted(got) == sorted(f"{f}.{s}" for f in (STATE, ACTION) for s in ("q01", "q99"))
        for key, value in got.items():
            feature, stat = key.rsplit(".", 1)
            assert value.tobytes() == np.asarray(stats[feature][stat], np.float32).tobytes(), key


@pytest.mark.slow
def test_zerojax_reading_its_export_samples_the_runs_actions(finetuned):
    """`zerojax.interop.lerobot.load` of the export makes the run's model (its two camera slots
    too: the empty one is config.json's empty_cameras) and samples the run's actions on a batch
    of the dataset."""
    from zerojax import config
    from zerojax.data import sources
    from zerojax.interop import lerobot
    from zerojax.train.export import load_model

    run_dir, export = finetuned
    saved, step, trained = load_model(run_dir)
    cfg, loaded = lerobot.load(export)  # the tower's head count from the export's zerojax.json
    assert step == 2 and (cfg.action.cameras, cfg.action.prompt_len, cfg.action.action_dim) == (2, 24, 3)
    src = sources.open_source(config.load(overrides=OVERRIDES + [f"model.init_from={FIXTURE / 'pi05'}"]))
    batch = {k: jnp.asarray(v) for k, v in src.rows(0, 0, slice(None)).items()}
    noise = jnp.asarray(np.random.default_rng(0).standard_normal(batch["noise"].shape), jnp.float32)
    want = np.asarray(trained.sample_actions(batch, noise))
    np.testing.assert_allclose(np.asarray(loaded.sample_actions(batch, noise)), want, atol=1e-6)
    np.testing.assert_allclose(np.asarray(loaded.flow_loss(batch, batch["noise"], batch["time"])),
                               np.asarray(trained.flow_loss(batch, batch["noise"], batch["time"])), atol=1e-6)


@pytest.mark.slow
def test_without_its_start_an_export_has_lerobots_pi05_steps_and_every_tensor(start, finetuned, tmp_path):
    """A run that kept no processor files gets make_pi05_pre_post_processors' steps (the fixture's,
    the tokenizer step naming the run's data.tokenizer directory); with model.init_from gone, the
    expert's unused lm_head is written as zeros, so LeRobot 0.6's strict load finds every tensor."""
    from zerojax import cli

    run_dir = shutil.copytree(finetuned[0], tmp_path / "run")
    for name in PROCESSORS:
        (run_dir / "lerobot_init" / name).unlink()
    start.rename(start.with_name("gone"))
    try:
        assert cli.main(["export", str(run_dir), "--format", "lerobot", "--out", str(tmp_path / "out")]) == 0
    finally:
        start.with_name("gone").rename(start)
    for name in PROCESSORS:
        got = read_json(tmp_path / "out" / name)
        assert {**got, "steps": as_fixture_steps(got["steps"])} == read_json(FIXTURE / "pi05" / name)
    out, fixture = load_file(tmp_path / "out" / "model.safetensors"), load_file(FIXTURE / "pi05" / "model.safetensors")
    assert set(out) == set(fixture) and not out[EXPERT_LM_HEAD].any()
