import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zerojax import config, train
from zerojax.train import state as state_lib
from zerojax.train import step as step_lib
from zerojax.train.metrics import kept_metrics, write_line


def losses(overrides, **kw):
    result = train.run(config.load(overrides=overrides), show_progress=False, **kw)
    return np.array([line["loss"] for line in result.history]), result


def test_stage0_on_8_devices_equals_1_device(tiny_overrides):
    # fp32: the only difference is the order of the cross-device sums (a few ulps per step).
    one, _ = losses(tiny_overrides + ["mesh.replica=1", "mesh.data=1", "zero.stage=0"])
    eight, result = losses(tiny_overrides + ["mesh.data=8", "zero.stage=0"])
    assert len(one) == 5
    np.testing.assert_allclose(eight, one, rtol=1e-5)
    params = result.state.params
    assert all(len(x.sharding.device_set) == 8 and x.sharding.is_fully_replicated for x in jax.tree.leaves(params))


def test_hybrid_mesh_and_grad_accum_equal_the_plain_step(tiny_overrides):
    plain, _ = losses(tiny_overrides + ["mesh.data=8"])
    hybrid, _ = losses(tiny_overrides + ["mesh.replica=2", "mesh.data=4", "train.grad_accum=2"])
    np.testing.assert_allclose(hybrid, plain, rtol=1e-5)


def test_a_short_run_learns_and_writes_the_run_directory(tiny_overrides, tmp_path):
    overrides = tiny_overrides + ["train.steps=60", "train.log_every=10", "train.eval_every=30",
                                  "optim.warmup_steps=5", "train.sample_tokens=200"]
    curve, result = losses(overrides)
    assert curve[-1] < curve[0], curve
    run = tmp_path / "run"
    assert (run / "config.yaml").is_file() and (run / "sample.txt").read_text() == result.sample
    assert config.load(run / "config.yaml").train.steps == 60
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [10, 20, 30, 40, 50, 60]
    assert set(lines[0]) == {"step", "loss", "grad_norm", "lr", "loss_scale", "skipped", "tokens_per_sec"}
    assert "eval_loss" in lines[2] and "eval_loss" in lines[5] and "eval_loss" not in lines[3]
    assert lines[-1]["eval_loss"] < 3.5, lines  # ln 256 = 5.55 nats at the start
    assert all(a["lr"] > b["lr"] for a, b in zip(lines, lines[1:]))  # cosine after the warmup
    assert result.sample.startswith("def ") and len(result.sample.encode("utf-8", "replace")) >= 200


def test_non_finite_gradients_skip_the_update(tiny_overrides):
    setup = train.prepare(config.load(overrides=tiny_overrides))
    state = state_lib.init_state(setup.engine)
    poisoned = state._replace(params=jax.tree.map(lambda x: x.at[..., 0].set(jnp.inf) if x.ndim == 3 else x, state.params))
    before = jax.device_get(poisoned)
    batch = train.global_batch(setup, 0, 0)
    after, metrics = step_lib.make_train_step(setup.engine)(poisoned, batch)
    assert bool(metrics["skipped"]) and int(after.skipped) == 1 and int(after.step) == 0
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), jax.device_get(after.params), before.params)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), jax.device_get(after.opt_state), before.opt_state)


def test_schedule_warms_up_then_decays_to_a_tenth():
    from zerojax.optim import make_schedule

    sched = make_schedule(config.OptimConfig(lr=1e-3, warmup_steps=10), total_steps=110)
    assert float(sched(0)) == 0.0 and float(sched(5)) == pytest.approx(5e-4)
    assert float(sched(10)) == pytest.approx(1e-3) and float(sched(110)) == pytest.approx(1e-4)
    flat = make_schedule(config.OptimConfig(lr=1e-3, warmup_steps=0, schedule="constant"), 50)
    assert float(flat(0)) == float(flat(49)) == pytest.approx(1e-3)


def test_weight_decay_spares_norms_and_biases():
    from zerojax.optim import decay_mask

    mask = decay_mask({"stack": {"norm": {"scale": 0, "bias": 0}, "mlp": {"up": {"kernel": 0, "bias": 0}}},
                       "table": {"embedding": 0}})
    assert mask == {"stack": {"norm": {"scale": False, "bias": False}, "mlp": {"up": {"kernel": True, "bias": False}}},
                    "table": {"embedding": True}}


@pytest.mark.parametrize("mask, decayed", [("matrices", {"kernel"}), ("all", {"kernel", "scale", "bias"})])
def test_the_decay_mask_names_what_weight_decay_shrinks(mask, decayed):
    """With no gradient, one AdamW step shrinks exactly the leaves optim.decay_mask names by
    lr * weight_decay: matrices only (the default), or every parameter (LeRobot's and openpi's)."""
    import jax.numpy as jnp
    from zerojax.optim import make_optimizer

    cfg = config.OptimConfig(lr=0.1, weight_decay=0.5, warmup_steps=0, schedule="constant", decay_mask=mask)
    params = {"norm": {"scale": jnp.ones(3)}, "up": {"kernel": jnp.ones((3, 3)), "bias": jnp.ones(3)}}
    opt = make_optimizer(cfg, 10)
    updates, _ = opt.update(jax.tree.map(jnp.zeros_like, params), opt.init(params), params)
    shrunk = {path[-1].key for path, u in jax.tree_util.tree_leaves_with_path(updates) if bool(jnp.all(u < 0))}
    assert shrunk == decayed
    for path, u in jax.tree_util.tree_leaves_with_path(updates):
        assert jnp.allclose(u, -0.05 if path[-1].key in decayed else 0.0)


@pytest.mark.parametrize("override, message", [
    ("mesh.data=16", "needs 16 devices but only 8 cpu devices exist"),
    ("train.global_batch=12", "must be divisible by the data-parallel size"),
])
def test_prepare_checks_what_needs_the_mesh(tiny_overrides, override, message):
    with pytest.raises(ValueError, match=message):
        train.prepare(config.load(overrides=tiny_overrides + [override]))


def test_a_vocabulary_larger_than_the_corpus_is_fine(tiny_overrides):
    train.prepare(config.load(overrides=tiny_overrides + ["model.vocab_size=300"]))  # 256 bytes need <= 300


def test_a_metrics_line_cut_short_by_a_kill_is_dropped_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n\n{"step": 3}\n{"step": 4, "lo')  # killed while writing step 4
    assert kept_metrics(path, 2) == ['{"step": 1}', '{"step": 2}']
    assert kept_metrics(path, 3) == ['{"step": 1}', '{"step": 2}', '{"step": 3}']
    path.write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')  # not the last line: not a kill's doing
    with pytest.raises(config.ConfigError, match="line 2: .* is not a metrics line"):
        kept_metrics(path, 3)


def test_a_non_finite_metric_is_written_as_json_null(tmp_path):
    """NaN and Infinity are not JSON: a strict reader (jq, JavaScript's JSON.parse) refuses them."""
    path = tmp_path / "metrics.jsonl"
    with path.open("w") as log:
        write_line(log, {"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "lr": 0.5, "skipped": True})

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    assert json.loads(path.read_text(), parse_constant=refuse) == {"step": 1, "loss": None, "grad_norm": None,
                                                                   "lr": 0.5, "skipped": True}
