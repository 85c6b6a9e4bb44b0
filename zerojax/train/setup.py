"""A run's set-up, in one pass: config → mesh → plan → model → optimizer → state → data.

`prepare` turns a Config into a `Setup` (the engine on its mesh, the data source, the checkpoint
to resume from) and is where bad input surfaces, as ConfigError, before anything is written.
`build` then makes the `Run` the loop steps (`train.loop.run`): its starting state, checkpoint
manager, first batch and compiled steps, and the run directory's files. The loop reaches back
into none of it.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable
import jax
import jax.numpy as jnp
from zerojax import config as config_lib
from zerojax import data as data_lib
from zerojax.config import Config
from zerojax.checkpoints import format as checkpoints
from zerojax.errors import ConfigError
from zerojax.interop import hf
from zerojax.interop import peft
from zerojax.models import protocol
from zerojax.parallel import mesh as mesh_lib
from zerojax.parallel import trees
from zerojax.train import checkpoint
from zerojax.train import model as model_lib
from zerojax.train import sinks as sinks_lib
from zerojax.train import state as state_lib
from zerojax.train import step as step_lib
from zerojax.train.metrics import kept_metrics


log = logging.getLogger("zerojax")


@dataclass(frozen=True)
class InitSource:
    """Where `model.init_from` (and `optim.lora.init_from`) start the weights from."""

    files: dict = dataclasses.field(default_factory=dict)  # init_from's files the run keeps (LeRobot's)
    load: Callable[[], dict | None] = lambda: None  # its parameters, sharded (None: initialise)


def init_source_of(cfg: Config, engine: step_lib.Engine) -> InitSource:
    """`model.init_from` and `optim.lora.init_from`, checked now from the files' headers (before
    anything is written); `load` builds them straight into the sharded master layout."""
    model, lora, plan, names = cfg.model, cfg.optim.lora, engine.plan, engine.units.names
    files = {}
    if model.init_from:
        hf.init_checkpoint(model.init_from, plan, model.family, names)
        # What the export needs of the start (a LeRobot policy's config.json and statistics, an
        # openpi checkpoint's assets/): the run keeps it, as its format says.
        record = checkpoints.detect(model.init_from)
        files = checkpoints.call(record.keep, model.init_from) if record.keep else {}
    if lora.init_from:
        peft.init_adapters(lora.init_from, plan, None, model.family, names,
                           dataclasses.asdict(lora), model_lib.lora_settings(model, lora), build=False)

    def load():
        loaded = None
        if model.init_from:
            loaded = hf.init_params(model.init_from, plan, engine.mesh, model.family, names)
        if lora.init_from:  # adapters to continue from (the rest: init_from's, or initialised)
            adapters = peft.init_adapters(lora.init_from, plan, engine.mesh, model.family, names,
                                          dataclasses.asdict(lora), model_lib.lora_settings(model, lora))
            loaded = trees.combine(loaded or {}, adapters)
        return loaded

    return InitSource(files, load)


@dataclass(frozen=True)
class Setup:
    """A run: its config, its engine, its data, and where it resumes from."""

    cfg: Config
    engine: step_lib.Engine
    source: data_lib.Source
    resume_step: int = 0  # the checkpoint this run continues from (0: a fresh start)
    init: InitSource = dataclasses.field(default_factory=InitSource)  # model.init_from's weights and files

    @property
    def mesh(self):
        return self.engine.mesh

    @property
    def init_files(self) -> dict:
        """model.init_from's files the run keeps (a LeRobot checkpoint's config.json, statistics)."""
        return self.init.files

    @property
    def corpus(self) -> data_lib.Corpus | None:
        """The token corpus behind the source, if it is one (the end-of-run sample's prompt)."""
        return getattr(self.source, "corpus", None)


def prepare(cfg: Config) -> Setup:
    """The Setup of `cfg`: the engine on its mesh, the data source, model.init_from checked and the
    checkpoint to resume from; bad input raises ConfigError here, before anything is written."""
    check_run_dir(cfg)
    sinks_lib.check(cfg)
    engine = step_lib.make_engine(cfg, mesh_lib.make_mesh(cfg.mesh))
    source = data_lib.open_source(cfg)
    if source.vocab_size > cfg.model.vocab_size:
        where = f"data.tokenizer={cfg.data.tokenizer!r}" if cfg.data.tokenizer else f"data.source={cfg.data.source!r}"
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the corpus needs "
            f"({source.vocab_size} from {where}); set model.vocab_size>={source.vocab_size}"
        )
    check_batch(cfg, engine)
    init = init_source_of(cfg, engine)
    if engine.policy.compute == jnp.float16 and engine.scaler.mode == "none":
        log.warning("float16 compute without loss scaling: small gradients underflow to zero; "
                    "set precision.loss_scale=dynamic")
    start = resume_step(cfg)
    if start:  # checked now, not when the run gets there: its model and trained leaves, its metrics
        checkpoint.check_matches(cfg.run_dir, start, engine.plan, ema=bool(cfg.optim.ema))
        kept_metrics(cfg.run_dir / "metrics.jsonl", start)
    return Setup(cfg, engine, source, start, init)


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
    engine = setup.engine
    if setup.resume_step:
        weights = lambda state: state._replace(weights=state_lib.weights_of(engine, state.params))
        return checkpoint.restore(ckpt, engine.plan, engine.mesh, setup.resume_step, abstract, shardings,
                                  finish=weights)
    return state_lib.init_state(engine, loaded=setup.init.load())


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


