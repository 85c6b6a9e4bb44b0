"""The train step: the model chosen by `model.family`, TrainState, init, and the jitted step
under either schedule. No run loop (`train.py`), so `zerojax analyze` builds a step without it.

Every ZeRO stage is the same step with a different sharding plan (`zerojax.sharding`): the fp32
master weights and Adam moments live in the plan's master layout and the optimizer updates
them where they lie. The loss and gradient come from one of two schedules with one signature,
`make_loss_and_grads(mesh, plan, policy, units, options)`: `fsdp` (`zero.schedule=shard_map`,
the explicit unit schedule) or `gspmd` (annotations left to XLA).
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from zerojax import fsdp, gspmd
from zerojax import lora as lora_lib
from zerojax import offload as offload_lib
from zerojax import mesh as mesh_lib
from zerojax import sharding as sharding_lib
from zerojax.config import Config, ConfigError, LoraConfig, ModelConfig
from zerojax.models import FAMILIES, ProtocolError, Units, protocol
from zerojax.optim import check_freeze, make_optimizer, make_schedule, optimizer_parts
from zerojax.precision import LossScaler, LossScaleState, Policy, make_loss_scaler, make_policy

SCHEDULES = {"shard_map": fsdp.make_loss_and_grads, "gspmd": gspmd.make_loss_and_grads}


class TrainState(NamedTuple):
    step: jax.Array  # optimizer updates applied
    params: Any  # a nested dict in the plan's master layout (padded): fp32 master weights of the
    #              trained leaves, and the frozen leaves themselves (precision.frozen)
    opt_state: Any  # optax state (Adam moments in fp32) of the trained leaves, laid out like them
    skipped: jax.Array  # consecutive non-finite steps
    loss_scale: LossScaleState
    weights: Any = None  # zero.offload=optimizer+master: the trained leaves in the gather dtype, on the
    #                      device, in the master layout (what forward and backward read); else None


# ---------------------------------------------------------------------------------------------
# The model: model.family names a built-in factory or an importable one of the user's.


def model_factory(family: str) -> Callable:
    """The factory `model.family` names (ConfigError if it cannot be found)."""
    if family in FAMILIES:
        return FAMILIES[family]
    module_name, _, attr = family.partition(":")
    where = f"model.family={family}"
    if not module_name or not attr:
        raise ConfigError(f"{where} is not valid; use gpt, llama, or module:factory (e.g. my_model:build)")
    if "" not in sys.path:  # the current directory, as `python -m` has it
        sys.path.insert(0, "")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - any failure to import is the user's module's, reported as such
        raise ConfigError(f"{where}: cannot import {module_name} ({type(err).__name__}: "
                          f"{str(err).splitlines()[0] if str(err) else ''})") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"{where}: module {module_name} has no callable {attr!r}")
    try:
        protocol.check_factory(factory, attr)
    except ProtocolError as err:
        raise ConfigError(f"{where}: {err}") from None
    return factory


def build_model(cfg: ModelConfig, policy: Policy, seed: int, lora: LoraConfig | None = None):
    """The model of `cfg` (call under nnx.eval_shape for shapes only), with `lora`'s adapters
    when its rank is set. A bug inside the model's own code raises as it is; a model that
    breaks the protocol is a ConfigError."""
    model = model_factory(cfg.family)(cfg=cfg, policy=policy, rngs=nnx.Rngs(seed))
    try:
        names = protocol.check(model)
    except ProtocolError as err:
        raise ConfigError(f"model.family={cfg.family}: {err}") from None
    if lora is not None and lora.rank:
        lora_lib.attach(model, lora, names, nnx.Rngs(lora=seed))
    return model


def abstract_model(cfg: ModelConfig, policy: Policy, seed: int = 0, lora: LoraConfig | None = None):
    """The model's structure and shapes; nothing is allocated."""
    return nnx.eval_shape(lambda: build_model(cfg, policy, seed, lora))


