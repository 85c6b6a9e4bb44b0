"""zerojax: ZeRO stages and the FSDP unit schedule over a named jax.sharding.Mesh.

`import zerojax` imports no jax, so the package names only what needs none:

    __version__
    load_config(path=None, overrides=()) -> Config    defaults <- YAML <- KEY=VALUE (`zerojax.config.load`)
    Config, ConfigError, TrainingError, DistributedError

The rest of the public API lives in its modules; import the module (`from zerojax.train import step`):

    zerojax.parallel.mesh      make_mesh(mesh_config) -> Mesh, batch_sharding(mesh), apply_xla_preset(name),
                               XLA_PRESETS (XLA flags, before the backend starts)
    zerojax.train.step         make_engine(cfg, mesh) -> Engine, make_train_step(engine), batch_shape(cfg)
    zerojax.train.state        init_state(engine, abstract=False) -> TrainState, born sharded
    zerojax.train.model        abstract_model(model_config, policy, seed): structure and shapes, nothing allocated
    zerojax.train              prepare(cfg) -> Setup; run(cfg, ...) -> RunResult (the loop, `train.loop`)
    zerojax.analysis.measure   compile_step, analyze (`zerojax analyze --json`), stage_report, measure_memory,
                               largest_fitting, count_params, param_counts, model_flops_per_token
    zerojax.analysis.formulas  peak_bytes, memory_report (no jax)
    zerojax.analysis.traced    unit_size(engine, stack): parameters of the outer unit (None) or one layer
    zerojax.schedules.quant    the quantized gathers' blocks (quantize, encode, ...)
    zerojax.interop.hf         Hugging Face in and out (`hf.load(DIR)`)
    zerojax.interop.lerobot    LeRobot policy checkpoints in (`lerobot.load(DIR)`)

The subpackages, from the bottom up (docs/design.md §3): models, config, parallel, data, schedules,
optim, interop, train, analysis, report, serve, sim; `cli` is the command line. Each `__init__.py`
says what lives in each module and re-exports a few names by name, only where importing them costs
what its package already must (no jax in zerojax, config, models, data, report, serve, sim).
"""

from zerojax.config import Config, load as load_config
from zerojax.errors import ConfigError, DistributedError, TrainingError

__version__ = "0.1.0"

__all__ = ["Config", "ConfigError", "DistributedError", "TrainingError", "__version__", "load_config"]
