"""The explicit FSDP unit schedule (`zero.schedule=shard_map`), written out in `jax.shard_map`.

Each device holds its shards of the fp32 master weights and its rows of the batch. The loss
and gradient are computed by an explicit forward and backward pass over the model's units
(`zerojax.models.protocol`: the outer unit, every parameter outside the stacks, and one unit
per layer of each stack), not by autodiff of the whole step, so where weights are gathered and
freed is decided here and nowhere else:

    forward:   gather the outer unit; enter; free it (after the last `between`, with several
               stacks); for each layer of each stack: gather, compute, free;
               gather the outer unit again; exit (the loss)
    backward:  exit's vjp (outer unit still gathered), free it; for each layer in reverse:
               gather again, vjp, reduce-scatter its gradient, free; the glue's and enter's
               vjps (for a token embedding a scatter-add into the rows it read: it keeps the
               token ids, not the weights); reduce-scatter the outer unit's gradient

Every unit is thus gathered twice per step and reduce-scattered once, as docs/design.md §2 counts
(FSDP likewise keeps its root unit gathered from the loss's forward into its backward).

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

The stage's table (`zerojax.sharding.LAYOUTS`) picks what "gather" and "scatter" mean, once:
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
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zerojax import quant
from zerojax.mesh import BATCH_AXES, DATA, REPLICA
from zerojax.models.protocol import REMAT_POLICIES, Units
from zerojax.precision import Policy
from zerojax.sharding import LeafPlan, Plan, combine, frozen_part, microbatches, trained


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


def layer_at(tree, i):
    """Layer i of stacked leaves (i may be traced: a dynamic slice, not a copy of the stack)."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def layer_put(tree, piece, i):
    """Stacked leaves with layer i replaced by `piece` (in place on a donated buffer)."""
    return jax.tree.map(lambda a, p: jax.lax.dynamic_update_index_in_dim(a, p, i, 0), tree, piece)


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
        queue = tuple(gather(layer_at(sources, unit(j))) for j in range(ahead))
    out_shapes = jax.eval_shape(lambda c, w, e: step(c, w, e)[1], carry, queue[0] if queue else gather(layer_at(sources, 0)),
                                layer_at(extras, 0))
    outs = jax.tree.map(lambda s: jnp.zeros((L,) + s.shape, s.dtype), out_shapes)

    def compute(state, weights, i):
        carry, outs = state
        carry, out = step(carry, weights, layer_at(extras, i))
        return carry, layer_put(outs, out, i)

    def body(state, j):
        state, queue = state
        weights = gather(layer_at(sources, upcoming(j + ahead)))  # issued before this iteration's compute
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


def vjp_trained(fn: Callable, w, frozen, *args):
    """jax.vjp of fn(w, *args) with respect to w's trained leaves and `args`: frozen leaves
    (`frozen`, a mask like w) are closed over, so no gradient is ever computed for them.
    The pullback returns (d trained leaves, *d args)."""
    w_frozen = frozen_part(w, frozen)
    return jax.vjp(lambda w_trained, *args: fn(combine(w_trained, w_frozen), *args), trained(w, frozen), *args)


def block_residuals(apply_block: Callable, remat_policy: Callable, w, frozen, x_BTD):
    """y, and the residuals a block's backward needs under `remat_policy`, without its weights.

    The vjp's residuals are what the policy saves (all of them for remat=none, the matmul
    outputs for remat=dots) plus the block's inputs. The weights among them are recognised by
    identity and left out, with their slots: the backward puts the re-gathered weights back in
    their places, so a gathered unit is never stored for the backward pass (frozen weights,
    closed over, are found the same way).
    Returns (y, residuals, treedef, slots)."""
    fn = apply_block if remat_policy is REMAT_POLICIES["none"] else jax.checkpoint(apply_block, policy=remat_policy)
    y_BTD, vjp = vjp_trained(fn, w, frozen, x_BTD)
    leaves, treedef = jax.tree.flatten(vjp)
    slot_of = {id(leaf): k for k, leaf in enumerate(jax.tree.leaves(w))}
    slots = tuple(slot_of.get(id(leaf)) for leaf in leaves)
    return y_BTD, [leaf for leaf, k in zip(leaves, slots) if k is None], treedef, slots