def param_plan(cfg: Config, model, stacked: tuple[str, ...], stage: int, data_size: int) -> sharding_lib.Plan:
    """The plan of `model`'s parameters under `stage` on `data_size` devices, frozen leaves
    (optim.freeze, a LoRA base) marked and stored in precision.frozen; the freeze checked."""
    abstract = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    lora = bool(cfg.optim.lora.rank)
    frozen = lora_lib.frozen_mask(abstract, cfg.optim.freeze, lora)
    check_freeze(abstract, cfg.optim.freeze, frozen, lora=lora)
    return sharding_lib.make_plan(abstract, stage, data_size, cfg.zero.min_shard_size, stacked=stacked,
                                  frozen=frozen, frozen_dtype=cfg.precision.frozen)


# ---------------------------------------------------------------------------------------------
# Everything the compiled step needs, and nothing of the loop.


@dataclass(frozen=True)
class Step:
    model: ModelConfig
    seed: int
    mesh: Mesh
    policy: Policy
    units: Units  # the model's units (graphdefs); parameters travel separately
    plan: sharding_lib.Plan  # also says which leaves are frozen (LeafPlan.frozen)
    lora: LoraConfig
    optimizer: optax.GradientTransformation
    lr: optax.Schedule
    scaler: LossScaler
    schedule: str  # shard_map | gspmd
    options: fsdp.StepOptions
    offload: offload_lib.Offload = offload_lib.Offload()
    clip: optax.GradientTransformation | None = None  # `optimizer`'s two parts (optim.optimizer_parts)
    elementwise: optax.GradientTransformation | None = None

    def view(self, master):
        """The model over the compute view of the master weights (eval, sampling)."""
        return self.units.model(gspmd.compute_view(master, self.mesh, self.plan, self.policy))

    @property
    def weights_dtype(self):
        """The dtype of the device copy of offloaded master weights (`fsdp.weights_dtype`)."""
        return fsdp.weights_dtype(self.policy)

    def weights_of(self, params):
        """The device copy of the trained leaves that `optimizer+master` keeps (else None), as
        `fsdp.stored_weights` keeps it (bf16 as its bits)."""
        if not self.offload.master:
            return None
        trained = offload_lib.to_device(sharding_lib.trained(params, self.plan.frozen))
        return fsdp.stored_weights(trained, self.weights_dtype)

    def step_params(self, state: TrainState):
        """What the train step's forward and backward read: the master, or with the master on
        the host, its device copy (as stored) beside the frozen leaves."""
        if not self.offload.master:
            return state.params
        return sharding_lib.combine(state.weights, sharding_lib.frozen_part(state.params, self.plan.frozen))

    def forward_params(self, state: TrainState):
        """What eval and sampling read: `step_params` with the device copy's values."""
        return fsdp.read_weights(self.step_params(state), self.weights_dtype)


def make_step(cfg: Config, mesh: Mesh) -> Step:
    """The Step of `cfg` on `mesh`; bad input surfaces here as ConfigError, before any work."""
    dp, micro = mesh_lib.data_parallel_size(mesh), cfg.train.global_batch // cfg.train.grad_accum
    if micro % dp:
        raise ConfigError(
            f"train.global_batch={cfg.train.global_batch} / train.grad_accum={cfg.train.grad_accum} "
            f"= {micro} rows per microbatch must be divisible by the data-parallel size "
            f"mesh.replica x mesh.data = {dp}; try train.global_batch={cfg.train.grad_accum * dp * max(1, round(micro / dp))}"
        )
    p = cfg.precision
    if p.reduce != "float32" and cfg.zero.schedule == "gspmd":
        raise ConfigError(f"precision.reduce={p.reduce!r}: choosing the reduce dtype under gspmd is not "
                          "implemented in zerojax yet; use zero.schedule=shard_map")
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
    options = fsdp.StepOptions(cfg.train.grad_accum, cfg.model.remat, z.prefetch, z.reshard_after_forward)
    clip, elementwise = optimizer_parts(cfg.optim, cfg.train.steps)
    return Step(cfg.model, cfg.train.seed, mesh, policy, units, plan, lora,
                make_optimizer(cfg.optim, cfg.train.steps), make_schedule(cfg.optim, cfg.train.steps), scaler,
                z.schedule, options, offload_lib.Offload(z.offload), clip, elementwise)


