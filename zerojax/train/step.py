"""The train step: the model chosen by `model.family`, TrainState, init, and the jitted step
under either schedule. No run loop (`train.py`), so `zerojax analyze` builds a step without it.

Every ZeRO stage is the same step with a different sharding plan (`zerojax.sharding`): the fp32
master weights and Adam moments live in the plan's master layout and the optimizer updates
them where they lie. The loss and gradient come from one of two schedules with one signature,
`make_loss_and_grads(mesh, plan, policy, units, options)`: `fsdp` (`zero.schedule=shard_map`,
the explicit unit schedule) or `gspmd` (annotations left to XLA).
"""

from __future__ import annotations

from dataclasses import dataclass
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from zerojax.schedules import gspmd
from zerojax.optim import offload as offload_lib
from zerojax.parallel import mesh as mesh_lib
from zerojax.config import Config, LoraConfig, ModelConfig
from zerojax.errors import ConfigError
from zerojax.models import Units
from zerojax.optim import make_optimizer, make_schedule, optimizer_parts
from zerojax.precision import LossScaler, Policy, make_loss_scaler, make_policy
from zerojax.parallel import plan as plan_lib
from zerojax.parallel import trees
from zerojax.schedules import explicit
from zerojax.schedules.options import StepOptions
from zerojax.schedules import storage
from zerojax.train.model import abstract_model, param_plan
from zerojax.train.state import TrainState, init_state, state_shardings


SCHEDULES = {"shard_map": explicit.make_loss_and_grads, "gspmd": gspmd.make_loss_and_grads}


# ---------------------------------------------------------------------------------------------
# Everything the compiled step needs, and nothing of the loop.


@dataclass(frozen=True)
class Engine:
    model: ModelConfig
    seed: int
    mesh: Mesh
    policy: Policy
    units: Units  # the model's units (graphdefs); parameters travel separately
    plan: plan_lib.Plan  # also says which leaves are frozen (LeafPlan.frozen)
    lora: LoraConfig
    optimizer: optax.GradientTransformation
    lr: optax.Schedule
    scaler: LossScaler
    schedule: str  # shard_map | gspmd
    options: StepOptions
    offload: offload_lib.Offload = offload_lib.Offload()
    clip: optax.GradientTransformation | None = None  # `optimizer`'s two parts (optim.optimizer_parts)
    elementwise: optax.GradientTransformation | None = None

    def view(self, master):
        """The model over the compute view of the master weights (eval, sampling)."""
        return self.units.model(gspmd.compute_view(master, self.mesh, self.plan, self.policy))

    @property
    def weights_dtype(self):
        """The dtype of the device copy of offloaded master weights (`storage.weights_dtype`)."""
        return storage.weights_dtype(self.policy)

    def weights_of(self, params):
        """The device copy of the trained leaves that `optimizer+master` keeps (else None), as
        `storage.stored_weights` keeps it (bf16 as its bits)."""
        if not self.offload.master:
            return None
        trained = offload_lib.to_device(trees.trained(params, self.plan.frozen))
        return storage.stored_weights(trained, self.weights_dtype)

    def step_params(self, state: TrainState):
        """What the train step's forward and backward read: the master, or with the master on
        the host, its device copy (as stored) beside the frozen leaves."""
        if not self.offload.master:
            return state.params
        return trees.combine(state.weights, trees.frozen_part(state.params, self.plan.frozen))

    def forward_params(self, state: TrainState):
        """What eval and sampling read: `step_params` with the device copy's values."""
        return storage.read_weights(self.step_params(state), self.weights_dtype)


def make_engine(cfg: Config, mesh: Mesh) -> Engine:
    """The Engine of `cfg` on `mesh`; bad input surfaces here as ConfigError, before any work."""
    dp, micro = mesh_lib.data_parallel_size(mesh), cfg.train.global_batch // cfg.train.grad_accum
    if micro % dp:
        raise ConfigError(
            f"train.global_batch={cfg.train.global_batch} / train.grad_accum={cfg.train.grad_accum} "
            f"= {micro} rows per microbatch must be divisible by the data-parallel size "
            f"mesh.replica x mesh.data = {dp}; try train.global_batch={cfg.train.grad_accum * dp * max(1, round(micro / dp))}"
        )
    p = cfg.precision
    policy = make_policy(p.param, p.compute, p.gather, p.reduce, mesh.devices.flat[0].platform, cfg.zero.quant_block)
    scaler = make_loss_scaler(p.loss_scale, policy, initial_scale_power=p.initial_scale_power,
                              loss_scale_window=p.loss_scale_window, hysteresis=p.hysteresis,
                              min_loss_scale=p.min_loss_scale)
    lora = cfg.optim.lora
    model = abstract_model(cfg.model, policy, cfg.train.seed, lora)
    units = Units.of(model)
    plan = param_plan(cfg, model, units.names, cfg.zero.stage, mesh.shape[mesh_lib.DATA])
    z = cfg.zero
    offload_lib.check_backend(mesh, z.offload)
    options = StepOptions(cfg.train.grad_accum, cfg.model.remat, z.prefetch, z.reshard_after_forward)
    clip, elementwise = optimizer_parts(cfg.optim, cfg.train.steps)
    return Engine(cfg.model, cfg.train.seed, mesh, policy, units, plan, lora,
                make_optimizer(cfg.optim, cfg.train.steps), make_schedule(cfg.optim, cfg.train.steps), scaler,
                z.schedule, options, offload_lib.Offload(z.offload), clip, elementwise)


