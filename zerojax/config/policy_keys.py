"""The run keys a policy's model and checkpoint set (STYLE 13, "the checkpoint sets the run"),
applied by `load` to the tree of the keys the user set, before the Config is built:

    shapes     a policy family's data.action_horizon, data.image_size and data.prompt_len are
               its model's (model.action.horizon, model.vision.image_size,
               model.action.prompt_len); the user's own value must agree with the model's
    openpi     model.init_from of an openpi checkpoint sets what openpi's model type and its
               TrainConfig imply (the family's `OpenpiLayout.run_keys`): the normalization
               (quantiles for π0.5, mean and std for π0) and the fine-tuning recipe (AdamW, lr
               2.5e-5 with 1,000 warmup steps and a cosine decay over 30,000 to 2.5e-6, EMA 0.99)
    LeRobot    model.init_from of a LeRobot policy directory sets what its files know: the
               normalization (config.json's normalization_mapping), the tokenizer its
               processors name (where it is a local directory) and its optimizer preset
               (optimizer_*, scheduler_*), as LeRobot's `use_policy_training_preset` does, and
               its action space (use_relative_actions, relative_exclude_joints: model.action.relative
               and relative_exclude)

A key the user set (YAML or KEY=VALUE) wins, except a shape, which contradicting the model is an
error. `origins` says where each of these settings came from, for the start line (`describe`).
Generic: the registry says which families are policies; the checkpoint's files say the rest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zerojax.config.hf_config import read_json_object
from zerojax.config.normalization import NormalizationMode
from zerojax.config.sections import Config, VisionConfig
from zerojax.config.values import _field_type, coerce
from zerojax.errors import ConfigError
from zerojax.models import registry
from zerojax.models.family import local_file

# where a setting came from: the checkpoint, the user's config, the family's recipe (`Family.recipe`), a default
CHECKPOINT, CONFIG, RECIPE, DEFAULT = "checkpoint", "config", "family's recipe", "default"
# data.* shape key -> (the model's section, its key): the model owns the shape, the data follows
SHAPES = {"action_horizon": ("action", "horizon"), "image_size": ("vision", "image_size"),
          "prompt_len": ("action", "prompt_len")}
# LeRobot's config.json optimizer and scheduler preset (its policies' get_optimizer_preset and
# get_scheduler_preset: AdamW and cosine_decay_with_warmup) -> the optim key it sets
PRESET = {"optimizer_lr": "lr", "optimizer_eps": "eps", "optimizer_weight_decay": "weight_decay",
          "optimizer_grad_clip_norm": "clip_norm", "scheduler_warmup_steps": "warmup_steps",
          "scheduler_decay_steps": "decay_steps", "scheduler_decay_lr": "final_lr"}
NORMALIZED = {"STATE": "data.norm_state", "ACTION": "data.norm_action"}  # normalization_mapping's kinds
RELATIVE, EXCLUDE = "model.action.relative", "model.action.relative_exclude"  # LeRobot 0.6's relative actions
# the settings a policy run's start line reports, whatever their origin
REPORTED = ("data.norm_state", "data.norm_action", "data.tokenizer", RELATIVE, "optim.lr", "optim.warmup_steps",
            "optim.schedule", "optim.decay_steps", "optim.final_lr", "optim.weight_decay", "optim.decay_mask",
            "optim.clip_norm")


def _model_value(model: dict, section: str, key: str) -> Any:
    """model.<section>.<key> as the tree has it, else the section's default."""
    value = (model.get(section) or {}).get(key)
    if value is not None:
        return value
    return getattr(VisionConfig() if section == "vision" else registry.sections()[section](), key)


