"""Training: TrainState, the jitted train step, and the run loop.

`prepare` turns a Config into everything a run needs and is where bad input surfaces (as
ValueError, before anything is written); `run` then creates the run directory, resumes from the
newest checkpoint if there is one, and trains.

Every ZeRO stage is the same step with a different sharding plan (`zerojax.sharding`): the fp32
master weights and Adam moments live in the plan's master layout and the optimizer updates
them where they lie. The loss and gradient come from one of two schedules:
- `shard_map` (default): the explicit FSDP unit schedule of `zerojax.fsdp`;
- `gspmd` (`accumulated_grads` below): the forward/backward sees a compute view of the master
  weights (unpadded, cast to the gather dtype, placed in the compute layout), the gradient is
  constrained to the gradient layout and activations are kept batch-sharded between blocks;
  XLA places the collectives (on CPU it all-reduces and slices the gradients instead of
  reduce-scattering them).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerojax import checkpoint
from zerojax import config as config_lib
from zerojax import data as data_lib
from zerojax import fsdp
from zerojax import mesh as mesh_lib
from zerojax import sharding as sharding_lib
from zerojax.config import Config
from zerojax.models import GPT, cross_entropy
from zerojax.models.gpt import REMAT_POLICIES
from zerojax.optim import check_freeze, frozen_mask, make_optimizer, make_schedule
from zerojax.precision import LossScaler, LossScaleState, Policy, make_loss_scaler, make_policy
from zerojax.sample import Progress, sample_text

log = logging.getLogger("zerojax")


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. gradients stayed non-finite); what was written stays."""


class TrainState(NamedTuple):
    step: jax.Array  # optimizer updates applied
    params: Any  # fp32 master weights, a nested dict, in the plan's master layout (padded)
    opt_state: Any  # optax state (Adam moments in fp32), laid out like the master weights
    skipped: jax.Array  # consecutive non-finite steps
    loss_scale: LossScaleState


@dataclass(frozen=True)
class Setup:
    cfg: Config
    mesh: Mesh
    policy: Policy
    corpus: data_lib.Corpus
    graphdef: Any  # static structure of the model; params travel separately
    plan: sharding_lib.Plan
    units: dict  # graphdefs of the model's units (embed, block, head) for the shard_map schedule
    frozen: Any  # pytree of bools: leaves that get no gradient
    optimizer: optax.GradientTransformation
    scaler: LossScaler
    resume_step: int = 0  # the checkpoint this run continues from (0: a fresh start)

    def view(self, master) -> GPT:
        """The model over the compute view of the master weights (for eval and sampling)."""
        return nnx.merge(self.graphdef, compute_params(self, master))


NOT_YET = {  # config values whose feature has not landed yet: (is it asked for, what, the fix)
    "precision.reduce": (lambda c: c.precision.reduce != "float32" and c.zero.schedule == "gspmd",
                         "choosing the reduce dtype under gspmd is", "use zero.schedule=shard_map"),
}


