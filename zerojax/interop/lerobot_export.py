"""A run as a LeRobot policy directory: `save`, what `zerojax export --format lerobot` writes
(`interop.lerobot`'s docstring, "Out": config.json, model.safetensors, the processor files with
their statistics, the run's tokenizer and ZEROJAX_FILE). Split from `interop.lerobot`, which reads
such directories, by concept: reading and writing share its names and readers, nothing else.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from zerojax.config import read_json_object
from zerojax.checkpoints import lerobot as lerobot_format
from zerojax.config.hf_config import ZEROJAX_FILE
from zerojax.config.normalization import V03_MODES, NormalizationMode
from zerojax.data import corpus, mixture
from zerojax.data.lerobot.relative import RECORD as RELATIVE
from zerojax.errors import ConfigError
from zerojax.interop import lerobot_processors as processors
from zerojax.interop.lerobot import BEFORE, BUFFERS, CENTRED, INIT_DIR, PADDING_KEY, STATS_FILE, buffer_name
from zerojax.interop.safetensors import Checkpoint, Entry, create_safetensors, fill
from zerojax.models import registry
from zerojax.models.family import ACTION, CAMERA, STATE

ALIAS = "alias:"  # an export's second name for a leaf's tensor (LeRobotLayout.aliases)


def _run_policy(run_dir: Path, dataset: str | None = None) -> tuple[dict, dict, dict]:
    """(config.json to start from, {feature: {stat: array}}, the data's {features, modes} or {})
    of a run: RUN_DIR/lerobot_init/ (it started from a LeRobot checkpoint) and RUN_DIR/lerobot.json
    (it trained on a LeRobot dataset; its statistics win: the model learnt in their space), or of
    a mixture run the record of the dataset `dataset` names (`mixture.record_of`: its statistics,
    its own cameras and widths; the mixture's camera slots it lacks were masked, and a masked slot
    changes no action, so LeRobot's layout of its own cameras answers as the mixture's did)."""
    from safetensors.numpy import load_file

    init = run_dir / INIT_DIR
    base = read_json_object(init / "config.json", "a LeRobot policy config") if (init / "config.json").is_file() else {}
    stats = {}
    if (init / STATS_FILE).is_file():
        for key, value in load_file(init / STATS_FILE).items():
            feature, stat = key.rsplit(".", 1)
            stats.setdefault(feature, {})[stat] = value
    mixed = (run_dir / mixture.RUN_FILE).is_file()
    if dataset is not None and not mixed:
        raise ConfigError(f"--dataset {dataset!r} picks a dataset of a mixture run (data.source=mixture); {run_dir} "
                          "trained on one dataset: drop --dataset")
    data = {}
    doc = mixture.record_of(run_dir, dataset) if mixed else None
    if doc is None and (run_dir / "lerobot.json").is_file():
        doc = read_json_object(run_dir / "lerobot.json", "a run's LeRobot dataset record")
    if doc is not None:
        data = {"features": doc["features"], "modes": {k: v["mode"] for k, v in doc["normalization"].items()},
                "fps": doc.get("fps", 0.0), "relative": doc.get(RELATIVE)}
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
         dtype: str = "float32", tokenizer: str = "", dataset: str | None = None) -> tuple[int, int]:
    """A LeRobot policy directory at `out` (what `zerojax export --format lerobot` writes):
    config.json, model.safetensors and, in 0.6's layout, the processor files (module docstring).
    0.3's layout where the run started from a 0.3 checkpoint, else 0.6's. `shapes`: zerojax path ->
    true shape; `blocks_of(path)` yields a leaf's pieces; `tokenizer`: the run's data.tokenizer (the
    processor files name it; `dataset`: of a mixture run, the dataset whose policy it is). Written
    to `out`.tmp, renamed once complete. Returns (bytes, tensors)."""
    from zerojax.interop.hf import hf_tensors

    if out.exists():
        raise ConfigError(f"--out {str(out)!r} already exists; give a new directory")
    layout = registry.lerobot_layout(model["family"])
    config, stats, data, v03 = _export_config(run_dir, model, layout, tokenizer, dataset)
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
        processors.write(tmp, config, stats, steps, processors.TOKENIZER_DIR if tokenizer else "",
                         data.get("relative") if data else processors.KEEP)
    tmp.rename(out)  # the directory appears only once complete
    return sum(f.stat().st_size for f in out.rglob("*") if f.is_file()), len(tensors)


def write(job) -> tuple[int, int]:
    """`zerojax export --format lerobot` (`zerojax.checkpoints.lerobot`): `save` of an `ExportJob`."""
    return save(job.out, job.run_dir, job.config["model"], job.shapes, job.stacked(), job.blocks_of, dtype=job.dtype,
                tokenizer=job.config["data"].get("tokenizer", ""), dataset=job.dataset)


def _export_config(run_dir: Path, model: dict, layout, tokenizer: str,
                   dataset: str | None) -> tuple[dict, dict, dict, bool]:
    """(config.json, statistics, the data's record, whether LeRobot 0.3's layout) of the export,
    checked before anything is written: features to name, and the tokenizer it will carry."""
    base, stats, data = _run_policy(run_dir, dataset)
    config = layout.to_config(model, base)
    v03 = layout.legacy(config)
    if data:
        config.update(_data_config(data, model["vision"]["image_size"], model["action"]["cameras"],
                                   V03_MODES if v03 else tuple(NormalizationMode)))
    if data:
        _relative_config(config, data.get("relative"), v03, layout.processors and layout.processors(config))
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
    return config, stats, data, v03


def _relative_config(config: dict, relative: dict | None, v03: bool, steps) -> None:
    """config.json's use_relative_actions, relative_exclude_joints and action_feature_names for a
    run's relative actions (data.lerobot.relative.RECORD; off where it had none), checked: a family
    whose LeRobot processors have no relative step, or LeRobot 0.3's layout, cannot say them."""
    names = {s["registry_name"] for s in (steps[0] if steps else [])}
    if relative and (v03 or processors.RELATIVE_STEP not in names):
        raise ConfigError(f"the run learnt relative actions (model.action.relative), which LeRobot's {config['type']}"
                          f"{' in 0.3' if v03 else ''} cannot undo (no {processors.RELATIVE_STEP}); export it with "
                          "--format safetensors or openpi")
    if relative:
        config.update(use_relative_actions=True, relative_exclude_joints=relative["exclude_joints"],
                      action_feature_names=relative["action_names"])
    elif "use_relative_actions" in config:  # a run that turned the checkpoint's off
        config["use_relative_actions"] = False


def _record(model: dict, data: dict) -> dict:
    """ZEROJAX_FILE's content: what LeRobot's config.json has no field for, read back by
    `model.init_from` (`config.hf_config.recorded_model_keys`, every key of it) and `zerojax serve` (`read_policy`):
    the tower's head count (no tensor's shape holds it), training-time real-time chunking's delay
    (LeRobot 0.6.1's rtc_config is inference-time guidance: no field says a model was trained to
    take a given prefix) and, where the run trained on a LeRobot dataset, its fps and its
    features' names (the action names a robot maps the actions by)."""
    out: dict = {"model": {"vision": {"n_heads": int(model["vision"]["n_heads"])}}}
    if model["action"].get("train_delay"):
        out["model"]["action"] = {"train_delay": int(model["action"]["train_delay"])}
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
    start = Path(init_from) if init_from else None
    if start is None or not lerobot_format.detect(start) or not (start / "model.safetensors").is_file():
        return {}
    shapes = Checkpoint([Path(init_from) / "model.safetensors"], init_from).shapes
    stats = tuple(f"{module}." for module, _ in BUFFERS)
    return {name: shape for name, shape in shapes.items() if name not in written and not name.startswith(stats)}
