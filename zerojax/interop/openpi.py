"""openpi checkpoints in and out, for any family that declares an `OpenpiLayout` (π0's and π0.5's
live in their own rooms: models/pi0/openpi.py, models/pi05/openpi.py, on
models/paligemma_expert/openpi.py). This module names no family: the layouts' `Rule`s say which
openpi leaves hold which zerojax leaves, both ways.

An openpi checkpoint directory, as openpi's training writes a step (`training/checkpoints.py:
save_state`) and its released checkpoints hold:

    DIR/params/                          orbax PyTree {"params": the model's pure dict} (training's
                                         leaves end in "value", nnx.State's: stripped on reading,
                                         as openpi's `model.restore_params` does)
    DIR/assets/<asset_id>/norm_stats.json   {"norm_stats": {"state": {mean, std, q01, q99}, "actions": ...}}
                                         (`shared/normalize.py`; asset_id may hold a "/")

In: `model.init_from=DIR`. The model's keys come from the tree's shapes (`config.openpi_dir`,
through the family whose heads the tree has; a model.family that contradicts it is refused); the
shapes are checked from orbax's metadata before anything is read or compiled
(`openpi_tree.TreeCheckpoint`); the tree is
read whole, on the host, on the first read (as openpi's `restore_params` does), and each device
takes its slices from it (`interop.hf.sharded_params`). A tree with leaves no rule reads (openpi's
LoRA `lora_a`/`lora_b`) is refused, not half-read. The run keeps assets/ in RUN_DIR/openpi_init/.

Out: `save` (`zerojax export --format openpi`) writes DIR/params with orbax's PyTreeCheckpointer
as openpi's released checkpoints hold it ({"params": pure dict}, no "value") and DIR/assets: the
run's LeRobot dataset's statistics (RUN_DIR/lerobot.json, completed from the dataset's
meta/stats.json where it is still there) under the dataset's name; a mixture run's, one asset a
dataset under its name (`mixture.asset_ids`), as openpi's own checkpoints hold one asset a robot
and its `create_trained_policy` picks one by the TrainConfig's asset_id; else the assets the run
started from. Host memory holds the whole model: orbax writes one tree. Beside them ZEROJAX_FILE
holds what a safetensors export carries in its metadata (`train.export.run_metadata`: the run's
config, its lerobot.json or mixture.json, its tokenizer), which openpi keeps in its code (a
TrainConfig) and ignores here, so that `zerojax serve DIR` serves it (`served_record`: a mixture
run's request names its dataset, answered with its asset's statistics).

    cfg, model = zerojax.interop.openpi.load(DIR)   # one device, fp32
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from zerojax.config.hf_config import ZEROJAX_FILE
from zerojax.config.openpi_dir import ASSETS, INIT_DIR, NORM_STATS, PARAMS, STATS, read_assets
from zerojax.data import mixture
from zerojax.data.lerobot.relative import RECORD as RELATIVE
from zerojax.errors import ConfigError
from zerojax.models import registry
from zerojax.models.family import ACTION, STATE

FEATURES = {"state": STATE, "actions": ACTION}  # openpi's norm-stat keys -> zerojax's (LeRobot's) features
EPS = 1e-6  # openpi's norms' epsilon, in its code (gemma.RMSNorm; flax's LayerNorm default in siglip.py), in no file


def norm_stats(directory, asset_id: str | None = None) -> dict:
    """{feature: {stat: array}} by zerojax's (LeRobot's) feature names, of one asset (the only
    one, or `asset_id`)."""
    assets = read_assets(directory)
    if asset_id is None and len(assets) > 1:
        raise ConfigError(f"{directory}/{ASSETS} holds {len(assets)} assets ({', '.join(assets)}); name one")
    stats = assets[asset_id or next(iter(assets))]
    return {FEATURES.get(key, key): value for key, value in stats.items()}


def read_checkpoint(init_from: str, plan, family: str, stacked: tuple[str, ...]):
    """`model.init_from` of an openpi checkpoint (`zerojax.checkpoints.openpi`): its params/ tree
    seen as zerojax's leaves through its family's rules (`openpi_tree.TreeCheckpoint`), which
    keep the layer axis, checked against the plan from orbax's metadata alone."""
    import jax

    from zerojax.interop.hf import base_leaves, check
    from zerojax.interop.openpi_tree import TreeCheckpoint
    from zerojax.models.family import Tensor

    ckpt = TreeCheckpoint(init_from, family)
    table = {leaf.path: Tensor(leaf.path) for leaf in jax.tree.leaves(base_leaves(plan))}
    check(ckpt, plan, table, ())
    return ckpt, table, ()


