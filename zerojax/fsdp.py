"""The explicit FSDP unit schedule (`zero.schedule=shard_map`), written out in `jax.shard_map`.

Each device holds its shards of the fp32 master weights and its rows of the batch. The loss
and gradient are computed by an explicit forward and backward pass over the model's units
(the outer unit, embedding + head, and one unit per transformer block), not by autodiff of the
whole step, so where weights are gathered and freed is decided here and nowhere else:

    forward:   gather the embedding; embed; free it; for each block: gather, compute, free;
               gather the head (with the tied embedding again); head; loss
    backward:  head (still gathered), free it; for each block in reverse: gather
               again, vjp, reduce-scatter its gradient, free; embedding vjp (a scatter-add
               into the rows it read: it keeps the token ids, not the weights); reduce-scatter
               the outer gradient

Every unit is thus gathered twice per step and reduce-scattered once, as DESIGN §2 counts
(FSDP likewise keeps its root unit gathered from the head's forward into its backward).

A unit's gather is one `all_gather` of one flat buffer holding all its sharded leaves (in
`precision.gather`), and its gradient one `psum_scatter` of the same layout (in
`precision.reduce`): FSDP's flat parameter. Gathered weights never outlive their use and are
never saved for the backward pass (with `zero.reshard_after_forward=false` the forward's
gathered blocks are kept instead of gathered again). What a block does keep is `model.remat`'s
choice, made per block with `jax.checkpoint` policies: its input only (`full`: the backward
recomputes the block), its matmul outputs too (`dots`), or every residual its vjp needs
(`none`); the weights among those residuals are left out and the re-gathered ones put back in
their places (`block_residuals`). `zero.prefetch=k` issues the gather of unit i+k before unit
i computes (a queue of k gathered units carried through the scan), so XLA's async collectives
can overlap it with compute; the forward's last k iterations already gather the backward's
first k units.

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
ALL = jax.checkpoint_policies.everything_saveable  # remat=none: the block's vjp saves what it needs
OUTER = ("embed", "head")  # the outer unit: its gradient is reduce-scattered once, at the end


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
    """Layer i of stacked leaves (i may be traced: a dynamic slice, not a copy of the stack)."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def queued_scan(step: Callable, gather: Callable, sources, extras, carry, ahead: int, *, reverse: bool = False,
                queue: tuple | None = None, wrap: bool = False):
    """for each unit i (0..L-1, or L-1..0 when `reverse`): carry, out[i] = step(carry,
    gather(sources[i]), extras[i]), the gather of the unit `ahead` places later in that order
    issued before unit i computes (a queue of `ahead` gathered units carried through the scan).

    `queue`: units already gathered for the first `ahead` places (else gathered here first).
    `wrap`: the last `ahead` iterations go on gathering the first units of the reverse pass
    (the backward after a forward) instead of idling; they are returned as its `queue`, so
    one scan covers every unit. Without it the last `ahead` units, already gathered, run after
    the scan.

    Stacked inputs are read by index and the outputs written in place into [L, ...] buffers in
    layer order, so nothing stacked is ever sliced, reversed or concatenated (each of those
    would be a copy of the whole stack alive next to the units). Returns (carry, outs, queue)."""
    L = jax.tree.leaves(sources)[0].shape[0]
    ahead = min(ahead, L)
    unit = (lambda j: L - 1 - j) if reverse else (lambda j: j)
    # The unit gathered k places ahead: k < L in this pass's order, then the reverse pass's.
    upcoming = lambda k: unit(k) if not wrap else jnp.where(k < L, unit(k), unit(2 * L - 1 - k))
    if queue is None:
        queue = tuple(gather(_at(sources, unit(j))) for j in range(ahead))
    out_shapes = jax.eval_shape(lambda c, w, e: step(c, w, e)[1], carry, queue[0] if queue else gather(_at(sources, 0)),
                                _at(extras, 0))
    outs = jax.tree.map(lambda s: jnp.zeros((L,) + s.shape, s.dtype), out_shapes)

    def compute(state, weights, i):
        carry, outs = state
        carry, out = step(carry, weights, _at(extras, i))
        return carry, jax.tree.map(lambda buf, o: jax.lax.dynamic_update_index_in_dim(buf, o, i, 0), outs, out)

    def body(state, j):
        state, queue = state
        weights = gather(_at(sources, upcoming(j + ahead)))  # issued before this iteration's compute
        if queue:
            weights, queue = queue[0], queue[1:] + (weights,)
        return (compute(state, weights, unit(j)), queue), None

    state, steps = (carry, outs), L if wrap else L - ahead
    if steps:
        (state, queue), _ = jax.lax.scan(body, (state, queue), jnp.arange(steps))
    if not wrap:
        for j, weights in enumerate(queue):  # the last `ahead` units, already gathered
            state = compute(state, weights, unit(L - ahead + j))
        queue = ()
    return (*state, queue)


