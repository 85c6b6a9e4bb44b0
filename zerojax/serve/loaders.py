"""The ways a policy comes to be served, each a `ServedPolicy` compiled and warmed up by `load`
(openpi's `create_trained_policy`): a run directory's checkpoint with its lerobot.json
(`run_policy`), or a checkpoint whose format's record names a server (`zerojax.checkpoints`): a
safetensors file `zerojax export` wrote of such a run (`export_policy`), an openpi checkpoint
directory `zerojax export --format openpi` wrote of one (`openpi_policy`), and a LeRobot policy
directory, served as LeRobot runs it (`lerobot_policy`). Each refuses, before any
weight is read, what is not a policy trained on LeRobot data (ConfigError). A mixture run (or
its export) is served from its mixture.json instead of a lerobot.json: each request names its
dataset, answered with that dataset's statistics, cameras and widths (serve/mixture.py).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from zerojax.checkpoints import format as checkpoints
from zerojax.data import corpus
from zerojax.data.lerobot.relative import RECORD as RELATIVE
from zerojax.data.mixture import RUN_FILE as MIXTURE_FILE
from zerojax.errors import ConfigError
from zerojax.models import registry
from zerojax.models.family import CAMERA, POLICY
from zerojax.serve.mixture import Datasets
from zerojax.serve.observation import Observations
from zerojax.serve.policy import ServedPolicy


def load(target: Path, step: int | None = None, num_steps: int = 10, seed: int = 0, tokenizer: str | None = None,
         vision_heads: int | None = None, max_batch: int = 1, rtc_jacobian: bool = False) -> ServedPolicy:
    """A policy, compiled and warmed up (for batches of up to `max_batch` observations): a run
    directory's checkpoint (the newest, or `step`) and its lerobot.json, a safetensors file
    `zerojax export` wrote of such a run (its config, lerobot.json and tokenizer travel in the
    file's metadata: export.run_metadata), or a LeRobot policy directory (`lerobot_policy`:
    `tokenizer` and `vision_heads` are for it alone). ConfigError, before any weight is read, for
    a run that is not a policy trained on LeRobot data."""
    served = _policy(Path(target), step, num_steps, seed, tokenizer, vision_heads)
    served.max_batch, served.rtc_jacobian = max_batch, rtc_jacobian  # before the first trace
    served.warm_up()
    return served


def _policy(target: Path, step, num_steps: int, seed: int, tokenizer, vision_heads) -> ServedPolicy:
    """The loader `target` calls for, unwarmed: a zerojax run directory's, or its checkpoint
    format's server (`zerojax.checkpoints`: a zerojax export file, a LeRobot policy directory)."""
    record = None if (target / "checkpoints").is_dir() or not target.exists() else checkpoints.recognise(target)
    if record is None:  # a zerojax run directory (run_policy says what is wrong with one that is not)
        _no_checkpoint_flags(target, tokenizer, vision_heads)
        return run_policy(target, step, num_steps, seed)
    if not record.serve:
        served = ", ".join(f.what for f in checkpoints.formats() if f.serve)
        raise ConfigError(f"{target} is {record.what}, which zerojax serve does not take; give a zerojax run "
                          f"directory, {served}")
    return checkpoints.call(record.serve, target, step, num_steps, seed, tokenizer, vision_heads)


def _no_checkpoint_flags(target: Path, tokenizer, vision_heads) -> None:
    """--tokenizer and --vision-heads are for a checkpoint that does not record them."""
    if tokenizer is not None or vision_heads is not None:
        raise ConfigError(f"--tokenizer and --vision-heads are for a LeRobot checkpoint directory (its config.json "
                          f"names no tokenizer and no tower heads); {target} is a zerojax run or export, which "
                          "carries both: drop them")


def export_policy(target: Path, step, num_steps: int, seed: int, tokenizer=None, vision_heads=None) -> ServedPolicy:
    """A `zerojax export` safetensors file of a policy run (`zerojax.checkpoints.safetensors`): its
    config, lerobot.json and tokenizer travel in the file's metadata (export.run_metadata)."""
    from zerojax.train import export

    _no_checkpoint_flags(target, tokenizer, vision_heads)
    if step is not None:
        raise ConfigError(f"--step {step} picks a checkpoint of a run directory; {target} is an export of one "
                          "step: drop --step, or give the run directory")
    saved, step, metadata, weights = export.read_export(target)
    where = f"{target} (exported at step {step})"
    check_family(saved, where)
    doc, tokenizer = _carried(target, saved, metadata)
    model = export.exported_model(saved, weights, str(target))
    return _served(where, model, doc, tokenizer, saved, num_steps, seed)


