"""The Engine (everything the compiled step needs: the model chosen by `model.family`, its plan,
the optimizer), the jitted train step under either unit schedule, and the eval step. No run
loop (`train.loop`), so `zerojax analyze` builds a step without it; the state is `train.state`'s.

Every ZeRO stage is the same step with a different sharding plan (`zerojax.parallel.plan`): the
fp32 master weights and Adam moments live in the plan's master layout and the optimizer updates
them where they lie, in place or streamed through host memory (`zero.offload`), one update path
either way. The loss and gradient come from one of two schedules with one signature,
`make_loss_and_grads(mesh, plan, policy, units, options)`: `explicit` (`zero.schedule=shard_map`,
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
from zerojax import data as data_lib
from zerojax.data import augment as augment_lib
from zerojax.config import Config, LoraConfig, ModelConfig
from zerojax.errors import ConfigError
from zerojax.models.protocol import Units
from zerojax.optim import Optimizer, make_optimizer, make_schedule
from zerojax.precision import LossScaler, Policy, make_loss_scaler, make_policy
from zerojax.parallel import plan as plan_lib
from zerojax.parallel import trees
from zerojax.schedules import explicit
from zerojax.schedules.options import StepOptions
from zerojax.schedules import storage
from zerojax.train.model import abstract_model, param_plan
from zerojax.train.state import TrainState, init_state, state_shardings, step_params


SCHEDULES = {"shard_map": explicit.make_loss_and_grads, "gspmd": gspmd.make_loss_and_grads}


# ---------------------------------------------------------------------------------------------
# Everything the compiled step needs, and nothing of the loop.


@dataclass(frozen=True, kw_only=True)
class Engine:
    model: ModelConfig
    seed: int
    mesh: Mesh
    policy: Policy
    units: Units  # the model's units (graphdefs); parameters travel separately
    plan: plan_lib.Plan  # also says which leaves are frozen (LeafPlan.frozen)
    lora: LoraConfig
    optimizer: Optimizer  # the optax chain and its two parts (zerojax.optim.adamw)
    lr_schedule: optax.Schedule  # the optimizer's learning rate at a step (for the metrics)
    scaler: LossScaler
    unit_schedule: str  # zero.schedule: shard_map | gspmd (a key of SCHEDULES)
    options: StepOptions
    offload: offload_lib.Offload = offload_lib.Offload()
    ema: float = 0.0  # optim.ema: the decay of the trained weights' moving average (0: none kept)
    augment: augment_lib.Augment | None = None  # data.augment: the training images' augmentation (None: none)

    def view(self, master):
        """The model over the compute view of the master weights (eval, sampling)."""
        return self.units.model(gspmd.compute_view(master, self.mesh, self.plan, self.policy))

    @property
    def weights_dtype(self):
        """The dtype of the device copy of offloaded master weights (`storage.weights_dtype`)."""
        return storage.weights_dtype(self.policy)


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
    model = abstract_model(cfg.model, policy, cfg.train.seed, cfg.optim.lora)
    units = Units.of(model)
    z = cfg.zero
    plan = param_plan(cfg, model, units.names, z.stage, mesh.shape[mesh_lib.DATA])
    offload_lib.check_backend(mesh, z.offload)
    return Engine(model=cfg.model, seed=cfg.train.seed, mesh=mesh, policy=policy, units=units, plan=plan,
                  lora=cfg.optim.lora, optimizer=make_optimizer(cfg.optim, cfg.train.steps),
                  lr_schedule=make_schedule(cfg.optim, cfg.train.steps), scaler=scaler,
                  unit_schedule=z.schedule, options=StepOptions(cfg.train.grad_accum, cfg.model.remat, z.prefetch,
                                                                z.reshard_after_forward),
                  offload=offload_lib.Offload(z.offload), ema=cfg.optim.ema, augment=augment_lib.make(cfg))


def make_train_step(engine: Engine, abstract_state: TrainState | None = None):
    """The jitted step: scaled gradients, unscaled in fp32, global norm, AdamW (in place on the
    device, or streamed through host memory with zero.offload: the same optimizer either way).

    A step whose gradient is not finite changes nothing but the loss-scale state: parameters,
    Adam moments and the optimizer's step count stay bit-identical."""
    loss_and_grads = SCHEDULES[engine.unit_schedule](engine.mesh, engine.plan, engine.policy, engine.units,
                                                     engine.options)
    update = (offload_lib.streamed(engine.optimizer, engine.offload, engine.units.names, engine.weights_dtype)
              if engine.offload.moments else engine.optimizer.in_place)
    frozen = engine.plan.frozen

    def train_step(state: TrainState, batch_BS: jax.Array):
        if engine.augment is not None:  # data.augment: training images only, per (seed, step, row)
            batch_BS = engine.augment(batch_BS, state.step)
        scale = state.loss_scale.scale
        # Gradients of the trained leaves only: frozen ones get none, so none is clipped,
        # reduced or applied, and they come out of the step as they went in.
        loss, grads = loss_and_grads(step_params(engine, state), batch_BS, scale)
        grads = jax.tree.map(lambda g: g / scale, grads)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(grad_norm)
        trained, opt_state, weights, ema = update(grads, state.opt_state, trees.trained(state.params, frozen),
                                                  state.weights, finite, state.ema)
        new_state = TrainState(step=state.step + finite.astype(jnp.int32),
                               params=trees.combine(trained, trees.frozen_part(state.params, frozen)),
                               opt_state=opt_state, skipped=jnp.where(finite, 0, state.skipped + 1),
                               loss_scale=engine.scaler.update(state.loss_scale, finite), weights=weights,
                               ema=ema)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": engine.lr_schedule(state.step), "skipped": ~finite,
                   "skipped_in_a_row": new_state.skipped, "loss_scale": scale}
        return new_state, metrics

    shardings = state_shardings(engine, abstract_state or init_state(engine, abstract=True))
    return jax.jit(train_step, in_shardings=(shardings, mesh_lib.batch_sharding(engine.mesh)),
                   out_shardings=(shardings, mesh_lib.replicated(engine.mesh)), donate_argnums=0)


def make_eval_step(engine: Engine):
    """(master, batch) -> the batch's mean loss (weighted as the protocol says)."""
    loss = gspmd.make_loss(engine.mesh, engine.plan, engine.policy, engine.units)
    return jax.jit(lambda params, batch_BS: loss(params, batch_BS)[0])


def batch_shape(cfg: Config, rows: int | None = None, sharding=None):
    """The global batch the config's data source yields, as a pytree of ShapeDtypeStruct (a
    token corpus: int32 tokens [B, T+1]), from the config alone; `rows` in place of B, and
    `sharding` on every leaf, when given."""

    def struct(f):
        shape = f.shape if rows is None else (rows, *f.shape[1:])
        return jax.ShapeDtypeStruct(shape, jnp.dtype(f.dtype), sharding=sharding)

    return jax.tree.map(struct, data_lib.batch_spec(cfg), is_leaf=lambda x: isinstance(x, data_lib.Field))
