"""zerojax: ZeRO stages and the FSDP unit schedule over a named jax.sharding.Mesh.

The public API, for scripts and notebooks (each name is imported on first use, so
`import zerojax` imports no jax):

    load_config(path=None, overrides=()) -> Config    defaults <- YAML <- KEY=VALUE
    Config, ConfigError, TrainingError, DistributedError
    make_mesh(mesh_config) -> Mesh                    the ("replica", "data") mesh
    batch_sharding(mesh) -> NamedSharding             a batch's rows split over every device
    make_engine(cfg, mesh) -> Engine                  model units, plan, policy, optimizer
    init_state(engine, abstract=False) -> TrainState  born sharded (or only its shapes)
    make_train_step(engine) -> jitted step            state, batch -> state, metrics
    batch_shape(cfg) -> pytree of ShapeDtypeStruct    the global batch the data yields
    abstract_model(model_config, policy, seed)        the model's structure and shapes, nothing allocated
    prepare(cfg) -> Setup; run(cfg, ...) -> RunResult the run loop (resume, signals, metrics)
    compile_step(cfg) -> (Engine, compiled)           nothing allocated
    analyze(cfg, stages=None, budget_gb=None) -> dict `zerojax analyze --json`
    stage_report, measure_memory, peak_bytes, largest_fitting, count_params, param_counts,
    model_flops_per_token, memory_report              what analyze and memory are made of
    unit_size(engine, stack) -> int                   parameters of the outer unit (None) or one layer
    quant                                             the quantized gathers' blocks (quantize, encode, ...)
    apply_xla_preset(name)                            XLA flags, before the backend starts
    hf                                                Hugging Face in and out (`hf.load(DIR)`)
    lerobot                                           LeRobot's π0 checkpoints in (`lerobot.load(DIR)`)

The subpackages, from the bottom up (docs/design.md §3): config, models, parallel, schedules,
optim, interop, train, analysis, report; `cli` is the command line.
"""

import importlib

__version__ = "0.1.0"

_API = {  # public name -> (module, attribute)
    "Config": ("zerojax.config", "Config"),
    "load_config": ("zerojax.config", "load"),
    "ConfigError": ("zerojax.errors", "ConfigError"),
    "TrainingError": ("zerojax.errors", "TrainingError"),
    "DistributedError": ("zerojax.errors", "DistributedError"),
    "make_mesh": ("zerojax.parallel.mesh", "make_mesh"),
    "apply_xla_preset": ("zerojax.parallel.mesh", "apply_xla_preset"),
    "batch_sharding": ("zerojax.parallel.mesh", "batch_sharding"),
    "Engine": ("zerojax.train.step", "Engine"),
    "make_engine": ("zerojax.train.step", "make_engine"),
    "make_train_step": ("zerojax.train.step", "make_train_step"),
    "batch_shape": ("zerojax.train.step", "batch_shape"),
    "abstract_model": ("zerojax.train.model", "abstract_model"),
    "TrainState": ("zerojax.train.state", "TrainState"),
    "init_state": ("zerojax.train.state", "init_state"),
    "prepare": ("zerojax.train.loop", "prepare"),
    "run": ("zerojax.train.loop", "run"),
    "RunResult": ("zerojax.train.loop", "RunResult"),
    "compile_step": ("zerojax.analysis.measure", "compile_step"),
    "analyze": ("zerojax.analysis.measure", "analyze"),
    "stage_report": ("zerojax.analysis.measure", "stage_report"),
    "measure_memory": ("zerojax.analysis.measure", "measure_memory"),
    "largest_fitting": ("zerojax.analysis.measure", "largest_fitting"),
    "count_params": ("zerojax.analysis.measure", "count_params"),
    "param_counts": ("zerojax.analysis.measure", "param_counts"),
    "model_flops_per_token": ("zerojax.analysis.measure", "model_flops_per_token"),
    "peak_bytes": ("zerojax.analysis.formulas", "peak_bytes"),
    "memory_report": ("zerojax.analysis.formulas", "memory_report"),
    "unit_size": ("zerojax.analysis.traced", "unit_size"),
    "quant": ("zerojax.schedules.quant", None),
    "hf": ("zerojax.interop.hf", None),
    "lerobot": ("zerojax.interop.lerobot", None),
}
__all__ = sorted(_API)


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'zerojax' has no attribute {name!r}")
    module, attr = _API[name]
    value = importlib.import_module(module)
    return value if attr is None else getattr(value, attr)


def __dir__():
    return sorted(set(globals()) | set(_API))
