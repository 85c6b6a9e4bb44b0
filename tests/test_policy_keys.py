"""The checkpoint sets the run (STYLE 13, issue 42): a policy's shapes are its model's, and
model.init_from of a LeRobot policy carries its normalization, tokenizer and optimizer preset
into the run unless the user says otherwise (zerojax/config/policy_keys.py)."""

import json
import math
import shutil

import pytest
import yaml

from conftest import ROOT, load_config_file, one_error_line
from zerojax import config
from zerojax.config import policy_keys
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
    cfg = load_config_file(path)
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


# ---------------------------------------------------------------------------------------------
# model.init_from of a LeRobot policy: its normalization, tokenizer and optimizer preset.

PI05_PRESET = {"lr": 2.5e-5, "b1": 0.9, "b2": 0.95, "eps": 1e-8, "weight_decay": 0.01, "decay_mask": "all",
               "clip_norm": 1.0, "warmup_steps": 1000, "schedule": "cosine", "decay_steps": 30000, "final_lr": 2.5e-6}


def test_lerobots_pi05_fixture_trains_with_its_own_settings_from_the_dataset_alone(tmp_path, capsys):
    """`zerojax train model.init_from=DIR data.source=lerobot:DS` and a tiny run's keys: the run
    takes the checkpoint's shapes, QUANTILES normalization, tokenizer and optimizer preset (its
    config.yaml holds them), and its start line says they came from the checkpoint."""
    from zerojax import cli

    out = tmp_path / "run"
    code = cli.main(["train", "--no-progress", f"model.init_from={FIXTURE / 'pi05'}", DATASET, "model.vision.n_heads=2",
                     "train.steps=2", "train.global_batch=8", f"train.out_dir={out}", "train.report=false"])
    said = capsys.readouterr().out
    assert code == 0, said
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert {k: saved["data"][k] for k in (*SHAPE_KEYS, "norm_state", "norm_action")} == \
        {"action_horizon": 4, "image_size": 28, "prompt_len": 24, "norm_state": "quantiles", "norm_action": "quantiles"}
    assert saved["data"]["tokenizer"] == str((FIXTURE / "tokenizer" / "tokenizer.json").resolve())
    assert {k: saved["optim"][k] for k in PI05_PRESET} == PI05_PRESET
    line = next(x for x in said.splitlines() if "policy settings" in x)
    assert "from the checkpoint: " in line and "norm_state=quantiles" in line and "lr=2.5e-05" in line, line
    assert "warmup 1000 and decay 30000 scaled to 0 and 2 for train.steps=2" in line, line


def test_a_key_the_user_sets_wins_over_the_checkpoint(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("data:\n  norm_action: min_max\noptim:\n  weight_decay: 0.0\n")
    cfg, origins = config.load_with_origins(path, [f"model.init_from={FIXTURE / 'pi05'}", DATASET,
                                                   "model.vision.n_heads=2", "optim.lr=1e-4", "data.tokenizer="])
    assert (cfg.data.norm_state, cfg.data.norm_action, cfg.data.tokenizer) == ("quantiles", "min_max", "")
    assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.warmup_steps) == (1e-4, 0.0, 1000)
    assert {k: origins[k] for k in ("data.norm_state", "data.norm_action", "data.tokenizer", "optim.lr",
                                    "optim.weight_decay", "optim.warmup_steps")} == \
        {"data.norm_state": "checkpoint", "data.norm_action": "config", "data.tokenizer": "config",
         "optim.lr": "config", "optim.weight_decay": "config", "optim.warmup_steps": "checkpoint"}


def test_a_constant_schedule_the_user_chose_takes_no_decay_from_the_checkpoint():
    cfg = config.load(overrides=[f"model.init_from={FIXTURE / 'smolvla'}", DATASET, "optim.schedule=constant"])
    assert (cfg.optim.schedule, cfg.optim.decay_steps, cfg.optim.final_lr) == ("constant", 0, None)
    assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.clip_norm) == (1e-4, 1e-10, 10.0)  # SmolVLA's preset
    assert cfg.data.tokenizer == str((FIXTURE / "smolvla_vlm" / "tokenizer.json").resolve())


def test_a_normalization_zerojax_lacks_is_one_error_line(tmp_path, capsys):
    shutil.copytree(FIXTURE / "pi05", tmp_path / "pi05")
    doc = json.loads((tmp_path / "pi05" / "config.json").read_text())
    doc["normalization_mapping"]["ACTION"] = "TANH"
    (tmp_path / "pi05" / "config.json").write_text(json.dumps(doc))
    err = one_error_line(["train", f"model.init_from={tmp_path / 'pi05'}", DATASET, "model.vision.n_heads=2",
                          f"train.out_dir={tmp_path / 'run'}"], capsys)
    assert "normalization_mapping ACTION='TANH'; zerojax normalizes with IDENTITY, MEAN_STD" in err, err
    assert not (tmp_path / "run").exists()


def lerobots_lambda(step, warmup, decay, peak, final):
    """LeRobot 0.6.1's cosine_decay_with_warmup lr_lambda (optim/schedulers.py) times the peak,
    written from its source for the comparison, after its scaling for a short run."""
    if step < warmup:
        return peak * ((1 / (warmup + 1) - 1) * (1 - step / warmup) + 1)
    cosine = 0.5 * (1 + math.cos(math.pi * min(step, decay) / decay))
    return peak * ((1 - final / peak) * cosine + final / peak)


