"""The train state: fp32 master weights (or frozen leaves as stored), optax state, the step and
loss-scale counters, born in the plan's layout and placed where `zero.offload` says, and the
views of it that the step, eval and sampling read.

Its functions take the Engine (`train.step`, which imports this module) for its plan, offload,
policy and optimizer; it is not imported here, so the two modules stay one-way.
"""

from __future__ import annotations

from typing import Any, NamedTuple
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P
from zerojax.optim import offload as offload_lib
from zerojax.precision import LossScaleState
from zerojax.parallel import plan as plan_lib
from zerojax.parallel import trees
from zerojax.schedules import storage
from zerojax.train.model import build_model


class TrainState(NamedTuple):
    step: jax.Array  # optimizer updates applied
    params: Any  # a nested dict in the plan's master layout (padded): fp32 master weights of the
    #              trained leaves, and the frozen leaves themselves (precision.frozen)
    opt_state: Any  # optax state (Adam moments in fp32) of the trained leaves, laid out like them
    skipped: jax.Array  # consecutive non-finite steps
    loss_scale: LossScaleState
    weights: Any = None  # zero.offload=optimizer+master: the trained leaves in the gather dtype, on the
    #                      device, in the master layout (what forward and backward read); else None
    ema: Any = None  # optim.ema > 0: the moving average of the trained leaves' fp32 master, laid out as
    #                  the master (sharded at stages 1-3, 4 bytes a trained parameter); else None


# ---------------------------------------------------------------------------------------------
# Views of the state: what the step, eval and sampling read of it.


def weights_of(engine, params):
    """The device copy of the trained leaves that `optimizer+master` keeps (else None), as
    `storage.stored_weights` keeps it (bf16 as its bits)."""
    if not engine.offload.master:
        return None
    trained = offload_lib.to_device(trees.trained(params, engine.plan.frozen))
    return storage.stored_weights(trained, engine.weights_dtype)


def step_params(engine, state: TrainState):
    """What the train step's forward and backward read: the master, or with the master on
    the host, its device copy (as stored) beside the frozen leaves."""
    if not engine.offload.master:
        return state.params
    return trees.combine(state.weights, trees.frozen_part(state.params, engine.plan.frozen))


def forward_params(engine, state: TrainState):
    """What eval and sampling read: `step_params` with the device copy's values."""
    return storage.read_weights(step_params(engine, state), engine.weights_dtype)


# ---------------------------------------------------------------------------------------------
# The state's layout and its birth.


def state_shardings(engine, abstract_state: TrainState):
    """Where each part of the state lives: the plan's layout, in host memory where zero.offload
    puts it (every optimizer-state copy of a parameter; the trained leaves' master and their EMA)."""
    plan, offload = engine.plan, engine.offload  # frozen leaves: sharded at stage 3 only, never offloaded
    weights = plan.specs(plan.layout.master, plan.trained_leaves) if offload.master else None
    ema = plan.specs(plan.layout.master, plan.trained_leaves) if abstract_state.ema is not None else None
    specs = TrainState(P(), plan.master_specs, plan_lib.state_specs(abstract_state.opt_state, plan,
                                                                         plan.layout.master),
                       P(), jax.tree.map(lambda _: P(), abstract_state.loss_scale), weights, ema)
    shardings = trees.named(engine.mesh, specs)
    if offload.moments:
        copies = plan_lib.map_like_params(abstract_state.opt_state, plan, lambda *_: True, lambda _: False)
        shardings = shardings._replace(opt_state=jax.tree.map(
            lambda s, host: offload_lib.on_host(s) if host else s, shardings.opt_state, copies))
    if offload.master:
        shardings = shardings._replace(params=plan.map(
            lambda leaf, s: s if leaf.frozen else offload_lib.on_host(s), shardings.params))
        if ema is not None:  # optim.ema: where the master is
            shardings = shardings._replace(ema=jax.tree.map(offload_lib.on_host, shardings.ema))
    return shardings


def init_state(engine, *, abstract: bool = False, loaded: dict | None = None) -> TrainState:
    """Master weights and optimizer state, born in the plan's layout (never gathered whole).

    With `abstract`, only the shapes and shardings (for compiling without allocating);
    `loaded`: parameters (true or stored shapes) to start from instead of the model's
    initialisation; leaves it lacks (new LoRA adapters) are initialised (XLA drops the rest of
    the initialisation, whose values are not used)."""
    plan = engine.plan

    def init(loaded) -> TrainState:
        if loaded is None or jax.tree.structure(loaded) != jax.tree.structure(plan.leaves):
            model = build_model(engine.model, engine.policy, engine.seed, engine.lora)
            fresh = nnx.to_pure_dict(nnx.state(model, nnx.Param))
            loaded = fresh if loaded is None else _fill(fresh, loaded)
        params = plan.cast(plan.pad(loaded))
        zero = jnp.zeros((), jnp.int32)
        trained = trees.trained(params, plan.frozen)
        opt_state = engine.optimizer.init(trained)
        # The EMA starts at the initial weights (openpi's), in its own buffers (a copy: the state
        # is donated to the step, and one buffer cannot be two of its leaves).
        ema = jax.tree.map(jnp.copy, trained) if engine.ema else None
        return TrainState(zero, params, opt_state, zero, engine.scaler.init(), weights_of(engine, params), ema)

    shapes = jax.eval_shape(init, None)
    shardings = state_shardings(engine, shapes)
    if abstract:
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)
    return jax.jit(init, out_shardings=shardings)(loaded)


def _fill(fresh: dict, loaded: dict) -> dict:
    """`fresh` with every leaf that `loaded` has replaced by loaded's."""
    return {k: (_fill(v, loaded[k]) if isinstance(v, dict) else loaded[k]) if k in loaded else v
            for k, v in fresh.items()}
