"""ZeRO stages as data: for every parameter leaf, the PartitionSpec of each of its copies.

A stage says which copies are split over the `data` axis (they are always replicated over
`replica`, the hybrid-sharding axis):

    stage  master + Adam moments  gradient  accumulator  compute params
    0      replicated             repl.     repl.        replicated      (DDP, NO_SHARD)
    1      sharded                sharded   repl.        replicated
    2      sharded                sharded   sharded      replicated      (SHARD_GRAD_OP)
    3      sharded                sharded   sharded      sharded         (FULL_SHARD)

Stage 1 reduces the full gradient once per step (its accumulator holds full gradients, as
ZeRO-1 keeps them); stage 2 keeps even the accumulator sharded. A sharded leaf is split along
one dim: the largest dim divisible by the data size, never the stacked layer axis, so that a
scan over layers slices a layer without communication. A parameter with fewer than
`min_shard_size` elements (per layer, for stacked leaves) stays replicated, as DeepSpeed's
`stage3_param_persistence_threshold` keeps small parameters whole: norms' scales and biases
then never wait on a gather, nor keep a unit's gathered buffer alive into the backward pass
(its bytes are reported as unsharded). A leaf with no
divisible dim is zero-padded along its largest dim up to a multiple of the data size: the
stored copies (master, moments) are padded, and `unpad` slices the true shape back wherever
the values are used, so padding never reaches the loss, a parameter count or an export.

Notation (scaling-book): `W[L, D_data, F]` is W with dim D sharded over the data axis.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from zerojax.parallel.mesh import DATA
from zerojax.parallel.stages import LAYOUTS, StageLayout
from zerojax.parallel.trees import path_name, trained


@dataclass(frozen=True)
class LeafPlan:
    path: str
    shape: tuple[int, ...]  # the parameter's true shape
    stored: tuple[int, ...]  # the shape of its stored copies (padded where needed)
    dim: int | None  # the dim split over `data`; None: always replicated
    dtype: str = "float32"  # of the stored copy: the fp32 master, or a frozen leaf's precision.frozen
    frozen: bool = False  # no master, no optimizer state, no gradient: stored as the weight itself

    @property
    def itemsize(self) -> int:
        return jnp.dtype(self.dtype).itemsize

    def spec(self, sharded: bool) -> P:
        if not sharded or self.dim is None:
            return P()
        return P(*[DATA if i == self.dim else None for i in range(len(self.stored))])

    @property
    def padded(self) -> bool:
        return self.stored != self.shape

    def pad(self, x):
        """A value of the true shape, zero-padded to the stored shape."""
        if not self.padded or tuple(x.shape) == self.stored:  # already stored (e.g. built sharded)
            return x
        return jnp.pad(x, [(0, s - t) for s, t in zip(self.stored, self.shape)])

    def unpad(self, x, layer: bool = False):
        """A stored value sliced back to the true shape (`layer`: one layer of a stacked leaf)."""
        shape = self.shape[1:] if layer else self.shape
        return x[tuple(slice(0, t) for t in shape)] if x.shape != shape else x


def choose_dim(shape: tuple[int, ...], n: int, first: int) -> tuple[int, tuple[int, ...]]:
    """The dim to shard (largest divisible by n, dims before `first` excluded) and stored shape."""
    dims = sorted(range(first, len(shape)), key=lambda d: (-shape[d], d))
    for d in dims:
        if shape[d] % n == 0:
            return d, shape
    d = dims[0]  # nothing divides: pad the largest dim
    return d, shape[:d] + (math.ceil(shape[d] / n) * n,) + shape[d + 1 :]


@dataclass(frozen=True)
class Plan:
    stage: int
    data_size: int
    leaves: dict  # a pytree like the params, of LeafPlan

    @property
    def layout(self) -> StageLayout:
        return LAYOUTS[self.stage]

    def specs(self, sharded: bool, leaves=None):
        return jax.tree.map(lambda leaf: leaf.spec(sharded), self.leaves if leaves is None else leaves)

    @property
    def master_specs(self):
        return self.specs(self.layout.master)

    @property
    def grad_specs(self):  # gradients exist for trained leaves only
        return self.specs(self.layout.grads, self.trained_leaves)

    @property
    def accum_specs(self):
        return self.specs(self.layout.accum, self.trained_leaves)

    @property
    def compute_specs(self):
        return self.specs(self.layout.compute)

    def pad(self, params):
        return self.map(lambda leaf, x: leaf.pad(x), params)

    def unpad(self, params):
        return self.map(lambda leaf, x: leaf.unpad(x), params)

    def map(self, fn, tree):
        """fn(leaf plan, x) over `tree`: the params or any part of them (the trained leaves)."""
        return jax.tree_util.tree_map_with_path(lambda path, x: fn(self.leaf(path_name(path)), x), tree)

    def leaf(self, path: str) -> LeafPlan:
        node = self.leaves
        for key in path.split("/"):
            node = node[key]
        return node

    @property
    def frozen(self):
        """A pytree of bools like the params: leaves that are not trained."""
        return jax.tree.map(lambda leaf: leaf.frozen, self.leaves)

    @property
    def trained_leaves(self):
        """The plan of the trained leaves only (what gradients and optimizer state cover)."""
        return trained(self.leaves, self.frozen)

    def cast(self, params):
        """Params as stored: frozen leaves in their precision.frozen dtype, the rest as given."""
        return self.map(lambda leaf, x: x.astype(leaf.dtype) if leaf.frozen else x, params)

    def rows(self) -> list[dict]:
        """One row per leaf for printing: path, shape, dim, padding, bytes per device."""
        out = []
        for leaf in jax.tree.leaves(self.leaves):
            sharded = self.layout.master and leaf.dim is not None
            stored = math.prod(leaf.stored) * leaf.itemsize
            out.append({"path": leaf.path, "shape": list(leaf.shape), "stored": list(leaf.stored),
                        "dim": leaf.dim, "spec": str(leaf.spec(self.layout.master)), "dtype": leaf.dtype,
                        "frozen": leaf.frozen,
                        "master_bytes_per_device": stored // self.data_size if sharded else stored})
        return out

    def unsharded_bytes(self) -> int:
        """Bytes of master weights that stay replicated (small leaves), per device."""
        return sum(math.prod(x.stored) * x.itemsize for x in jax.tree.leaves(self.leaves) if x.dim is None)


def make_plan(abstract_params, stage: int, data_size: int, min_shard_size: int,
              stacked: tuple[str, ...] = (), frozen=None, frozen_dtype: str = "bfloat16") -> Plan:
    """The plan for `abstract_params` (a pytree of shapes; nothing is allocated).

    `stacked` names the top-level units whose leaves carry a leading layer axis. `frozen` (a
    pytree of bools like the params) marks leaves that are not trained: they have no master
    copy, only the weight itself in `frozen_dtype`, laid out as the stage lays out compute
    weights (sharded at stage 3, replicated below it).
    """
    frozen = jax.tree.map(lambda _: False, abstract_params) if frozen is None else frozen

    def leaf_plan(path, x, is_frozen) -> LeafPlan:
        name, shape = path_name(path), tuple(x.shape)
        first = 1 if name.split("/")[0] in stacked else 0
        dtype = frozen_dtype if is_frozen else jnp.dtype(x.dtype).name
        # The threshold applies per unit: a stacked leaf is L parameters of one layer each.
        small = math.prod(shape[first:]) < min_shard_size or len(shape) <= first or data_size == 1
        if small or (is_frozen and not LAYOUTS[stage].compute):
            return LeafPlan(name, shape, shape, None, dtype, bool(is_frozen))
        dim, stored = choose_dim(shape, data_size, first)
        return LeafPlan(name, shape, stored, dim, dtype, bool(is_frozen))

    return Plan(stage, data_size, jax.tree_util.tree_map_with_path(leaf_plan, abstract_params, frozen))


def map_like_params(tree, plan: Plan, fn, other=lambda x: x, stored: bool = True):
    """Apply `fn(leaf_plan, x)` to the leaves of `tree` (an optax state, a checkpoint) that are
    copies of a parameter: their path ends in the parameter's path and their shape is its
    stored (padded) shape, or its true shape with `stored=False`. Adam's mu and nu qualify,
    whatever chain or mask wraps them; `other(x)` maps the rest (step counts, scalars)."""
    by_path = {tuple(leaf.path.split("/")): leaf for leaf in jax.tree.leaves(plan.leaves)}
    depths = {len(k) for k in by_path}

    def visit(path, x):
        names = tuple(path_name(path).split("/"))
        for n in depths:
            leaf = by_path.get(names[-n:])
            if leaf is not None and tuple(x.shape) == (leaf.stored if stored else leaf.shape):
                return fn(leaf, x)
        return other(x)

    return jax.tree_util.tree_map_with_path(visit, tree)


def state_specs(opt_state, plan: Plan, sharded: bool):
    """Specs for an optax state: copies of a parameter follow it; the rest is replicated."""
    return map_like_params(opt_state, plan, lambda leaf, _: leaf.spec(sharded), lambda _: P())
