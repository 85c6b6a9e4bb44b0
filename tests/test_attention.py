"""models/attention.py and protocol.chunked_text_loss: the blockwise attention against the naive
reference (forward and gradients, every mask kind, odd lengths, blocks that do not divide the
keys), the mask descriptors against the families' reference masks, the chunked loss against the
whole one, and the compiled temporaries growing linearly with the sequence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zerojax.errors import ConfigError
from zerojax.models import attention, llama, protocol
from zerojax.models.vla.layers import make_att_2d_masks

B, T, H, G, K = 2, 13, 4, 2, 8  # T odd; G < H: grouped-query


def _mask(kind: str):
    if kind == "causal":
        return attention.causal(T), T
    if kind == "none":
        return None, T
    if kind == "prefix_segments":  # two packed examples, each opening with a prefix, then padding
        prefix = jnp.array([[1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0], [1] * 4 + [0] * 9], bool)
        seg = jnp.array([[1] * 5 + [2] * 6 + [0] * 2, [1] * 13])
        return attention.of_structure({"prefix": prefix, "segment_ids": seg}, T), T
    if kind == "pi0_blocks":  # padding inside the prefix (a missing camera) and a fully padded row end
        pad = jnp.array([[1] * 10 + [0] * 3, [1] * 5 + [0] * 2 + [1] * 6], bool)
        ar = jnp.array([[0] * 8 + [1, 1, 0, 0, 0]] * 2)
        return attention.blocks(pad, ar), T
    if kind == "decoding":  # 3 new tokens at positions 4..6 over a cache of 13 slots
        return attention.cached(jnp.broadcast_to(jnp.arange(4, 7), (B, 3)), T), 3
    raise ValueError(kind)


def _inputs(n_queries: int):
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(kq, (B, n_queries, H, K)), jax.random.normal(kk, (B, T, G, K)),
            jax.random.normal(kv, (B, T, G, K)))


@pytest.mark.parametrize("kind", ["causal", "none", "prefix_segments", "pi0_blocks", "decoding"])
@pytest.mark.parametrize("block", [4, 5, 16])  # 4 and 5 do not divide 13; 16 is one padded block
def test_blockwise_equals_naive_forward_and_gradients(kind, block):
    mask, n_queries = _mask(kind)
    q, k, v = _inputs(n_queries)
    weights = jax.random.normal(jax.random.key(1), (B, n_queries, H, K))  # a loss that reads every output

    def loss(q, k, v, impl):
        return (attention.attend(q, k, v, mask, attention.Spec(impl, block)) * weights).sum()

    np.testing.assert_allclose(attention.attend(q, k, v, mask, attention.Spec("blockwise", block)),
                               attention.attend(q, k, v, mask, attention.Spec("naive", block)), rtol=1e-5, atol=1e-5)
    for got, want in zip(jax.grad(loss, (0, 1, 2))(q, k, v, "blockwise"), jax.grad(loss, (0, 1, 2))(q, k, v, "naive")):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_descriptors_give_the_families_reference_masks():
    # protocol.attention_mask (the language families' first mask): a prefix run per segment
    seg = jnp.array([[1, 1, 1, 2, 2, 0]])
    prefix = jnp.array([[True, True, False, True, False, False]])
    structure = {"segment_ids": seg, "prefix": prefix}
    np.testing.assert_array_equal(attention.dense(attention.of_structure(structure, 6)),
                                  protocol.attention_mask(structure, 6))
    np.testing.assert_array_equal(attention.dense(attention.causal(5))[0], np.tril(np.ones((5, 5), bool)))
    # π0's: big_vision's make_att_2d_masks
    pad = jnp.array([[1, 1, 0, 1, 1, 1, 1]], bool)
    ar = jnp.array([[0, 0, 0, 0, 1, 1, 0]])
    np.testing.assert_array_equal(attention.dense(attention.blocks(pad, ar)), make_att_2d_masks(pad, ar))


def test_auto_is_the_dense_code_for_short_rows_and_cudnn_is_refused_off_gpu():
    jaxpr = lambda S, impl: str(jax.make_jaxpr(lambda *a: attention.attend(*a, attention.causal(S),
                                                                          attention.Spec(impl, 64)))(
        jnp.zeros((1, S, 2, 8)), jnp.zeros((1, S, 2, 8)), jnp.zeros((1, S, 2, 8))))
    assert "custom_vjp_call" not in jaxpr(attention.DENSE_KEYS, "auto")
    assert "custom_vjp_call" in jaxpr(attention.DENSE_KEYS, "blockwise")
    assert "custom_vjp_call" in jaxpr(attention.DENSE_KEYS + 1, "auto")
    if jax.default_backend() != "gpu":
        class Cfg:
            attention, attention_block = "cudnn", 512
        with pytest.raises(ConfigError, match="model.attention=cudnn needs a GPU"):
            attention.spec_of(Cfg)


def _tiny_llama(spec, loss_chunk=1024, vocab=61, tie=False):
    return llama.Llama(vocab_size=vocab, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
                       rngs=nnx.Rngs(0), spec=spec, loss_chunk=loss_chunk, tie_embeddings=tie)


def _loss_and_grads(model, batch):
    graphdef, params = nnx.split(model)
    loss = lambda p: protocol.as_loss_and_weight(
        nnx.merge(graphdef, p).exit(protocol.apply_stack(nnx.merge(graphdef, p).layers,
                                                         nnx.merge(graphdef, p).enter(batch)), batch))[0]
    return jax.value_and_grad(loss)(params)


def _packed_batch(T_in=21):
    tokens = jax.random.randint(jax.random.key(2), (2, T_in + 1), 0, 61)
    seg = jnp.array([[1] * 9 + [2] * 12, [1] * 21])
    positions = jnp.concatenate([jnp.arange(9), jnp.arange(12)])[None].repeat(2, 0).at[1].set(jnp.arange(21))
    prefix = jnp.array([[1] * 3 + [0] * 6 + [1] * 2 + [0] * 10, [1] * 5 + [0] * 16], bool)
    loss_mask = ~prefix
    return {"tokens": tokens, "segment_ids": seg, "positions": positions, "prefix": prefix, "loss_mask": loss_mask}


def test_a_model_with_blockwise_attention_equals_naive():
    batch = _packed_batch()
    (want, want_g), (got, got_g) = (_loss_and_grads(_tiny_llama(attention.Spec(impl, 4)), batch)
                                    for impl in ("naive", "blockwise"))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("masked, tie", [(False, False), (True, False), (True, True)])
def test_the_chunked_loss_equals_the_whole_one(masked, tie):
    batch = _packed_batch()
    if not masked:
        batch = batch["tokens"]
    whole, whole_g = _loss_and_grads(_tiny_llama(attention.Spec("naive"), 10_000, tie=tie), batch)
    chunked, chunked_g = _loss_and_grads(_tiny_llama(attention.Spec("naive"), 5, tie=tie), batch)  # 42 = 8·5 + 2
    np.testing.assert_allclose(chunked, whole, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(chunked_g), jax.tree.leaves(whole_g)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _temp_bytes(spec, T_in: int, loss_chunk: int) -> int:
    """The compiled temporaries of a tiny Llama's loss and gradient at sequence T_in (as
    `zerojax analyze` reads them: memory_analysis of the compiled step)."""
    model = _tiny_llama(spec, loss_chunk, vocab=512)
    graphdef, params = nnx.split(model)
    tokens = jax.ShapeDtypeStruct((1, T_in + 1), jnp.int32)

    def step(p, tokens):
        return jax.grad(lambda p: protocol.as_loss_and_weight(
            nnx.merge(graphdef, p).exit(protocol.apply_stack(nnx.merge(graphdef, p).layers,
                                                             nnx.merge(graphdef, p).enter(tokens)), tokens))[0])(p)

    compiled = jax.jit(step).lower(params, tokens).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_the_compiled_temporaries_grow_linearly_with_the_sequence():
    new = [_temp_bytes(attention.Spec("blockwise", 64), T_in, 128) for T_in in (512, 2048)]
    old = [_temp_bytes(attention.Spec("naive"), T_in, 10**6) for T_in in (512, 2048)]
    assert new[1] / new[0] <= 5.0, new  # 4x the tokens: linear is 4x
    assert old[1] / old[0] >= 8.0, old  # the control: dense scores and whole logits grow faster
