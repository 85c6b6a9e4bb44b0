"""What a model's units hold and do, traced from the model itself on abstract values: the
activations a block keeps, a unit's working set, stage 3's transient estimate and the
weight-gathering or activation-moving regime."""

from __future__ import annotations

import math
import jax
import numpy as np
import jax.numpy as jnp
from zerojax.schedules import quant
from zerojax.parallel.mesh import DATA
from zerojax.models.protocol import REMAT_POLICIES
from zerojax.schedules import residuals
from zerojax.train import step as step_lib


# ---------------------------------------------------------------------------------------------
# What a model's units hold and do, traced from the model itself on abstract values.


def local_rows(cfg, engine) -> int:
    """Rows of one microbatch on one device."""
    return cfg.train.global_batch // cfg.train.grad_accum // engine.mesh.devices.size


def unit_params(engine, name: str | None, dtype):
    """Abstract parameters (true shapes) of the outer unit (None) or of one layer of a stack."""
    if name is None:
        return jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, dtype), engine.units.outer_of(engine.plan.leaves))
    return jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape[1:], dtype), engine.plan.leaves[name])


def unit_size(engine, name: str | None) -> int:
    """Parameters in the outer unit (None) or in one layer of stack `name`."""
    return sum(math.prod(p.shape) for p in jax.tree.leaves(unit_params(engine, name, jnp.float32)))


def stack_inputs(cfg, engine, rows: int) -> dict:
    """Per stack, the (abstract) activations a layer takes, for `rows` rows on one device."""
    units, compute = engine.units, engine.policy.compute
    batch = step_lib.batch_shape(cfg, rows)

    def trace(outer, batch):
        x, xs = units.enter(outer, batch), {}
        for k, name in enumerate(units.names):
            x = units.between(outer, name, x, batch) if k else x
            xs[name] = x  # a block keeps its input's shapes: the next stack's glue takes the same
        return xs

    return jax.eval_shape(trace, unit_params(engine, None, compute), batch)


def nbytes(tree) -> int:
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def compiled_temp(fn, *args) -> int:
    """XLA's temporary bytes for `fn` on one device: a unit's working set, measured."""
    return int(jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes)


def cotangent_like(x):
    """x as a cotangent of itself: its float leaves, and float0 zeros for its integer ones."""
    return jax.tree.map(lambda a: a if jnp.issubdtype(a.dtype, jnp.inexact)
                        else np.zeros(a.shape, jax.dtypes.float0), x)


def transient_estimate(cfg, engine, b_gather: int, b_reduce: int) -> dict:
    """Stage 3 under the explicit schedule: what its temporaries should be made of, per device,
    from the model's own units (an estimate to read next to XLA's measured temp_bytes)."""
    rows, units, compute = local_rows(cfg, engine), engine.units, engine.policy.compute
    xs = stack_inputs(cfg, engine, rows)
    depth = {name: jax.tree.leaves(engine.plan.leaves[name])[0].shape[0] for name in units.names}
    layer = max(unit_size(engine, name) for name in units.names)
    batch = step_lib.batch_shape(cfg, rows)

    def block_vjp(name):  # x as its own cotangent (float0 for integer leaves: positions, segment ids)
        return lambda w, x: jax.vjp(lambda w, x: units.block(name, w, x), w, x)[1](cotangent_like(x))

    # allow_int: a stream's integer and bool leaves (positions, prefix) pass through with no gradient
    exit_grad = jax.grad(lambda w, x, batch: units.exit(w, x, batch)[0], argnums=(0, 1), allow_int=True)
    last = units.names[-1]
    # One block's backward working set, or the loss's: XLA never holds both at once.
    work = max([compiled_temp(block_vjp(name), unit_params(engine, name, compute), xs[name]) for name in units.names]
               + [compiled_temp(exit_grad, unit_params(engine, None, compute), xs[last], batch)])
    saved = sum(depth[name] * saved_per_block(cfg, engine, name, xs[name]) for name in units.names)
    keep_outer = 0 if cfg.zero.reshard_after_forward else unit_size(engine, None)
    if quant.is_quantized(engine.policy.gather):  # a unit arrives as bytes, then is dequantized
        b_gather += engine.policy.compute.itemsize
    trained = sum(math.prod(x.stored) for x in jax.tree.leaves(engine.plan.trained_leaves))  # elements stored
    return {
        "activations": saved + work,  # what the blocks keep, plus one block's or the loss's working set
        # in the backward: the unit and its prefetched successors (and, kept from the forward
        # with reshard_after_forward=false, the outer unit)
        "gathered_units": round(((1 + cfg.zero.prefetch) * layer + keep_outer) * b_gather),
        "unit_gradient": 2 * layer * b_reduce,  # the unit's gradient and its flat layout
        # the fp32 gradient shards of the trained leaves, alive from the backward until the in-place Adam update
        "optimizer": 4 * trained // engine.plan.data_size,
    }


def saved_per_block(cfg, engine, name: str, x) -> int:
    """Bytes one layer of stack `name` keeps for its backward under `model.remat` in the explicit
    schedule: its input (full), or its vjp's residuals without the weights (dots, none), traced
    from the block itself on abstract values."""

    if cfg.model.remat == "full":
        return nbytes(x)
    w = unit_params(engine, name, engine.policy.compute)
    apply = lambda w, x: engine.units.block(name, w, x)
    frozen = engine.plan.frozen[name]
    kept = jax.eval_shape(
        lambda w, x: residuals.block_residuals(apply, REMAT_POLICIES[cfg.model.remat], w, frozen, x)[1], w, x)
    return nbytes(kept)


def regime(cfg, engine) -> dict:
    """Which bytes a unit should move: its weights (ZeRO-3) or its activations.

    Per unit and step, ZeRO-3 sends about 3 x its weights (two gathers and a reduce-scatter).
    Moving activations instead (tensor-parallel style, which GSPMD may pick on its own) sends
    about 3 passes x 4 matmul inputs x the data group's activations. With few tokens per device
    the second is smaller, and ZeRO-3 is the wrong schedule for that shape."""
    rows = local_rows(cfg, engine)
    xs = stack_inputs(cfg, engine, rows)
    name = max(engine.units.names, key=lambda n: unit_size(engine, n))  # the largest unit decides
    policy = engine.policy
    b_g = (quant.bytes_per_element(policy.quant_block, policy.quant_scale) if quant.is_quantized(policy.gather)
           else policy.gather.itemsize)
    weight_bytes = round(3 * unit_size(engine, name) * b_g)
    x_elements = sum(x.size for x in jax.tree.leaves(xs[name]))
    activation_bytes = 3 * 4 * engine.mesh.shape[DATA] * x_elements * engine.policy.compute.itemsize
    tokens = rows * cfg.model.seq_len
    moving_weights = weight_bytes <= activation_bytes
    return {"unit_weight_bytes": weight_bytes, "unit_activation_bytes": activation_bytes,
            "tokens_per_device": tokens,
            "regime": "weight-gathering" if moving_weights else "activation-moving",
            "advice": (f"ZeRO-3 / FSDP is the right schedule: a unit's weights ({weight_bytes:,} B per step) "
                       f"move fewer bytes than its activations would ({activation_bytes:,} B)")
            if moving_weights else
            (f"few tokens per device ({tokens}): moving a unit's activations ({activation_bytes:,} B per step) "
             f"sends less than gathering its weights ({weight_bytes:,} B); tensor parallelism (or GSPMD's own "
             "choice, zero.schedule=gspmd) fits this shape better, or raise train.global_batch")}