@dataclass(frozen=True)
class StepOptions:
    """What a schedule needs of the config beyond the plan and the policy."""

    grad_accum: int = 1  # microbatches per step
    remat: str = "full"  # model.remat: none | full | dots
    prefetch: int = 1  # stage 3: units gathered ahead of the one computing
    reshard_after_forward: bool = True  # stage 3: free the forward's gathered units


@dataclass(frozen=True)
class Exchange:
    """How one unit's weights reach its compute and how its gradient leaves, for the stage."""

    layout: UnitLayout  # every leaf of the unit: what is gathered
    grad_layout: UnitLayout  # its trained leaves: what is reduce-scattered
    policy: Policy
    gather: bool  # all_gather per unit per pass (else the weights are already whole)
    scatter: bool  # psum_scatter per unit (else the gradient stays whole until the step's end)

    def fetch(self, source):
        return self.layout.gather(source, self.policy) if self.gather else source

    def send(self, grads, shards):
        return self.grad_layout.scatter(grads, shards, self.policy) if self.scatter else grads


class Tape(NamedTuple):
    """What the forward leaves for the backward."""

    x: Any  # the last stack's output
    outer: Any  # the gathered outer unit, kept when reshard_after_forward=false (else None)
    saved: dict  # per stack: (block inputs or residuals, kept gathered layers or None)
    enter_vjp: Callable
    glue_vjps: dict  # per stack after the first: the vjp of `between`
    queue: tuple  # units the forward already gathered for the backward (prefetch)


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


def _add(a, b):
    return jax.tree.map(jnp.add, a, b)


