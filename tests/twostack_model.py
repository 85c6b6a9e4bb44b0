"""A model written only against the unit protocol, as a user outside zerojax would write it.

Two stacks run in order (`tower`: residual MLP blocks, then `decoder`: causal attention blocks),
glued by a projection that reads an outer parameter; the outer unit (`tok`, `bridge`, `final`,
`readout`) has no `embed` or `head`; the read-out is untied; and the loss is masked (targets
that are spaces do not count), so rows weigh differently and `exit` returns (loss, weight).
"""

import jax
import jax.numpy as jnp
from flax import nnx

IGNORED = ord(" ")  # targets that carry no loss


def dense(d_in, d_out, rngs, policy):
    return nnx.Linear(d_in, d_out, dtype=policy.compute, param_dtype=policy.param,
                      kernel_init=nnx.initializers.normal(0.05), rngs=rngs)


class TowerBlock(nnx.Module):
    def __init__(self, d, rngs, policy):
        self.norm = nnx.LayerNorm(d, dtype=policy.compute, param_dtype=policy.param, rngs=rngs)
        self.up = dense(d, 2 * d, rngs, policy)
        self.down = dense(2 * d, d, rngs, policy)

    def __call__(self, x):
        return x + self.down(jax.nn.relu(self.up(self.norm(x))))


class DecoderBlock(nnx.Module):
    def __init__(self, d, rngs, policy):
        self.norm = nnx.LayerNorm(d, dtype=policy.compute, param_dtype=policy.param, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=d, dtype=policy.compute,
                                           param_dtype=policy.param, decode=False, rngs=rngs)

    def __call__(self, x):
        T = x.shape[1]
        return x + self.attn(self.norm(x), mask=jnp.tril(jnp.ones((1, 1, T, T), bool)))


def stack(block, n, d, rngs, policy):
    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return block(d, rngs, policy)

    return make(rngs)


class TwoStacks(nnx.Module):
    STACKED = ("tower", "decoder")

    def __init__(self, vocab, d, n_tower, n_decoder, policy, rngs):
        self.tok = nnx.Embed(vocab, d, dtype=policy.compute, param_dtype=policy.param, rngs=rngs)
        self.tower = stack(TowerBlock, n_tower, d, rngs, policy)
        self.bridge = dense(d, d, rngs, policy)
        self.decoder = stack(DecoderBlock, n_decoder, d, rngs, policy)
        self.final = nnx.LayerNorm(d, dtype=policy.compute, param_dtype=policy.param, rngs=rngs)
        self.readout = dense(d, vocab, rngs, policy)

    def enter(self, batch):
        return self.tok(batch[:, :-1])

    def between(self, name, x, batch):
        assert name == "decoder"
        return x + jnp.tanh(self.bridge(x))

    def exit(self, x, batch):
        logits = self.readout(self.final(x)).astype(jnp.float32)
        targets = batch[:, 1:]
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1)[..., 0]
        keep = (targets != IGNORED).astype(jnp.float32)
        count = keep.sum()
        return (nll * keep).sum() / jnp.maximum(count, 1.0), count


def build(*, cfg, policy, rngs):
    return TwoStacks(cfg.vocab_size, cfg.d_model, n_tower=2, n_decoder=cfg.n_layers, policy=policy, rngs=rngs)


# Models that break the protocol, each in its own way (tests of `model.family` errors).
class NoExit(nnx.Module):
    STACKED = ("tower",)

    def __init__(self, policy, rngs):
        self.tok = nnx.Embed(256, 8, rngs=rngs)
        self.tower = stack(TowerBlock, 2, 8, rngs, policy)

    def enter(self, batch):
        return self.tok(batch[:, :-1])


def no_exit(*, cfg, policy, rngs):
    return NoExit(policy, rngs)


def not_a_module(*, cfg, policy, rngs):
    return {"weights": jnp.zeros(3)}


def wrong_signature(cfg):
    return None


def buggy(*, cfg, policy, rngs):
    """A bug inside the model's own code: not bad input, it must show its traceback."""
    raise ZeroDivisionError("a bug in the user's model")