def init_files(directory) -> dict:
    """RUN_DIR/openpi_init/'s files (name -> bytes): the checkpoint's assets, as they are."""
    read_assets(directory)
    assets = Path(directory) / ASSETS
    return {f"{INIT_DIR}/{ASSETS}/{p.relative_to(assets)}": p.read_bytes() for p in sorted(assets.rglob(NORM_STATS))}


# ---------------------------------------------------------------------------------------------
# Out: what openpi's `restore_params` and its policies' assets loader read.


def _run_assets(run_dir: Path) -> dict:
    """{asset_id: {openpi key: {stat: list}}} for the export: the run's LeRobot dataset's
    statistics (RUN_DIR/lerobot.json), a mixture run's datasets' (RUN_DIR/mixture.json: one asset
    a dataset, `mixture.asset_ids`), else the assets the run started from (RUN_DIR/openpi_init/);
    ConfigError if it has none, or lacks mean and std."""
    if (run_dir / mixture.RUN_FILE).is_file():
        datasets = json.loads((run_dir / mixture.RUN_FILE).read_text())["datasets"]
        ids = mixture.asset_ids([d["dataset"] for d in datasets])
        return {asset: _record_assets(run_dir, d["lerobot.json"]) for asset, d in zip(ids, datasets)}
    record = run_dir / "lerobot.json"
    if record.is_file():
        doc = json.loads(record.read_text())
        return {Path(doc.get("dataset", "dataset")).name: _record_assets(run_dir, doc)}
    kept = run_dir / INIT_DIR
    if (kept / ASSETS).is_dir():
        return {k: {key: {s: v.tolist() for s, v in st.items()} for key, st in a.items()}
                for k, a in read_assets(kept).items()}
    raise ConfigError(f"{run_dir} neither trained on a LeRobot dataset (data.source=lerobot:DIR) nor started from "
                      f"an openpi checkpoint (model.init_from): it has no normalization statistics for {ASSETS}/")


def _record_assets(run_dir: Path, doc: dict) -> dict:
    """{openpi key: {stat: list}} of a dataset's lerobot.json record: the stats its modes kept, the
    rest of mean/std/q01/q99 from the dataset's meta/stats.json where it is still there."""
    stats = {k: {s: v for s, v in n.items() if s != "mode"} for k, n in doc["normalization"].items()}
    source = Path(doc.get("dataset", "")) / "meta" / "stats.json"
    if source.is_file():  # the absolute statistics: never a relative action's (lerobot.json holds all of those)
        for key, kept in json.loads(source.read_text()).items():
            if key in stats and not (key == ACTION and doc.get(RELATIVE)):
                stats[key].update({s: v for s, v in kept.items() if s in STATS and s not in stats[key]})
    names = {v: k for k, v in FEATURES.items()}
    out = {names[k]: {s: np.asarray(v, np.float32).reshape(-1).tolist() for s, v in st.items() if s in STATS}
           for k, st in stats.items() if k in names}
    missing = [f"{k}.{s}" for k, st in out.items() for s in ("mean", "std") if s not in st]
    if missing:
        raise ConfigError(f"{run_dir}: the statistics of {doc.get('dataset', 'its dataset')} lack "
                          f"{', '.join(missing)}, which openpi's NormStats requires (the dataset's meta/stats.json at "
                          f"{source.parent.parent} holds none)")
    return out


def served_record(directory: Path, doc: dict) -> dict:
    """A zerojax openpi export's data record (its lerobot.json or mixture.json, ZEROJAX_FILE), each
    dataset's statistics read from its assets/<asset_id>/norm_stats.json (openpi's one source of
    them; the modes stay the record's: openpi keeps those in its TrainConfig); ConfigError naming
    the assets there where one is missing."""
    doc = json.loads(json.dumps(doc))  # a copy, its lists fresh
    records = [d["lerobot.json"] for d in doc["datasets"]] if "datasets" in doc else [doc]
    assets = read_assets(directory)
    for asset, record in zip(mixture.asset_ids([r.get("dataset", "dataset") for r in records]), records):
        if asset not in assets:
            raise ConfigError(f"{directory}/{ASSETS}/{asset}/{NORM_STATS}: no such file, the statistics of "
                              f"{record.get('dataset')}; its {ASSETS}/ holds {', '.join(assets)}")
        stats = {FEATURES.get(key, key): value for key, value in assets[asset].items()}
        for key, norm in record["normalization"].items():
            norm.update({s: stats[key][s].tolist() for s in norm if s in stats.get(key, {})})
    return doc


