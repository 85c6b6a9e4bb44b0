"""The run loop: resume, checkpoints, signals, progress, metrics, the sample.

`prepare` turns a Config into everything a run needs and is where bad input surfaces (as
ConfigError, before anything is written); `run` then creates the run directory, resumes from
the newest checkpoint if there is one, and trains. The step itself (the state, init, the
jitted train step under either schedule) lives in `zerojax.step`.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
import time
from dataclasses import dataclass
import jax
import jax.numpy as jnp
import numpy as np
from zerojax import config as config_lib
from zerojax import data as data_lib
from zerojax.parallel import mesh as mesh_lib
from zerojax.config import Config
from zerojax.config.hf_config import LEROBOT, init_source
from zerojax.errors import ConfigError
from zerojax.train.metrics import kept_metrics, metrics_line, open_metrics, write_line
from zerojax.train.sample import Generator, Progress, sample_reply, sample_text
from zerojax.interop import hf
from zerojax.interop import lerobot
from zerojax.interop import peft
from zerojax.models import protocol
from zerojax.parallel import trees
from zerojax.train import checkpoint
from zerojax.train import model as model_lib
from zerojax.train import sinks as sinks_lib
from zerojax.train import state as state_lib
from zerojax.train import step as step_lib
from zerojax.errors import TrainingError


log = logging.getLogger("zerojax")


@dataclass(frozen=True)
class Setup:
    """A run: its config, its engine, its data, and where it resumes from."""

    cfg: Config
    engine: step_lib.Engine
    source: data_lib.Source
    resume_step: int = 0  # the checkpoint this run continues from (0: a fresh start)
    init_files: dict = dataclasses.field(default_factory=dict)  # model.init_from's files the run keeps (LeRobot's)

    @property
    def mesh(self):
        return self.engine.mesh

    @property
    def corpus(self) -> data_lib.Corpus | None:
        """The token corpus behind the source, if it is one (the end-of-run sample's prompt)."""
        return getattr(self.source, "corpus", None)


def prepare(cfg: Config) -> Setup:
    check_run_dir(cfg)
    sinks_lib.check(cfg)
    step = step_lib.make_engine(cfg, mesh_lib.make_mesh(cfg.mesh))
    source = data_lib.open_source(cfg)
    if source.vocab_size > cfg.model.vocab_size:
        where = f"data.tokenizer={cfg.data.tokenizer!r}" if cfg.data.tokenizer else f"data.source={cfg.data.source!r}"
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the corpus needs "
            f"({source.vocab_size} from {where}); set model.vocab_size>={source.vocab_size}"
        )
    check_batch(cfg, step)
    init_files = {}
    if cfg.model.init_from:  # checked now, from the files' headers, before anything is written
        hf.init_checkpoint(cfg.model.init_from, step.plan, cfg.model.family, step.units.names)
        if init_source(cfg.model.init_from) == LEROBOT:  # its config.json and statistics, for the export
            init_files = lerobot.init_files(cfg.model.init_from)
    lora = cfg.optim.lora
    if lora.init_from:
        peft.init_adapters(lora.init_from, step.plan, None, cfg.model.family, step.units.names,
                           dataclasses.asdict(lora), model_lib.lora_settings(cfg.model, lora), build=False)
    if step.policy.compute == jnp.float16 and step.scaler.mode == "none":
        log.warning("float16 compute without loss scaling: small gradients underflow to zero; "
                    "set precision.loss_scale=dynamic")
    start = resume_step(cfg)
    if start:  # checked now, not when the run gets there: its model and trained leaves, its metrics
        checkpoint.check_matches(cfg.run_dir, start, step.plan, ema=bool(cfg.optim.ema))
        kept_metrics(cfg.run_dir / "metrics.jsonl", start)
    return Setup(cfg, step, source, start, init_files)


def check_batch(cfg: Config, engine) -> None:
    """The model reads the source's batch (a vision model needs its pixel_values): its forward
    traced on one row's shapes, nothing computed, before anything is written; a model's
    ConfigError surfaces here."""
    params = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, engine.policy.compute), engine.plan.leaves)
    jax.eval_shape(lambda p, b: protocol.forward(engine.units, p, b), params, step_lib.batch_shape(cfg, rows=1))


RUN_FILES = ("config.yaml", "metrics.jsonl", "sample.txt")  # what the run writes, besides checkpoints/


