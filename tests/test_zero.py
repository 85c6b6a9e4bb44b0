"""ZeRO stages 0-3 as sharding plans: equal losses, the plan's layouts, padding, freezing, memory."""

import math

import jax
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest
from flax import nnx

from zerojax import config, train
from zerojax.models.protocol import cross_entropy

from conftest import SMALL, TINY, run
from zerojax.analysis import measure
from zerojax.parallel import plan as plan_lib
from zerojax.parallel import trees
from zerojax.train import state as state_lib
from zerojax.train import step as step_lib


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Stage 0 on one device: what every stage and mesh must reproduce."""
    out = tmp_path_factory.mktemp("ref")
    return run(TINY + SMALL + ["mesh.replica=1", "mesh.data=1", "zero.stage=0", f"train.out_dir={out}"])[0]


@pytest.mark.parametrize("extra", [
    ["zero.stage=0"], ["zero.stage=1"], ["zero.stage=2"], ["zero.stage=3"],
    ["zero.stage=3", "mesh.replica=2", "mesh.data=4"],
    ["zero.stage=1", "train.grad_accum=4"],
    ["zero.stage=2", "train.grad_accum=2"],
    ["zero.stage=3", "train.grad_accum=4", "mesh.replica=2", "mesh.data=4"],
], ids=lambda e: " ".join(e))
@pytest.mark.parametrize("schedule", ["shard_map", "gspmd"])
def test_every_stage_matches_one_device(extra, schedule, reference, tmp_path):
    # fp32 throughout; the runs differ only in the order of sums (over devices, microbatches),
    # a few ulps per step that Adam carries along: 1e-5 relative holds over 5 steps.
    losses, _ = run(TINY + SMALL + extra + [f"zero.schedule={schedule}", f"train.out_dir={tmp_path}"])
    np.testing.assert_allclose(losses, reference, rtol=1e-5)


def test_optimizer_equals_plain_optax_adamw(tmp_path):
    overrides = TINY + SMALL + ["mesh.replica=1", "mesh.data=1", "zero.stage=0", "optim.clip_norm=0", "optim.schedule=constant",
                                "optim.warmup_steps=0", "optim.weight_decay=0.1", f"train.out_dir={tmp_path}"]
    setup = train.prepare(config.load(overrides=overrides))
    state = state_lib.init_state(setup.engine)
    step = step_lib.make_train_step(setup.engine)
    batches = [train.global_batch(setup, 0, i) for i in range(3)]

    params = jax.device_get(state.params)
    decays = jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key not in ("bias", "scale"), params)
    adamw = optax.adamw(3e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, mask=decays)
    opt_state = adamw.init(params)
    grad = jax.jit(jax.grad(lambda p, b: cross_entropy(nnx.merge(setup.engine.units.graphdef, p).logits(b[:, :-1]), b[:, 1:])))
    for batch in batches:
        state, _ = step(state, batch)
        updates, opt_state = adamw.update(grad(params, batch), opt_state, params)
        params = optax.apply_updates(params, updates)
    # Two compiled programs round the gradient differently in the last bits. Adam divides by
    # sqrt(v), which turns that into real differences where the true gradient is zero: the
    # attention key bias (softmax ignores a shift of the scores) moves by rounding noise alone,
    # up to ~1e-6 here. A wrong update rule would be off by ~lr = 3e-3 on most elements.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), jax.device_get(state.params), params)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_state_lives_in_the_plans_layout(stage, tmp_path):
    setup = train.prepare(config.load(overrides=TINY + SMALL + [f"zero.stage={stage}", f"train.out_dir={tmp_path}"]))
    plan, n = setup.engine.plan, setup.mesh.shape["data"]
    state = state_lib.init_state(setup.engine)
    step = step_lib.make_train_step(setup.engine)
    batch = train.global_batch(setup, 0, 0)

    def check(state):
        specs = jax.tree.leaves(plan.master_specs, is_leaf=lambda s: isinstance(s, P))
        assert [x.sharding.spec for x in jax.tree.leaves(state.params)] == specs
        params = {trees.path_name(p): x for p, x in jax.tree_util.tree_leaves_with_path(state.params)}
        for x in params.values():
            if x.sharding.spec != P():  # really 1/N of the leaf on each device
                assert x.addressable_shards[0].data.size * n == x.size
        # Every Adam moment (found by its path, not by the code's own mapping) lies like its parameter.
        moments = 0
        for path, x in jax.tree_util.tree_leaves_with_path(state.opt_state):
            name = trees.path_name(path)
            owner = [k for k in params if name.endswith("/" + k) and x.shape == params[k].shape]
            if not owner:
                assert x.ndim == 0, name  # only counts and scalars are not copies of a parameter
                continue
            assert x.sharding.spec == params[owner[0]].sharding.spec, name
            moments += 1
        assert moments == 2 * len(params)  # mu and nu of every parameter
        sharded = [x for x in params.values() if x.sharding.spec != P()]
        assert sum(x.nbytes for x in sharded) > 0.95 * sum(x.nbytes for x in params.values())

    check(state)  # after init
    state, _ = step(state, batch)  # the arrays a real step returns
    check(state)


def test_clipping_uses_the_norm_of_the_whole_gradient(tmp_path):
    common = TINY + SMALL + ["optim.clip_norm=0.01", "train.steps=3"]
    one, a = run(common + ["mesh.replica=1", "mesh.data=1", "zero.stage=0", f"train.out_dir={tmp_path / 'a'}"])
    three, b = run(common + ["zero.stage=3", f"train.out_dir={tmp_path / 'b'}"])
    assert all(line["grad_norm"] > 0.01 for line in b.history)  # clipping was active
    np.testing.assert_allclose(three, one, rtol=1e-5)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-7),
                 jax.device_get(a.state.params), jax.device_get(b.state.params))


def test_the_plan():
    assert plan_lib.choose_dim((4, 128, 384), 8, first=1) == (2, (4, 128, 384))  # largest divisible, not L
    assert plan_lib.choose_dim((8, 36, 100), 8, first=1) == (2, (8, 36, 104))  # pad the largest
    params = {"stack": {"w": jax.ShapeDtypeStruct((8, 16, 24), np.float32),
                        "ln": jax.ShapeDtypeStruct((8, 16), np.float32)},
              "table": jax.ShapeDtypeStruct((250, 64), np.float32)}
    plan = plan_lib.make_plan(params, 3, 8, min_shard_size=200, stacked=("stack",))
    assert plan.leaves["stack"]["w"].dim == 2 and plan.leaves["stack"]["ln"].dim is None  # 16 per layer < 200
    assert plan.leaves["table"].dim == 1 and plan.unsharded_bytes() == 8 * 16 * 4
    assert plan.master_specs["stack"]["w"] == P(None, None, "data")
    stage1 = plan_lib.make_plan(params, 1, 8, 200, ("stack",))
    assert stage1.compute_specs["table"] == P() and stage1.grad_specs["table"] == P(None, "data")
    assert plan_lib.make_plan(params, 2, 8, 200, ("stack",)).accum_specs["table"] == P(None, "data")
    assert stage1.accum_specs["table"] == P()  # ZeRO-1 keeps full gradients


def test_measured_persistent_state_is_the_master_and_moments():
    # What a step keeps between steps is the fp32 master and Adam's m and v (3 x 4 bytes a
    # parameter: split over 8 devices from stage 1 on, small leaves whole), this device's rows
    # of the batch, and a few scalar counters; no 2-byte copy of the weights or the gradients.
    cfg = config.load(overrides=["train.global_batch=32"])
    doc = measure.analyze(cfg)
    rows = doc["plan"]  # stage 3's, the last analyzed: the master layout of stages 1-3
    sharded = 3 * sum(r["master_bytes_per_device"] for r in rows)
    whole = 3 * sum(math.prod(r["stored"]) * 4 for r in rows)
    batch = 32 * (cfg.model.seq_len + 1) * 4 // 8
    for stage, m in doc["stages"].items():
        extra = m["argument_bytes"] - (whole if stage == "0" else sharded) - batch
        assert 0 <= extra <= 64, (stage, m["argument_bytes"], extra)  # step, Adam's count, loss scale
        assert m["argument_bytes"] <= m["formula_bytes"]  # within the paper's bill, which counts 2-byte copies
    ratio = doc["stages"]["0"]["argument_bytes"] / doc["stages"]["3"]["argument_bytes"]
    assert ratio >= 0.8 * doc["devices"], ratio
