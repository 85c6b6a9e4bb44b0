"""What a block keeps for its backward under the explicit schedule: the vjp of its trained
leaves, its residuals without its weights, and their layout (`Residuals`), traced once.

Gathered weights are never autodiff residuals: the weights among a block's residuals are found
by identity and left out, with their slots; the backward puts the re-gathered weights back in
their places. `model.remat` chooses what else is kept (`models.protocol.REMAT_POLICIES`)."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax

from zerojax.models.protocol import REMAT_POLICIES
from zerojax.parallel.trees import combine, frozen_part, trained


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


class Residuals(NamedTuple):
    """What one layer of a stack keeps for its backward, as a layout traced once from abstract
    values: the dtypes of what is saved (stored as bits, `storage.as_bits`), and for
    remat=none|dots the pullback's treedef and, for each of its leaves, the index of the weight
    it is (None: a residual that is saved). Every trace of a block (the scan body, the unrolled
    prefetch units) has this layout; the backward rebuilds the pullback from it."""

    dtypes: tuple
    treedef: Any = None
    slots: tuple = ()
