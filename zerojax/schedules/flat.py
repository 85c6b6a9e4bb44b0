"""FSDP's flat parameter: one unit's sharded leaves as one buffer, gathered in one `all_gather`
and reduce-scattered in one `psum_scatter` (`UnitLayout`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any
import jax
import jax.numpy as jnp
from zerojax.schedules import quant
from zerojax.parallel.mesh import DATA
from zerojax.precision import Policy
from zerojax.parallel.plan import LeafPlan
from zerojax.schedules.storage import read_weights, weights_dtype


@dataclass(frozen=True)
class UnitLayout:
    """How one unit's leaves map to one flat buffer (`layer`: per-layer slices of stacked leaves).

    `reverse` packs the sharded leaves in the opposite order: the outer unit's second gather (for
    `exit`) then differs from its first (for `enter`) as a value, and XLA cannot merge the two into
    one gathered unit alive all step (its CPU pipeline drops optimization barriers before CSE)."""

    plans: Any  # pytree of LeafPlan
    layer: bool
    n: int  # data-axis size
    reverse: bool = False

    def _sharded(self):
        return [p for p in jax.tree.leaves(self.plans) if p.dim is not None]

    def local_shape(self, p: LeafPlan) -> tuple[int, ...]:
        stored = p.stored[1:] if self.layer else p.stored
        d = self.dim(p)
        return stored[:d] + (stored[d] // self.n,) + stored[d + 1 :]

    def dim(self, p: LeafPlan) -> int:
        return p.dim - 1 if self.layer else p.dim

    def _offsets(self) -> list:
        """Each leaf's offset in the flat buffer (None for a leaf that is not sharded)."""
        plans = jax.tree.leaves(self.plans)
        order = [i for i, p in enumerate(plans) if p.dim is not None]
        offsets, at = [None] * len(plans), 0
        for i in reversed(order) if self.reverse else order:
            offsets[i], at = at, at + math.prod(self.local_shape(plans[i]))
        return offsets

    def pack(self, shards, dtype) -> jax.Array:
        """The unit's sharded leaves, flattened into one local buffer [n]."""
        flat = [(o, x.astype(dtype).ravel()) for x, o in zip(jax.tree.leaves(shards), self._offsets()) if o is not None]
        return jnp.concatenate([x for _, x in sorted(flat, key=lambda t: t[0])]) if flat else jnp.zeros((0,), dtype)

    def unpack(self, gathered_Nn: jax.Array, shards, dtype):
        """Full (unpadded) leaves from the gathered buffer [N, n]; small leaves from `shards`."""
        out = []
        for x, p, offset in zip(jax.tree.leaves(shards), jax.tree.leaves(self.plans), self._offsets()):
            if offset is None:
                out.append(x.astype(dtype))
                continue
            shape, d = self.local_shape(p), self.dim(p)
            piece = gathered_Nn[:, offset : offset + math.prod(shape)].reshape((self.n,) + shape)
            full = jnp.moveaxis(piece, 0, d).reshape(shape[:d] + (self.n * shape[d],) + shape[d + 1 :])
            out.append(p.unpad(full, self.layer))
        return jax.tree.unflatten(jax.tree.structure(shards), out)

    def gather(self, shards, policy: Policy):
        """One all_gather of the unit's flat buffer, in the gather dtype (int8 / float8_e4m3fn:
        the fp32 buffer quantized in blocks, gathered, and dequantized into the compute dtype;
        the backward's gradient is then taken at the dequantized weights: straight through)."""
        shards = read_weights(shards, weights_dtype(policy))  # one layer's bits, if stored as bits
        if quant.is_quantized(policy.gather):
            return self.unpack(self.quantized_gather(shards, policy), shards, policy.compute)
        gathered = jax.lax.all_gather(self.pack(shards, policy.gather), DATA)
        return self.unpack(gathered, shards, policy.gather)

    def quantized_gather(self, shards, policy: Policy) -> jax.Array:
        """The gathered buffer [N, n], dequantized (`zerojax.quant`: its blocks are cut from this
        device's flat buffer, so they may straddle leaves, as ZeRO++'s do)."""
        flat = self.pack(shards, jnp.float32)
        return quant.all_gather(flat, DATA, policy.quant_block, policy.gather, policy.compute, policy.quant_scale)

    def scatter(self, grads, shards, policy: Policy):
        """The gather's transpose: one psum_scatter of the unit's gradient, in the reduce dtype.

        Returns fp32 gradient shards laid out like `shards`; small leaves are psum'd. (The
        layout of a unit's gradient holds its trained leaves only: nothing is sent for frozen ones.)"""
        if not jax.tree.leaves(self.plans):
            return {}
        n_local = sum(math.prod(self.local_shape(p)) for p in self._sharded())
        _, layout_t = jax.vjp(lambda g: self.unpack(g, shards, policy.reduce),
                              jnp.zeros((self.n, n_local), policy.reduce))
        grads_r = jax.tree.map(lambda g: g.astype(policy.reduce), grads)
        (flat_Nn,) = layout_t(grads_r)
        flat = jax.lax.psum_scatter(flat_Nn, DATA, scatter_dimension=0, tiled=False).astype(jnp.float32)
        out = []
        for g, x, offset in zip(jax.tree.leaves(grads_r), jax.tree.leaves(shards), self._offsets()):
            if offset is None:
                out.append(jax.lax.psum(g, DATA).astype(jnp.float32))
                continue
            out.append(flat[offset : offset + x.size].reshape(x.shape))
        return jax.tree.unflatten(jax.tree.structure(shards), out)