def openpi_policy(target: Path, step, num_steps: int, seed: int, tokenizer=None, vision_heads=None) -> ServedPolicy:
    """An openpi checkpoint directory `zerojax export --format openpi` wrote of a policy run
    (`zerojax.checkpoints.openpi`): its params/ read as `model.init_from` reads them, into the model
    of the run's config, which its ZEROJAX_FILE carries with the run's lerobot.json or mixture.json
    and tokenizer (export.run_metadata); each dataset's statistics are its assets/<asset_id>/'s
    (`interop.openpi.served_record`), so a mixture's request names its dataset as with any export."""
    from zerojax.config.hf_config import ZEROJAX_FILE
    from zerojax.config.sections import ModelConfig
    from zerojax.interop import hf, openpi
    from zerojax.train import export

    _no_checkpoint_flags(target, tokenizer, vision_heads)
    if step is not None:
        raise ConfigError(f"--step {step} picks a checkpoint of a run directory; {target} is an openpi checkpoint "
                          "(one step): drop --step")
    if not (target / ZEROJAX_FILE).is_file():
        raise ConfigError(f"{target} is an openpi checkpoint without {ZEROJAX_FILE}: openpi keeps a policy's features, "
                          "prompt and transforms in its code (a TrainConfig), not in the directory, so zerojax serve "
                          "takes one that `zerojax export --format openpi` wrote, which records them there")
    metadata = json.loads((target / ZEROJAX_FILE).read_text())
    saved = json.loads(metadata[export.CONFIG_KEY])
    where = f"{target} (openpi export of step {metadata.get(export.STEP_KEY)})"
    check_family(saved, where)
    doc, tokenizer = _carried(target, saved, metadata)
    model = hf.one_device(ModelConfig(**{**saved["model"], "init_from": str(target)}))
    return _served(where, model, openpi.served_record(target, doc), tokenizer, saved, num_steps, seed)


def _carried(target: Path, saved: dict, metadata: dict) -> tuple[dict, object]:
    """(the run's lerobot.json or mixture.json, its tokenizer or None) an export carries beside its
    weights (export.run_metadata); ConfigError where it lacks either."""
    from zerojax.train import export

    doc_text = metadata.get(export.RUN_FILE_KEY.format(name="lerobot.json"))
    mixture = metadata.get(export.RUN_FILE_KEY.format(name=MIXTURE_FILE))
    if doc_text is None and mixture is None:
        raise ConfigError(f"{target}: the export carries no lerobot.json; zerojax serve needs the statistics and "
                          "features of a run trained on data.source=lerobot:DIR or mixture (this run's data.source="
                          f"{saved['data']['source']})")
    tokenizer = None
    if saved["data"].get("tokenizer"):
        if export.TOKENIZER_KEY not in metadata:
            raise ConfigError(f"{target}: the export carries no tokenizer (data.tokenizer="
                              f"{saved['data']['tokenizer']} was not there when it was exported); export again")
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_str(metadata[export.TOKENIZER_KEY])
    return json.loads(mixture or doc_text), tokenizer


def run_policy(target: Path, step, num_steps: int, seed: int) -> ServedPolicy:
    """A run directory's checkpoint (the newest, or `step`), with the lerobot.json a run of
    data.source=lerobot:DIR writes and its data.tokenizer."""
    from zerojax.train import export

    saved, step = export.saved_config(target, step)
    where = f"{target} (step {step})"
    check_family(saved, str(target))
    doc_path = target / MIXTURE_FILE if (target / MIXTURE_FILE).is_file() else target / "lerobot.json"
    if not doc_path.is_file():
        raise ConfigError(f"{doc_path}: no such file; zerojax serve needs the statistics and features a run of "
                          f"data.source=lerobot:DIR writes there (this run's data.source={saved['data']['source']})")
    doc = json.loads(doc_path.read_text())
    _, _, model = export.load_model(target, step)
    tokenizer = corpus.load_tokenizer(saved["data"]["tokenizer"]) if saved["data"].get("tokenizer") else None
    return _served(where, model, doc, tokenizer, saved, num_steps, seed)


