import dataclasses

import pytest

from conftest import ROOT, load_config_file
from zerojax import config
from zerojax.config import rules


def test_defaults_are_the_tiny_run():
    cfg = config.load()
    assert cfg.name == "tiny" and cfg.zero.stage == 3 and cfg.mesh.cpu_devices == 8
    assert cfg.data.source == "stdlib" and cfg.model.vocab_size == 256
    assert str(cfg.run_dir) == "runs/tiny"


def test_tiny_yaml_spells_out_the_defaults():
    assert config.load(ROOT / "configs" / "tiny.yaml") == config.load()


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_config_file_loads(path):
    cfg = load_config_file(path)
    assert cfg.name == path.stem
    assert cfg.model.d_model % cfg.model.n_heads == 0


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("model:\n  d_model: 64\noptim:\n  lr: 1e-4\ntrain:\n  steps: 7\n")
    cfg = config.load(path, ["train.steps=9", "zero.reshard_after_forward=false", "optim.freeze=head,embed"])
    assert cfg.name == "exp" and cfg.model.d_model == 64
    assert cfg.optim.lr == 1e-4  # YAML 1.1 reads "1e-4" as a string: parsed to the field's type
    assert cfg.train.steps == 9 and cfg.zero.reshard_after_forward is False
    assert cfg.optim.freeze == ("head", "embed")


@pytest.mark.parametrize("text, field, value", [
    ("precision.loss_scale=128", "loss_scale", 128.0),
    ("precision.loss_scale=none", "loss_scale", "none"),
    ("precision.min_loss_scale=2", "min_loss_scale", 2.0),
])
def test_override_types(text, field, value):
    assert getattr(config.load(overrides=[text]).precision, field) == value


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.load().train.steps = 3


@pytest.mark.parametrize("text, message", [
    ("zero.stag=1", "unknown config key 'zero.stag'; did you mean 'zero.stage'?"),
    ("trian.steps=1", "did you mean 'train.steps'?"),
    ("train.steps=ten", "train.steps expects an integer, got 'ten'"),
    ("train.steps=1.5", "train.steps expects an integer"),
    ("optim.lr=fast", "optim.lr expects a number, got 'fast'"),
    ("zero.reshard_after_forward=maybe", "expects true or false"),
    ("zero.stage=5", "zero.stage=5 is not valid; choose one of 0, 1, 2, 3"),
    ("model.n_heads=3", "model.d_model=128 must be divisible by model.n_heads=3"),
    ("precision.compute=float64", "precision.compute='float64' is not valid"),
    ("train.steps", "is not KEY=VALUE"),
    ("data.source=corpus.csv", "data.source='corpus.csv' is not valid"),
    ("train.global_batch=30", "train.global_batch=30 must be divisible by train.grad_accum=4"),
])
def test_bad_overrides_name_the_key_and_the_fix(text, message):
    overrides = [text] + (["train.grad_accum=4"] if "global_batch" in text else [])
    with pytest.raises(ValueError, match=None) as err:
        config.load(overrides=overrides)
    assert message in str(err.value)


ENUMERATIONS = [("zero.stage", rules.STAGES, "7"), ("zero.schedule", rules.SCHEDULES, "x"),
                ("zero.offload", rules.OFFLOADS, "x"), ("model.remat", rules.REMATS, "x"),
                ("precision.param", rules.PARAM_DTYPES, "x"), ("precision.reduce", rules.DTYPES, "x"),
                ("precision.frozen", rules.DTYPES, "x"), ("precision.loss_scale", rules.LOSS_SCALES, "x"),
                ("optim.schedule", rules.LR_SCHEDULES, "x"), ("mesh.distributed", rules.DISTRIBUTED, "x"),
                ("train.resume", rules.RESUMES, "x")]


@pytest.mark.parametrize("key, valid, bad", ENUMERATIONS, ids=[key for key, _, _ in ENUMERATIONS])
def test_each_enumeration_is_the_rules(key, valid, bad):
    """A key takes every value of its enumeration in config.rules (the CLI's choices), and the
    error for any other value lists exactly those."""
    for value in valid:
        assert str(getattr(getattr(config.load(overrides=[f"{key}={value}"]), key.split(".")[0]),
                           key.split(".")[1])) == str(value)
    with pytest.raises(config.ConfigError) as err:
        config.load(overrides=[f"{key}={bad}"])
    assert str(err.value).endswith(f"is not valid; choose one of {', '.join(map(str, valid))}")


@pytest.mark.parametrize("overrides, message", [
    # needs no mesh: it fails as the config loads, before any device is touched
    (["zero.schedule=gspmd", "precision.reduce=bf16"],
     "precision.reduce='bfloat16': choosing the reduce dtype under gspmd is not implemented in zerojax yet; "
     "use zero.schedule=shard_map"),
    (["zero.schedule=gspmd", "zero.offload=optimizer"], "zero.offload=optimizer (the update streamed unit by unit"),
    (["model.vocab_size=100"], "model.vocab_size=100 is too small for the byte corpus data.source=stdlib"),
])
def test_the_rules_between_keys(overrides, message):
    with pytest.raises(config.ConfigError) as err:
        config.load(overrides=overrides)
    assert message in str(err.value)
    assert config.load(overrides=overrides[:-1]) is not None  # each key alone is fine


def test_bad_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  d_modle: 64\n")
    with pytest.raises(ValueError, match="unknown config key 'model.d_modle'; did you mean 'model.d_model'"):
        config.load(path)
    with pytest.raises(ValueError, match="does not exist"):
        config.load(tmp_path / "missing.yaml")
    path.write_text("model: [1, 2\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        config.load(path)


def test_a_section_whose_keys_are_all_commented_out_is_empty(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("model:\n  # d_model: 64\ntrain:\n  steps: 7\n")
    cfg = config.load(path)
    assert cfg.model == config.ModelConfig() and cfg.train.steps == 7


def test_dump_round_trips(tmp_path):
    cfg = config.load(overrides=["optim.freeze=head", "precision.loss_scale=64", "name=x"])
    config.dump(cfg, tmp_path / "config.yaml")
    again = config.load(tmp_path / "config.yaml")
    assert dataclasses.replace(again, name="x") == cfg