def block_residuals(apply_block: Callable, remat_policy: Callable, w, x_BTD):
    """y, and the residuals a block's backward needs under `remat_policy`, without its weights.

    The vjp's residuals are what the policy saves (all of them for remat=none, the matmul
    outputs for remat=dots) plus the block's inputs. The weights among them are recognised by
    identity and left out, with their slots: the backward puts the re-gathered weights back in
    their places, so a gathered unit is never stored for the backward pass.
    Returns (y, residuals, treedef, slots)."""
    fn = apply_block if remat_policy is ALL else jax.checkpoint(apply_block, policy=remat_policy)
    y_BTD, vjp = jax.vjp(fn, w, x_BTD)
    leaves, treedef = jax.tree.flatten(vjp)
    slot_of = {id(leaf): k for k, leaf in enumerate(jax.tree.leaves(w))}
    slots = tuple(slot_of.get(id(leaf)) for leaf in leaves)
    return y_BTD, [leaf for leaf, k in zip(leaves, slots) if k is None], treedef, slots


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
    remat_policy: Callable | None = None  # None: every block recomputed in backward (remat=full)

    def layouts(self):
        plans, n = self.plan.leaves, self.plan.data_size
        outer = {k: plans[k] for k in OUTER}
        return UnitLayout(outer, False, n), UnitLayout(plans["blocks"], True, n), UnitLayout(plans["blocks"], False, n)

    def apply_block(self, w, x_BTD):
        return nnx.merge(self.units["block"], w)(x_BTD)

    def embed(self, outer_w, tokens_BT):
        return nnx.merge(self.units["embed"], outer_w["embed"])(tokens_BT)

    def head_part(self, outer):
        """What the head reads of the outer unit: its own leaves and, tied, the token embedding."""
        tied = "lm_head" not in self.plan.leaves["head"]
        return {"head": outer["head"], **({"embed": {"wte": outer["embed"]["wte"]}} if tied else {})}

    def head_loss(self, head_w, x_BTD, targets_BT):
        embed = None  # an untied head never reads the embedding
        if "embed" in head_w:  # tied: only `wte.attend` is read; the position table stays out
            embed = nnx.merge(self.units["embed"], {**head_w["embed"], "wpe": jnp.zeros((), self.policy.gather)})
        return self.loss_fn(nnx.merge(self.units["head"], head_w["head"])(x_BTD, embed), targets_BT)

    def block_forward(self, w, x_BTD, structure: dict):
        """A block's output and the residuals its backward needs, without its weights."""
        y_BTD, residuals, treedef, slots = block_residuals(self.apply_block, self.remat_policy, w, x_BTD)
        # Every trace of a block (scan body, unrolled prefetch units) gives the same slots; the
        # first trace's pullback serves all of them (its residuals are all in `leaves`).
        if structure.setdefault("vjp", (treedef, slots))[1] != slots:
            raise AssertionError("a block's vjp residuals changed between traces")
        return y_BTD, residuals

    def block_backward(self, w, residuals, dy_BTD, structure: dict):
        treedef, slots = structure["vjp"]
        weights, saved = jax.tree.leaves(w), iter(residuals)
        vjp = jax.tree.unflatten(treedef, [next(saved) if k is None else weights[k] for k in slots])
        return vjp(dy_BTD)

    def local_grads(self, weights, batch_BS, scale):
        """Loss and gradient of one microbatch on this device.

        `weights` is what the stage keeps per device: master shards (stages 2, 3: `weights` =
        (shards, pre-gathered full weights or None)) or full weights (stages 0, 1)."""
        outer_lay, layer_lay, _ = self.layouts()
        shards, full = weights
        p = self.policy
        sharded = self.stage >= 2
        n, plans = self.plan.data_size, self.plan.leaves
        if self.stage == 3:
            def gather_head(kept_embed):
                if kept_embed is None:
                    return UnitLayout(self.head_part(plans), False, n).gather(self.head_part(shards), p)
                own = UnitLayout({"head": plans["head"]}, False, n).gather({"head": shards["head"]}, p)
                return self.head_part({**own, **kept_embed})

            gather_embed = lambda: UnitLayout({"embed": plans["embed"]}, False, n).gather({"embed": shards["embed"]}, p)
            gather_layer = lambda s: layer_lay.gather(s, p)
            layer_sources = shards["blocks"]
        else:  # weights are already whole on every device: "gathering" is reading them
            gather_embed = lambda: {"embed": full["embed"]}
            gather_head = lambda _: self.head_part(full)
            gather_layer = lambda w: w
            layer_sources = full["blocks"]
        scatter_layer = (lambda g, s: layer_lay.scatter(g, s, p)) if sharded else (lambda g, s: g)
        tokens_BT, targets_BT = batch_BS[:, :-1], batch_BS[:, 1:]

        # The embedding's backward is a scatter-add into the rows it read: its vjp keeps the
        # token ids, not the weights, so the outer unit is freed after the embedding...
        keep = self.stage == 3 and not self.reshard_after_forward
        embed_w = gather_embed()
        x0, embed_vjp = jax.vjp(lambda w: self.embed(w, tokens_BT), embed_w)

        recompute = self.remat_policy is None
        structure: dict = {}
        # Weights enter a block in the compute dtype (as the model would cast them), so that
        # the only weight-sized residuals of its vjp are the weights themselves.
        as_compute = lambda w: jax.tree.map(lambda a: a.astype(p.compute), w)

        def forward(x, w, _):
            if recompute:  # keep only the block's input; the backward recomputes the rest
                return self.apply_block(w, x), (x, w if keep else None)
            y, residuals = self.block_forward(as_compute(w), x, structure)
            return y, (residuals, w if keep else None)

        ahead = self.prefetch if self.stage == 3 else 0
        # With the forward's gathered units freed (reshard_after_forward), its last iterations
        # already gather the backward's first units: no idle tail, one scan over every block.
        xL, (inputs, kept), queue = queued_scan(forward, gather_layer, layer_sources, (), x0, ahead,
                                                wrap=ahead > 0 and not keep)
        # ... and the head gathers what it reads (the tied embedding again), its backward
        # following at once (with reshard_after_forward=false the forward's copy is kept).
        head_w = gather_head(embed_w if keep else None)
        loss, head_vjp = jax.vjp(lambda w, x: self.head_loss(w, x, targets_BT), head_w, xL)
        d_head, dx = head_vjp(scale.astype(jnp.float32) / self.n_devices)

        def backward(dy, w, xs):
            saved, shard = xs
            if recompute:
                _, vjp = jax.vjp(self.apply_block, w, saved)
                dw, dx = vjp(dy)
            else:
                dw, dx = self.block_backward(as_compute(w), saved, dy, structure)
            return dx, scatter_layer(dw, shard)

        sources, gather_back = (kept, lambda w: w) if keep else (layer_sources, gather_layer)
        shard_src = shards["blocks"] if sharded else layer_sources
        dx0, d_blocks, _ = queued_scan(backward, gather_back, sources, (inputs, shard_src), dx, 0 if keep else ahead,
                                       reverse=True, queue=queue or None)
        (d_outer,) = embed_vjp(dx0)
        d_outer = {**d_outer, "head": d_head["head"]}
        if "embed" in d_head:  # the tied embedding's gradient from the head
            d_outer["embed"] = {**d_outer["embed"], "wte": jax.tree.map(jnp.add, d_outer["embed"]["wte"],
                                                                         d_head["embed"]["wte"])}
        if sharded:
            d_outer = outer_lay.scatter(d_outer, {k: shards[k] for k in OUTER}, p)
        grads = {**d_outer, "blocks": d_blocks}
        return loss / self.n_devices, jax.tree.map(lambda g: g.astype(jnp.float32), grads)



def make_loss_and_grads(mesh, plan: Plan, policy: Policy, units: dict, loss_fn: Callable, *, grad_accum: int,
                        prefetch: int, reshard_after_forward: bool, remat_policy: Callable | None = None):
    """(master, batch, scale) -> (loss, fp32 gradient of scale x loss in the plan's grad layout),
    computed per device in `jax.shard_map` by the unit schedule of `plan.stage`."""
    n_devices = mesh.shape[REPLICA] * mesh.shape[DATA]
    schedule = Schedule(plan.stage, policy, plan, units, loss_fn, prefetch, reshard_after_forward, n_devices,
                        remat_policy)
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
