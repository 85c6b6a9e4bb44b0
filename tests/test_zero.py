"""ZeRO stages 0-3 as sharding plans: equal losses, the plan's layouts, padding, freezing, memory."""

import math

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from zerojax import accounting, config, sharding, train
from zerojax.models import cross_entropy

# 32 rows: divisible by 8 devices x grad_accum 4. min_shard_size 64 shards nearly every leaf.
SMALL = ["train.global_batch=32", "zero.min_shard_size=64"]


def run(overrides):
    result = train.run(config.load(overrides=overrides), show_progress=False)
    return np.array([line["loss"] for line in result["history"]]), result


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Stage 0 on one device: what every stage and mesh must reproduce."""
    out = tmp_path_factory.mktemp("ref")
    return run(TINY + SMALL + ["mesh.data=1", "zero.stage=0", f"train.out_dir={out}"])[0]


TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64", "model.seq_len=16",
        "train.steps=5", "train.log_every=1", "train.eval_every=0", "train.ckpt_every=0"]


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


def test_untied_head_in_stage_3(tmp_path):
    common = TINY + SMALL + ["model.tie_embeddings=false"]
    one, _ = run(common + ["mesh.data=1", "zero.stage=0", f"train.out_dir={tmp_path / 'a'}"])
    three, result = run(common + ["zero.stage=3", f"train.out_dir={tmp_path / 'b'}"])
    np.testing.assert_allclose(three, one, rtol=1e-5)
    assert result["state"].params["head"]["lm_head"]["kernel"].sharding.spec == sharding.P(None, "data")


def test_optimizer_equals_plain_optax_adamw(tmp_path):
    overrides = TINY + SMALL + ["mesh.data=1", "zero.stage=0", "optim.clip_norm=0", "optim.schedule=constant",
                                "optim.warmup_steps=0", "optim.weight_decay=0.1", f"train.out_dir={tmp_path}"]
    setup = train.prepare(config.load(overrides=overrides))
    state = train.init_state(setup)
    step = train.make_train_step(setup)
    batches = [train.global_batch(setup, setup.corpus.train, 0, i) for i in range(3)]

    params = jax.device_get(state.params)
    decays = jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key not in ("bias", "scale"), params)
    adamw = optax.adamw(3e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, mask=decays)
    opt_state = adamw.init(params)
    grad = jax.jit(jax.grad(lambda p, b: cross_entropy(nnx.merge(setup.graphdef, p)(b[:, :-1]), b[:, 1:])))
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
    plan, n = setup.plan, setup.mesh.shape["data"]
    state = train.init_state(setup)
    step = train.make_train_step(setup)
    batch = train.global_batch(setup, setup.corpus.train, 0, 0)
    compiled_out = step.lower(state, batch).compile().output_shardings[0]

    def check(state):
        opt_specs = sharding.state_specs(state.opt_state, plan, True)
        for x, spec in zip(jax.tree.leaves((state.params, state.opt_state)), jax.tree.leaves(
                (plan.master_specs, opt_specs), is_leaf=lambda s: isinstance(s, sharding.P))):
            assert x.sharding.spec == spec
            if spec != sharding.P():  # really 1/N of the leaf on each device
                assert x.addressable_shards[0].data.size * n == x.size
        sharded = [x for x in jax.tree.leaves(state.params) if x.sharding.spec != sharding.P()]
        assert sum(x.nbytes for x in sharded) > 0.95 * sum(x.nbytes for x in jax.tree.leaves(state.params))

    check(state)  # after init
    mu = jax.tree.leaves(compiled_out.opt_state)  # under jit: the step's declared outputs
    assert [s.spec for s in jax.tree.leaves(compiled_out.params)] == jax.tree.leaves(
        plan.master_specs, is_leaf=lambda s: isinstance(s, sharding.P))
    assert len(mu) == len(jax.tree.leaves(state.opt_state))
    state, _ = step(state, batch)
    check(state)  # after a step


def test_clipping_uses_the_norm_of_the_whole_gradient(tmp_path):
    common = TINY + SMALL + ["optim.clip_norm=0.01", "train.steps=3"]
    one, a = run(common + ["mesh.data=1", "zero.stage=0", f"train.out_dir={tmp_path / 'a'}"])
    three, b = run(common + ["zero.stage=3", f"train.out_dir={tmp_path / 'b'}"])
    assert all(line["grad_norm"] > 0.01 for line in b["history"])  # clipping was active
    np.testing.assert_allclose(three, one, rtol=1e-5)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-7),
                 jax.device_get(a["state"].params), jax.device_get(b["state"].params))


def test_padding_is_invisible(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 250, 20_000).astype(np.uint16)
    np.save(tmp_path / "tokens.npy", tokens)
    common = ["model.vocab_size=250", "model.d_model=36", "model.n_heads=2", "model.n_layers=2", "model.d_ff=72",
              "model.seq_len=16", "train.steps=4", "train.log_every=1", "train.eval_every=0",
              f"data.source={tmp_path / 'tokens.npy'}", "train.global_batch=16", "zero.min_shard_size=64"]
    one, _ = run(common + ["mesh.data=1", "zero.stage=0", f"train.out_dir={tmp_path / 'a'}"])
    three, result = run(common + ["zero.stage=3", f"train.out_dir={tmp_path / 'b'}"])
    np.testing.assert_allclose(three, one, rtol=1e-5)
    setup = train.prepare(config.load(overrides=common + ["zero.stage=3"]))
    wte = setup.plan.leaves["embed"]["wte"]["embedding"]
    assert wte.shape == (250, 36) and wte.stored == (256, 36) and wte.dim == 0
    stored = np.asarray(result["state"].params["embed"]["wte"]["embedding"])
    assert stored.shape == (256, 36) and not stored[250:].any()  # pad rows stay zero
    assert accounting.count_params(setup.cfg) == sum(math.prod(x.shape) for x in jax.tree.leaves(setup.plan.leaves))


def test_frozen_leaves_keep_their_values_and_have_no_optimizer_state(tmp_path):
    overrides = TINY + SMALL + ["zero.stage=3", "optim.freeze=embed,*/ln1/*", f"train.out_dir={tmp_path}"]
    setup = train.prepare(config.load(overrides=overrides))
    before = jax.device_get(train.init_state(setup).params)
    losses, result = run(overrides)
    assert losses[-1] < losses[0]
    after = jax.device_get(result["state"].params)
    for frozen in (lambda p: p["embed"], lambda p: p["blocks"]["ln1"]):
        jax.tree.map(np.testing.assert_array_equal, frozen(after), frozen(before))
    assert not np.array_equal(after["blocks"]["mlp"]["up"]["kernel"], before["blocks"]["mlp"]["up"]["kernel"])
    paths = [sharding.path_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(result["state"].opt_state)]
    assert not [p for p in paths if "embed/" in p or "/ln1/" in p]
    assert [p for p in paths if p.endswith("mlp/up/kernel")]


def test_the_plan():
    assert sharding.choose_dim((4, 128, 384), 8, first=1) == (2, (4, 128, 384))  # largest divisible, not L
    assert sharding.choose_dim((8, 36, 100), 8, first=1) == (2, (8, 36, 104))  # pad the largest
    params = {"blocks": {"w": jax.ShapeDtypeStruct((8, 16, 24), np.float32),
                         "ln": jax.ShapeDtypeStruct((8, 16), np.float32)},
              "embed": jax.ShapeDtypeStruct((250, 64), np.float32)}
    plan = sharding.make_plan(params, 3, 8, min_shard_size=200, stacked=("blocks",))
    assert plan.leaves["blocks"]["w"].dim == 2 and plan.leaves["blocks"]["ln"].dim is None  # 16 per layer < 200
    assert plan.leaves["embed"].dim == 1 and plan.unsharded_bytes() == 8 * 16 * 4
    assert plan.master_specs["blocks"]["w"] == sharding.P(None, None, "data")
    stage1 = sharding.make_plan(params, 1, 8, 200, ("blocks",))
    assert stage1.compute_specs["embed"] == sharding.P() and stage1.grad_specs["embed"] == sharding.P(None, "data")
    assert sharding.make_plan(params, 2, 8, 200, ("blocks",)).accum_specs["embed"] == sharding.P(None, "data")
    assert stage1.accum_specs["embed"] == sharding.P()  # ZeRO-1 keeps full gradients


def test_measured_persistent_state_is_within_the_formulas():
    cfg = config.load(overrides=["train.global_batch=32"])
    doc = accounting.analyze(cfg)
    n = doc["devices"]
    for stage, m in doc["stages"].items():
        assert 0 < m["argument_bytes"] <= m["formula_bytes"], (stage, m)
    ratio = doc["stages"]["0"]["argument_bytes"] / doc["stages"]["3"]["argument_bytes"]
    assert ratio >= 0.8 * n, ratio
