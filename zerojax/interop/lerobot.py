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

Out: `save` (`zerojax export --format lerobot`) writes what LeRobot loads: config.json (the one
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
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from zerojax.config import hf_model_keys, read_json_object
from zerojax.config import policy_keys
from zerojax.config.hf_config import LEROBOT, ZEROJAX_FILE, init_source
from zerojax.config.normalization import V03_MODES, NormalizationMode
from zerojax.data import corpus
from zerojax.errors import ConfigError
from zerojax.models import registry
from zerojax.models.family import ACTION, CAMERA, STATE
from zerojax.interop import lerobot_processors as processors
from zerojax.interop.safetensors import Checkpoint, Entry, create_safetensors, fill

# model.safetensors' metadata in an export: zerojax trains with openpi's centred image padding,
# LeRobot 0.3.x pads top and left, so `zerojax serve` of the export knows which it learnt with.
PADDING_KEY, CENTRED, BEFORE = "zerojax.image_padding", "centre", "before"
INIT_DIR = "lerobot_init"  # RUN_DIR/lerobot_init/: the LeRobot checkpoint's config.json and statistics
ALIAS = "alias:"  # an export's second name for a leaf's tensor (LeRobotLayout.aliases)
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
                     registry.pads_before(family) or image_padding(directory) == BEFORE, fps)


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


# ---------------------------------------------------------------------------------------------
# Out: what PI0Policy.from_pretrained (LeRobot 0.3.x) loads.


def _run_policy(run_dir: Path) -> tuple[dict, dict, dict]:
    """(config.json to start from, {feature: {stat: array}}, the data's {features, modes} or {})
    of a run: RUN_DIR/lerobot_init/ (it started from a LeRobot checkpoint) and RUN_DIR/lerobot.json
    (it trained on a LeRobot dataset; its statistics win: the model learnt in their space)."""
    from safetensors.numpy import load_file

    init = run_dir / INIT_DIR
    base = read_json_object(init / "config.json", "a LeRobot policy config") if (init / "config.json").is_file() else {}
    stats = {}
    if (init / STATS_FILE).is_file():
        for key, value in load_file(init / STATS_FILE).items():
            feature, stat = key.rsplit(".", 1)
            stats.setdefault(feature, {})[stat] = value
    if (run_dir / "mixture.json").is_file():  # data.source=mixture: no one dataset's statistics to write
        raise ConfigError(f"{run_dir} trained on a mixture of datasets (mixture.json lists each one's statistics); "
                          "exporting it with per-dataset normalization is not supported yet")
    data = {}
    if (run_dir / "lerobot.json").is_file():
        doc = read_json_object(run_dir / "lerobot.json", "a run's LeRobot dataset record")
        data = {"features": doc["features"], "modes": {k: v["mode"] for k, v in doc["normalization"].items()},
                "fps": doc.get("fps", 0.0)}
        stats = {k: {s: np.asarray(x, np.float32) for s, x in v.items() if s != "mode"}
                 for k, v in doc["normalization"].items()}
    return base, stats, data


def _data_config(data: dict, image_size: int, slots: int, modes: tuple = V03_MODES) -> dict:
    """config.json's features, normalization_mapping and empty_cameras for the run's LeRobot
    dataset (`slots`: the model's camera slots, model.action.cameras: those the dataset does not
    fill are LeRobot's empty cameras, all -1 and masked as zerojax trained them; `modes`: the
    `NormalizationMode`s the LeRobot written can normalize with)."""
    inputs, outputs, mapping = {}, {}, {"VISUAL": NormalizationMode.IDENTITY.value}
    for key, feature in data["features"].items():
        if key == ACTION:
            outputs[key] = {"type": "ACTION", "shape": [int(feature["shape"][-1])]}
        elif key == STATE:
            inputs[key] = {"type": "STATE", "shape": [int(feature["shape"][-1])]}
        else:
            inputs[key] = {"type": "VISUAL", "shape": [3, image_size, image_size]}
    for key, kind in ((STATE, "STATE"), (ACTION, "ACTION")):
        mode = data["modes"].get(key, NormalizationMode.IDENTITY.config)
        if NormalizationMode.of_config(mode) not in modes:
            raise ConfigError(f"the run normalized {key} with {mode!r}; LeRobot 0.3's π0 normalizes with "
                              f"{', '.join(m.config for m in modes)} only, so --format lerobot cannot write it")
        mapping[kind] = NormalizationMode.of_config(mode).value
    empty = slots - sum(key.startswith(CAMERA) for key in inputs)
    return {"input_features": inputs, "output_features": outputs, "normalization_mapping": mapping,
            "empty_cameras": empty}


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