@dataclass(frozen=True)
class Schedule:
    """The per-device forward and backward of one microbatch over a model's units."""

    units: Units
    plan: Plan
    policy: Policy
    options: StepOptions
    n_calls: int  # calls of `exit` per step: devices x microbatches

    @property
    def ahead(self) -> int:
        return self.options.prefetch if self.plan.layout.gather_per_unit else 0

    @property
    def keep(self) -> bool:
        return self.plan.layout.gather_per_unit and not self.options.reshard_after_forward

    @property
    def recompute(self) -> bool:  # remat=full: keep only a block's input; its backward recomputes it
        return self.options.remat == "full"

    def exchange(self, name: str | None, reverse: bool = False) -> Exchange:
        """The outer unit's (name None) or one layer of stack `name`'s exchange."""
        leaves, stage, n = self.unit_of(self.plan.leaves, name), self.plan.layout, self.plan.data_size
        layout = UnitLayout(leaves, name is not None, n, reverse)
        grad_layout = UnitLayout(trained(leaves, self.frozen(name)), name is not None, n)
        return Exchange(layout, grad_layout, self.policy, stage.gather_per_unit, stage.scatter_per_unit)

    def unit_of(self, tree, name: str | None):
        return self.units.outer_of(tree) if name is None else tree.get(name, {})

    def frozen(self, name: str | None):
        """The unit's mask of frozen leaves."""
        return self.unit_of(self.plan.frozen, name)

    def as_compute(self, w):
        """Weights enter a block in the compute dtype (as the model would cast them), so that the
        only weight-sized residuals of its vjp are the weights themselves."""
        return jax.tree.map(lambda a: a.astype(self.policy.compute), w)

    def block_forward(self, name: str, structure: dict, x, w, _):
        """A block's output and what its backward needs (its input, or its residuals without
        its weights), plus its gathered weights when they are kept."""
        kept = w if self.keep else None
        if self.recompute:
            y, saved = self.units.block(name, w, x), x
        else:
            apply = lambda w, x: self.units.block(name, w, x)
            y, saved, treedef, slots = block_residuals(apply, REMAT_POLICIES[self.options.remat],
                                                       self.as_compute(w), self.frozen(name), x)
            # Every trace of a block (scan body, unrolled prefetch units) gives the same slots; the
            # first trace's pullback serves all of them (its residuals are all in `leaves`).
            if structure.setdefault("vjp", (treedef, slots))[1] != slots:
                raise AssertionError("a block's vjp residuals changed between traces")
        structure.setdefault("saved", [a.dtype for a in jax.tree.leaves(saved)])
        return y, (as_bits(saved), kept)

    def block_backward(self, name: str, structure: dict, send: Callable, dy, w, xs):
        """A block's input gradient, and its weight gradient sent on (reduce-scattered or not)."""
        (saved, _), shard = xs
        saved = from_bits(saved, structure["saved"])
        if self.recompute:
            _, vjp = vjp_trained(lambda w, x: self.units.block(name, w, x), w, self.frozen(name), saved)
        else:
            treedef, slots = structure["vjp"]
            weights, residuals = jax.tree.leaves(self.as_compute(w)), iter(saved)
            vjp = jax.tree.unflatten(treedef, [next(residuals) if k is None else weights[k] for k in slots])
        dw, dx = vjp(dy)
        return dx, send(dw, shard)

    def forward(self, sources, batch, structures: dict) -> Tape:
        """enter, each stack's layers (and the glue between stacks), up to the loss's input."""
        outer, frozen = self.exchange(None).fetch(self.units.outer_of(sources)), self.frozen(None)
        x, enter_vjp = vjp_trained(lambda w: self.units.enter(w, batch), outer, frozen)
        saved, glue, queue, names = {}, {}, (), self.units.names
        for k, name in enumerate(names):
            if k:  # the glue reads the outer unit gathered for enter (freed after the last glue)
                x, glue[name] = vjp_trained(lambda w, x, name=name: self.units.between(w, name, x, batch),
                                            outer, frozen, x)
            # The last stack's forward goes on gathering its backward's first units (prefetch).
            wrap = k == len(names) - 1 and self.ahead > 0 and not self.keep
            step = lambda x, w, e, name=name: self.block_forward(name, structures[name], x, w, e)
            x, saved[name], queue = queued_scan(step, self.exchange(name).fetch, sources[name], (), x, self.ahead,
                                                wrap=wrap)
        return Tape(x, outer if self.keep else None, saved, enter_vjp, glue, queue)

    def backward(self, tape: Tape, sources, shards, batch, scale, structures: dict):
        """The loss (the outer unit gathered again, or kept), then every unit's gradient in
        reverse order. Returns (w·l / n_calls, w / n_calls, gradients)."""
        outer_ex = self.exchange(None)
        # Packed in reverse, this gather stays distinct from enter's (UnitLayout), so enter's is freed.
        outer = tape.outer if self.keep else self.exchange(None, reverse=True).fetch(self.units.outer_of(sources))
        (loss, weight), exit_vjp = vjp_trained(lambda w, x: self.units.exit(w, x, batch), outer, self.frozen(None),
                                               tape.x)
        share = weight / self.n_calls  # this call's part of the step's loss
        d_outer, dx = exit_vjp((scale.astype(jnp.float32) * share, jnp.zeros_like(weight)))
        grads, names = {}, self.units.names
        for k in reversed(range(len(names))):
            name, ex = names[k], self.exchange(names[k])
            source, fetch = (tape.saved[name][1], lambda w: w) if self.keep else (sources[name], ex.fetch)
            step = lambda dy, w, xs, name=name, ex=ex: self.block_backward(name, structures[name], ex.send, dy, w, xs)
            queue = tape.queue if k == len(names) - 1 else ()
            dx, grads[name], _ = queued_scan(step, fetch, source, (tape.saved[name], shards.get(name, {})), dx,
                                             0 if self.keep else self.ahead, reverse=True, queue=queue or None)
            if k:
                d_glue, dx = tape.glue_vjps[name](dx)
                d_outer = _add(d_outer, d_glue)
        (d_enter,) = tape.enter_vjp(dx)
        grads.update(outer_ex.send(_add(d_outer, d_enter), self.units.outer_of(shards)))
        grads = {k: v for k, v in grads.items() if jax.tree.leaves(v)}  # a stack with nothing trained
        return loss * share, share, jax.tree.map(lambda g: g.astype(jnp.float32), grads)

    def local_grads(self, sources, shards, batch, scale):
        """This device's part of the loss, its weight, and its gradient, for one microbatch.

        `sources`: what units are fetched from (master shards at stage 3, whole weights else);
        `shards`: the trained leaves' master shards (the layout gradients are reduce-scattered into)."""
        structures = {name: {} for name in self.units.names}
        tape = self.forward(sources, batch, structures)
        return self.backward(tape, sources, shards, batch, scale, structures)