def prepare(cfg: Config) -> Setup:
    for key, (asked, what, fix) in NOT_YET.items():
        if asked(cfg):
            section, name = key.split(".")
            value = getattr(getattr(cfg, section), name)
            raise ValueError(f"{key}={value!r}: {what} not implemented in zerojax yet; {fix}")
    mesh = mesh_lib.make_mesh(cfg.mesh)
    dp = mesh_lib.data_parallel_size(mesh)
    micro = cfg.train.global_batch // cfg.train.grad_accum
    if micro % dp:
        raise ValueError(
            f"train.global_batch={cfg.train.global_batch} / train.grad_accum={cfg.train.grad_accum} "
            f"= {micro} rows per microbatch must be divisible by the data-parallel size "
            f"mesh.replica x mesh.data = {dp}; try train.global_batch={cfg.train.grad_accum * dp * max(1, round(micro / dp))}"
        )
    corpus = data_lib.load_corpus(cfg.data.source, cfg.data.val_fraction, cfg.model.seq_len)
    if corpus.vocab_size > cfg.model.vocab_size:
        raise ValueError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the corpus needs "
            f"({corpus.vocab_size} from data.source={cfg.data.source!r}); set model.vocab_size>={corpus.vocab_size}"
        )
    p = cfg.precision
    policy = make_policy(p.param, p.compute, p.gather, p.reduce, mesh.devices.flat[0].platform)
    scaler = make_loss_scaler(p.loss_scale, policy, initial_scale_power=p.initial_scale_power,
                              loss_scale_window=p.loss_scale_window, hysteresis=p.hysteresis,
                              min_loss_scale=p.min_loss_scale)
    if policy.compute == jnp.float16 and scaler.mode == "none":
        log.warning("float16 compute without loss scaling: small gradients underflow to zero; "
                    "set precision.loss_scale=dynamic")
    model = nnx.eval_shape(lambda: build_model(cfg, policy))
    graphdef, abstract = nnx.split(model)
    abstract = nnx.to_pure_dict(abstract)
    units = {"embed": nnx.split(model.embed)[0], "block": nnx.split(model.blocks)[0], "head": nnx.split(model.head)[0]}
    check_freeze(abstract, cfg.optim.freeze)
    plan = sharding_lib.make_plan(abstract, cfg.zero.stage, mesh.shape["data"], cfg.zero.min_shard_size,
                                  stacked=GPT.STACKED)
    return Setup(cfg, mesh, policy, corpus, graphdef, plan, units, frozen_mask(abstract, cfg.optim.freeze),
                 make_optimizer(cfg.optim, cfg.train.steps), scaler, resume_step(cfg))


def resume_step(cfg: Config) -> int:
    """The newest complete checkpoint to continue from (train.resume=auto), checked readable."""
    steps = checkpoint.complete_steps(cfg.run_dir)
    if cfg.train.resume == "never":
        if steps or (cfg.run_dir / "metrics.jsonl").is_file():
            raise ValueError(f"train.resume=never but {cfg.run_dir} already holds a run; use train.resume=auto "
                             "to continue it, or another train.out_dir")
        return 0
    if not steps:
        return 0
    if steps[-1] > cfg.train.steps:
        raise ValueError(f"{cfg.run_dir} has a checkpoint at step {steps[-1]}, past train.steps={cfg.train.steps}; "
                         "raise train.steps or use another train.out_dir")
    checkpoint.read_metadata(checkpoint.manager(cfg.run_dir, cfg.train.keep, create=False), steps[-1])
    return steps[-1]


def build_model(cfg: Config, policy: Policy) -> GPT:
    m = cfg.model
    return GPT(vocab_size=m.vocab_size, d_model=m.d_model, n_layers=m.n_layers, n_heads=m.n_heads,
               d_ff=m.d_ff, seq_len=m.seq_len, tie_embeddings=m.tie_embeddings, remat=m.remat,
               policy=policy, rngs=nnx.Rngs(cfg.train.seed))


def state_shardings(setup: Setup, abstract_state: TrainState):
    plan, mesh = setup.plan, setup.mesh
    specs = TrainState(P(), plan.master_specs, sharding_lib.state_specs(abstract_state.opt_state, plan, plan.layout.master),
                       P(), jax.tree.map(lambda _: P(), abstract_state.loss_scale))
    return sharding_lib.named(mesh, specs)