def state_shardings(step: Step, abstract_state: TrainState):
    """Where each part of the state lives: the plan's layout, in host memory where zero.offload
    puts it (every optimizer-state copy of a parameter; the trained leaves' master)."""
    plan, offload = step.plan, step.offload  # frozen leaves: sharded at stage 3 only, never offloaded
    weights = plan.specs(plan.layout.master, plan.trained_leaves) if offload.master else None
    specs = TrainState(P(), plan.master_specs, sharding_lib.state_specs(abstract_state.opt_state, plan,
                                                                         plan.layout.master),
                       P(), jax.tree.map(lambda _: P(), abstract_state.loss_scale), weights)
    shardings = sharding_lib.named(step.mesh, specs)
    if offload.moments:
        copies = sharding_lib.map_like_params(abstract_state.opt_state, plan, lambda *_: True, lambda _: False)
        shardings = shardings._replace(opt_state=jax.tree.map(
            lambda s, host: offload_lib.on_host(s) if host else s, shardings.opt_state, copies))
    if offload.master:
        shardings = shardings._replace(params=plan.map(
            lambda leaf, s: s if leaf.frozen else offload_lib.on_host(s), shardings.params))
    return shardings


def init_state(step: Step, *, abstract: bool = False, loaded: dict | None = None) -> TrainState:
    """Master weights and optimizer state, born in the plan's layout (never gathered whole).

    With `abstract`, only the shapes and shardings (for compiling without allocating);
    `loaded`: parameters (true or stored shapes) to start from instead of the model's
    initialisation; leaves it lacks (new LoRA adapters) are initialised (XLA drops the rest of
    the initialisation, whose values are not used)."""
    plan = step.plan

    def init(loaded) -> TrainState:
        if loaded is None or jax.tree.structure(loaded) != jax.tree.structure(plan.leaves):
            fresh = nnx.to_pure_dict(nnx.state(build_model(step.model, step.policy, step.seed, step.lora), nnx.Param))
            loaded = fresh if loaded is None else _fill(fresh, loaded)
        params = plan.cast(plan.pad(loaded))
        zero = jnp.zeros((), jnp.int32)
        opt_state = step.optimizer.init(sharding_lib.trained(params, plan.frozen))
        return TrainState(zero, params, opt_state, zero, step.scaler.init(), step.weights_of(params))

    shapes = jax.eval_shape(init, None)
    shardings = state_shardings(step, shapes)
    if abstract:
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)
    return jax.jit(init, out_shardings=shardings)(loaded)


def _fill(fresh: dict, loaded: dict) -> dict:
    """`fresh` with every leaf that `loaded` has replaced by loaded's."""
    return {k: (_fill(v, loaded[k]) if isinstance(v, dict) else loaded[k]) if k in loaded else v
            for k, v in fresh.items()}


def make_train_step(step: Step, abstract_state: TrainState | None = None):
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
                                          sharding_lib.trained(state.params, frozen), state.opt_state)
        params = sharding_lib.combine(trained, sharding_lib.frozen_part(state.params, frozen))
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
            step.elementwise, step.offload, grads, adam_state, sharding_lib.trained(state.params, frozen),
            finite, step.units.names, state.weights, step.weights_dtype)
        opt_state = (opt_state[0], adam_state) if step.clip is not None else adam_state
        new_state = TrainState(step=state.step + finite.astype(jnp.int32),
                               params=sharding_lib.combine(trained, sharding_lib.frozen_part(state.params, frozen)),
                               opt_state=opt_state, skipped=jnp.where(finite, 0, state.skipped + 1),
                               loss_scale=step.scaler.update(state.loss_scale, finite), weights=weights)
        return new_state, metrics_of(state, new_state, finite, loss, grad_norm)

    shardings = state_shardings(step, abstract_state or init_state(step, abstract=True))
    return jax.jit(train_step, in_shardings=(shardings, mesh_lib.batch_sharding(step.mesh)),
                   out_shardings=(shardings, mesh_lib.replicated(step.mesh)), donate_argnums=0)


def make_eval_step(step: Step):
    """(master, batch) -> the batch's mean loss (weighted as the protocol says)."""
    loss = gspmd.make_loss(step.mesh, step.plan, step.policy, step.units)
    return jax.jit(lambda params, batch_BS: loss(params, batch_BS)[0])


def batch_shape(cfg: Config) -> jax.ShapeDtypeStruct:
    """The global batch the data pipeline yields: int32 tokens [B, T+1]."""
    return jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.model.seq_len + 1), jnp.int32)