def _served(where: str, model, doc: dict, tokenizer, saved: dict, num_steps: int, seed: int) -> ServedPolicy:
    """A zerojax run's policy (a run directory's or an export's) with its lerobot.json `doc`, or
    a mixture run's with its mixture.json (each request names its dataset: serve/mixture.py)."""
    if "datasets" in doc:
        records = [d["lerobot.json"] for d in doc["datasets"]]  # the image size and prompt length are the run's
        seen = Datasets(doc, tokenizer, max(r["image_size"] for r in records), records[0]["prompt_len"],
                        saved["model"])
        return ServedPolicy(where, model, seen, num_steps, seed)
    seen = Observations(doc["features"], doc["normalization"], tokenizer, doc["image_size"], doc["prompt_len"],
                        saved["model"], relative=doc.get(RELATIVE))
    return ServedPolicy(where, model, seen, num_steps, seed, fps=doc.get("fps", 0.0))


def check_family(saved: dict, where: str) -> None:
    family = saved["model"]["family"]
    if not registry.is_policy(family):
        raise ConfigError(f"{where} is a {family} run (model.family={family}); zerojax serve and rollout take "
                          f"policies: a run of model.family={' or '.join(registry.of_kind(POLICY))} trained on "
                          "data.source=lerobot:DIR")


# ---------------------------------------------------------------------------------------------
# A LeRobot policy checkpoint (PI0Policy.save_pretrained's directory), served as LeRobot runs it.


def lerobot_policy(directory: Path, step, num_steps: int, seed: int, tokenizer: str | None,
                   vision_heads: int | None) -> ServedPolicy:
    """A LeRobot policy directory served as LeRobot's `select_action` answers, with what
    `interop.lerobot.read_policy` reads of it: its features (cameras in its order, CHW shapes read
    as HWC frames), normalization, image padding (top and left: LeRobot 0.3.x's π0 and SmolVLA;
    centred: 0.4+'s π0 and π0.5, openpi) and prompt length, and where a zerojax export recorded them
    (interop.lerobot.ZEROJAX_FILE) the dataset's fps and feature names and the tower's head count.
    `tokenizer`, a tokenizer.json, or the one the directory names where it is at hand
    (`interop.lerobot.named_tokenizer`: a zerojax export's own copy); LeRobot's π0 fetches
    PaliGemma's from the Hub, which its directory does not hold."""
    from zerojax.interop import lerobot as lerobot_io

    where = str(directory)
    if step is not None:
        raise ConfigError(f"--step {step} picks a checkpoint of a run directory; {where} is a LeRobot checkpoint (one "
                          "step): drop --step")
    lerobot_io.read_config(directory)
    tokenizer = tokenizer or lerobot_io.named_tokenizer(directory)
    if tokenizer is None:
        raise ConfigError(f"{where} is a LeRobot checkpoint, which does not carry its tokenizer (LeRobot's π0 loads "
                          "google/paligemma-3b-pt-224's from the Hub; a SmolVLA names its SmolVLM, here not a local "
                          "directory): give --tokenizer PATH, that model's tokenizer.json (or the one the policy was "
                          "trained with)")
    found = lerobot_io.read_policy(directory)
    tok = corpus.load_tokenizer(tokenizer)
    cfg, model = lerobot_io.load(directory, vision_heads)
    if cfg.vision.image_size != found.image_size:
        key = "resize_imgs_with_padding" if "resize_imgs_with_padding" in found.config else "image_resolution"
        raise ConfigError(f"{where}/config.json: {key}={found.config.get(key)}, "
                          f"but the tower reads {cfg.vision.image_size} x {cfg.vision.image_size} images")
    cameras = [k for k in found.features if k.startswith(CAMERA)]
    if len(cameras) > cfg.action.cameras:
        raise ConfigError(f"{where}: {len(cameras)} cameras in config.json but the model takes {cfg.action.cameras}")
    seen = Observations(found.features, found.norms, tok, found.image_size, found.prompt_len or cfg.action.prompt_len,
                        dataclasses.asdict(cfg), pad_before=found.pad_before, relative=found.relative)
    return ServedPolicy(f"{where} (LeRobot {found.version} {found.config['type']} checkpoint)", model, seen,
                        num_steps, seed, fps=found.fps)
