"""LeRobot policy checkpoints in and out (a `save_pretrained` directory: config.json whose "type"
names the policy, model.safetensors with LeRobot's tensor names), for any family that declares a
`LeRobotLayout` (π0's today: its type, names and model keys live in its own room, models/).

In: `model.init_from=DIR`. The model keys come from config.json and the tensors' shapes
(`config.hf_config.lerobot_model_keys`, through the family's `LEROBOT` layout: LeRobot's
config.json does not name the sizes); the tensors are read into the sharded master layout slice
by slice as for Hugging Face (`interop.hf.init_checkpoint`). The normalization statistics: LeRobot
0.3.x keeps them as buffers in model.safetensors (`normalize_inputs.buffer_observation_state.mean`,
`normalize_targets.buffer_action.std`, ...), LeRobot 0.4.x in its processors' files
(policy_preprocessor.json, whose `normalizer_processor` step names a safetensors file of
`observation.state.mean`, ...); `read_stats` reads either. The run keeps config.json and the
statistics in RUN_DIR/lerobot_init/ (`init_files`), so its export does not depend on DIR.

Out: `lerobot_export.save` (`zerojax export --format lerobot`) writes what LeRobot loads: config.json (the one
the run started from, with the keys the model fixes set from the run, and the features and
normalization of the run's LeRobot dataset where it trained on one) and one model.safetensors. In
LeRobot 0.6's layout (the default): the prompt's embedding under both names the layout gives it
(`LeRobotLayout.aliases`: embed_tokens and lm_head), and the processor files
(`lerobot_processors`: the starting checkpoint's steps, else the family's) with the statistics (the
dataset's where the run has them, RUN_DIR/lerobot.json, else the checkpoint's it started from).
In 0.3's, where the run started from a LeRobot 0.3 checkpoint (its config.json has
`resize_imgs_with_padding`): the embedding as lm_head alone, the statistics as buffers in
model.safetensors. Tensors of the starting checkpoint that the model does not use (the expert's
`lm_head`: π0 predicts velocities, not tokens) are copied from model.init_from while that
directory is there; without it they are left out (LeRobot 0.3's non-strict load accepts that).
The export stands alone: the run's tokenizer is copied into it (`lerobot_processors.TOKENIZER_DIR`,
which its tokenizer step names relatively to the export), and ZEROJAX_FILE beside config.json
records what LeRobot's config.json has no field for (the tower's head count, the dataset's fps and
feature names), read back by `model.init_from` and `zerojax serve` of the export.

    cfg, model = zerojax.interop.lerobot.load(DIR)  # one device, fp32
    model.flow_loss(batch, noise, time)           # LeRobot's PI0FlowMatching.forward
    model.sample_actions(batch, noise)            # LeRobot's sample_actions
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zerojax.config import hf_model_keys, read_json_object
from zerojax.config import policy_keys
from zerojax.config.hf_config import ZEROJAX_FILE
from zerojax.config.normalization import NormalizationMode
from zerojax.errors import ConfigError
from zerojax.models import registry
from zerojax.models.family import ACTION, CAMERA, STATE
from zerojax.interop import lerobot_processors as processors

# model.safetensors' metadata in an export: zerojax trains with openpi's centred image padding,
# LeRobot 0.3.x pads top and left, so `zerojax serve` of the export knows which it learnt with.
PADDING_KEY, CENTRED, BEFORE = "zerojax.image_padding", "centre", "before"
INIT_DIR = "lerobot_init"  # RUN_DIR/lerobot_init/: the LeRobot checkpoint's config.json and statistics
STATS_FILE = "stats.safetensors"  # `feature.stat` -> float32, as LeRobot 0.4's normalizer saves them
# LeRobot 0.3.x's normalization modules: (module, the features it normalizes)
BUFFERS = (("normalize_inputs", "input_features"), ("normalize_targets", "output_features"),
           ("unnormalize_outputs", "output_features"))


def read_config(directory: Path) -> dict:
    """config.json of a LeRobot policy of a type zerojax reads (ConfigError naming it if not)."""
    directory = Path(directory)
    path = directory / "config.json"
    if not path.is_file():
        raise ConfigError(f"{directory}: no config.json (a LeRobot policy directory, as PI0Policy.save_pretrained "
                          "writes it)")
    config = read_json_object(path, "a LeRobot policy config")
    layouts = registry.lerobot_layouts()
    if config.get("type") not in layouts:
        raise ConfigError(f"{path}: a LeRobot {config.get('type')!r} policy; zerojax reads LeRobot's "
                          f"{', '.join(layouts)} policies")
    return config


def buffer_name(module: str, feature: str, stat: str) -> str:
    """LeRobot 0.3.x's name of a statistic's buffer: normalize_inputs.buffer_observation_state.mean."""
    return f"{module}.buffer_{feature.replace('.', '_')}.{stat}"


def image_padding(directory) -> str:
    """How a LeRobot policy directory's images were padded in training, as its family's own
    convention leaves it open: a zerojax export names it (PADDING_KEY); else "centre" (openpi's,
    LeRobot 0.4's π0: a 0.4 directory has processor files) or "before" (LeRobot 0.3.x pads top
    and left). SmolVLA pads top and left in every version (`PolicyAdapter.pad_before`)."""
    from safetensors import safe_open

    directory = Path(directory)
    with safe_open(directory / "model.safetensors", framework="numpy") as f:
        named = (f.metadata() or {}).get(PADDING_KEY)
        if named in (CENTRED, BEFORE):
            return named
    return CENTRED if (directory / "policy_preprocessor.json").is_file() else BEFORE


def read_stats(directory) -> dict:
    """The normalization statistics of a LeRobot policy directory, {feature: {stat: float32
    array}}: LeRobot 0.4.x's normalizer processor's file where there is one, else 0.3.x's
    buffers in model.safetensors (the inputs' and the targets'); {} if it has neither."""
    from safetensors.numpy import load_file

    directory = Path(directory)
    pipeline = directory / "policy_preprocessor.json"
    if pipeline.is_file():
        doc = read_json_object(pipeline, "a LeRobot processor pipeline")
        for step in doc.get("steps", []):
            if step.get("registry_name") == "normalizer_processor" and step.get("state_file"):
                flat = load_file(directory / step["state_file"])
                out: dict = {}
                for key, value in flat.items():
                    feature, stat = key.rsplit(".", 1)
                    out.setdefault(feature, {})[stat] = np.asarray(value, np.float32)
                return out
    config = read_config(directory)
    from safetensors import safe_open

    out = {}
    with safe_open(directory / "model.safetensors", framework="numpy") as f:
        names = set(f.keys())
        for module, features in BUFFERS[:2]:
            for feature in config.get(features) or {}:
                for stat in ("mean", "std", "min", "max"):
                    name = buffer_name(module, feature, stat)
                    if name in names:
                        value = np.asarray(f.get_tensor(name), np.float32)
                        if np.isfinite(value).all():  # LeRobot's unset buffers are inf
                            out.setdefault(feature, {})[stat] = value
    return out


@dataclass(frozen=True)
class PolicyDir:
    """What a LeRobot policy directory says of the data its policy reads (`read_policy`): the
    features and normalization as a run's lerobot.json holds them, the square image side, the
    prompt's tokens, LeRobot's version (0.3 keeps its statistics as buffers, 0.4 and later in
    processor files; 0.6's π0 and π0.5 name the image size image_resolution, "0.4+" where the
    directory does not say which) and whether its images are padded top and left (LeRobot 0.3.x's
    π0, and SmolVLA in every version) rather than centred."""

    config: dict
    features: dict
    norms: dict
    image_size: int
    prompt_len: int | None  # tokenizer_max_length (None: the model's)
    version: str
    pad_before: bool
    fps: float = 0.0  # the dataset's frame rate where a zerojax export recorded it (ZEROJAX_FILE), else unknown
    relative: dict | None = None  # use_relative_actions' mask as lerobot.json records it (`relative_actions`), or None


def read_policy(directory) -> PolicyDir:
    """The `PolicyDir` of a LeRobot policy directory (ConfigError naming what it lacks)."""
    directory = Path(directory)
    where, config = str(directory), read_config(directory)
    features, norms = features_of(config, read_stats(directory), where)
    fps, names = _recorded_dataset(directory)
    features = {k: {**f, "names": names[k]} if names.get(k) is not None else f for k, f in features.items()}
    key = "resize_imgs_with_padding" if "resize_imgs_with_padding" in config else "image_resolution"  # 0.3, 0.4+
    resize = config.get(key)
    if resize is None or len(set(resize)) != 1:
        raise ConfigError(f"{where}/config.json: {key}={resize}; zerojax serves policies whose images are resized to "
                          "a square (LeRobot's default [224, 224])")
    prompt_len = config.get("tokenizer_max_length")
    family, _ = registry.lerobot_layouts()[config["type"]]
    return PolicyDir(config, features, norms, int(resize[0]), None if prompt_len is None else int(prompt_len),
                     "0.3" if not (directory / "policy_preprocessor.json").is_file() else
                     "0.6" if key == "image_resolution" else "0.4+",
                     registry.pads_before(family) or image_padding(directory) == BEFORE, fps,
                     relative_actions(directory, config, features))


def relative_actions(directory: Path, config: dict, features: dict) -> dict | None:
    """The relative actions of a LeRobot 0.6 policy saved with use_relative_actions=True, as a run's
    lerobot.json records them (`data.lerobot.relative.RECORD`), else None. The mask is
    RelativeActionsProcessorStep._build_mask's: a joint whose name holds an excluded one, lower-cased,
    stays absolute; the names are its preprocessor step's action_names, else config.json's
    action_feature_names, else those a zerojax export recorded; with none, every joint is relative."""
    if not config.get("use_relative_actions"):
        return None
    pipeline = directory / "policy_preprocessor.json"
    steps = read_json_object(pipeline, "a LeRobot processor pipeline").get("steps", []) if pipeline.is_file() else []
    step = next((s.get("config") or {} for s in steps if isinstance(s, dict)
                 and s.get("registry_name") == "relative_actions_processor"), {})
    exclude = [str(j) for j in step.get("exclude_joints", config.get("relative_exclude_joints") or []) if j]
    names = step.get("action_names") or config.get("action_feature_names") or features[ACTION].get("names")
    width = int(features[ACTION]["shape"][-1])
    tokens = [j.lower() for j in exclude]
    mask = [not (names and i < len(names) and any(t in str(names[i]).lower() for t in tokens)) for i in range(width)]
    return {"state": STATE, "exclude_joints": exclude, "action_names": names, "mask": mask}


def _recorded_dataset(directory: Path) -> tuple[float, dict]:
    """(fps, {feature: names}) of the dataset a zerojax export's run trained on, as its ZEROJAX_FILE
    records them (LeRobot's config.json holds neither); (0.0, {}) for any other directory."""
    path = directory / ZEROJAX_FILE
    if not path.is_file():
        return 0.0, {}
    doc = read_json_object(path, "a zerojax export's record")
    fps, features = doc.get("fps", 0.0), doc.get("features") or {}
    if (not isinstance(fps, (int, float)) or fps < 0 or not isinstance(features, dict)
            or not all(isinstance(v, dict) for v in features.values())):
        raise ConfigError(f"{path}: 'fps' must be a number >= 0 and 'features' an object of {{feature: {{\"names\": "
                          f"[...]}}}}; got {fps!r} and {json.dumps(features)[:80]}")
    return float(fps), {k: v.get("names") for k, v in features.items()}


def named_tokenizer(directory) -> str | None:
    """The tokenizer.json a LeRobot policy directory names where it is at hand
    (`config.policy_keys.named_tokenizer`, which a run from the directory takes as data.tokenizer;
    a zerojax export's own copy first)."""
    return policy_keys.named_tokenizer(directory, read_config(Path(directory)))


def read_checkpoint(init_from: str, plan, family: str, stacked: tuple[str, ...]):
    """`model.init_from` of a LeRobot policy (`zerojax.checkpoints.lerobot`): (checkpoint, name
    table, stacked names) of its model.safetensors, named by its family's LeRobot layout and
    checked against the plan from the header alone."""
    from zerojax.interop.hf import check
    from zerojax.interop.safetensors import Checkpoint

    layout = registry.lerobot_layout(family)
    ckpt = Checkpoint([Path(init_from) / "model.safetensors"], init_from, aliases=layout.aliases)
    check(ckpt, plan, layout.tensors, stacked)
    return ckpt, layout.tensors, stacked


def init_files(directory) -> dict:
    """RUN_DIR/lerobot_init/'s files (name -> bytes) for a run that starts from a LeRobot
    checkpoint: its config.json as it is, and its statistics (`read_stats`)."""
    from safetensors.numpy import save

    directory = Path(directory)
    read_config(directory)
    flat = {f"{feature}.{stat}": value for feature, stats in read_stats(directory).items()
            for stat, value in stats.items()}
    kept = {f"{INIT_DIR}/{name}": (directory / name).read_bytes() for name in processors.FILES
            if (directory / name).is_file()}  # 0.4+'s processor steps, for the export
    return {f"{INIT_DIR}/config.json": (directory / "config.json").read_bytes(),
            f"{INIT_DIR}/{STATS_FILE}": save(flat), **kept}


def features_of(config: dict, stats: dict, where: str) -> tuple[dict, dict]:
    """(features, normalization) as lerobot.json holds them, from a LeRobot policy's config.json
    (input_features, output_features, normalization_mapping) and its statistics: the reverse of
    `_data_config`."""
    inputs, outputs = config.get("input_features") or {}, config.get("output_features") or {}
    kinds = {k: f.get("type") for k, f in {**inputs, **outputs}.items()}
    want = {STATE: "STATE", ACTION: "ACTION"}
    for key, kind in want.items():
        if kinds.get(key) != kind:
            raise ConfigError(f"{where}/config.json: no {kind} feature {key!r} (its features: {sorted(kinds)}); "
                              f"zerojax serves policies of {STATE!r}, {ACTION!r} and {CAMERA}<camera> images")
    odd = [k for k, kind in kinds.items() if k not in want and (kind != "VISUAL" or not k.startswith(CAMERA))]
    if odd:
        raise ConfigError(f"{where}/config.json: features {odd} are not {STATE!r}, {ACTION!r} or {CAMERA}<camera> "
                          "images, which zerojax serves")
    features = {}
    for key, f in {**inputs, **outputs}.items():
        shape = list(f["shape"])
        features[key] = {"shape": shape[1:] + shape[:1] if kinds[key] == "VISUAL" else shape,  # CHW -> HWC frames
                         "dtype": "video" if kinds[key] == "VISUAL" else "float32"}
    mapping = config.get("normalization_mapping") or {}
    norms = {}
    for key in (STATE, ACTION):
        mode = NormalizationMode.of_lerobot(mapping.get(kinds[key], NormalizationMode.IDENTITY.value))
        if mode is None:
            raise ConfigError(f"{where}/config.json: normalization_mapping {kinds[key]}={mapping[kinds[key]]!r}; "
                              f"zerojax applies {', '.join(m.value for m in NormalizationMode)}")
        missing = [s for s in mode.stats if s not in stats.get(key, {})]
        if missing:
            raise ConfigError(f"{where}: no {key} {'/'.join(missing)} statistics (normalization {mode.config}); the "
                              "checkpoint holds none (0.3.x: buffers in model.safetensors; 0.4.x: its processor files)")
        norms[key] = {"mode": mode.config, **{s: stats[key][s] for s in mode.stats}}
    return features, norms


# ---------------------------------------------------------------------------------------------
# The Python API: one device, fp32.


def load(directory, vision_heads: int | None = None):
    """(cfg, model): a LeRobot policy directory's ModelConfig and its model on one device, in fp32,
    each tensor read through the same path as `model.init_from`. `vision_heads`: the tower's
    head count, which no tensor's shape holds (None: the family's layout's default)."""
    from zerojax.config.sections import ModelConfig
    from zerojax.interop import hf

    directory = str(directory)
    read_config(Path(directory))
    given = {"vision": {"n_heads": vision_heads}} if vision_heads else {}
    cfg = ModelConfig(**hf_model_keys(directory, given), init_from=directory)
    return cfg, hf.one_device(cfg)