@pytest.mark.parametrize("total, warmup, decay", [(60000, 1000, 30000), (40, 1, 40), (3000, 100, 3000)])
def test_the_checkpoints_schedule_is_lerobots_scaled_for_a_short_run(total, warmup, decay):
    from zerojax.optim import make_schedule

    cfg = config.OptimConfig(lr=2.5e-5, warmup_steps=1000, decay_steps=30000, final_lr=2.5e-6)
    assert policy_keys.scaled(1000, 30000, total) == (warmup, decay)
    schedule = make_schedule(cfg, total)
    for step in sorted({0, 1, warmup - 1, warmup, warmup + 1, decay // 2, decay - 1, decay, total - 1}):
        assert float(schedule(step)) == pytest.approx(lerobots_lambda(step, warmup, decay, 2.5e-5, 2.5e-6), rel=1e-5)


def test_without_decay_steps_the_schedule_is_todays():
    import optax

    from zerojax.optim import make_schedule

    cfg, total = config.OptimConfig(lr=1e-3, warmup_steps=10), 100
    today = optax.join_schedules([optax.linear_schedule(0.0, 1e-3, 10), optax.cosine_decay_schedule(1e-3, 90, 0.1)], [10])
    assert [float(make_schedule(cfg, total)(s)) for s in range(total)] == [float(today(s)) for s in range(total)]


def test_a_decay_on_a_constant_schedule_is_one_error_line(tmp_path, capsys):
    err = one_error_line(["train", "optim.schedule=constant", "optim.decay_steps=100", f"train.out_dir={tmp_path}/run"],
                         capsys)
    assert "optim.decay_steps shapes the cosine decay, and optim.schedule=constant has none" in err, err


def test_the_start_line_names_what_a_policy_from_scratch_left_at_the_defaults():
    cfg, origins = config.load_with_origins(ROOT / "configs" / "pi05-metaworld-tiny.yaml")
    line = policy_keys.describe(origins, cfg)
    assert "from the config: action_horizon=8 image_size=32 prompt_len=208 lr=0.001" in line, line
    assert "decay_steps=0 final_lr=None norm_state=min_max norm_action=min_max norm_eps=1e-05;" in line, line
    assert "from the family's recipe: b1=0.9 b2=0.95 eps=1e-08 decay_mask=all clip_norm=1 schedule=cosine;" in line, line
    assert "defaults: tokenizer='' relative=False" in line, line


@pytest.mark.parametrize("family, lr, decay, clip, norm", [("pi0", 2.5e-5, 0.01, 1.0, "mean_std"),
                                                          ("pi05", 2.5e-5, 0.01, 1.0, "quantiles"),
                                                          ("smolvla", 1e-4, 1e-10, 10.0, "mean_std")])
def test_a_policy_from_scratch_takes_its_familys_recipe_not_the_tiny_gpts(family, lr, decay, clip, norm):
    """No default of the tiny GPT's (lr 3e-3, weight decay 0.1, warmup 50) reaches a policy: where
    neither the user nor a checkpoint sets them, its family's recipe (LeRobot 0.6.1's preset, as
    the fixtures' config.json state it) does, and the start line says so; the user's key wins."""
    cfg, origins = config.load_with_origins(overrides=[f"model.family={family}"])
    o, d = cfg.optim, cfg.data
    assert (o.lr, o.b1, o.b2, o.eps, o.weight_decay, o.clip_norm) == (lr, 0.9, 0.95, 1e-8, decay, clip)
    assert o.decay_mask == "all" and origins["optim.decay_mask"] == "family's recipe"  # torch's AdamW: every parameter
    assert cfg.model.norm_eps == (1e-5 if family == "smolvla" else 1e-6)  # SmolVLM2's RMSNorm eps; Gemma's
    assert (o.schedule, o.warmup_steps, o.decay_steps, o.final_lr) == ("cosine", 1000, 30000, 2.5e-6)
    assert (d.norm_state, d.norm_action) == (norm, norm)
    assert origins["optim.lr"] == origins["data.norm_action"] == "family's recipe"
    assert "from the family's recipe: lr=" in policy_keys.describe(origins, cfg)
    cfg, origins = config.load_with_origins(overrides=[f"model.family={family}", "optim.lr=1e-3"])
    assert cfg.optim.lr == 1e-3 and origins["optim.lr"] == "config"
    preset = json.loads((ROOT / "tests" / "fixtures" / "lerobot06" / family / "config.json").read_text())
    assert (preset["optimizer_lr"], preset["optimizer_weight_decay"], preset["optimizer_grad_clip_norm"],
            preset["scheduler_warmup_steps"], preset["scheduler_decay_steps"], preset["scheduler_decay_lr"]) == \
        (lr, decay, clip, 1000, 30000, 2.5e-6)  # LeRobot's own preset, as LeRobot 0.6.1 wrote it


def test_a_language_model_keeps_its_own_defaults():
    cfg, origins = config.load_with_origins(overrides=["model.family=llama"])
    assert cfg.optim.lr == 3e-3 and origins == {}
