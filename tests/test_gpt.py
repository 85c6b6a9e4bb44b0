"""GPT's own tests: its layout, its logits, and the places where a run names its attributes.
(Only these tests may name GPT's attributes; every other test goes through the protocol.)"""

import math

import jax
from jax.sharding import PartitionSpec as P
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import SMALL, TINY, run
from zerojax import config, train
from zerojax.models import protocol
from zerojax.models.gpt import GPT
from zerojax.models.protocol import Units
from zerojax.precision import make_policy
from zerojax.analysis import measure
from zerojax.parallel import trees
from zerojax.train import state as state_lib

SHAPES = dict(vocab_size=64, d_model=32, n_layers=3, n_heads=4, d_ff=64, seq_len=16)


def model(**kw):
    return GPT(**{**SHAPES, **kw}, rngs=nnx.Rngs(0))


def test_units_and_stacked_blocks():
    m = model(tie_embeddings=False)
    _, blocks = nnx.split(m.blocks)
    shapes = jax.tree.map(jnp.shape, nnx.to_pure_dict(blocks))
    assert shapes["attn"]["qkv"]["kernel"] == (3, 32, 96)  # leading layer axis
    assert shapes["mlp"]["up"]["kernel"] == (3, 32, 64)
    assert m.embed.wte.embedding.shape == (64, 32) and m.head.lm_head.kernel.shape == (32, 64)
    assert model().head.lm_head is None  # tied: the head reads the token embedding
    logits = m.logits(jnp.zeros((2, 16), jnp.int32))
    assert logits.shape == (2, 16, 64) and logits.dtype == jnp.float32


def test_parameter_count():
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model(), nnx.Param)))
    d, f, v, t, layers = 32, 64, 64, 16, 3
    block = (d * 3 * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d) + 4 * d
    assert n == v * d + t * d + layers * block + 2 * d


def test_causal():
    m = model()
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (1, 16)), jnp.int32)
    changed = tokens.at[0, 9].set((tokens[0, 9] + 1) % 64)
    a, b = m.logits(tokens), m.logits(changed)
    np.testing.assert_array_equal(a[0, :9], b[0, :9])  # positions before t see nothing of t
    assert not np.allclose(a[0, 9:], b[0, 9:])


def test_the_protocol_loss_is_the_logits_loss():
    m = model(tie_embeddings=False)
    batch = jnp.asarray(np.random.default_rng(2).integers(0, 64, (2, 17)), jnp.int32)
    units, params = Units.of(m), nnx.to_pure_dict(nnx.state(m, nnx.Param))
    loss, weight = protocol.forward(units, params, batch)
    assert float(weight) == 1.0  # a bare loss
    np.testing.assert_allclose(loss, protocol.cross_entropy(m.logits(batch[:, :-1]), batch[:, 1:]), rtol=1e-6)
    assert units.names == ("blocks",) and set(units.outer_of(params)) == {"embed", "head"}


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_does_not_change_gradients(remat):
    batch = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 17)), jnp.int32)
    m = model()
    units, params = Units.of(m), nnx.to_pure_dict(nnx.state(m, nnx.Param))

    def grads(remat):
        return jax.grad(lambda p: protocol.forward(units, p, batch, remat)[0])(params)

    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads("none"), grads(remat))


def test_bf16_compute_keeps_fp32_master():
    m = model(policy=make_policy("float32", "bfloat16", "auto", "float32", "cpu"))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(m, nnx.Param)))
    logits = m.logits(jnp.zeros((2, 16), jnp.int32))
    assert logits.dtype == jnp.float32 and bool(jnp.isfinite(logits).all())
    ref = model().logits(jnp.zeros((2, 16), jnp.int32))
    np.testing.assert_allclose(logits, ref, atol=0.05)  # bf16 keeps ~3 significant digits


# Runs that name GPT's leaves: the untied head's sharding, a padded embedding, frozen units.


def test_untied_head_in_stage_3(tmp_path):
    common = TINY + SMALL + ["model.tie_embeddings=false"]
    one, _ = run(common + ["mesh.replica=1", "mesh.data=1", "zero.stage=0", f"train.out_dir={tmp_path / 'a'}"])
    three, result = run(common + ["zero.stage=3", f"train.out_dir={tmp_path / 'b'}"])
    np.testing.assert_allclose(three, one, rtol=1e-5)
    assert result.state.params["head"]["lm_head"]["kernel"].sharding.spec == P(None, "data")


def test_padding_is_invisible(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 250, 20_000).astype(np.uint16)
    np.save(tmp_path / "tokens.npy", tokens)
    common = ["model.vocab_size=250", "model.d_model=36", "model.n_heads=2", "model.n_layers=2", "model.d_ff=72",
              "model.seq_len=16", "train.steps=4", "train.log_every=1", "train.eval_every=0", "train.sample_tokens=0",
              f"data.source={tmp_path / 'tokens.npy'}", "train.global_batch=16", "zero.min_shard_size=64"]
    one, _ = run(common + ["mesh.replica=1", "mesh.data=1", "zero.stage=0", f"train.out_dir={tmp_path / 'a'}"])
    three, result = run(common + ["zero.stage=3", f"train.out_dir={tmp_path / 'b'}"])
    np.testing.assert_allclose(three, one, rtol=1e-5)
    setup = train.prepare(config.load(overrides=common + ["zero.stage=3", f"train.out_dir={tmp_path / 'b'}"]))
    wte = setup.engine.plan.leaves["embed"]["wte"]["embedding"]
    assert wte.shape == (250, 36) and wte.stored == (256, 36) and wte.dim == 0
    stored = np.asarray(result.state.params["embed"]["wte"]["embedding"])
    assert stored.shape == (256, 36) and not stored[250:].any()  # pad rows stay zero
    assert measure.count_params(setup.cfg) == sum(math.prod(x.shape) for x in jax.tree.leaves(setup.engine.plan.leaves))


def test_frozen_leaves_keep_their_values_and_have_no_optimizer_state(tmp_path):
    overrides = TINY + SMALL + ["zero.stage=3", "optim.freeze=embed,*/ln1/*", f"train.out_dir={tmp_path}"]
    setup = train.prepare(config.load(overrides=overrides))
    before = jax.device_get(state_lib.init_state(setup.engine).params)
    losses, result = run(overrides)
    assert losses[-1] < losses[0]
    after = jax.device_get(result.state.params)
    for frozen in (lambda p: p["embed"], lambda p: p["blocks"]["ln1"]):
        jax.tree.map(np.testing.assert_array_equal, frozen(after), frozen(before))
    assert not np.array_equal(after["blocks"]["mlp"]["up"]["kernel"], before["blocks"]["mlp"]["up"]["kernel"])
    paths = [trees.path_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(result.state.opt_state)]
    assert not [p for p in paths if "embed/" in p or "/ln1/" in p]
    assert [p for p in paths if p.endswith("mlp/up/kernel")]