def check_run_dir(cfg: Config) -> None:
    """train.out_dir can hold the run: it is a directory (or one can be made there), and where
    the run's files and checkpoints/ exist already, they are files and a directory."""
    out = cfg.run_dir
    in_the_way = config_lib.file_in_the_way(out)
    if in_the_way:
        raise ConfigError(f"train.out_dir={str(out)!r}: {in_the_way} is a file, not a directory; "
                          "give a directory for the run")
    if (out / "checkpoints").exists() and not (out / "checkpoints").is_dir():
        raise ConfigError(f"{out / 'checkpoints'} is a file; the run keeps its checkpoints in that directory: "
                          "move the file, or use another train.out_dir")
    for name in RUN_FILES:
        if (out / name).is_dir():
            raise ConfigError(f"{out / name} is a directory; the run writes its {name} there: "
                              "move the directory, or use another train.out_dir")


def resume_step(cfg: Config) -> int:
    """The newest complete checkpoint to continue from (train.resume=auto), checked readable."""
    steps = checkpoint.complete_steps(cfg.run_dir)
    if cfg.train.resume == "never":
        if steps or (cfg.run_dir / "metrics.jsonl").is_file():
            raise ConfigError(f"train.resume=never but {cfg.run_dir} already holds a run; use train.resume=auto "
                              "to continue it, or another train.out_dir")
        return 0
    if not steps:
        return 0
    if steps[-1] > cfg.train.steps:
        raise ConfigError(f"{cfg.run_dir} has a checkpoint at step {steps[-1]}, past train.steps={cfg.train.steps}; "
                          "raise train.steps or use another train.out_dir")
    reader = checkpoint.manager(cfg.run_dir, cfg.train.keep, create=False, writer=False)
    try:
        checkpoint.read_metadata(reader, steps[-1])
    finally:
        reader.close()
    return steps[-1]


def start_state(setup: Setup, ckpt, abstract, shardings):
    """The state the run starts from: its newest checkpoint, `model.init_from`, or a fresh init."""
    cfg, step = setup.cfg, setup.engine
    if setup.resume_step:
        return checkpoint.restore(ckpt, step.plan, step.mesh, setup.resume_step, abstract, shardings,
                                  finish=lambda state: state._replace(weights=state_lib.weights_of(step, state.params)))
    loaded = None
    if cfg.model.init_from:  # built straight into the sharded master layout
        loaded = hf.init_params(cfg.model.init_from, step.plan, step.mesh, cfg.model.family, step.units.names)
    if cfg.optim.lora.init_from:  # adapters to continue from (the rest: init_from's, or initialised)
        adapters = peft.init_adapters(cfg.optim.lora.init_from, step.plan, step.mesh, cfg.model.family,
                                      step.units.names, dataclasses.asdict(cfg.optim.lora),
                                      model_lib.lora_settings(cfg.model, cfg.optim.lora))
        loaded = trees.combine(loaded or {}, adapters)
    return state_lib.init_state(step, loaded=loaded)


def global_batch(setup: Setup, split: int, step: int):
    """The global batch of `split` (data.TRAIN or data.EVAL) for `step`, a pytree of arrays
    sharded over the batch axis, built from the rows this process owns."""
    sharding = mesh_lib.batch_sharding(setup.engine.mesh)
    spec = setup.source.spec()
    is_field = lambda x: isinstance(x, data_lib.Field)
    rows = data_lib.process_rows(sharding, jax.tree.leaves(spec, is_leaf=is_field)[0].shape[0])
    local = setup.source.rows(split, step, rows)
    return jax.tree.map(lambda field, x: jax.make_array_from_process_local_data(sharding, x, field.shape),
                        spec, local, is_leaf=is_field)


def evaluate(setup: Setup, eval_step, params) -> float:
    losses = [eval_step(params, global_batch(setup, data_lib.EVAL, i))
              for i in range(setup.cfg.train.eval_batches)]
    return float(np.mean([float(x) for x in losses]))


@dataclass(frozen=True)
class Stopped:
    """A run cut short by a signal: it finished `step`, checkpointed it and returned."""

    signal: str  # "SIGTERM" or "SIGINT"
    step: int


@dataclass(frozen=True)
class RunResult:
    """What one call of `run` did."""

    history: list[dict]  # the metrics lines this call wrote (a resumed run: only its own)
    sample: str  # the text sampled at the end ("" if stopped, or the model has no `logits`)
    run_dir: str
    state: state_lib.TrainState  # the final state
    stopped: Stopped | None  # None: the run reached train.steps
    resumed_from: int  # the checkpoint step this call continued from (0: a fresh start)


