"""models/vocab_loss.py (the loss of a linear head in blocks of tokens and of the vocabulary)
against the whole logits' loss, and schedules/outer.py (the outer unit split by use) on a Llama:
what enter and exit read, and the explicit step gathering the outer unit inside the
train.grad_accum loop."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zerojax import config
from zerojax.analysis import hlo as hlo_lib, measure
from zerojax.models import attention, llama, protocol, vocab_loss
from zerojax.schedules import outer


def _whole(h_BTD, w_DV, fields):
    out = protocol.text_loss(jnp.einsum("btd,dv->btv", h_BTD, w_DV), fields)
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("vocab_dim", [1, 0])  # an untied head's kernel [D, V]; a tied embedding [V, D]
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("V, block, chunk", [(60, 7, 5), (61, 8, 4), (60, 64, 100)])  # 61 prime: one block
def test_the_blockwise_loss_equals_the_whole_logits_loss(vocab_dim, masked, V, block, chunk, monkeypatch):
    monkeypatch.setattr(vocab_loss, "VOCAB_BLOCK", block)
    k = jax.random.split(jax.random.key(0), 4)
    B, T, D = 2, 13, 8  # 26 tokens: chunks of 5 and 4 leave a padded last chunk
    h, w = jax.random.normal(k[0], (B, T, D)), jax.random.normal(k[1], (D, V))
    tokens = jax.random.randint(k[2], (B, T + 1), 0, V)
    fields = protocol.text({"tokens": tokens, "loss_mask": jax.random.bernoulli(k[3], 0.7, (B, T))} if masked
                           else tokens)
    W = w if vocab_dim == 1 else w.T

    def blockwise(h, W):
        out = vocab_loss.linear_text_loss(h, W, fields, chunk, vocab_dim)
        return out[0] if isinstance(out, tuple) else out

    got, got_g = jax.value_and_grad(blockwise, (0, 1))(h, W)
    want, want_g = jax.value_and_grad(lambda h, W: _whole(h, W if vocab_dim == 1 else W.T, fields), (0, 1))(h, W)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(got_g, want_g):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_vocab_blocks_split_evenly():
    assert vocab_loss.vocab_blocks(128256, 8192) == 16  # 8,016 entries each
    assert vocab_loss.vocab_blocks(61, 8) == 61 and vocab_loss.vocab_blocks(60, 64) == 1


@pytest.mark.parametrize("tie", [False, True])
def test_a_llamas_loss_is_its_logits_loss(tie):
    model = llama.Llama(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, rngs=nnx.Rngs(0),
                        spec=attention.Spec("naive"), loss_chunk=7, tie_embeddings=tie)
    tokens = jax.random.randint(jax.random.key(1), (2, 22), 0, 61)
    graphdef, params = nnx.split(model)

    def by_exit(p):
        m = nnx.merge(graphdef, p)
        return m.exit(protocol.apply_stack(m.layers, m.enter(tokens)), tokens)

    def by_logits(p):
        return protocol.text_loss(nnx.merge(graphdef, p).logits(tokens[:, :-1]), protocol.text(tokens))

    (got, got_g), (want, want_g) = (jax.value_and_grad(f)(params) for f in (by_exit, by_logits))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_outer_unit_split_by_use():
    model = llama.Llama(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, rngs=nnx.Rngs(0))
    units = protocol.Units.of(model)
    params = units.outer_of(nnx.split(model)[1].to_pure_dict())
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    tokens = jax.ShapeDtypeStruct((2, 9), jnp.int32)
    front = outer.reads(lambda w, b: units.enter(w, b), shapes, jnp.float32, tokens)
    x = jax.ShapeDtypeStruct((2, 8, 32), jnp.float32)
    back = outer.reads(lambda w, x, b: units.exit(w, x, b), shapes, jnp.float32, x, tokens)
    flat = lambda mask: {"/".join(str(k.key) for k in path) for path, v in jax.tree_util.tree_leaves_with_path(mask)
                         if v}
    assert flat(front) == {"embed_tokens/embedding"}
    assert flat(back) == {"lm_head/kernel", "norm/scale"}
    split = outer.Split(front, back)
    assert flat(split.early) == {"lm_head/kernel", "norm/scale"} and flat(split.late) == {"embed_tokens/embedding"}


def test_the_outer_unit_is_gathered_inside_the_accumulation_loop():
    """Its sources are the same in every microbatch, so XLA would hoist its two gathers out of the
    train.grad_accum loop and hold the gathered unit through the step (`outer.after`)."""
    cfg = config.load(Path(__file__).parents[1] / "configs" / "llama-tiny.yaml", overrides=[
        "model.n_layers=2", "train.grad_accum=2", "train.global_batch=16", "model.seq_len=32", "zero.prefetch=0"])
    _, compiled = measure.compile_step(cfg)
    comm = hlo_lib.collective_bytes(compiled.as_text(), 8)
    assert comm["outside_loops"]["all-gather"] == 0
    # two gathers of the outer unit and two per layer, in each of the two microbatches (with
    # zero.prefetch=1 the forward's first layer, gathered before its loop, is hoisted likewise)
    assert comm["counts"]["all-gather"] == 2 * (2 + 2 * 2)
    # the head's gradient right after the loss, the embedding's at the end, one per layer
    assert comm["counts"]["reduce-scatter"] == 2 * (2 + 2)
