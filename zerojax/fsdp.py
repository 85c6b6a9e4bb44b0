"""The explicit FSDP unit schedule (`zero.schedule=shard_map`), written out in `jax.shard_map`.

Each device holds its shards of the fp32 master weights and its rows of the batch. The loss
and gradient are computed by an explicit forward and backward pass over the model's units
(the outer unit, embedding + head, and one unit per transformer block), not by autodiff of the
whole step, so where weights are gathered and freed is decided here and nowhere else:

    forward:   gather outer; embed; for each block: gather, compute, free; head; loss
    backward:  head (outer still gathered), free outer; for each block in reverse: gather
               again, recompute its forward, vjp, reduce-scatter its gradient, free; embedding
               vjp (a scatter-add: no weights needed); reduce-scatter the outer gradient

The outer unit is thus gathered once per step, not twice as DESIGN §2's stage-3 formula
counts: its backward starts right where its forward ends (as FSDP keeps its root unit
unsharded), and the embedding's gradient needs no weights.

A unit's gather is one `all_gather` of one flat buffer holding all its sharded leaves (in
`precision.gather`), and its gradient one `psum_scatter` of the same layout (in
`precision.reduce`): FSDP's flat parameter. Only each block's input activation is kept for the
backward pass; gathered weights never outlive their use (with `zero.reshard_after_forward=false`
the forward's gathered blocks are kept instead of gathered again). `zero.prefetch=k` issues the
gather of unit i+k before unit i computes (a queue of k gathered units carried through the
scan), so XLA's async collectives can overlap it with compute.

Stages pick what "gather" and "scatter" mean (master layout from `zerojax.sharding`):
    3  gather = all_gather per unit per pass; scatter = psum_scatter per unit
    2  weights all-gathered once per step; scatter = psum_scatter per unit in the backward
    1  weights all-gathered once per step; full local gradients (accumulated over
       microbatches), one psum_scatter per unit group at the end of the step
    0  replicated weights; local gradients, one psum (all-reduce) at the end of the step
Leaves too small to shard are used as they are and their gradients psum'd. Hybrid meshes add a
psum over `replica` at the end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from zerojax.mesh import BATCH_AXES
from zerojax.precision import Policy
from zerojax.sharding import DATA, LeafPlan, Plan

REPLICA = "replica"
OUTER = ("embed", "head")  # the root unit: gathered at the start of forward, as FSDP's root


@dataclass(frozen=True)
class UnitLayout:
    """How one unit's leaves map to one flat buffer (`layer`: per-layer slices of stacked leaves)."""

    plans: Any  # pytree of LeafPlan
    layer: bool
    n: int  # data-axis size

    def _sharded(self):
        return [p for p in jax.tree.leaves(self.plans) if p.dim is not None]

    def local_shape(self, p: LeafPlan) -> tuple[int, ...]:
        stored = p.stored[1:] if self.layer else p.stored
        d = self.dim(p)
        return stored[:d] + (stored[d] // self.n,) + stored[d + 1 :]

    def dim(self, p: LeafPlan) -> int:
        return p.dim - 1 if self.layer else p.dim

    def true_shape(self, p: LeafPlan) -> tuple[int, ...]:
        return p.shape[1:] if self.layer else p.shape

    def pack(self, shards, dtype) -> jax.Array:
        """The unit's sharded leaves, flattened into one local buffer [n]."""
        flat = [x.astype(dtype).ravel() for x, p in zip(jax.tree.leaves(shards), jax.tree.leaves(self.plans))
                if p.dim is not None]
        return jnp.concatenate(flat) if flat else jnp.zeros((0,), dtype)

    def unpack(self, gathered_Nn: jax.Array, shards, dtype):
        """Full (unpadded) leaves from the gathered buffer [N, n]; small leaves from `shards`."""
        out, offset = [], 0
        for x, p in zip(jax.tree.leaves(shards), jax.tree.leaves(self.plans)):
            if p.dim is None:
                out.append(x.astype(dtype))
                continue
            shape, d = self.local_shape(p), self.dim(p)
            size = math.prod(shape)
            piece = gathered_Nn[:, offset : offset + size].reshape((self.n,) + shape)
            full = jnp.moveaxis(piece, 0, d).reshape(shape[:d] + (self.n * shape[d],) + shape[d + 1 :])
            out.append(full[tuple(slice(0, t) for t in self.true_shape(p))])
            offset += size
        return jax.tree.unflatten(jax.tree.structure(shards), out)

    def gather(self, shards, policy: Policy):
        """One all_gather of the unit's flat buffer, in the gather dtype."""
        gathered = jax.lax.all_gather(self.pack(shards, policy.gather), DATA)
        return self.unpack(gathered, shards, policy.gather)

    def scatter(self, grads, shards, policy: Policy):
        """The gather's transpose: one psum_scatter of the unit's gradient, in the reduce dtype.

        Returns fp32 gradient shards laid out like `shards`; small leaves are psum'd."""
        n_local = sum(math.prod(self.local_shape(p)) for p in self._sharded())
        _, layout_t = jax.vjp(lambda g: self.unpack(g, shards, policy.reduce),
                              jnp.zeros((self.n, n_local), policy.reduce))
        grads_r = jax.tree.map(lambda g: g.astype(policy.reduce), grads)
        (flat_Nn,) = layout_t(grads_r)
        flat = jax.lax.psum_scatter(flat_Nn, DATA, scatter_dimension=0, tiled=False).astype(jnp.float32)
        out, offset = [], 0
        for g, x, p in zip(jax.tree.leaves(grads_r), jax.tree.leaves(shards), jax.tree.leaves(self.plans)):
            if p.dim is None:
                out.append(jax.lax.psum(g, DATA).astype(jnp.float32))
                continue
            size = math.prod(x.shape)
            out.append(flat[offset : offset + size].reshape(x.shape))
            offset += size
        return jax.tree.unflatten(jax.tree.structure(shards), out)


def _at(tree, i):
    return jax.tree.map(lambda a: a[i], tree)


def _slice(tree, start, stop):
    return jax.tree.map(lambda a: a[start:stop], tree)


def queued_scan(step: Callable, gather: Callable, sources, extras, carry, ahead: int):
    """for i in range(L): carry, out_i = step(carry, gather(sources[i]), extras[i]), with the
    gather of unit i+ahead issued before unit i computes (a queue of `ahead` gathered units)."""
    L = jax.tree.leaves(sources)[0].shape[0]
    ahead = min(ahead, L)
    queue = tuple(gather(_at(sources, i)) for i in range(ahead))

    def body(state, xs):
        carry, queue = state
        source, extra = xs
        weights = gather(source)  # issued before this iteration's compute
        if queue:
            weights, queue = queue[0], queue[1:] + (weights,)
        carry, out = step(carry, weights, extra)
        return (carry, queue), out

    outs = []
    if L > ahead:
        (carry, queue), scanned = jax.lax.scan(body, (carry, queue), (_slice(sources, ahead, L), _slice(extras, 0, L - ahead)))
        outs.append(scanned)
    for j, weights in enumerate(queue):  # the last `ahead` units, already gathered
        carry, out = step(carry, weights, _at(extras, L - ahead + j))
        outs.append(jax.tree.map(lambda a: a[None], out))
    return carry, jax.tree.map(lambda *parts: jnp.concatenate(parts), *outs)


@dataclass(frozen=True)
class Schedule:
    """The per-device forward and backward of one microbatch for a stage."""

    stage: int
    policy: Policy
    plan: Plan
    units: dict  # graphdefs: embed, block (one layer), head
    loss_fn: Callable  # (logits, targets) -> mean loss
    prefetch: int
    reshard_after_forward: bool
    n_devices: int  # replica x data: each device's loss is 1/n of the global mean

    def layouts(self):
        plans, n = self.plan.leaves, self.plan.data_size
        outer = {k: plans[k] for k in OUTER}
        return UnitLayout(outer, False, n), UnitLayout(plans["blocks"], True, n), UnitLayout(plans["blocks"], False, n)

    def apply_block(self, w, x_BTD):
        return nnx.merge(self.units["block"], w)(x_BTD)

    def embed(self, outer_w, tokens_BT):
        return nnx.merge(self.units["embed"], outer_w["embed"])(tokens_BT)

    def head_loss(self, outer_w, x_BTD, targets_BT):
        embed = nnx.merge(self.units["embed"], outer_w["embed"])
        return self.loss_fn(nnx.merge(self.units["head"], outer_w["head"])(x_BTD, embed), targets_BT)

    def local_grads(self, weights, batch_BS, scale):
        """Loss and gradient of one microbatch on this device.

        `weights` is what the stage keeps per device: master shards (stages 2, 3: `weights` =
        (shards, pre-gathered full weights or None)) or full weights (stages 0, 1)."""
        outer_lay, layer_lay, _ = self.layouts()
        shards, full = weights
        p = self.policy
        sharded = self.stage >= 2
        if self.stage == 3:
            gather_outer_from = lambda shards: outer_lay.gather({k: shards[k] for k in OUTER}, p)
            gather_layer = lambda s: layer_lay.gather(s, p)
            layer_sources = shards["blocks"]
        else:  # weights are already whole on every device: "gathering" is reading them
            gather_outer_from = lambda _: {k: full[k] for k in OUTER}
            gather_layer = lambda w: w
            layer_sources = full["blocks"]
        scatter_layer = (lambda g, s: layer_lay.scatter(g, s, p)) if sharded else (lambda g, s: g)
        tokens_BT, targets_BT = batch_BS[:, :-1], batch_BS[:, 1:]

        outer_w = gather_outer_from(shards)
        x0 = self.embed(outer_w, tokens_BT)
        keep = self.stage == 3 and not self.reshard_after_forward

        def forward(x, w, _):
            return self.apply_block(w, x), (x, w if keep else None)

        ahead = self.prefetch if self.stage == 3 else 0
        xL, (inputs, kept) = queued_scan(forward, gather_layer, layer_sources, None, x0, ahead)
        loss, head_vjp = jax.vjp(lambda w, x: self.head_loss(w, x, targets_BT), outer_w, xL)
        d_outer, dx = head_vjp(scale.astype(jnp.float32) / self.n_devices)

        def backward(dy, w, xs):
            x, shard = xs
            _, vjp = jax.vjp(self.apply_block, w, x)
            dw, dx = vjp(dy)
            return dx, scatter_layer(dw, shard)

        rev = lambda tree: jax.tree.map(lambda a: a[::-1], tree)
        sources, gather_back = (kept, lambda w: w) if keep else (layer_sources, gather_layer)
        shard_src = shards["blocks"] if sharded else layer_sources
        dx0, d_blocks = queued_scan(backward, gather_back, rev(sources), (rev(inputs), rev(shard_src)), dx,
                                    0 if keep else ahead)
        # The embedding's backward (a scatter-add into the rows it read) needs no weights, so
        # the outer unit is not gathered again: its forward copy dies after the head's backward.
        _, embed_vjp = jax.vjp(lambda w: self.embed(w, tokens_BT), outer_w)
        (d_embed,) = embed_vjp(dx0)
        d_outer = jax.tree.map(jnp.add, d_outer, d_embed)
        if sharded:
            d_outer = outer_lay.scatter(d_outer, {k: shards[k] for k in OUTER}, p)
        grads = {**d_outer, "blocks": rev(d_blocks)}
        return loss / self.n_devices, jax.tree.map(lambda g: g.astype(jnp.float32), grads)



def make_loss_and_grads(mesh, plan: Plan, policy: Policy, units: dict, loss_fn: Callable, *, grad_accum: int,
                        prefetch: int, reshard_after_forward: bool):
    """(master, batch, scale) -> (loss, fp32 gradient of scale x loss in the plan's grad layout),
    computed per device in `jax.shard_map` by the unit schedule of `plan.stage`."""
    n_devices = mesh.shape[REPLICA] * mesh.shape[DATA]
    schedule = Schedule(plan.stage, policy, plan, units, loss_fn, prefetch, reshard_after_forward, n_devices)
    outer_lay, _, stack_lay = schedule.layouts()
    outer_of = lambda tree: {k: tree[k] for k in OUTER}

    def whole(master):
        """Stages 0-2: the weights every device holds whole during the step."""
        if plan.stage == 0:
            return jax.tree.map(lambda x: x.astype(policy.gather), plan.unpad(master))
        if plan.stage in (1, 2):  # one all_gather per unit group per step
            return {**outer_lay.gather(outer_of(master), policy), "blocks": stack_lay.gather(master["blocks"], policy)}
        return None

    def reduce(grads, master):
        """What is left to reduce at the end of the step."""
        if plan.stage == 0:
            grads = jax.tree.map(lambda g: jax.lax.psum(g.astype(policy.reduce), (REPLICA, DATA)), plan.pad(grads))
        elif plan.stage == 1:
            grads = {**outer_lay.scatter(outer_of(grads), outer_of(master), policy),
                     "blocks": stack_lay.scatter(grads["blocks"], master["blocks"], policy)}
        if plan.stage and mesh.shape[REPLICA] > 1:
            grads = jax.tree.map(lambda g: jax.lax.psum(g, REPLICA), grads)
        return jax.tree.map(lambda g: g.astype(jnp.float32), grads)

    def local(master, batch_BS, scale):
        weights = (master, whole(master))
        if grad_accum == 1:
            loss, grads = schedule.local_grads(weights, batch_BS, scale)
        else:
            B, S = batch_BS.shape
            micro_kBS = batch_BS.reshape(B // grad_accum, grad_accum, S).swapaxes(0, 1)

            def body(acc, micro_BS):
                return jax.tree.map(jnp.add, acc, schedule.local_grads(weights, micro_BS, scale)), None

            like = master if plan.stage >= 2 else weights[1]  # shards, or local full gradients
            zeros = (jnp.zeros((), jnp.float32), jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), like))
            (loss, grads), _ = jax.lax.scan(body, zeros, micro_kBS)
            loss, grads = loss / grad_accum, jax.tree.map(lambda g: g / grad_accum, grads)
        return jax.lax.psum(loss, (REPLICA, DATA)), reduce(grads, master)

    return jax.shard_map(local, mesh=mesh, in_specs=(plan.master_specs, P(BATCH_AXES), P()),
                         out_specs=(P(), plan.grad_specs), check_vma=False)
