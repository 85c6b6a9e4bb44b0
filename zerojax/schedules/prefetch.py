"""The prefetching scan over a stack's layers (`queued_scan`): the gather of unit i+k issued
before unit i computes, and layer-by-layer reads and writes of stacked leaves."""

from __future__ import annotations

from typing import Callable
import jax
import jax.numpy as jnp


def layer_at(tree, i):
    """Layer i of stacked leaves (i may be traced: a dynamic slice, not a copy of the stack)."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def layer_put(tree, piece, i):
    """Stacked leaves with layer i replaced by `piece` (in place on a donated buffer)."""
    return jax.tree.map(lambda a, p: jax.lax.dynamic_update_index_in_dim(a, p, i, 0), tree, piece)


def queued_scan(step: Callable, gather: Callable, sources, extras, carry, ahead: int, *, reverse: bool = False,
                queue: tuple | None = None, wrap: bool = False, into=None):
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
    would be a copy of the whole stack alive next to the units). `into`: [L, ...] buffers the
    outputs are added into (train.grad_accum's running sums), instead of new ones.
    Returns (carry, outs, queue)."""
    L = jax.tree.leaves(sources)[0].shape[0]
    ahead = min(ahead, L)
    unit = (lambda j: L - 1 - j) if reverse else (lambda j: j)
    # The unit gathered k places ahead: k < L in this pass's order, then the reverse pass's.
    upcoming = lambda k: unit(k) if not wrap else jnp.where(k < L, unit(k), unit(2 * L - 1 - k))
    if queue is None:
        queue = tuple(gather(layer_at(sources, unit(j))) for j in range(ahead))
    out_shapes = jax.eval_shape(lambda c, w, e: step(c, w, e)[1], carry, queue[0] if queue else gather(layer_at(sources, 0)),
                                layer_at(extras, 0))
    outs = jax.tree.map(lambda s: jnp.zeros((L,) + s.shape, s.dtype), out_shapes) if into is None else into

    def compute(state, weights, i):
        carry, outs = state
        carry, out = step(carry, weights, layer_at(extras, i))
        if into is not None:
            out = jax.tree.map(lambda a, b: a + b, layer_at(outs, i), out)
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
