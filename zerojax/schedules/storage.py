"""How weights and saved activations are stored between uses: 2-byte floats as their bits.

XLA's CPU backend computes bf16 in f32, and converts a whole loop-invariant bf16 stack to f32
before a loop that reads it layer by layer (twice its bytes, alive through the loop). Kept as
uint16 bits and bitcast back one layer at a time, only the layer being read is converted. A
bitcast is exact and costs nothing on GPU and TPU. Used by the explicit schedule (what the
forward saves for the backward) and by host offload (the device copy of offloaded weights)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from zerojax.schedules import quant
from zerojax.precision import Policy


def as_bits(tree):
    """2-byte floats (bf16, f16) as their bits (uint16); other leaves as they are.

    What the forward stores for the backward, stacked over a stack's layers, is kept like this.
    XLA's CPU backend computes bf16 in f32: a stack of bf16 block inputs read layer by layer in
    the backward's loop would be converted to f32 as a whole before the loop (twice its bytes,
    alive through the backward). Read as bits, only the layer being read is converted. Exact
    (a bitcast); on GPU and TPU a no-op."""
    narrow = lambda a: a.dtype.itemsize == 2 and jnp.issubdtype(a.dtype, jnp.floating)
    return jax.tree.map(lambda a: jax.lax.bitcast_convert_type(a, jnp.uint16) if narrow(a) else a, tree)


def from_bits(tree, dtypes):
    """as_bits undone: each leaf back to its dtype (`dtypes`, in leaf order)."""
    leaves = [a if a.dtype == d else jax.lax.bitcast_convert_type(a, d) for a, d in zip(jax.tree.leaves(tree), dtypes)]
    return jax.tree.unflatten(jax.tree.structure(tree), leaves)


def weights_dtype(policy: Policy):
    """The dtype of a device copy of the weights (zero.offload=optimizer+master): what is
    gathered, or for a quantized gather the compute dtype it quantizes from."""
    return policy.compute if quant.is_quantized(policy.gather) else policy.gather


def stored_weights(tree, dtype):
    """Weights as the state keeps them on the device: in `dtype`, a 2-byte float as its bits
    (uint16, `as_bits`). The schedule reads them layer by layer (`read_weights`), so XLA's CPU
    backend, which computes bf16 in f32, never converts a whole stack of them at once."""
    return as_bits(jax.tree.map(lambda a: a.astype(dtype), tree))


def read_weights(tree, dtype):
    """`stored_weights` undone: uint16 leaves are the bits of `dtype`; others are as they are."""
    return jax.tree.map(lambda a: jax.lax.bitcast_convert_type(a, dtype) if a.dtype == jnp.uint16 else a, tree)