def stat_tensors(config: dict, stats: dict) -> dict:
    """LeRobot 0.3.x's normalization buffers {name: float32 array} for config.json's features and
    modes (ConfigError naming a statistic the run does not have)."""
    mapping, out = config.get("normalization_mapping") or {}, {}
    for module, features in BUFFERS:
        for feature, spec in (config.get(features) or {}).items():
            name = mapping.get(spec.get("type"), NormalizationMode.IDENTITY.value)
            mode = NormalizationMode.of_lerobot(name)
            if mode not in V03_MODES:
                raise ConfigError(f"normalization_mapping {spec.get('type')}={name!r}: LeRobot 0.3's π0 normalizes "
                                  f"with {', '.join(m.value for m in V03_MODES)} only")
            for stat in mode.stats:
                if stat not in stats.get(feature, {}):
                    raise ConfigError(f"the run has no normalization statistic {feature}.{stat} ({name}); train on a "
                                      "LeRobot dataset (data.source=lerobot:DIR) or start from a LeRobot checkpoint "
                                      "that has its statistics (model.init_from)")
                value = np.asarray(stats[feature][stat], np.float32)
                out[buffer_name(module, feature, stat)] = value.reshape(-1, 1, 1) if spec.get("type") == "VISUAL" \
                    else value
    return out


