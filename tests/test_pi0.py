"""π0 (`model.family=pi0`): its flow-matching losses and sampled actions equal LeRobot's own
PyTorch π0 on a tiny random checkpoint (tests/fixtures/lerobot/, scripts/make_lerobot_fixtures.py,
LeRobot 0.3.3 in fp32), and its joint-layer units train on 8 devices as on one."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import ROOT, run
from zerojax import ConfigError, lerobot

FIXTURE = ROOT / "tests" / "fixtures" / "lerobot"
TINY = ["model.family=pi0", "data.source=pi0_source:build", "model.vocab_size=64", "model.d_model=32",
        "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=8", "model.d_ff=64",
        "model.expert.d_model=16", "model.expert.d_ff=48", "model.action.horizon=4", "model.action.cameras=2",
        "model.action.prompt_len=6", "model.action.action_dim=3", "model.vision.image_size=28",
        "model.vision.patch_size=14", "model.vision.d_model=24", "model.vision.n_heads=2", "model.vision.d_ff=48",
        "train.global_batch=16", "zero.min_shard_size=64", "train.steps=3", "train.log_every=1",
        "train.eval_every=0", "train.sample_tokens=0", "train.ckpt_every=0", "optim.warmup_steps=0", "model.remat=none"]


@pytest.fixture(scope="module")
def reference():
    return load_file(FIXTURE / "pi0.reference.safetensors")


@pytest.fixture(scope="module")
def loaded():
    return lerobot.load(FIXTURE / "pi0", vision_heads=2)


def test_losses_and_sampled_actions_equal_lerobots(loaded, reference):
    cfg, model = loaded
    assert (cfg.expert.d_model, cfg.action.horizon, cfg.action.cameras, cfg.action.action_dim) == (16, 4, 2, 3)
    batch = {k: jnp.asarray(reference[k]) for k in ("images", "image_masks", "tokens", "token_mask", "state",
                                                    "actions")}
    losses = model.flow_loss(batch, jnp.asarray(reference["noise"]), jnp.asarray(reference["time"]))
    assert losses.shape == reference["losses"].shape == (2, 4, 32)
    np.testing.assert_allclose(losses, reference["losses"], atol=1e-4, rtol=1e-4)
    sampled = model.sample_actions(batch, jnp.asarray(reference["sample_noise"]))
    np.testing.assert_allclose(sampled, reference["actions_sampled"], atol=1e-4, rtol=1e-4)


def test_the_masks_matter(loaded, reference):
    """Control: a missing camera and padded prompt tokens change LeRobot's losses; so must they ours."""
    _, model = loaded
    batch = {k: jnp.asarray(reference[k]) for k in ("images", "image_masks", "tokens", "token_mask", "state",
                                                    "actions")}
    unmasked = {**batch, "image_masks": jnp.ones_like(batch["image_masks"]), "token_mask": jnp.ones_like(batch["token_mask"])}
    losses = model.flow_loss(unmasked, jnp.asarray(reference["noise"]), jnp.asarray(reference["time"]))
    assert np.abs(np.asarray(losses[1]) - reference["losses"][1]).max() > 1e-3


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    return run(TINY + ["mesh.data=1", "zero.stage=0", "zero.schedule=gspmd",
                       f"train.out_dir={tmp_path_factory.mktemp('one')}"])[0]


@pytest.mark.parametrize("extra", [
    ["zero.stage=3", "train.grad_accum=2"],
    ["zero.stage=1", "zero.schedule=gspmd", "mesh.replica=2", "mesh.data=4"],
], ids=lambda e: " ".join(e))
def test_joint_layer_units_on_8_devices_give_one_devices_losses(extra, one_device, tmp_path):
    losses, result = run(TINY + extra + [f"train.out_dir={tmp_path}"])
    # Rows carry different numbers of in-episode steps: only the weighted mean makes them equal.
    np.testing.assert_allclose(losses, one_device, rtol=1e-5)
    assert {"vision", "layers", "expert_norm", "action_out_proj"} <= set(result.state.params)
    assert set(result.state.params["layers"]) == {"vlm", "expert"}  # one unit holds both experts' weights


def test_another_policy_type_is_refused(tmp_path):
    shutil.copytree(FIXTURE / "pi0", tmp_path / "act")
    config = json.loads((tmp_path / "act" / "config.json").read_text())
    (tmp_path / "act" / "config.json").write_text(json.dumps({**config, "type": "act"}))
    with pytest.raises(ConfigError, match="a LeRobot 'act' policy; zerojax reads pi0"):
        lerobot.load(tmp_path / "act")


def test_each_joint_layer_is_gathered_once_per_pass_with_both_experts():
    """Stage 3's HLO: the joint layers' loops (3 layers; the tower has 2) gather one unit per
    iteration, forward and backward, and the backward reduce-scatters one: both experts' weights
    travel as one unit (PyTorch FSDP cannot wrap π0 block by block)."""
    from zerojax import config
    from zerojax.analysis import hlo, measure

    cfg = config.load(overrides=TINY + ["model.n_layers=3", "model.vision.n_layers=2", "zero.stage=3",
                                        "zero.schedule=shard_map", "zero.prefetch=0"])
    engine, compiled = measure.compile_step(cfg, measured_only=True)
    assert set(engine.plan.leaves["layers"]) == {"vlm", "expert"}
    loops = [x for x in hlo.loop_collectives(compiled.as_text(), 8) if x["per_iteration"]["all-gather"]]
    joint = sorted((x for x in loops if x["trip_count"] == 3), key=lambda x: x["per_iteration"]["reduce-scatter"])
    assert len(joint) == 2, loops  # the forward's loop and the backward's
    forward, backward = joint
    assert forward["per_iteration"]["all-gather"] == backward["per_iteration"]["all-gather"] == 1
    assert forward["per_iteration"]["reduce-scatter"] == 0 and backward["per_iteration"]["reduce-scatter"] == 1
    assert [x["trip_count"] for x in loops if x["trip_count"] != 3] == [2, 2]  # the tower's two loops
