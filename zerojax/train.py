"""Training: TrainState, the jitted train step, and the run loop.

`prepare` turns a Config into everything a run needs and is where bad input surfaces (as
ValueError, before anything is written); `run` then creates the run directory and trains.
Stage 0 (plain data parallelism): the batch is split over every device of the mesh, the fp32
master weights and Adam state are replicated, and XLA all-reduces the gradients because the
loss is a mean over the global batch.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerojax import config as config_lib
from zerojax import data as data_lib
from zerojax import mesh as mesh_lib
from zerojax.config import Config
from zerojax.models import GPT, cross_entropy
from zerojax.optim import make_optimizer, make_schedule
from zerojax.precision import LossScaler, LossScaleState, Policy, make_loss_scaler, make_policy

log = logging.getLogger("zerojax")


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. gradients stayed non-finite); what was written stays."""


class TrainState(NamedTuple):
    step: jax.Array  # optimizer updates applied
    params: Any  # fp32 master weights, a nested dict
    opt_state: Any  # optax state (Adam moments in fp32)
    skipped: jax.Array  # consecutive non-finite steps
    loss_scale: LossScaleState


@dataclass(frozen=True)
class Setup:
    cfg: Config
    mesh: Mesh
    policy: Policy
    corpus: data_lib.Corpus
    graphdef: Any  # static structure of the model; params travel separately
    optimizer: optax.GradientTransformation
    scaler: LossScaler


NOT_YET = {  # config values whose feature has not landed yet: (is it asked for, what, the fix)
    "zero.stage": (lambda c: c.zero.stage != 0, "ZeRO stages 1-3 are", "use zero.stage=0"),
    "optim.freeze": (lambda c: bool(c.optim.freeze), "frozen parameters are", "leave it empty"),
    "train.ckpt_every": (lambda c: c.train.ckpt_every != 0, "checkpoints are", "use 0"),
    "model.init_from": (lambda c: bool(c.model.init_from), "loading weights is", "leave it empty"),
    "precision.reduce": (lambda c: c.precision.reduce != "float32",
                         "gradient reduction below fp32 is", "use float32"),
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
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: build_model(cfg, policy)))
    optimizer = make_optimizer(cfg.optim, cfg.train.steps)
    return Setup(cfg, mesh, policy, corpus, graphdef, optimizer, scaler)


def build_model(cfg: Config, policy: Policy) -> GPT:
    m = cfg.model
    return GPT(vocab_size=m.vocab_size, d_model=m.d_model, n_layers=m.n_layers, n_heads=m.n_heads,
               d_ff=m.d_ff, seq_len=m.seq_len, tie_embeddings=m.tie_embeddings, remat=m.remat,
               policy=policy, rngs=nnx.Rngs(cfg.train.seed))


def init_state(setup: Setup) -> TrainState:
    """Parameters and optimizer state, born with their (replicated) shardings."""

    def init() -> TrainState:
        params = nnx.to_pure_dict(nnx.state(build_model(setup.cfg, setup.policy), nnx.Param))
        zero = jnp.zeros((), jnp.int32)
        return TrainState(zero, params, setup.optimizer.init(params), zero, setup.scaler.init())

    return jax.jit(init, out_shardings=mesh_lib.replicated(setup.mesh))()


def loss_fn(graphdef, params, batch_BS: jax.Array) -> jax.Array:
    """Mean next-token loss of a [B, T+1] batch (inputs and their successors)."""
    logits_BTV = nnx.merge(graphdef, params)(batch_BS[:, :-1])
    return cross_entropy(logits_BTV, batch_BS[:, 1:])


def accumulated_grads(graphdef, params, batch_BS, grad_accum: int, mesh: Mesh, scale: jax.Array):
    """Loss and fp32 gradient of `scale` x loss, averaged over `grad_accum` microbatches.

    The microbatches run in a lax.scan with an fp32 accumulator. Microbatch j takes rows j,
    j+k, j+2k, ...: each device's contiguous block of rows splits evenly into the k
    microbatches, so no rows move between devices.
    """

    def scaled_loss(p, b):
        loss = loss_fn(graphdef, p, b)
        return loss * scale, loss

    grad_fn = lambda p, b: jax.grad(scaled_loss, has_aux=True)(p, b)[::-1]
    if grad_accum == 1:
        return grad_fn(params, batch_BS)
    B, S = batch_BS.shape
    micro_kBS = batch_BS.reshape(B // grad_accum, grad_accum, S).swapaxes(0, 1)
    micro_kBS = jax.lax.with_sharding_constraint(
        micro_kBS, NamedSharding(mesh, P(None, mesh_lib.BATCH_AXES)))

    def body(acc, micro_BS):
        loss, grads = grad_fn(params, micro_BS)
        return jax.tree.map(jnp.add, acc, (loss, grads)), None

    zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
    total, _ = jax.lax.scan(body, zeros, micro_kBS)
    return jax.tree.map(lambda x: x / grad_accum, total)


def make_train_step(setup: Setup):
    """The jitted step: scaled gradients, unscaled in fp32, global norm, AdamW.

    A step whose gradient is not finite changes nothing but the loss-scale state: parameters,
    Adam moments and the optimizer's step count stay bit-identical.
    """
    schedule = make_schedule(setup.cfg.optim, setup.cfg.train.steps)

    def train_step(state: TrainState, batch_BS: jax.Array):
        scale = state.loss_scale.scale
        loss, grads = accumulated_grads(setup.graphdef, state.params, batch_BS,
                                        setup.cfg.train.grad_accum, setup.mesh, scale)
        grads = jax.tree.map(lambda g: g / scale, grads)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = setup.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        finite = jnp.isfinite(grad_norm)
        keep_if_finite = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
        new_state = TrainState(
            step=state.step + finite.astype(jnp.int32),
            params=keep_if_finite(params, state.params),
            opt_state=keep_if_finite(opt_state, state.opt_state),
            skipped=jnp.where(finite, 0, state.skipped + 1),
            loss_scale=setup.scaler.update(state.loss_scale, finite),
        )
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state.step), "skipped": ~finite,
                   "skipped_in_a_row": new_state.skipped, "loss_scale": scale}
        return new_state, metrics

    replicated = mesh_lib.replicated(setup.mesh)
    return jax.jit(train_step, in_shardings=(replicated, mesh_lib.batch_sharding(setup.mesh)),
                   out_shardings=(replicated, replicated), donate_argnums=0)


