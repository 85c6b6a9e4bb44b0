"""The checkpoint sets the run (STYLE 13, issue 42): a policy's shapes are its model's, and
model.init_from of a LeRobot policy carries its normalization, tokenizer and optimizer preset
into the run unless the user says otherwise (zerojax/config/policy_keys.py)."""

import json
import shutil

import pytest
import yaml

from conftest import ROOT, one_error_line
from zerojax import config
from zerojax.models import registry

FIXTURE = ROOT / "tests" / "fixtures" / "lerobot06"
DATASET = f"data.source=lerobot:{FIXTURE / 'dataset'}"
SHAPE_KEYS = ("action_horizon", "image_size", "prompt_len")


def policy_configs():
    out = []
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        doc = yaml.safe_load(path.read_text()) or {}
        if registry.is_policy((doc.get("model") or {}).get("family", registry.DEFAULT)):
            out.append(path)
    return out


@pytest.mark.parametrize("path", policy_configs(), ids=lambda p: p.name)
def test_a_policy_config_states_its_shapes_once_and_the_data_follows_the_model(path):
    doc = yaml.safe_load(path.read_text())
    assert not set(SHAPE_KEYS) & set(doc.get("data") or {}), f"{path.name} states a policy shape under data:"
    cfg = config.load(path)
    assert (cfg.data.action_horizon, cfg.data.image_size, cfg.data.prompt_len) == \
        (cfg.model.action.horizon, cfg.model.vision.image_size, cfg.model.action.prompt_len)


def test_the_metaworld_configs_shapes_come_from_their_model_section():
    cfg, origins = config.load_with_origins(ROOT / "configs" / "pi0-metaworld-tiny.yaml")
    assert (cfg.data.action_horizon, cfg.data.image_size, cfg.data.prompt_len) == (8, 32, 32)
    assert {origins[f"data.{k}"] for k in SHAPE_KEYS} == {"config"}


def test_a_checkpoints_shapes_reach_the_data_without_being_repeated():
    cfg, origins = config.load_with_origins(overrides=[f"model.init_from={FIXTURE / 'pi05'}", DATASET,
                                                       "model.vision.n_heads=2"])
    assert (cfg.data.action_horizon, cfg.data.image_size, cfg.data.prompt_len) == (4, 28, 24)
    assert {origins[f"data.{k}"] for k in SHAPE_KEYS} == {"checkpoint"}


def test_a_shape_the_user_repeats_rightly_is_accepted():
    cfg = config.load(overrides=[f"model.init_from={FIXTURE / 'pi05'}", DATASET, "model.vision.n_heads=2",
                                 "data.action_horizon=4", "data.image_size=28", "data.prompt_len=24"])
    assert cfg.data.action_horizon == 4


def test_a_language_model_keeps_the_data_shape_defaults():
    cfg, origins = config.load_with_origins(overrides=[DATASET])
    assert (cfg.data.action_horizon, cfg.data.image_size, cfg.data.prompt_len) == (50, 224, 48) and origins == {}


@pytest.mark.parametrize("override, said", [
    ("data.action_horizon=8", "data.action_horizon=8 contradicts model.action.horizon=4 (read from model.init_from="),
    ("data.image_size=224", "data.image_size=224 contradicts model.vision.image_size=28 (read from model.init_from="),
])
def test_a_shape_contradicting_the_checkpoint_is_one_error_line(override, said, tmp_path, capsys):
    err = one_error_line(["train", f"model.init_from={FIXTURE / 'pi05'}", DATASET, "model.vision.n_heads=2", override,
                          f"train.out_dir={tmp_path / 'run'}"], capsys)
    assert said in err and f"drop {override.split('=')[0]}" in err, err
    assert not (tmp_path / "run").exists()


def test_a_shape_contradicting_the_config_names_both_values(tmp_path, capsys):
    err = one_error_line(["train", "--config", str(ROOT / "configs" / "pi0-metaworld-tiny.yaml"), "data.prompt_len=16",
                          f"train.out_dir={tmp_path / 'run'}"], capsys)
    assert "data.prompt_len=16 contradicts model.action.prompt_len=32 (set in the config)" in err, err
    assert not (tmp_path / "run").exists()