def run(cfg: Config, *, show_progress: bool = True, setup: Setup | None = None) -> RunResult:
    """Train per `cfg`, writing the run directory (and resuming from its newest checkpoint).
    SIGTERM or SIGINT during a step: the loop finishes it, checkpoints and returns."""
    setup = setup or prepare(cfg)
    out, start, engine = cfg.run_dir, setup.resume_step, setup.engine
    abstract = state_lib.init_state(engine, abstract=True)
    ckpt = checkpoint.manager(out, cfg.train.keep) if cfg.train.ckpt_every or start else None
    state = start_state(setup, ckpt, abstract, state_lib.state_shardings(engine, abstract))
    first = global_batch(setup, data_lib.TRAIN, start)
    train_step = step_lib.make_train_step(engine, abstract).lower(state, first).compile()  # compile before timing
    eval_step = step_lib.make_eval_step(engine)

    lead = jax.process_index() == 0  # process 0 writes the run directory; all write checkpoints
    if lead:
        out.mkdir(parents=True, exist_ok=True)
        config_lib.dump(cfg, out / "config.yaml")
        for name, text in getattr(setup.source, "run_files", dict)().items():  # e.g. a LeRobot source's statistics
            (out / name).write_text(text)
        for name, blob in setup.init_files.items():  # e.g. a LeRobot checkpoint's config.json and statistics
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            (out / name).write_bytes(blob)
    history, saved_at, stopped = [], start, None
    tokens_per_step = cfg.train.global_batch * cfg.model.seq_len
    mfu, profile = sinks_lib.mfu_of(cfg, engine.mesh), sinks_lib.Profile(cfg)
    with open_metrics(out / "metrics.jsonl", start, lead) as log, sinks_lib.open_sinks(cfg, start, lead) as sinks, \
            Progress(cfg.train.steps, show_progress and lead, start) as bar, StopSignals() as signals:
        tick, since, pending = time.perf_counter(), 0, None
        for i in range(start, cfg.train.steps):
            batch = first if i == start else global_batch(setup, data_lib.TRAIN, i)
            profile.before(i)
            state, metrics = train_step(state, batch)
            profile.after(i + 1, metrics)
            since += 1
            if pending is not None and int(pending) >= cfg.precision.max_skipped_steps:
                raise TrainingError(
                    f"{int(pending)} consecutive steps had non-finite gradients (precision.max_skipped_steps"
                    f"={cfg.precision.max_skipped_steps}); lower optim.lr or check the data")
            pending = metrics["skipped_in_a_row"]  # read next step: keeps one step in flight
            step = i + 1
            do_eval = cfg.train.eval_every and (step % cfg.train.eval_every == 0 or step == cfg.train.steps)
            if do_eval or (cfg.train.log_every and step % cfg.train.log_every == 0):
                metrics = jax.device_get(metrics)  # waits for this step: the time below includes it
                line = metrics_line(step, metrics, since * tokens_per_step / (time.perf_counter() - tick))
                line.update(({"mfu": round(mfu(line["tokens_per_sec"]), 4)} if mfu else {}), **sinks_lib.memory_gb())
                if do_eval:
                    line["eval_loss"] = evaluate(setup, eval_step, state_lib.forward_params(engine, state))
                write_line(log, line)
                sinks.write(line)
                history.append(line)
                bar.update(step, line)
                tick, since = time.perf_counter(), 0
            else:
                bar.update(step)
            if ckpt and (signals.received or (cfg.train.ckpt_every and step % cfg.train.ckpt_every == 0)):
                checkpoint.save(ckpt, engine.plan, engine.mesh, state, step, config_lib.to_dict(cfg))
                saved_at = step
            if signals.received:
                stopped = Stopped(signals.received, step)
                break
    if ckpt:
        if stopped is None and saved_at != cfg.train.steps:
            checkpoint.save(ckpt, engine.plan, engine.mesh, state, cfg.train.steps, config_lib.to_dict(cfg))
        ckpt.wait_until_finished()  # never exit before the last save is complete
        ckpt.close()
    sample = "" if stopped else write_sample(setup, state, lead)
    return RunResult(history, sample, str(out), state, stopped, start)


def write_sample(setup: Setup, state, lead: bool) -> str:
    """The end-of-run sample of `train.sample_tokens` tokens (every process samples: SPMD; a model
    without `logits`, or sample_tokens=0, has none), written to sample.txt by process 0."""
    cfg, engine = setup.cfg, setup.engine
    sample = ""
    chat = getattr(setup.source, "sample_messages", None)  # a chat source: a reply to its last conversation
    n_new = cfg.train.sample_tokens
    if n_new and engine.units.has_logits and (setup.corpus is not None or chat):
        generator = Generator(engine.view, state_lib.forward_params(engine, state), cfg.model.seq_len, engine.units.has_decode,
                              vocab=setup.source.vocab_size)
        sample = sample_text(generator, setup.corpus, cfg.train.seed, n_new=n_new) if setup.corpus is not None else \
            sample_reply(generator, setup.source, cfg.train.seed, n_new)
    if lead:
        (cfg.run_dir / "sample.txt").write_text(sample)
    return sample


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
