import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zerojax.models import GPT
from zerojax.precision import make_policy

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
    logits = m(jnp.zeros((2, 16), jnp.int32))
    assert logits.shape == (2, 16, 64) and logits.dtype == jnp.float32


def test_parameter_count():
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model(), nnx.Param)))
    d, f, v, t, layers = 32, 64, 64, 16, 3
    block = (d * 3 * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d) + 4 * d
    assert n == v * d + t * d + layers * block + 2 * d


@pytest.mark.parametrize("remat", ["none", "full", "dots"])
def test_causal(remat):
    m = model(remat=remat)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (1, 16)), jnp.int32)
    changed = tokens.at[0, 9].set((tokens[0, 9] + 1) % 64)
    a, b = m(tokens), m(changed)
    np.testing.assert_array_equal(a[0, :9], b[0, :9])  # positions before t see nothing of t
    assert not np.allclose(a[0, 9:], b[0, 9:])


def test_remat_does_not_change_gradients():
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 16)), jnp.int32)

    def grads(remat):
        graphdef, params = nnx.split(model(remat=remat))
        return jax.grad(lambda p: nnx.merge(graphdef, p)(tokens).mean())(params)

    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grads("none"), grads("full"))


def test_bf16_compute_keeps_fp32_master():
    m = model(policy=make_policy("float32", "bfloat16", "auto", "float32", "cpu"))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(m, nnx.Param)))
    logits = m(jnp.zeros((2, 16), jnp.int32))
    assert logits.dtype == jnp.float32 and bool(jnp.isfinite(logits).all())
    ref = model()(jnp.zeros((2, 16), jnp.int32))
    np.testing.assert_allclose(logits, ref, atol=0.05)  # bf16 keeps ~3 significant digits