def init_state(setup: Setup, *, abstract: bool = False) -> TrainState:
    """Master weights and optimizer state, born in the plan's layout (never gathered whole).

    With `abstract`, only the shapes and shardings (for compiling without allocating).
    """

    from_file = setup.cfg.model.init_from and not abstract
    loaded = checkpoint.load_safetensors(setup.cfg.model.init_from, setup.plan) if from_file else None

    def init(loaded) -> TrainState:
        params = nnx.to_pure_dict(nnx.state(build_model(setup.cfg, setup.policy), nnx.Param))
        params = setup.plan.pad(params if loaded is None else loaded)
        zero = jnp.zeros((), jnp.int32)
        return TrainState(zero, params, setup.optimizer.init(params), zero, setup.scaler.init())

    shapes = jax.eval_shape(init, None)
    shardings = state_shardings(setup, shapes)
    if abstract:
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)
    return jax.jit(init, out_shardings=shardings)(loaded)


def compute_params(setup: Setup, master):
    """What the forward/backward sees: unpadded, cast to the gather dtype, in the compute layout."""
    params = setup.plan.unpad(master)
    params = jax.tree.map(lambda x, f: jax.lax.stop_gradient(x) if f else x, params, setup.frozen)
    params = jax.tree.map(lambda x: x.astype(setup.policy.gather), params)
    # A padded leaf, sliced back to its true shape, stays sharded (unevenly: XLA pads inside).
    return sharding_lib.constrain(params, setup.mesh, setup.plan.compute_specs)


def loss_fn(setup: Setup, master, batch_BS: jax.Array) -> jax.Array:
    """Mean next-token loss of a [B, T+1] batch (inputs and their successors)."""
    batch_axes = NamedSharding(setup.mesh, P(mesh_lib.BATCH_AXES))
    model = nnx.merge(setup.graphdef, compute_params(setup, master))
    logits_BTV = model(batch_BS[:, :-1], constrain=lambda x: jax.lax.with_sharding_constraint(x, batch_axes))
    return cross_entropy(logits_BTV, batch_BS[:, 1:])


def accumulated_grads(setup: Setup, master, batch_BS, scale: jax.Array):
    """Loss and fp32 gradient of `scale` x loss over `train.grad_accum` microbatches.

    The microbatches run in a lax.scan with an fp32 accumulator in the stage's accumulator
    layout. Microbatch j takes rows j, j+k, j+2k, ...: each device's contiguous block of rows
    splits evenly into the k microbatches, so no rows move between devices.
    """
    plan, mesh, k = setup.plan, setup.mesh, setup.cfg.train.grad_accum

    def grad_fn(micro_BS):
        scaled = lambda p: (lambda loss: (loss * scale, loss))(loss_fn(setup, p, micro_BS))
        grads, loss = jax.grad(scaled, has_aux=True)(master)
        return loss, grads

    if k == 1:
        loss, grads = grad_fn(batch_BS)
        return loss, sharding_lib.constrain(grads, mesh, plan.grad_specs)
    B, S = batch_BS.shape
    micro_kBS = batch_BS.reshape(B // k, k, S).swapaxes(0, 1)
    micro_kBS = jax.lax.with_sharding_constraint(micro_kBS, NamedSharding(mesh, P(None, mesh_lib.BATCH_AXES)))

    def body(acc, micro_BS):
        loss, grads = grad_fn(micro_BS)
        acc = jax.tree.map(jnp.add, acc, (loss, grads))
        return (acc[0], sharding_lib.constrain(acc[1], mesh, plan.accum_specs)), None

    zeros = sharding_lib.constrain(jax.tree.map(jnp.zeros_like, master), mesh, plan.accum_specs)
    (loss, grads), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), micro_kBS)
    grads = sharding_lib.constrain(jax.tree.map(lambda g: g / k, grads), mesh, plan.grad_specs)
    return loss / k, grads


