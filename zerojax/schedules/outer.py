"""The outer unit split by use: which of its leaves `enter` (with the glue) and `exit` read.

The outer unit holds every parameter outside the stacks: for a language model the token
embedding and, untied, the LM head, each V x D (Llama-3-8B: 128,256 x 4,096, 0.5B parameters
each). Gathered and differentiated whole, at stage 3 it was the step's largest temporary: the
exit's gather held the embedding it never reads, and the head's gradient (and a zero gradient
for it from `enter`) stayed alive from the loss through the whole backward to the one
reduce-scatter at the end. So the explicit schedule gathers for each of `enter` and `exit` only
the leaves that function reads, differentiates only those, and reduce-scatters the gradient of
leaves that only `exit` reads right after the loss (`Split`).

Which leaves a function reads is found from its jaxpr, traced on abstract values: a leaf is read
when an equation (or the output) takes it. That is conservative (a leaf handed to a nested call
that ignores it counts as read), so a split never drops a gradient; at worst it splits less.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from zerojax.parallel.trees import select


def reads(fn: Callable, plans, dtype, *args):
    """A mask like `plans` (the outer unit's LeafPlans): which leaves fn(weights, *args) reads.
    Traced on abstract values: the weights at their true shapes in `dtype`, `args` as given."""
    w = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, dtype), plans)
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), args)
    jaxpr = jax.make_jaxpr(fn)(w, *abstract).jaxpr
    used = {id(v) for eqn in jaxpr.eqns for v in eqn.invars} | {id(v) for v in jaxpr.outvars}
    n = len(jax.tree.leaves(w))
    return jax.tree.unflatten(jax.tree.structure(plans), [id(v) in used for v in jaxpr.invars[:n]])


def union(a, b):
    return jax.tree.map(lambda x, y: x or y, a, b)


class Split(NamedTuple):
    """The outer unit's leaves by use (masks like its plans): `front` read by enter or the glue,
    `back` by exit. `early` (back and not front) is reduce-scattered right after exit; `late`
    (every other leaf) at the end of the backward, as before."""

    front: Any
    back: Any

    @property
    def early(self):
        return jax.tree.map(lambda f, b: b and not f, self.front, self.back)

    @property
    def late(self):
        return jax.tree.map(lambda f, b: f or not b, self.front, self.back)


def placeholders(plans, mask, dtype):
    """Zeros at the true shapes of the leaves `mask` leaves out: what the unit's function is
    given in their place (it does not read them, so XLA drops them)."""
    return jax.tree.map(lambda p: jnp.zeros(p.shape, dtype), select(plans, mask, keep=False))


def fill(grads: dict, plans: dict, dtype) -> dict:
    """`grads` with a zero gradient for every leaf of `plans` it lacks (a trained leaf that no
    function read: its gradient is zero)."""
    if not isinstance(plans, dict):
        return grads if grads is not None else jnp.zeros(plans.shape, dtype)
    return {k: fill(grads.get(k) if isinstance(grads, dict) else None, v, dtype) for k, v in plans.items()}


def after(tree, dep):
    """`tree` made to depend on `dep` (a pytree with a non-empty leaf): each numeric leaf plus
    0 x one element of dep (as float32, cast to the leaf's dtype: the weights as stored may be
    uint16 bits). XLA keeps a float x * 0 (it is NaN for an infinite x), so the dependence
    survives where `lax.optimization_barrier` does not (XLA's CPU pipeline removes barriers
    before it schedules). Costs one fused add per element of `tree` (a shard)."""
    first = next((a for a in jax.tree.leaves(dep) if a.size), None)
    if first is None:
        return tree
    zero = first.ravel()[0].astype(jnp.float32) * 0.0
    return jax.tree.map(lambda a: a if a.dtype == jnp.bool_ else a + zero.astype(a.dtype), tree)