def make_loss_and_grads(mesh, plan: Plan, policy: Policy, units: Units, options: StepOptions):
    """(master, batch, scale) -> (loss, fp32 gradient of scale x loss in the plan's grad layout),
    computed per device in `jax.shard_map` by the unit schedule of the plan's stage."""
    n_devices, stage, k = mesh.shape[REPLICA] * mesh.shape[DATA], plan.layout, options.grad_accum
    schedule = Schedule(units, plan, policy, options, n_devices * k)
    frozen = plan.frozen

    def by_group(leaves, fn, *trees):
        """fn(layout, *subtrees) for the outer unit and for each whole stack of `leaves` (a plan)."""
        layout = lambda sub: UnitLayout(sub, False, plan.data_size)
        out = fn(layout(units.outer_of(leaves)), *[units.outer_of(t) for t in trees])
        return {**out, **{name: fn(layout(leaves[name]), *[t[name] for t in trees])
                          for name in units.names if name in leaves}}

    def sources(master):
        """What the units are fetched from: shards (stage 3), or weights whole during the step."""
        if stage.gather_per_unit:
            return master
        if stage.gather_per_step:  # one all_gather per unit group per step
            return by_group(plan.leaves, lambda lay, m: lay.gather(m, policy), master)
        return jax.tree.map(lambda x: x.astype(policy.gather), plan.unpad(read_weights(master, weights_dtype(policy))))

    def reduce(grads, master):
        """What is left to reduce at the end of the step (`master`: the trained leaves')."""
        if not stage.grads:
            grads = jax.tree.map(lambda g: jax.lax.psum(g.astype(policy.reduce), (REPLICA, DATA)), plan.pad(grads))
        elif stage.scatter_per_step:
            grads = by_group(plan.trained_leaves, lambda lay, g, m: lay.scatter(g, m, policy), grads, master)
        if stage.grads and mesh.shape[REPLICA] > 1:
            grads = jax.tree.map(lambda g: jax.lax.psum(g, REPLICA), grads)
        return jax.tree.map(lambda g: g.astype(jnp.float32), grads)

    def local(master, batch_BS, scale):
        weights, shards = sources(master), trained(master, frozen)
        if k == 1:
            loss, weight, grads = schedule.local_grads(weights, shards, batch_BS, scale)
        else:
            like = shards if stage.accum else trained(weights, frozen)  # sharded, or whole local gradients

            def body(acc, micro_BS):
                return _add(acc, schedule.local_grads(weights, shards, micro_BS, scale)), None

            zero = jnp.zeros((), jnp.float32)
            acc = (zero, zero, jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), like))
            (loss, weight, grads), _ = jax.lax.scan(body, acc, microbatches(batch_BS, k))
        loss, weight = jax.lax.psum((loss, weight), (REPLICA, DATA))
        # Σ w·l / Σ w (protocol.py); with bare losses every weight is 1 and this divides by 1.
        return loss / weight, jax.tree.map(lambda g: g / weight, reduce(grads, shards))

    return jax.shard_map(local, mesh=mesh, in_specs=(plan.master_specs, P(BATCH_AXES), P()),
                         out_specs=(P(), plan.grad_specs), check_vma=False)


def gathered_weights(mesh, plan: Plan, policy: Policy, units: Units):
    """master -> every weight whole (true shapes), as the step's forward computes with it at
    stages 1-3: each unit (stage 3) or unit group (stages 1, 2: the outer unit, each whole
    stack) gathered on its own, in the gather dtype (a quantized one dequantized into the
    compute dtype). What a quantized gather does to the weights, to compare runs and measure
    its error. (Stage 3's second gather of the outer unit packs its leaves in reverse,
    `UnitLayout`: where a block straddles two of them, `exit` sees other blocks.)"""
    n, per_unit = plan.data_size, plan.layout.gather_per_unit

    def local(master):
        whole = UnitLayout(units.outer_of(plan.leaves), False, n).gather(units.outer_of(master), policy)
        for name in units.names:
            layout = UnitLayout(plan.leaves[name], per_unit, n)
            whole[name] = (jax.lax.map(lambda w, layout=layout: layout.gather(w, policy), master[name]) if per_unit
                           else layout.gather(master[name], policy))
        return whole

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(plan.master_specs,), out_specs=P(), check_vma=False))