def policy_shapes(tree: dict, origins: dict, given: dict, init_from: str = "") -> None:
    """A policy family's data shape keys from its model keys; ConfigError, naming both values,
    where the user set one that contradicts the model. `given`: the model section as the user set
    it, before model.init_from's checkpoint (`init_from`) added its keys."""
    model, data = tree.get("model", {}), tree.setdefault("data", {})
    if not registry.is_policy(model.get("family", registry.DEFAULT)):
        return
    for data_key, (section, key) in SHAPES.items():
        value, mine = _model_value(model, section, key), data.get(data_key)
        origin = CONFIG if key in (given.get(section) or {}) else \
            CHECKPOINT if key in (model.get(section) or {}) else DEFAULT
        if mine is not None and mine != value:
            whose = {CHECKPOINT: f"read from model.init_from={init_from}", CONFIG: "set in the config",
                     DEFAULT: "its default"}[origin]
            raise ConfigError(f"data.{data_key}={mine} contradicts model.{section}.{key}={value} ({whose}); a "
                              f"policy's shapes are its model's: drop data.{data_key}, which follows "
                              f"model.{section}.{key} (or set model.{section}.{key})")
        data[data_key] = value
        origins[f"data.{data_key}"] = origin


def lerobot_keys(directory: str, model: dict | None = None) -> dict:
    """The run keys ("data.norm_state": "quantiles", ...) a LeRobot policy directory's files know:
    normalization_mapping's STATE and ACTION modes, the tokenizer its processors (or its family's
    layout) name where it is a local directory, config.json's optimizer and scheduler preset, and
    its relative actions (LeRobot 0.6's use_relative_actions; the excluded joints only where on)."""
    where = Path(directory) / "config.json"
    checkpoint, out = read_json_object(where, "a LeRobot policy config"), {}
    mapping = checkpoint.get("normalization_mapping") or {}
    for kind, key in NORMALIZED.items():
        if kind in mapping:
            mode = NormalizationMode.of_lerobot(mapping[kind])
            if mode is None:
                raise ConfigError(f"{where}: normalization_mapping {kind}={mapping[kind]!r}; zerojax normalizes with "
                                  f"{', '.join(m.value for m in NormalizationMode)}")
            out[key] = mode.config
    tokenizer = named_tokenizer(directory, checkpoint)
    if tokenizer:
        out["data.tokenizer"] = str(Path(tokenizer).resolve())
    out.update({f"optim.{key}": checkpoint[name] for name, key in PRESET.items() if checkpoint.get(name) is not None})
    betas = checkpoint.get("optimizer_betas")
    if isinstance(betas, list) and len(betas) == 2:
        out["optim.b1"], out["optim.b2"] = betas
    if "optim.decay_steps" in out:
        out["optim.schedule"] = "cosine"
    if any(key in checkpoint for key in PRESET):  # its preset is torch's AdamW over every parameter
        out["optim.decay_mask"] = "all"
    if isinstance(checkpoint.get("use_relative_actions"), bool):  # LeRobot 0.6's π0, π0.5: a key since 0.5
        out[RELATIVE] = checkpoint["use_relative_actions"]
        if checkpoint["use_relative_actions"]:
            out[EXCLUDE] = list(checkpoint.get("relative_exclude_joints") or [])
    return out


def openpi_keys(directory: str, model: dict) -> dict:
    """The run keys an openpi checkpoint implies (`model`: the model keys read from its tree, which
    name its family): openpi's normalization for that model type and its fine-tuning recipe, as
    the family's `OpenpiLayout.run_keys` declares them (no file of the checkpoint records them)."""
    return dict(registry.openpi_layouts()[model["family"]].run_keys)


def named_tokenizer(directory, config: dict) -> str | None:
    """The tokenizer.json a LeRobot policy directory (its config.json: `config`) names where it is
    at hand: its preprocessor's tokenizer step's `tokenizer_name` (what LeRobot tokenizes with; a
    zerojax export writes the run's data.tokenizer there), else its family's
    `LeRobotLayout.tokenizer` (SmolVLA's local SmolVLM directory), each as a path from the policy's
    directory (a zerojax export's own `tokenizer/`), the current directory or one above the
    policy's; else None."""
    pipeline = Path(directory) / "policy_preprocessor.json"
    steps = read_json_object(pipeline, "a LeRobot processor pipeline").get("steps", []) if pipeline.is_file() else []
    for name in filter(None, (s.get("config", {}).get("tokenizer_name") for s in steps if isinstance(s, dict))):
        own = Path(directory).resolve() / name / "tokenizer.json"  # an export names its own copy, relatively
        if own.is_file():
            return str(own)
        if path := local_file(name, str(directory), "tokenizer.json"):
            return str(path)
    _, layout = registry.lerobot_layouts()[config["type"]]
    return layout.tokenizer(config, str(directory))


