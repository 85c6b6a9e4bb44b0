"""Nested-dict parameter trees: paths, the trained and frozen parts, microbatches, shardings."""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def path_name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def select(tree, mask, keep: bool = True):
    """The leaves of nested-dict `tree` whose `mask` (a pytree of bools like it) is `keep`, as a
    nested dict (dicts left empty dropped)."""
    if not isinstance(tree, dict):
        return tree if bool(mask) == keep else None
    out = {k: select(v, mask[k], keep) for k, v in tree.items()}
    return {k: v for k, v in out.items() if v is not None and not (isinstance(v, dict) and not v)}


def trained(tree, frozen):
    """The trained leaves of a nested-dict `tree` (frozen ones, and dicts left empty, dropped)."""
    return select(tree, frozen, False)


def frozen_part(tree, frozen):
    """The frozen leaves of `tree`, as a nested dict."""
    return select(tree, frozen, True)


def combine(a: dict, b: dict) -> dict:
    """Two disjoint nested dicts as one (the trained leaves and the frozen ones)."""
    out = dict(a)
    for k, v in b.items():
        out[k] = combine(out[k], v) if k in out else v
    return out


def microbatches(batch, k: int):
    """Every leaf [B, ...] as [k, B/k, ...]: microbatch j takes rows j, j+k, j+2k, ...; each
    device's contiguous block of rows splits evenly into the k microbatches, so no row moves
    between devices. The batch is any pytree of arrays with the batch axis first."""

    def split(x):
        return x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1)

    return jax.tree.map(split, batch)


def named(mesh: Mesh, specs):
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P))


def constrain(tree, mesh: Mesh, specs):
    """with_sharding_constraint leaf by leaf: where XLA must place each value."""
    return jax.lax.with_sharding_constraint(tree, named(mesh, specs))