def make_eval_step(setup: Setup):
    return jax.jit(lambda params, batch_BS: loss_fn(setup.graphdef, params, batch_BS),
                   in_shardings=(mesh_lib.replicated(setup.mesh), mesh_lib.batch_sharding(setup.mesh)))


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


def run(cfg: Config, *, show_progress: bool = True, setup: Setup | None = None) -> dict:
    """Train per `cfg`, writing the run directory; returns the metrics lines and the sample."""
    setup = setup or prepare(cfg)
    state = init_state(setup)
    first = global_batch(setup, setup.corpus.train, data_lib.TRAIN, 0)
    train_step = make_train_step(setup).lower(state, first).compile()  # compile before timing
    eval_step = make_eval_step(setup)

    out = cfg.run_dir
    out.mkdir(parents=True, exist_ok=True)
    config_lib.dump(cfg, out / "config.yaml")
    history: list[dict] = []
    tokens_per_step = cfg.train.global_batch * cfg.model.seq_len
    with (out / "metrics.jsonl").open("w") as log, Progress(cfg.train.steps, show_progress) as bar:
        tick, since, pending = time.perf_counter(), 0, None
        for i in range(cfg.train.steps):
            batch = first if i == 0 else global_batch(setup, setup.corpus.train, data_lib.TRAIN, i)
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
    sample = sample_text(setup, state.params)
    (out / "sample.txt").write_text(sample)
    return {"history": history, "sample": sample, "run_dir": str(out), "state": state}


def _metrics_line(step: int, metrics: dict, tokens_per_sec: float) -> dict:
    m = jax.device_get(metrics)
    return {"step": step, "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
            "lr": float(m["lr"]), "loss_scale": float(m["loss_scale"]), "skipped": bool(m["skipped"]),
            "tokens_per_sec": round(tokens_per_sec, 1)}


def sample_text(setup: Setup, params, prompt: str = "def ", n_new: int = 200) -> str:
    """A short continuation of `prompt` (bytes corpora) from the trained model."""
    if setup.corpus.vocab_size != 256:
        prompt_ids = [int(t) for t in setup.corpus.val[:8]]
    else:
        prompt_ids = list(prompt.encode())
    ids = generate(setup.graphdef, params, prompt_ids, n_new, setup.cfg.model.seq_len, setup.cfg.train.seed)
    if setup.corpus.vocab_size != 256:
        return " ".join(map(str, ids))
    return bytes(ids).decode("utf-8", errors="replace")


def generate(graphdef, params, prompt_ids: list[int], n_new: int, seq_len: int, seed: int,
             temperature: float = 0.8) -> list[int]:
    """Sample `n_new` tokens after the prompt, re-running the last `seq_len` tokens each time."""

    @jax.jit
    def next_token(params, window_1T, length, key):
        logits_V = nnx.merge(graphdef, params)(window_1T)[0, length - 1]
        return jax.random.categorical(key, logits_V / temperature)

    ids, key = list(prompt_ids), jax.random.key(seed)
    for _ in range(n_new):
        context = ids[-seq_len:]
        window = np.zeros((1, seq_len), np.int32)
        window[0, : len(context)] = context
        key, sub = jax.random.split(key)
        ids.append(int(next_token(params, window, len(context), sub)))
    return ids


class Progress:
    """A rich progress bar with step, loss, eval loss and tokens/s (silent when disabled)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeRemainingColumn
            self.bar = Bar(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                           TextColumn("loss {task.fields[loss]}  eval {task.fields[eval]}  {task.fields[tps]} tok/s"),
                           TimeRemainingColumn())
            self.bar.__enter__()
            self.task = self.bar.add_task("train", total=self.total, loss="-", eval="-", tps="-")
        return self

    def update(self, step: int, line: dict | None = None):
        if not self.enabled:
            return
        fields = {}
        if line:
            fields = {"loss": f"{line['loss']:.3f}", "tps": f"{line['tokens_per_sec']:,.0f}"}
            if "eval_loss" in line:
                fields["eval"] = f"{line['eval_loss']:.3f}"
        self.bar.update(self.task, completed=step, **fields)

    def __exit__(self, *exc):
        if self.enabled:
            self.bar.__exit__(*exc)