def carry(tree: dict, origins: dict, keys: dict, where: str, origin: str = CHECKPOINT) -> None:
    """Each of `keys` into the tree where the user set none (the user's wins), parsed to its
    field's type; `origins` records which came from `origin` (the checkpoint, or the family's
    recipe) and which the user kept."""
    schedule = (tree.get("optim") or {}).get("schedule")
    for key, value in keys.items():
        *sections, name = key.split(".")
        node, cls = tree, Config
        for section in sections:  # model.action.relative: a sub-section's key
            node, cls = node.setdefault(section, {}), _field_type(cls, section)
        if name in node:
            origins[key] = CONFIG
        elif schedule == "constant" and name in ("decay_steps", "final_lr"):
            continue  # the user's constant schedule has no decay to shape
        elif key == EXCLUDE and node.get("relative") is False:
            continue  # the user turned relative actions off: the checkpoint's exclusions go with them
        else:
            node[name] = coerce(f"{key} (from {where})", value, _field_type(cls, name))
            origins[key] = origin


def recipe(tree: dict, origins: dict, given: dict) -> None:
    """A policy family's recipe (`Family.recipe`) for the keys neither the user nor the checkpoint
    set: no default of the tiny GPT's (lr 3e-3, weight decay 0.1, ...) reaches a policy. `given`:
    the model section as the user set it; a model key in the tree beyond it is the checkpoint's."""
    family = tree.get("model", {}).get("family", registry.DEFAULT)
    if registry.is_policy(family):
        model = tree.get("model", {})
        for key in registry.family(family).recipe:
            name = key.removeprefix("model.")
            if name != key and "." not in name and name in model and name not in given:
                origins.setdefault(key, CHECKPOINT)  # model.init_from's model keys set it
        keys = {k: v for k, v in registry.family(family).recipe.items() if k not in origins}
        carry(tree, origins, keys, f"model.family={family}", RECIPE)


def reported(tree: dict, origins: dict) -> None:
    """The start line's other policy settings: the user's (config) or the defaults."""
    if not registry.is_policy(tree.get("model", {}).get("family", registry.DEFAULT)):
        return
    for key in REPORTED:
        *sections, name = key.split(".")
        node = tree
        for section in sections:
            node = node.get(section) or {}
        origins.setdefault(key, CONFIG if name in node else DEFAULT)
    relative = (tree.get("model", {}).get("action") or {})
    if relative.get("relative") and EXCLUDE not in origins:  # the excluded joints, where relative is on
        origins[EXCLUDE] = CONFIG if "relative_exclude" in relative else DEFAULT


def scaled(warmup: int, decay: int, total_steps: int) -> tuple[int, int]:
    """(warmup, decay) steps of LeRobot's cosine_decay_with_warmup for a run of `total_steps`: as
    LeRobot 0.6.1's CosineDecayWithWarmupSchedulerConfig.build, both scaled by total/decay (the
    warmup rounded down) when the run is shorter than the decay."""
    if total_steps >= decay:
        return warmup, decay
    return int(warmup * (total_steps / decay)), total_steps


def describe(origins: dict, cfg) -> str:
    """One line: each policy setting's value, grouped by where it came from."""
    groups: dict[str, list[str]] = {}
    for key, origin in origins.items():
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        groups.setdefault(origin, []).append(f"{key.rsplit('.', 1)[1]}={_short(value)}")
    order, opt = (CHECKPOINT, RECIPE, CONFIG, DEFAULT), cfg.optim
    line = "policy settings: " + "; ".join(f"from the {o}: {' '.join(groups[o])}" if o != DEFAULT else
                                           f"defaults: {' '.join(groups[o])}" for o in order if o in groups)
    if opt.decay_steps and scaled(opt.warmup_steps, opt.decay_steps, cfg.train.steps) != (opt.warmup_steps, opt.decay_steps):
        line += (f" (warmup {opt.warmup_steps} and decay {opt.decay_steps} scaled to "
                 f"{' and '.join(map(str, scaled(opt.warmup_steps, opt.decay_steps, cfg.train.steps)))} for train.steps={cfg.train.steps}, as LeRobot does)")
    return line


def _short(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(value) or "''"
    return f"{value:g}" if isinstance(value, float) else str(value) if value != "" else "''"