def _whole(blocks_of, path: str, shape: tuple) -> np.ndarray:
    """A leaf assembled from its blocks."""
    out = np.zeros(shape, np.float32)
    for index, block in blocks_of(path):
        out[index] = block
    return out


def _nested(flat: dict) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node, keys = out, path.split("/")
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
    return out


def save(out: Path, run_dir: Path, model: dict, shapes: dict, blocks_of, *, dtype: str = "float32",
         record: dict | None = None) -> tuple[int, int]:
    """An openpi checkpoint directory at `out` (what `zerojax export --format openpi` writes):
    params/ (orbax, {"params": the tree}), assets/<asset_id>/norm_stats.json and, given, `record`
    as ZEROJAX_FILE (module docstring). Written to `out`.tmp and renamed once complete. Returns
    (bytes, leaves)."""
    import ml_dtypes
    import orbax.checkpoint as ocp

    if out.exists():
        raise ConfigError(f"--out {str(out)!r} already exists; give a new directory")
    layouts = registry.openpi_layouts()
    if model["family"] not in layouts:
        raise ConfigError(f"model.family={model['family']}: no openpi layout; --format openpi writes "
                          f"{', '.join(layouts)} runs")
    eps = {"model.norm_eps": model["norm_eps"], "model.vision.norm_eps": model["vision"]["norm_eps"]}
    odd = {k: v for k, v in eps.items() if v != EPS}
    if odd:
        raise ConfigError(f"{run_dir}: {', '.join(f'{k}={v}' for k, v in odd.items())}; openpi's Gemma and SigLIP "
                          f"norms compute with eps {EPS} (gemma.py RMSNorm, flax's LayerNorm), so openpi would compute "
                          "other numbers with these weights")
    assets = _run_assets(Path(run_dir))  # before anything is written
    rules = layouts[model["family"]].rules(model)
    covered = {p for rule in rules for p in rule.zerojax}
    if covered != set(shapes):
        odd = sorted(set(shapes) ^ covered)
        raise ConfigError(f"{run_dir}: its parameters are not the {model['family']} model's openpi holds "
                          f"(first: {odd[0]!r}); merge LoRA adapters first (--merge)")
    store = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    tree = {}
    for rule in rules:
        values = rule.to_openpi(np, *[_whole(blocks_of, p, shapes[p]) for p in rule.zerojax])
        tree.update({name: np.ascontiguousarray(v).astype(store) for name, v in zip(rule.openpi, values)})
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    with ocp.PyTreeCheckpointer() as ckptr:
        ckptr.save((tmp / PARAMS).resolve(), {PARAMS: _nested(tree)})
    for asset_id, stats in assets.items():
        (tmp / ASSETS / asset_id).mkdir(parents=True, exist_ok=True)
        (tmp / ASSETS / asset_id / NORM_STATS).write_text(json.dumps({"norm_stats": stats}, indent=2))
    if record is not None:
        (tmp / ZEROJAX_FILE).write_text(json.dumps(record, indent=1))
    tmp.rename(out)  # the directory appears only once complete
    return sum(f.stat().st_size for f in out.rglob("*") if f.is_file()), len(tree)


def write(job) -> tuple[int, int]:
    """`zerojax export --format openpi` (`zerojax.checkpoints.openpi`): `save` of an `ExportJob`,
    with what a safetensors export carries beside its weights (`ExportJob.carried`)."""
    return save(job.out, job.run_dir, job.config["model"], job.shapes, job.blocks_of, dtype=job.dtype,
                record=job.carried())


def load(directory, given: dict | None = None):
    """(cfg, model): an openpi checkpoint's ModelConfig and its model on one device, in fp32, read
    through the same path as `model.init_from`. `given`: model keys no shape holds
    ({"action": {"horizon": 10, "prompt_len": 48}}) and, optionally, the family."""
    from zerojax.config import hf_model_keys
    from zerojax.config.sections import ModelConfig
    from zerojax.interop import hf

    directory, given = str(directory), dict(given or {})
    keys = hf_model_keys(directory, given)
    for key, value in given.items():
        keys[key] = {**value, **keys.get(key, {})} if isinstance(value, dict) else keys.get(key, value)
    cfg = ModelConfig(**keys, init_from=directory)
    return cfg, hf.one_device(cfg)
