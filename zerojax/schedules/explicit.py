"""The explicit FSDP unit schedule (`zero.schedule=shard_map`), written out in `jax.shard_map`.

Each device holds its shards of the fp32 master weights and its rows of the batch. The loss
and gradient are computed by an explicit forward and backward pass over the model's units
(`zerojax.models.protocol`: the outer unit, every parameter outside the stacks, and one unit
per layer of each stack), not by autodiff of the whole step, so where weights are gathered and
freed is decided here and nowhere else:

    forward:   gather the outer unit's leaves that enter and the glue read; enter; free them
               (after the last `between`, with several stacks); for each layer of each stack:
               gather, compute, free; gather the outer leaves that exit reads; exit (the loss)
    backward:  exit's vjp (those leaves still gathered), free them; reduce-scatter the gradient
               of the leaves only exit reads (an untied LM head); for each layer in reverse:
               gather again, vjp, reduce-scatter its gradient (added into train.grad_accum's
               running sums in the loop), free; the glue's and enter's vjps (for a token
               embedding a scatter-add into the rows it read: it keeps the token ids, not the
               weights); reduce-scatter the rest of the outer unit's gradient

Every unit is thus gathered twice per microbatch and reduce-scattered once, as docs/design.md §2
counts (FSDP likewise keeps its root unit gathered from the loss's forward into its backward);
the outer unit is split by use (`schedules.outer`), so an untied head is gathered once and its
gradient sent on before the layers' backward, and the outer unit's gathers wait for the
microbatch (XLA would hoist them out of the accumulation loop and hold them all step).

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

The stage's table (`zerojax.parallel.stages.LAYOUTS`) picks what "gather" and "scatter" mean, once:
    3  gather = all_gather per unit per pass; scatter = psum_scatter per unit
    2  weights all-gathered once per step; scatter = psum_scatter per unit in the backward
    1  weights all-gathered once per step; full local gradients (accumulated over
       microbatches), one psum_scatter per unit group at the end of the step
    0  replicated weights; local gradients, one psum (all-reduce) at the end of the step
Leaves too small to shard are used as they are and their gradients psum'd. Hybrid meshes add a
psum over `replica` at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from zerojax.parallel.mesh import BATCH_AXES, DATA, REPLICA
from zerojax.models.protocol import REMAT_POLICIES, Units
from zerojax.precision import Policy
from zerojax.parallel.plan import Plan
from zerojax.parallel.trees import combine, microbatches, select, trained
from zerojax.schedules import outer as outer_split
from zerojax.schedules.flat import UnitLayout
from zerojax.schedules.options import StepOptions
from zerojax.schedules.residuals import Residuals, block_residuals, vjp_trained
from zerojax.schedules.prefetch import queued_scan
from zerojax.schedules.storage import as_bits, from_bits, read_weights, weights_dtype


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
    residuals: dict  # per stack: the Residuals layout its saved values follow
    split: outer_split.Split  # the outer unit's leaves by use (enter and glue, exit)


def _add(a, b):
    return jax.tree.map(jnp.add, a, b)


def _merge_add(a: dict, b: dict) -> dict:
    """Two nested dicts of gradients as one: leaves in both added, the others kept."""
    out = dict(a)
    for k, v in b.items():
        out[k] = (_merge_add(out[k], v) if isinstance(v, dict) else out[k] + v) if k in out else v
    return out


def _or_not(frozen, mask):
    """A frozen mask that also closes over the leaves `mask` leaves out (not differentiated)."""
    return jax.tree.map(lambda f, m: f or not m, frozen, mask)


@dataclass(frozen=True)
class UnitPasses:
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

    def exchange(self, name: str | None, reverse: bool = False, mask=None) -> Exchange:
        """The outer unit's (name None; `mask`: only those of its leaves) or one layer of stack
        `name`'s exchange."""
        leaves, stage, n = self.unit_of(self.plan.leaves, name), self.plan.layout, self.plan.data_size
        frozen = self.frozen(name)
        if mask is not None:
            leaves, frozen = select(leaves, mask), select(frozen, mask)
        layout = UnitLayout(leaves, name is not None, n, reverse)
        grad_layout = UnitLayout(trained(leaves, frozen), name is not None, n)
        return Exchange(layout, grad_layout, self.policy, stage.gather_per_unit, stage.scatter_per_unit)

    def split(self, batch) -> outer_split.Split:
        """Which outer leaves enter and the glue read, and which exit reads (traced once, on
        abstract values; the stacks keep their activations' shapes, so they are skipped)."""
        plans, dtype = self.units.outer_of(self.plan.leaves), self.policy.compute

        def front(w, batch):
            x = self.units.enter(w, batch)
            for name in self.units.names[1:]:
                x = self.units.between(w, name, x, batch)
            return x

        abstract = lambda t: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), t)
        w = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, dtype), plans)
        x = jax.eval_shape(front, w, abstract(batch))
        return outer_split.Split(outer_split.reads(front, plans, dtype, abstract(batch)),
                                 outer_split.reads(lambda w, x, b: self.units.exit(w, x, b), plans, dtype, x,
                                                   abstract(batch)))

    def fetch_outer(self, sources, mask, after, reverse: bool = False):
        """The outer unit with the leaves of `mask` gathered, zeros (unread) for the others.
        The gather waits for `after` (the microbatch's batch or activations, `outer_split.after`):
        else XLA hoists it out of the train.grad_accum loop (its sources are the same in every
        microbatch) or schedules exit's before the forward, and the gathered unit is held
        through the step."""
        plans = self.units.outer_of(self.plan.leaves)
        source = select(self.units.outer_of(sources), mask)
        if self.plan.layout.gather_per_unit:  # else the sources are the weights, whole all step
            source = outer_split.after(source, after)
        got = self.exchange(None, reverse, mask).fetch(source)
        return combine(got, outer_split.placeholders(plans, mask, self.policy.compute))

    def send_outer(self, grads: dict, shards, mask) -> dict:
        """The outer unit's gradient of the leaves of `mask` sent on (zero for a trained leaf of
        `mask` that nothing read)."""
        like = select(self.units.outer_of(shards), mask)
        if not jax.tree.leaves(like):
            return {}
        plans = trained(select(self.units.outer_of(self.plan.leaves), mask), select(self.frozen(None), mask))
        return self.exchange(None, mask=mask).send(outer_split.fill(grads, plans, self.policy.compute), like)

    def unit_of(self, tree, name: str | None):
        return self.units.outer_of(tree) if name is None else tree.get(name, {})

    def frozen(self, name: str | None):
        """The unit's mask of frozen leaves."""
        return self.unit_of(self.plan.frozen, name)

    def as_compute(self, w):
        """Weights enter a block in the compute dtype (as the model would cast them), so that the
        only weight-sized residuals of its vjp are the weights themselves."""
        return jax.tree.map(lambda a: a.astype(self.policy.compute), w)

    def residuals_of(self, name: str, x) -> Residuals:
        """The layout of what one layer of stack `name` keeps, for input `x`: traced once, on
        abstract values (the block's weights as gathered: true shapes, compute dtype)."""
        if self.recompute:
            return Residuals(tuple(a.dtype for a in jax.tree.leaves(x)))
        w = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape[1:], self.policy.compute), self.plan.leaves[name])
        pullback = []  # the trace's (treedef, slots): Python values, not arrays, so not eval_shape's output

        def trace(w, x):
            _, saved, *layout = block_residuals(self.block_fn(name), REMAT_POLICIES[self.options.remat], w,
                                                self.frozen(name), x)
            pullback.append(layout)
            return saved

        saved = jax.eval_shape(trace, w, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), x))
        treedef, slots = pullback[0]
        return Residuals(tuple(a.dtype for a in jax.tree.leaves(saved)), treedef, slots)

    def block_fn(self, name: str) -> Callable:
        return lambda w, x: self.units.block(name, w, x)

    def block_forward(self, name: str, residuals: Residuals, x, w, _):
        """A block's output and what its backward needs (its input, or its residuals without
        its weights, laid out as `residuals` says), plus its gathered weights when they are kept."""
        kept = w if self.keep else None
        if self.recompute:
            y, saved = self.units.block(name, w, x), x
        else:
            y, saved, _, slots = block_residuals(self.block_fn(name), REMAT_POLICIES[self.options.remat],
                                                 self.as_compute(w), self.frozen(name), x)
            if slots != residuals.slots:  # a bug (in jax or here), never bad input
                raise AssertionError(f"the vjp residuals of a block of {name!r} differ between traces")
        return y, (as_bits(saved), kept)

    def block_backward(self, name: str, residuals: Residuals, send: Callable, dy, w, xs):
        """A block's input gradient, and its weight gradient sent on (reduce-scattered or not)."""
        (saved, _), shard = xs
        saved = from_bits(saved, residuals.dtypes)
        if self.recompute:
            _, vjp = vjp_trained(self.block_fn(name), w, self.frozen(name), saved)
        else:
            weights, values = jax.tree.leaves(self.as_compute(w)), iter(saved)
            vjp = jax.tree.unflatten(residuals.treedef, [next(values) if k is None else weights[k]
                                                         for k in residuals.slots])
        dw, dx = vjp(dy)
        return dx, send(dw, shard)

    def forward(self, sources, batch) -> Tape:
        """enter, each stack's layers (and the glue between stacks), up to the loss's input."""
        split = self.split(batch)
        outer = self.fetch_outer(sources, outer_split.union(split.front, split.back) if self.keep else split.front,
                                 batch)
        frozen = _or_not(self.frozen(None), split.front)
        x, enter_vjp = vjp_trained(lambda w: self.units.enter(w, batch), outer, frozen)
        saved, glue, queue, names, residuals = {}, {}, (), self.units.names, {}
        for k, name in enumerate(names):
            if k:  # the glue reads the outer unit gathered for enter (freed after the last glue)
                x, glue[name] = vjp_trained(lambda w, x, name=name: self.units.between(w, name, x, batch),
                                            outer, frozen, x)
            # The last stack's forward goes on gathering its backward's first units (prefetch).
            wrap = k == len(names) - 1 and self.ahead > 0 and not self.keep
            residuals[name] = self.residuals_of(name, x)
            step = lambda x, w, e, name=name: self.block_forward(name, residuals[name], x, w, e)
            x, saved[name], queue = queued_scan(step, self.exchange(name).fetch, sources[name], (), x, self.ahead,
                                                wrap=wrap)
        return Tape(x, outer if self.keep else None, saved, enter_vjp, glue, queue, residuals, split)

    def backward(self, tape: Tape, sources, shards, batch, scale, acc=None):
        """The loss (the outer unit gathered again, or kept), then every unit's gradient in
        reverse order. Returns (w·l / n_calls, w / n_calls, gradients); with `acc` (the running
        sums of train.grad_accum) the gradients are added into it, a stack's layer by layer in
        its backward's loop (no second stack-sized gradient beside the sums)."""
        split = tape.split
        # Packed in reverse, this gather stays distinct from enter's (UnitLayout), so enter's is freed.
        outer = tape.outer if self.keep else self.fetch_outer(sources, split.back, tape.x, reverse=True)
        (loss, weight), exit_vjp = vjp_trained(lambda w, x: self.units.exit(w, x, batch), outer,
                                               _or_not(self.frozen(None), split.back), tape.x)
        share = weight / self.n_calls  # this call's part of the step's loss
        d_exit, dx = exit_vjp((scale.astype(jnp.float32) * share, jnp.zeros_like(weight)))
        # Leaves only exit reads (an untied LM head): their gradient leaves now, not after every layer's.
        early = self.send_outer(select(d_exit, split.early), shards, split.early)
        d_outer, names = select(d_exit, split.early, keep=False), self.units.names
        grads = {}
        for k in reversed(range(len(names))):
            name, ex = names[k], self.exchange(names[k])
            source, fetch = (tape.saved[name][1], lambda w: w) if self.keep else (sources[name], ex.fetch)
            step = lambda dy, w, xs, name=name, ex=ex: self.block_backward(name, tape.residuals[name], ex.send, dy, w,
                                                                           xs)
            queue = tape.queue if k == len(names) - 1 else ()
            into = acc.get(name) if acc is not None and jax.tree.leaves(acc.get(name, {})) else None
            dx, grads[name], _ = queued_scan(step, fetch, source, (tape.saved[name], shards.get(name, {})), dx,
                                             0 if self.keep else self.ahead, reverse=True, queue=queue or None,
                                             into=into)
            if k:
                d_glue, dx = tape.glue_vjps[name](dx)
                d_outer = _merge_add(d_outer, d_glue)
        (d_enter,) = tape.enter_vjp(dx)
        outer = combine(early, self.send_outer(_merge_add(d_outer, d_enter), shards, split.late))
        grads.update(outer if acc is None else _add(self.units.outer_of(acc), outer))
        grads = {k: v for k, v in grads.items() if jax.tree.leaves(v)}  # a stack with nothing trained
        return loss * share, share, jax.tree.map(lambda g: g.astype(jnp.float32), grads)

    def local_grads(self, sources, shards, batch, scale, acc=None):
        """This device's part of the loss, its weight, and its gradient (added into `acc`, when
        given), for one microbatch.

        `sources`: what units are fetched from (master shards at stage 3, whole weights else);
        `shards`: the trained leaves' master shards (the layout gradients are reduce-scattered into)."""
        return self.backward(self.forward(sources, batch), sources, shards, batch, scale, acc)


def make_loss_and_grads(mesh, plan: Plan, policy: Policy, units: Units, options: StepOptions):
    """(master, batch, scale) -> (loss, fp32 gradient of scale x loss in the plan's grad layout),
    computed per device in `jax.shard_map` by the unit schedule of the plan's stage."""
    n_devices, stage, k = mesh.shape[REPLICA] * mesh.shape[DATA], plan.layout, options.grad_accum
    passes = UnitPasses(units, plan, policy, options, n_devices * k)
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
            loss, weight, grads = passes.local_grads(weights, shards, batch_BS, scale)
        else:
            like = shards if stage.accum else trained(weights, frozen)  # sharded, or whole local gradients

            def body(acc, micro_BS):
                loss, weight, grads = acc
                l, w, grads = passes.local_grads(weights, shards, micro_BS, scale, grads)
                return (loss + l, weight + w, grads), None

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