def save(out: Path, run_dir: Path, model: dict, shapes: dict, stacked: tuple[str, ...], blocks_of, *,
         dtype: str = "float32", tokenizer: str = "") -> tuple[int, int]:
    """A LeRobot policy directory at `out` (what `zerojax export --format lerobot` writes):
    config.json, model.safetensors and, in 0.6's layout, the processor files (module docstring).
    0.3's layout where the run started from a 0.3 checkpoint, else 0.6's. `shapes`: zerojax path ->
    true shape; `blocks_of(path)` yields a leaf's pieces; `tokenizer`: the run's data.tokenizer (the
    processor files name it). Written to `out`.tmp, renamed once complete. Returns (bytes, tensors)."""
    from zerojax.interop.hf import hf_tensors

    if out.exists():
        raise ConfigError(f"--out {str(out)!r} already exists; give a new directory")
    layout = registry.lerobot_layout(model["family"])
    base, stats, data = _run_policy(run_dir)
    config = layout.to_config(model, base)
    v03 = layout.legacy(config)
    if data:
        config.update(_data_config(data, model["vision"]["image_size"], model["action"]["cameras"],
                                   V03_MODES if v03 else tuple(NormalizationMode)))
    if not config.get("output_features"):
        raise ConfigError(f"{run_dir} neither started from a LeRobot checkpoint (model.init_from) nor trained on a "
                          "LeRobot dataset (data.source=lerobot:DIR): it names no features for LeRobot's config.json")
    if tokenizer:  # the export carries it: there, before anything is written
        try:
            corpus.tokenizer_file(tokenizer)
        except ConfigError:
            raise ConfigError(f"{run_dir}: the export carries the run's tokenizer, but data.tokenizer={tokenizer!r} "
                              f"holds no tokenizer.json (seen from {Path.cwd()}); put it back where the run's config "
                              "names it, or export from the directory the run trained in") from None
    extra = {f"lerobot:{name}": value for name, value in stat_tensors(config, stats).items()} if v03 else {}
    steps = None if v03 else processors.steps_of(_kept_processors(run_dir), layout.processors and
                                                 layout.processors(config))
    if not v03:
        processors.check_stats(config, stats)  # before anything is written
    # 0.3: the embedding under its tied name (lm_head); 0.6: under embed_tokens and lm_head both
    table = {path: replace(t, name=layout.aliases.get(t.name, t.name)) for path, t in layout.tensors.items()} \
        if v03 else layout.tensors
    tensors = hf_tensors(model["family"], shapes, stacked, table)
    tensors += [] if v03 else [e._replace(name=layout.aliases[e.name], path=f"{ALIAS}{e.path}") for e in tensors
                               if e.name in layout.aliases]  # a path of its own: `fill` takes one tensor a leaf
    # a tensor written under one name is not copied from model.init_from under its other (a stale table)
    unused = _unused_tensors(model.get("init_from", ""), {t.name for t in tensors} | set(layout.aliases))
    tensors += [Entry(name, f"lerobot:{name}", None, shape) for name, shape in unused.items()]
    if not v03 and layout.unused:  # 0.6 loads strictly: what the start did not give, as zeros
        extra.update({f"lerobot:{n}": np.zeros(shape, np.float32) for n, shape in layout.unused(model).items()
                      if n not in unused})
    tensors += [Entry(path.removeprefix("lerobot:"), path, None, value.shape) for path, value in extra.items()]
    source = Checkpoint([Path(model["init_from"]) / "model.safetensors"], model["init_from"]) if unused else None

    def blocks(path):
        if path in extra:
            yield tuple(slice(0, n) for n in extra[path].shape), extra[path]
        elif path.startswith(ALIAS):
            yield from blocks_of(path.removeprefix(ALIAS))
        elif path.startswith("lerobot:"):
            name = path.removeprefix("lerobot:")
            yield tuple(slice(0, n) for n in unused[name]), source.read(name, ())
        else:
            yield from blocks_of(path)

    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    padding = BEFORE if registry.pads_before(model["family"]) else CENTRED
    fill(create_safetensors(tmp / "model.safetensors", tensors, dtype, {PADDING_KEY: padding}), tensors, blocks, dtype)
    (tmp / "config.json").write_text(json.dumps(config, indent=4))
    (tmp / ZEROJAX_FILE).write_text(json.dumps(_record(model, data), indent=4))
    if tokenizer:  # the export carries its tokenizer, named relatively to itself
        processors.copy_tokenizer(tokenizer, tmp / processors.TOKENIZER_DIR)
    if steps:
        processors.write(tmp, config, stats, steps, processors.TOKENIZER_DIR if tokenizer else "")
    tmp.rename(out)  # the directory appears only once complete
    return sum(f.stat().st_size for f in out.rglob("*") if f.is_file()), len(tensors)


def _record(model: dict, data: dict) -> dict:
    """ZEROJAX_FILE's content: what LeRobot's config.json has no field for, read back by
    `model.init_from` (`config.hf_config.recorded_model_keys`) and `zerojax serve` (`read_policy`):
    the tower's head count (no tensor's shape holds it) and, where the run trained on a LeRobot
    dataset, its fps and its features' names (the action names a robot maps the actions by)."""
    out: dict = {"model": {"vision": {"n_heads": int(model["vision"]["n_heads"])}}}
    if data:
        out["fps"] = data["fps"]
        out["features"] = {k: {"names": f.get("names")} for k, f in data["features"].items()}
    return out


def _kept_processors(run_dir: Path) -> dict:
    """The processor files (name -> bytes) of the checkpoint the run started from, as it kept them."""
    init = run_dir / INIT_DIR
    return {name: (init / name).read_bytes() for name in processors.FILES if (init / name).is_file()}


def _unused_tensors(init_from: str, written: set) -> dict:
    """name -> shape of the tensors of the LeRobot checkpoint the run started from that the
    export writes no other way (not the model's, not statistics): {} if it is not there."""
    if (not init_from or not Path(init_from).exists() or init_source(init_from) != LEROBOT
            or not (Path(init_from) / "model.safetensors").is_file()):
        return {}
    shapes = Checkpoint([Path(init_from) / "model.safetensors"], init_from).shapes
    stats = tuple(f"{module}." for module, _ in BUFFERS)
    return {name: shape for name, shape in shapes.items() if name not in written and not name.startswith(stats)}


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
