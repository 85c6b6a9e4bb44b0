"""The model a config names (`model.family`, with LoRA's adapters attached) and the plan of its
parameters."""

from __future__ import annotations

from flax import nnx
from zerojax.optim import lora as lora_lib
from zerojax.config import Config, LoraConfig, ModelConfig
from zerojax.models import registry
from zerojax.optim import check_freeze
from zerojax.optim.components import components_of
from zerojax.precision import Policy
from zerojax.parallel import plan as plan_lib


def build_model(cfg: ModelConfig, policy: Policy, seed: int, lora: LoraConfig | None = None):
    """The model of `cfg` (call under nnx.eval_shape for shapes only), with `lora`'s adapters
    when its rank is set. A bug inside the model's own code raises as it is; a model that
    breaks the protocol is a ConfigError."""
    model = registry.build(cfg, policy, seed)
    names = model.STACKED
    if lora is not None and lora.rank:
        lora_lib.attach(model, lora, names, nnx.Rngs(lora=seed))
    return model


def abstract_model(cfg: ModelConfig, policy: Policy, seed: int = 0, lora: LoraConfig | None = None):
    """The model's structure and shapes; nothing is allocated."""
    return nnx.eval_shape(lambda: build_model(cfg, policy, seed, lora))


def lora_settings(cfg: ModelConfig, lora: LoraConfig, seed: int = 0) -> dict[str, tuple[int, float]]:
    """(rank, alpha) of each kernel `lora` adapts (`optim.lora.settings`; {} with LoRA off)."""
    if not lora.rank:
        return {}
    return lora_lib.settings(abstract_model(cfg, Policy(), seed), lora)


def param_plan(cfg: Config, model, stacked: tuple[str, ...], stage: int, data_size: int) -> plan_lib.Plan:
    """The plan of `model`'s parameters under `stage` on `data_size` devices, frozen leaves
    (optim.freeze, a LoRA base) marked and stored in precision.frozen; the freeze checked."""
    abstract = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    components = components_of(model)
    frozen = lora_lib.frozen_mask(abstract, cfg.optim.freeze, cfg.optim.lora, components)
    check_freeze(abstract, cfg.optim.freeze, frozen, lora=bool(cfg.optim.lora.rank), components=components)
    return plan_lib.make_plan(abstract, stage, data_size, cfg.zero.min_shard_size, stacked=stacked,
                                  frozen=frozen, frozen_dtype=cfg.precision.frozen)
