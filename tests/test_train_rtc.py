"""Training-time real-time chunking (`model.action.train_delay=D`, models/vla/rtc.py): each row's
delay is drawn with its noise (d ~ U{0..D}, after the noise: D = 0's noise and time unchanged),
its first d actions are given clean at time 0 per token and are not in the loss, a stage-3 run on
8 devices gives one device's losses, and sampling with a given prefix keeps it exactly, for π0,
π0.5 and SmolVLA alike."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pi0_source
from conftest import ROOT, robot_observation, run
from zerojax import config
from zerojax.models import protocol, registry
from zerojax.models.vla import batch as vla_batch
from zerojax.precision import Policy

BASE = ["data.source=pi0_source:build", "model.vocab_size=64", "model.d_model=32", "model.n_heads=2",
        "model.n_kv_heads=1", "model.head_dim=8", "model.d_ff=64", "model.expert.d_model=16", "model.expert.d_ff=48",
        "model.action.horizon=4", "model.action.cameras=2", "model.action.prompt_len=6", "model.action.action_dim=3",
        "model.vision.image_size=16", "model.vision.patch_size=8", "model.vision.d_model=16", "model.vision.n_layers=1",
        "model.vision.n_heads=2", "model.vision.d_ff=32", "train.global_batch=16", "zero.min_shard_size=64",
        "train.steps=2", "train.log_every=1", "train.eval_every=0", "train.sample_tokens=0", "train.ckpt_every=0",
        "optim.warmup_steps=0", "model.remat=none"]
FAMILIES = {"pi0": ["model.family=pi0", "model.n_layers=2"], "pi05": ["model.family=pi05", "model.n_layers=2"],
            "smolvla": ["model.family=smolvla", "model.n_layers=4"]}


def overrides(family, delay):
    return BASE + FAMILIES[family] + [f"model.action.train_delay={delay}"]


def model_and_batch(family, delay, rows=6):
    cfg = config.load(overrides=overrides(family, delay))
    model = registry.build(cfg.model, Policy(), 0)
    if family == "pi05":  # its adaptive norms start at zero (gates shut: no token sees another); open them
        params = nnx.state(model, nnx.Param)
        keys = iter(jax.random.split(jax.random.key(3), len(jax.tree.leaves(params))))
        nnx.update(model, jax.tree.map_with_path(
            lambda path, p: 0.3 * jax.random.normal(next(keys), p.shape) if "dense" in jax.tree_util.keystr(path)
            else p, params))
    batch = pi0_source.Robot(cfg).rows(0, 1, slice(0, rows))
    batch["action_is_pad"][:] = False  # every step inside the episode: the prefix alone is masked
    if family == "pi05":
        del batch["state"]
    return model, {k: jnp.asarray(v) for k, v in batch.items()}


def loss_of(model, batch):
    x = protocol.apply_stack(model.vision, model.enter(batch))
    x = protocol.apply_stack(model.layers, model.between("layers", x, batch))
    return x, model.exit(x, batch)


def test_the_delay_is_drawn_after_the_noise_and_time_uniform_on_0_to_d():
    plain = vla_batch.noise_and_time(5, 0, 3, range(2000), 4, 3)
    delayed = vla_batch.noise_and_time(5, 0, 3, range(2000), 4, 3, max_delay=3)
    assert set(plain) == {"noise", "time"}  # D = 0: the batch has no delay
    np.testing.assert_array_equal(plain["noise"], delayed["noise"])
    np.testing.assert_array_equal(plain["time"], delayed["time"])
    counts = np.bincount(delayed["delay"], minlength=5)
    assert counts[4] == 0 and (np.abs(counts[:4] / 2000 - 0.25) < 0.03).all(), counts
    again = vla_batch.noise_and_time(5, 0, 3, range(1000, 1004), 4, 3, max_delay=3)["delay"]
    np.testing.assert_array_equal(again, delayed["delay"][1000:1004])  # a pure function of the row


@pytest.mark.parametrize("family", FAMILIES)
def test_the_given_prefix_is_clean_at_time_0_and_carries_no_loss(family):
    model, batch = model_and_batch(family, 2)
    delay = np.asarray(batch["delay"])
    assert 0 < delay.max() <= 2
    time = np.asarray(model.token_time(batch))
    x_t = np.asarray(model.noisy_actions(batch))
    for b, d in enumerate(delay):
        assert (time[b, :d] == 0).all() and (time[b, d:] == np.asarray(batch["time"])[b]).all()
        np.testing.assert_array_equal(x_t[b, :d], np.asarray(batch["actions"])[b, :d])
    x, (loss, count) = loss_of(model, batch)
    losses = np.asarray(model.losses(x, batch))
    # independently: the mean over each row's steps from its delay on, the real dimensions only
    kept = [losses[b, d:, :3] for b, d in enumerate(delay)]
    assert int(count) == sum(k.size for k in kept)
    np.testing.assert_allclose(float(loss), sum(k.sum() for k in kept) / int(count), rtol=1e-6)
    # a row with delay 0 is today's row: the same losses as the batch without a delay
    _, (plain, _) = loss_of(model, {**{k: v for k, v in batch.items() if k != "delay"}})
    _, (zero, _) = loss_of(model, {**batch, "delay": jnp.zeros_like(batch["delay"])})
    np.testing.assert_allclose(float(zero), float(plain), rtol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_sampling_keeps_the_given_prefix_and_a_row_without_one_samples_as_before(family):
    model, batch = model_and_batch(family, 3, rows=3)
    observation = {k: v for k, v in batch.items() if k not in ("actions", "action_is_pad", "noise", "time", "delay")}
    noise = jax.random.normal(jax.random.key(1), batch["actions"].shape)
    given = jax.random.normal(jax.random.key(2), batch["actions"].shape)
    delay = jnp.asarray([0, 1, 3], jnp.int32)
    plain = np.asarray(model.sample_actions(observation, noise, 3))
    kept = np.asarray(model.sample_actions(observation, noise, 3, prefix_actions=given, delay=delay))
    np.testing.assert_allclose(kept[0], plain[0], atol=1e-6)  # delay 0: nothing given
    for b, d in enumerate([0, 1, 3]):
        np.testing.assert_allclose(kept[b, :d], np.asarray(given)[b, :d], atol=1e-5)
    assert np.abs(kept[2, 3:] - plain[2, 3:]).max() > 1e-4  # the rest is conditioned on what was given


@pytest.mark.parametrize("family", FAMILIES)
def test_stage_3_on_8_devices_gives_one_devices_losses(family, tmp_path):
    one, _ = run(overrides(family, 2) + ["mesh.data=1", "zero.stage=0", "zero.schedule=gspmd",
                                         f"train.out_dir={tmp_path / 'one'}"])
    eight, _ = run(overrides(family, 2) + ["zero.stage=3", "train.grad_accum=2", f"train.out_dir={tmp_path / 'eight'}"])
    np.testing.assert_allclose(eight, one, rtol=1e-5)  # each row's delay is its own, wherever it is computed


def test_a_delay_as_long_as_the_chunk_is_refused():
    with pytest.raises(ValueError, match="model.action.train_delay=4 must be smaller than model.action.horizon=4"):
        config.load(overrides=overrides("pi0", 4))


# -- serving a run trained with a delay: the prefix filled from prev_actions, no guidance ------------

@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A π0 run trained with model.action.train_delay=2 (and a tokenizer, for its LeRobot export)."""
    from test_serve import TRAIN

    from zerojax import cli

    out = tmp_path_factory.mktemp("trained") / "run"
    tokenizer = ROOT / "tests" / "fixtures" / "lerobot06" / "tokenizer"  # 276 tokens
    trained = TRAIN + ["model.action.horizon=4", "data.action_horizon=4", "model.action.train_delay=2",
                       f"data.tokenizer={tokenizer}", "model.vocab_size=288"]
    assert cli.main(["train", "--no-progress", *trained, f"train.out_dir={out}", "mesh.data=1", "zero.stage=0",
                     "zero.schedule=gspmd"]) == 0
    return out