def make_train_step(setup: Setup, abstract_state: TrainState | None = None):
    """The jitted step: scaled gradients, unscaled in fp32, global norm, AdamW.

    A step whose gradient is not finite changes nothing but the loss-scale state: parameters,
    Adam moments and the optimizer's step count stay bit-identical.
    """
    schedule = make_schedule(setup.cfg.optim, setup.cfg.train.steps)

    if setup.cfg.zero.schedule == "shard_map":
        z = setup.cfg.zero
        loss_and_grads = fsdp.make_loss_and_grads(
            setup.mesh, setup.plan, setup.policy, setup.units, cross_entropy, grad_accum=setup.cfg.train.grad_accum,
            prefetch=z.prefetch, reshard_after_forward=z.reshard_after_forward,
            remat_policy=None if setup.cfg.model.remat == "full" else REMAT_POLICIES[setup.cfg.model.remat])
    else:
        loss_and_grads = lambda master, batch, scale: accumulated_grads(setup, master, batch, scale)

    def train_step(state: TrainState, batch_BS: jax.Array):
        scale = state.loss_scale.scale
        loss, grads = loss_and_grads(state.params, batch_BS, scale)
        # Frozen leaves: no update (the optimizer's set_to_zero) and no part in the norm.
        grads = jax.tree.map(lambda g, f: jnp.zeros_like(g) if f else g / scale, grads, setup.frozen)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(grad_norm)

        def update(params, opt_state):
            updates, opt_state = setup.optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        # A cond, not a select between new and old: the update then runs in place on the
        # donated buffers (a select keeps the old state alive next to the new one).
        params, opt_state = jax.lax.cond(finite, update, lambda *old: old, state.params, state.opt_state)
        new_state = TrainState(
            step=state.step + finite.astype(jnp.int32),
            params=params,
            opt_state=opt_state,
            skipped=jnp.where(finite, 0, state.skipped + 1),
            loss_scale=setup.scaler.update(state.loss_scale, finite),
        )
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state.step), "skipped": ~finite,
                   "skipped_in_a_row": new_state.skipped, "loss_scale": scale}
        return new_state, metrics

    shardings = state_shardings(setup, abstract_state or init_state(setup, abstract=True))
    replicated = mesh_lib.replicated(setup.mesh)
    return jax.jit(train_step, in_shardings=(shardings, mesh_lib.batch_sharding(setup.mesh)),
                   out_shardings=(shardings, replicated), donate_argnums=0)


def make_eval_step(setup: Setup):
    return jax.jit(lambda params, batch_BS: loss_fn(setup, params, batch_BS))


def global_batch(setup: Setup, tokens: np.ndarray, stream: int, step: int) -> jax.Array:
    """The global batch for `step`, built from the rows this process owns."""
    cfg, sharding = setup.cfg, mesh_lib.batch_sharding(setup.mesh)
    rows = data_lib.process_rows(sharding, cfg.train.global_batch)
    local = data_lib.batch_rows(tokens, cfg.model.seq_len, cfg.train.seed, stream, step,
                                cfg.train.global_batch, rows)
    return jax.make_array_from_process_local_data(
        sharding, local, (cfg.train.global_batch, cfg.model.seq_len + 1))


def evaluate(setup: Setup, eval_step, params) -> float:
    losses = [eval_step(params, global_batch(setup, setup.corpus.val, data_lib.EVAL, i))
              for i in range(setup.cfg.train.eval_batches)]
    return float(np.mean([float(x) for x in losses]))


