"""π0 (`model.family=pi0`): its flow-matching losses and sampled actions equal LeRobot's own
PyTorch π0 on a tiny random checkpoint (tests/fixtures/lerobot/, scripts/fixtures/make_lerobot_fixtures.py,
LeRobot 0.3.3 in fp32), and its joint-layer units train on 8 devices as on one."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import ROOT, run
from zerojax.errors import ConfigError
from zerojax.interop import lerobot

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
    with pytest.raises(ConfigError, match="a LeRobot 'act' policy; zerojax reads LeRobot's pi0, pi05, smolvla policies"):
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


# ---------------------------------------------------------------------------------------------
# LeRobot checkpoints in (model.init_from=DIR) and out (zerojax export --format lerobot).

INIT = ["data.source=pi0_source:build", f"model.init_from={FIXTURE / 'pi0'}", "model.vision.n_heads=2",
        "train.global_batch=16", "zero.min_shard_size=64", "train.log_every=1", "train.eval_every=0",
        "train.sample_tokens=0", "optim.warmup_steps=0", "model.remat=none"]


def bits(tensors: dict) -> dict:
    return {k: (v.dtype, v.shape, v.tobytes()) for k, v in tensors.items()}


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """A stage-3 run on 8 devices from the LeRobot fixture: one step at lr 0 (the weights stay the
    checkpoint's), checkpointed, so the export can be held to the fixture bit for bit."""
    out = tmp_path_factory.mktemp("imported")
    losses, _ = run(INIT + ["zero.stage=3", "zero.schedule=shard_map", "train.steps=1", "train.ckpt_every=1",
                            "optim.lr=0", f"train.out_dir={out}"])
    assert np.isfinite(losses).all()
    return out


def test_lerobot_import_on_8_devices_and_export_give_every_tensor_bit_for_bit(imported, tmp_path):
    from zerojax import cli

    assert (imported / "lerobot_init" / "config.json").read_bytes() == (FIXTURE / "pi0" / "config.json").read_bytes()
    out = tmp_path / "exported"
    assert cli.main(["export", str(imported), "--format", "lerobot", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "zerojax.json"]
    want, have = load_file(FIXTURE / "pi0" / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(have) == sorted(want)  # the statistics' buffers and the expert's unused lm_head too
    assert bits(have) == bits(want)
    assert json.loads((out / "config.json").read_text()) == json.loads((FIXTURE / "pi0" / "config.json").read_text())
    from zerojax.interop import lerobot as lerobot_io  # zerojax trains with centred padding, LeRobot 0.3 pads before

    assert (lerobot_io.image_padding(out), lerobot_io.image_padding(FIXTURE / "pi0")) == ("centre", "before")


def without_buffers(directory):
    """`directory`'s model.safetensors as LeRobot 0.4 saves it: no normalization buffers."""
    from safetensors.numpy import save_file

    tensors = load_file(directory / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if not k.startswith(("normalize_", "unnormalize_"))},
              directory / "model.safetensors")


def test_lerobot_04s_processor_statistics_are_read_as_03s_buffers(imported, tmp_path):
    """LeRobot 0.4 keeps the statistics in its processors' files (tests/fixtures/lerobot/
    pi0_processors, written by LeRobot 0.4.4's make_pi0_pre_post_processors): the same numbers."""
    from zerojax import cli
    from zerojax.interop import lerobot as lerobot_io

    v04 = tmp_path / "v04"
    shutil.copytree(FIXTURE / "pi0", v04)
    without_buffers(v04)
    for f in (FIXTURE / "pi0_processors").iterdir():
        shutil.copy(f, v04 / f.name)
    buffers = load_file(FIXTURE / "pi0" / "model.safetensors")
    stats = lerobot_io.read_stats(v04)
    assert sorted(stats) == ["action", "observation.state"]
    for feature, module in (("observation.state", "normalize_inputs"), ("action", "normalize_targets")):
        for stat in ("mean", "std"):
            assert stats[feature][stat].tobytes() == buffers[lerobot_io.buffer_name(module, feature, stat)].tobytes()
    shutil.copytree(FIXTURE / "pi0", tmp_path / "bare")
    without_buffers(tmp_path / "bare")
    assert lerobot_io.read_stats(tmp_path / "bare") == {}  # neither layout: no statistics
    # A run that kept 0.4's statistics exports them as 0.3's buffers.
    run_dir = tmp_path / "run"
    shutil.copytree(imported, run_dir)
    for name, blob in lerobot_io.init_files(v04).items():
        (run_dir / name).write_bytes(blob)
    assert cli.main(["export", str(run_dir), "--format", "lerobot", "--out", str(tmp_path / "out")]) == 0
    assert bits(load_file(tmp_path / "out" / "model.safetensors")) == bits(buffers)


def test_an_export_without_statistics_is_refused(imported, tmp_path, capsys):
    from zerojax import cli

    run_dir = tmp_path / "run"
    shutil.copytree(imported, run_dir)
    (run_dir / "lerobot_init" / "stats.safetensors").unlink()
    assert cli.main(["export", str(run_dir), "--format", "lerobot", "--out", str(tmp_path / "out")]) == 2
    assert "no normalization statistic observation.state.mean" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


def test_a_lerobot_policy_of_another_type_exits_2_naming_it(tmp_path, capsys):
    from zerojax import cli

    shutil.copytree(FIXTURE / "pi0", tmp_path / "act")
    config = json.loads((tmp_path / "act" / "config.json").read_text())
    (tmp_path / "act" / "config.json").write_text(json.dumps({**config, "type": "act"}))
    assert cli.main(["train", f"model.init_from={tmp_path / 'act'}", f"train.out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "a LeRobot 'act' policy; zerojax reads LeRobot's pi0, pi05, smolvla policies" in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("change", ["depth", "heads", "head_dim"])
def test_experts_that_differ_exit_2(change, tmp_path, capsys):
    from safetensors.numpy import save_file

    from zerojax import cli

    shutil.copytree(FIXTURE / "pi0", tmp_path / "pi0")
    tensors = load_file(tmp_path / "pi0" / "model.safetensors")
    layer = "model.paligemma_with_expert.gemma_expert.model.layers."
    if change == "depth":  # one expert layer fewer
        tensors = {k: v for k, v in tensors.items() if not k.startswith(layer + "1.")}
    for i in (0, 1):
        q, k = f"{layer}{i}.self_attn.q_proj.weight", f"{layer}{i}.self_attn.k_proj.weight"
        if change == "heads" and q in tensors:  # 3 query heads of 8, the VLM has 2
            tensors[q] = np.zeros((24, 16), np.float32)
        if change == "head_dim" and q in tensors:  # 2 heads of 4, the VLM's are of 8
            tensors[q], tensors[k] = np.zeros((8, 16), np.float32), np.zeros((4, 16), np.float32)
    save_file(tensors, tmp_path / "pi0" / "model.safetensors")
    assert cli.main(["train", *INIT[:1], f"model.init_from={tmp_path / 'pi0'}", "model.vision.n_heads=2",
                     f"train.out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "the experts differ in depth, heads or head_dim" in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("norm_action", ["mean_std", "quantiles"])
def test_a_run_on_a_lerobot_dataset_exports_its_features_and_statistics(norm_action, imported, tmp_path, capsys):
    """The statistics the run normalized its data with (RUN_DIR/lerobot.json, as a LeRobot
    source writes it) win over the starting checkpoint's; LeRobot 0.3 has no quantile mode."""
    from zerojax import cli, config, data

    dataset = FIXTURE / "tiny"
    cfg = config.load(overrides=[f"data.source=lerobot:{dataset}", "data.action_horizon=4", "data.image_size=28",
                                 "train.global_batch=8", f"data.norm_action={norm_action}"])
    run_dir = tmp_path / "run"
    shutil.copytree(imported, run_dir)
    for name, text in data.open_source(cfg).run_files().items():
        (run_dir / name).write_text(text)
    out = tmp_path / "out"
    code = cli.main(["export", str(run_dir), "--format", "lerobot", "--out", str(out)])
    if norm_action == "quantiles":
        assert code == 2 and "with 'quantiles'" in capsys.readouterr().err and not out.exists()
        return
    assert code == 0
    written = json.loads((out / "config.json").read_text())
    assert written["input_features"] == {"observation.state": {"type": "STATE", "shape": [3]},
                                         "observation.images.front": {"type": "VISUAL", "shape": [3, 28, 28]},
                                         "observation.images.wrist": {"type": "VISUAL", "shape": [3, 28, 28]}}
    assert written["output_features"] == {"action": {"type": "ACTION", "shape": [2]}}
    assert written["normalization_mapping"] == {"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"}
    stats = json.loads((dataset / "meta" / "stats.json").read_text())
    tensors = load_file(out / "model.safetensors")
    for name, (feature, stat) in {"normalize_inputs.buffer_observation_state.std": ("observation.state", "std"),
                                  "normalize_targets.buffer_action.mean": ("action", "mean"),
                                  "unnormalize_outputs.buffer_action.std": ("action", "std")}.items():
        np.testing.assert_array_equal(tensors[name], np.asarray(stats[feature][stat], np.float32))