def make_train_step(step: Engine, abstract_state: TrainState | None = None):
    """The jitted step: scaled gradients, unscaled in fp32, global norm, AdamW.

    A step whose gradient is not finite changes nothing but the loss-scale state: parameters,
    Adam moments and the optimizer's step count stay bit-identical."""
    loss_and_grads = SCHEDULES[step.schedule](step.mesh, step.plan, step.policy, step.units, step.options)
    frozen = step.plan.frozen

    def train_step(state: TrainState, batch_BS: jax.Array):
        scale = state.loss_scale.scale
        # Gradients of the trained leaves only: frozen ones get none, so none is clipped,
        # reduced or applied, and they come out of the step as they went in.
        loss, grads = loss_and_grads(step.step_params(state), batch_BS, scale)
        grads = jax.tree.map(lambda g: g / scale, grads)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(grad_norm)
        if step.offload.moments:
            return offloaded(state, grads, finite, loss, grad_norm)

        def update(params, opt_state):
            updates, opt_state = step.optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        # A cond, not a select between new and old: the update then runs in place on the
        # donated buffers (a select keeps the old state alive next to the new one).
        trained, opt_state = jax.lax.cond(finite, update, lambda *old: old,
                                          trees.trained(state.params, frozen), state.opt_state)
        params = trees.combine(trained, trees.frozen_part(state.params, frozen))
        new_state = TrainState(step=state.step + finite.astype(jnp.int32), params=params, opt_state=opt_state,
                               skipped=jnp.where(finite, 0, state.skipped + 1),
                               loss_scale=step.scaler.update(state.loss_scale, finite))
        return new_state, metrics_of(state, new_state, finite, loss, grad_norm)

    def metrics_of(state, new_state, finite, loss, grad_norm):
        return {"loss": loss, "grad_norm": grad_norm, "lr": step.lr(state.step), "skipped": ~finite,
                "skipped_in_a_row": new_state.skipped, "loss_scale": state.loss_scale.scale}

    def offloaded(state: TrainState, grads, finite, loss, grad_norm):
        """The update streamed unit by unit through host memory (`zerojax.offload`): clipping
        first, on the device (it needs only the gradient's global norm), then AdamW per unit."""
        opt_state = state.opt_state
        if step.clip is not None:  # optax.chain's state: (clip's, adamw's)
            grads, _ = step.clip.update(grads, opt_state[0])
            adam_state = opt_state[1]
        else:
            adam_state = opt_state
        trained, adam_state, weights = offload_lib.streamed_update(
            step.elementwise, step.offload, grads, adam_state, trees.trained(state.params, frozen),
            finite, step.units.names, state.weights, step.weights_dtype)
        opt_state = (opt_state[0], adam_state) if step.clip is not None else adam_state
        new_state = TrainState(step=state.step + finite.astype(jnp.int32),
                               params=trees.combine(trained, trees.frozen_part(state.params, frozen)),
                               opt_state=opt_state, skipped=jnp.where(finite, 0, state.skipped + 1),
                               loss_scale=step.scaler.update(state.loss_scale, finite), weights=weights)
        return new_state, metrics_of(state, new_state, finite, loss, grad_norm)

    shardings = state_shardings(step, abstract_state or init_state(step, abstract=True))
    return jax.jit(train_step, in_shardings=(shardings, mesh_lib.batch_sharding(step.mesh)),
                   out_shardings=(shardings, mesh_lib.replicated(step.mesh)), donate_argnums=0)


def make_eval_step(step: Engine):
    """(master, batch) -> the batch's mean loss (weighted as the protocol says)."""
    loss = gspmd.make_loss(step.mesh, step.plan, step.policy, step.units)
    return jax.jit(lambda params, batch_BS: loss(params, batch_BS)[0])


def batch_shape(cfg: Config) -> jax.ShapeDtypeStruct:
    """The global batch the data pipeline yields: int32 tokens [B, T+1]."""
    return jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.model.seq_len + 1), jnp.int32)