def run(cfg: Config, *, show_progress: bool = True, setup: Setup | None = None, stop_at: int | None = None) -> dict:
    """Train per `cfg`, writing the run directory (and resuming from its newest checkpoint);
    returns the metrics lines written by this call, the sample and the final state.
    `stop_at`: behave as if SIGTERM arrived during that step (checkpoint and return)."""
    setup = setup or prepare(cfg)
    out, start = cfg.run_dir, setup.resume_step
    abstract = init_state(setup, abstract=True)
    ckpt = checkpoint.manager(out, cfg.train.keep) if cfg.train.ckpt_every or start else None
    shardings = state_shardings(setup, abstract)
    state = checkpoint.restore(ckpt, setup, start, abstract, shardings) if start else init_state(setup)
    first = global_batch(setup, setup.corpus.train, data_lib.TRAIN, start)
    train_step = make_train_step(setup, abstract).lower(state, first).compile()  # compile before timing
    eval_step = make_eval_step(setup)

    lead = jax.process_index() == 0  # process 0 writes the run directory; all write checkpoints
    if lead:
        out.mkdir(parents=True, exist_ok=True)
        config_lib.dump(cfg, out / "config.yaml")
    history, saved_at, stopped = [], start, None
    tokens_per_step = cfg.train.global_batch * cfg.model.seq_len
    with open_metrics(out / "metrics.jsonl", start, lead) as log, \
            Progress(cfg.train.steps, show_progress and lead, start) as bar, StopSignals() as signals:
        tick, since, pending = time.perf_counter(), 0, None
        for i in range(start, cfg.train.steps):
            batch = first if i == start else global_batch(setup, setup.corpus.train, data_lib.TRAIN, i)
            state, metrics = train_step(state, batch)
            since += 1
            if pending is not None and int(pending) >= cfg.precision.max_skipped_steps:
                raise TrainingError(
                    f"{int(pending)} consecutive steps had non-finite gradients (precision.max_skipped_steps"
                    f"={cfg.precision.max_skipped_steps}); lower optim.lr or check the data")
            pending = metrics["skipped_in_a_row"]  # read next step: keeps one step in flight
            step = i + 1
            do_eval = cfg.train.eval_every and (step % cfg.train.eval_every == 0 or step == cfg.train.steps)
            if do_eval or (cfg.train.log_every and step % cfg.train.log_every == 0):
                line = _metrics_line(step, metrics, since * tokens_per_step / (time.perf_counter() - tick))
                if do_eval:
                    line["eval_loss"] = evaluate(setup, eval_step, state.params)
                log.write(json.dumps(line) + "\n")
                log.flush()
                history.append(line)
                bar.update(step, line)
                tick, since = time.perf_counter(), 0
            else:
                bar.update(step)
            signals.received = signals.received or ("stop_at" if step == stop_at else None)
            if ckpt and (signals.received or (cfg.train.ckpt_every and step % cfg.train.ckpt_every == 0)):
                checkpoint.save(ckpt, setup, state, step)
                saved_at = step
            if signals.received:
                stopped = {"signal": signals.received, "step": step}
                break
    if ckpt:
        if stopped is None and saved_at != cfg.train.steps:
            checkpoint.save(ckpt, setup, state, cfg.train.steps)
        ckpt.wait_until_finished()  # never exit before the last save is complete
        ckpt.close()
    sample = sample_text(setup, state.params) if stopped is None else ""  # every process: SPMD
    if stopped is None and lead:
        (out / "sample.txt").write_text(sample)
    return {"history": history, "sample": sample, "run_dir": str(out), "state": state, "stopped": stopped,
            "resumed_from": start}


@contextlib.contextmanager
def open_metrics(path, resume_step: int, lead: bool = True):
    """metrics.jsonl, continued after `resume_step` (later lines from an unfinished run dropped);
    only process 0 writes it."""
    if not lead:
        with open(os.devnull, "w") as f:
            yield f
        return
    kept = []
    if resume_step and path.is_file():
        kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= resume_step]
    path.write_text("".join(line + "\n" for line in kept))
    with path.open("a") as f:
        yield f


class StopSignals:
    """SIGTERM and SIGINT ask the loop to finish its step, checkpoint and return; a second
    SIGINT aborts at once (KeyboardInterrupt)."""

    received: str | None = None

    def __enter__(self):
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.received = signal.Signals(signum).name
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _metrics_line(step: int, metrics: dict, tokens_per_sec: float) -> dict:
    m = jax.device_get(metrics)
    return {"step": step, "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
            "lr": float(m["lr"]), "loss_scale": float(m["loss_scale"]), "skipped": bool(m["skipped"]),
            "tokens_per_sec": round(tokens_per_sec, 1)}


