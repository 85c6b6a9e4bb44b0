"""openpi checkpoints in and out (`model.init_from=DIR`, `zerojax export --format openpi`) for π0
and π0.5: a run's export reads back to the same parameters and losses; a tree written here by
hand with openpi's names and shapes (from openpi's `gemma.py`, `siglip.py`, `pi0.py`), every leaf
of distinct values, lands each element where openpi's einsums use it; bad directories are refused
with one line before anything compiles."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from conftest import ROOT, run
from zerojax import cli
from zerojax.interop import openpi
from zerojax.train.export import export, load_model

DATASET = ROOT / "tests" / "fixtures" / "lerobot" / "tiny"
SIZES = ["model.norm_eps=1e-6", "model.vocab_size=256", "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1",
         "model.head_dim=8", "model.d_ff=32", "model.expert.d_model=16", "model.expert.d_ff=24",
         "model.vision.image_size=8", "model.vision.patch_size=4", "model.vision.d_model=16",
         "model.vision.n_layers=1", "model.vision.n_heads=2", "model.vision.d_ff=32", "model.action.horizon=2",
         "model.action.prompt_len=64", "model.action.max_state_dim=8", "model.action.max_action_dim=4",
         "model.action.action_dim=2", "model.action.cameras=2", "data.image_size=8", "data.action_horizon=2",
         "data.prompt_len=64", f"data.source=lerobot:{DATASET}", "train.global_batch=8", "zero.min_shard_size=64", "train.steps=1",
         "train.log_every=1", "train.eval_every=0", "train.sample_tokens=0", "optim.warmup_steps=0", "model.remat=none"]
GIVEN = {"action": {"horizon": 2, "prompt_len": 64, "max_state_dim": 8, "action_dim": 2, "cameras": 2}}


def params_of(model) -> dict:
    return {"/".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def batch_of(cfg, family: str, seed: int = 0):
    """A random batch, noise and time of the model's shapes."""
    a, B = cfg.action, 2
    rng = np.random.default_rng(seed)
    batch = {"images": rng.standard_normal((B, a.cameras, 3, cfg.vision.image_size, cfg.vision.image_size)),
             "image_masks": np.array([[True, True], [True, False]]),
             "tokens": rng.integers(0, cfg.vocab_size, (B, a.prompt_len)), "token_mask": np.arange(a.prompt_len) < 40,
             "actions": rng.standard_normal((B, a.horizon, a.max_action_dim))}
    batch["token_mask"] = np.broadcast_to(batch["token_mask"], (B, a.prompt_len))
    if family == "pi0":
        batch["state"] = rng.standard_normal((B, a.max_state_dim))
    batch = {k: jnp.asarray(v, jnp.float32 if v.dtype == np.float64 else None) for k, v in batch.items()}
    noise = jnp.asarray(rng.standard_normal((B, a.horizon, a.max_action_dim)), jnp.float32)
    return batch, noise, jnp.asarray([0.3, 0.8], jnp.float32)


@pytest.fixture(scope="module", params=["pi0", "pi05"])
def exported(request, tmp_path_factory):
    """(family, run dir, its openpi export) of a one-step run on the tiny LeRobot dataset."""
    family, tmp = request.param, tmp_path_factory.mktemp(request.param)
    norm = ["data.norm_state=quantiles", "data.norm_action=quantiles"] if family == "pi05" else []
    run([f"model.family={family}", *SIZES, *norm, f"train.out_dir={tmp / 'run'}"])
    export(tmp / "run", tmp / "openpi", fmt="openpi")
    return family, tmp / "run", tmp / "openpi"


def test_an_export_reads_back_to_the_same_parameters_and_losses(exported):
    family, run_dir, out = exported
    _, _, trained = load_model(run_dir)
    cfg, loaded = openpi.load(out, GIVEN)
    assert cfg.family == family and (cfg.expert.d_model, cfg.vision.n_heads, cfg.action.max_action_dim) == (16, 2, 4)
    want, have = params_of(trained), params_of(loaded)
    assert want.keys() == have.keys()
    for path in want:
        np.testing.assert_array_equal(have[path], want[path], err_msg=path)
    batch, noise, time = batch_of(cfg, family)
    np.testing.assert_array_equal(loaded.flow_loss(batch, noise, time), trained.flow_loss(batch, noise, time))


def test_the_assets_hold_the_datasets_statistics(exported):
    """assets/<dataset>/norm_stats.json as openpi's normalize.save writes it: the run's modes'
    statistics, mean and std (which openpi's NormStats requires) from the dataset beside them."""
    family, run_dir, out = exported
    record = json.loads((run_dir / "lerobot.json").read_text())["normalization"]
    stats = json.loads((out / "assets" / "tiny" / "norm_stats.json").read_text())["norm_stats"]
    dataset = json.loads((DATASET / "meta" / "stats.json").read_text())
    assert set(stats) == {"state", "actions"}
    for key, feature in (("state", "observation.state"), ("actions", "action")):
        kept = {s for s in record[feature] if s != "mode"}
        for stat in {"mean", "std", "q01", "q99"}:
            want = record[feature][stat] if stat in kept else dataset[feature][stat]
            np.testing.assert_allclose(stats[key][stat], want, rtol=1e-6, err_msg=f"{key}.{stat}")
    read = openpi.norm_stats(out)
    np.testing.assert_allclose(read["action"]["q99"], stats["actions"]["q99"])


@pytest.mark.parametrize("exported", ["pi0"], indirect=True)  # one family: the reading path is the same
def test_a_run_from_an_export_starts_where_it_ended_and_keeps_its_assets(exported, tmp_path):
    """model.init_from=DIR through the CLI's config: the model keys from the tree, the weights in
    the run's first checkpoint (a 0-lr step), assets/ kept in RUN_DIR/openpi_init/."""
    family, run_dir, out = exported
    sizes = [s for s in SIZES if not s.startswith(("model.norm_eps", "model.vocab", "model.d_", "model.n_", "model.head", "model.exp",
                                                   "model.vision.", "model.action.max_a"))]
    run([f"model.init_from={out}", *sizes, "optim.lr=0", "optim.weight_decay=0", f"train.out_dir={tmp_path / 'again'}"])
    _, _, before = load_model(run_dir)
    saved, _, after = load_model(tmp_path / "again")
    assert saved["model"]["family"] == "pi0" and saved["model"]["expert"]["d_model"] == 16
    for path, value in params_of(before).items():
        np.testing.assert_array_equal(params_of(after)[path], value, err_msg=path)
    kept = tmp_path / "again" / "openpi_init" / "assets" / "tiny" / "norm_stats.json"
    assert kept.read_bytes() == (out / "assets" / "tiny" / "norm_stats.json").read_bytes()