@pytest.fixture(scope="module")
def served_trained(trained_run):
    from zerojax import cli
    from zerojax.serve import loaders

    policy = trained_run.parent / "policy.safetensors"
    assert cli.main(["export", str(trained_run), "--out", str(policy)]) == 0
    return loaders.load(policy, num_steps=3)  # an export says how its run was trained (its config)


@pytest.mark.parametrize("fmt", ["lerobot", "openpi"])
def test_lerobot_and_openpi_exports_say_the_run_was_trained_with_a_delay(trained_run, served_trained, fmt, tmp_path):
    """LeRobot 0.6.1's config.json has no field for it (its rtc_config is inference-time
    guidance): the export's zerojax.json records model.action.train_delay, and the export served
    answers a request with a prefix as the run's safetensors export does, the prefix kept."""
    from zerojax import cli
    from zerojax.serve import loaders

    assert cli.main(["export", str(trained_run), "--format", fmt, "--out", str(tmp_path / fmt)]) == 0
    served = loaders.load(tmp_path / fmt, num_steps=3)
    assert served.metadata()["real_time_chunking"] == {"kind": "trained", "max_inference_delay": 2}
    obs = robot_observation(served_trained)
    leftover = served_trained.infer(obs, 4)["actions"][1:]
    asked = {**obs, "prev_actions": leftover, "inference_delay": 2}
    got = served.infer(asked, 3)["actions"]
    np.testing.assert_allclose(got, served_trained.infer(asked, 3)["actions"], atol=1e-5)
    np.testing.assert_allclose(got[:2], leftover[:2], atol=1e-5)


def test_a_trained_run_keeps_the_given_actions_and_refuses_a_longer_delay(served_trained):
    from zerojax.serve.observation import ObservationError

    served, obs = served_trained, robot_observation(served_trained)
    assert served.metadata()["real_time_chunking"] == {"kind": "trained", "max_inference_delay": 2}
    plain = served.infer(obs, 3)["actions"]
    leftover = served.infer(obs, 4)["actions"][1:]  # another chunk, one action of it already done
    for d in (1, 2):
        got = served.infer({**obs, "prev_actions": leftover, "inference_delay": d}, 3)["actions"]
        np.testing.assert_allclose(got[:d], leftover[:d], atol=1e-5)  # in the robot's units
        assert np.abs(got[d:] - plain[d:]).max() > 1e-6  # the rest is conditioned on them
    np.testing.assert_array_equal(served.infer({**obs, "prev_actions": leftover, "inference_delay": 0}, 3)["actions"],
                                  plain)
    with pytest.raises(ObservationError, match=r"'inference_delay'=3 is more than this run was trained to be given "
                                               r"\(model.action.train_delay=2\)"):
        served.infer({**obs, "prev_actions": leftover, "inference_delay": 3}, 3)