@dataclass(frozen=True)
class Run:
    """A run built and ready to step: what the loop (`train.loop.run`) reads, all made here."""

    setup: Setup  # the config, the engine (mesh, plan, model, optimizer), the data source, the resume step
    state: state_lib.TrainState  # where it starts (donated to the first step)
    ckpt: Any  # the checkpoint manager (None: train.ckpt_every=0 and nothing to resume)
    first: Any  # the first step's batch, on which the train step was compiled
    train_step: Any  # compiled (before the loop times anything)
    eval_step: Any
    lead: bool  # process 0, which writes the run directory (every process writes checkpoints)
    mfu: Callable[[float], float] | None  # tokens/s -> model FLOPs utilization (None: unknown device)
    profile: sinks_lib.Profile  # train.profile's trace window

    @property
    def cfg(self) -> Config:
        return self.setup.cfg

    @property
    def engine(self) -> step_lib.Engine:
        return self.setup.engine


def build(setup: Setup) -> Run:
    """The `Run` of a prepared `setup`: its state (resumed, loaded or fresh), its checkpoint
    manager, its first batch and compiled steps; process 0 writes the run directory's files."""
    cfg, engine, start = setup.cfg, setup.engine, setup.resume_step
    abstract = state_lib.init_state(engine, abstract=True)
    # a fresh run's manager (which makes RUN_DIR/checkpoints) only once model.init_from's weights have
    # been read: a checkpoint that fails to read leaves nothing written
    ckpt = checkpoint.manager(cfg.run_dir, cfg.train.keep) if start else None
    state = start_state(setup, ckpt, abstract, state_lib.state_shardings(engine, abstract))
    if ckpt is None and cfg.train.ckpt_every:
        ckpt = checkpoint.manager(cfg.run_dir, cfg.train.keep)
    first = global_batch(setup, data_lib.TRAIN, start)
    train_step = step_lib.make_train_step(engine, abstract).lower(state, first).compile()  # compile before timing
    eval_step = step_lib.make_eval_step(engine)
    lead = jax.process_index() == 0
    if lead:
        write_run_files(setup)
    return Run(setup, state, ckpt, first, train_step, eval_step, lead, sinks_lib.mfu_of(cfg, engine.mesh),
               sinks_lib.Profile(cfg))


def write_run_files(setup: Setup) -> None:
    """The run directory and the files it holds from the start: config.yaml, the source's and
    model.init_from's files."""
    cfg, out = setup.cfg, setup.cfg.run_dir
    out.mkdir(parents=True, exist_ok=True)
    config_lib.dump(cfg, out / "config.yaml")
    for name, text in getattr(setup.source, "run_files", dict)().items():  # e.g. a LeRobot source's statistics
        (out / name).write_text(text)
    for name, blob in setup.init_files.items():  # e.g. a LeRobot checkpoint's config.json and statistics
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(blob)
