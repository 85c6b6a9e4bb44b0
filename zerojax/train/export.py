"""Export: a checkpoint's weights in a checkpoint format (`zerojax.checkpoints`: zerojax's one
safetensors file, a Hugging Face directory, PEFT adapters, a LeRobot or openpi policy), written
leaf by leaf (host memory holds one saved shard of one leaf at a time) by the format's writer."""

from __future__ import annotations

import ctypes
import itertools
import json
import math
from pathlib import Path
import jax
import numpy as np
import orbax.checkpoint as ocp
from zerojax.errors import ConfigError
from zerojax.checkpoints import format as checkpoints
from zerojax.config import EXPORT_WEIGHTS, LoraConfig, ModelConfig, file_in_the_way
from zerojax.data import corpus
from zerojax.optim.lora import is_adapter
from zerojax.interop import safetensors as safetensors_io
from zerojax.train import model as model_lib
from zerojax.models.protocol import Units
from zerojax.precision import Policy
from zerojax.train.checkpoint import manager, read_metadata


# ---------------------------------------------------------------------------------------------
# Export: one consolidated safetensors file, or a Hugging Face directory, written leaf by leaf.

def _leaf_blocks(mgr: ocp.CheckpointManager, step: int, path: str, shape: tuple, tree: str = "params"):
    """One parameter of checkpoint `step` (from its `params`, or its `ema`), as (index, fp32
    numpy block) pieces.

    Read chunk by chunk (the shards it was saved in) with tensorstore from orbax's OCDBT + zarr
    layout, so host memory holds one chunk at a time; where that layout is not found (another
    orbax version), the whole leaf at once through orbax's own restore."""
    store = _chunked_store(mgr, step, path, shape, tree)
    if store is None:  # any other layout: let orbax read it
        item = _nest(path, jax.ShapeDtypeStruct(shape, np.float32))
        args = ocp.args.PyTreeRestore({tree: item}, partial_restore=True,
                                      restore_args={tree: _nest(path, ocp.RestoreArgs(restore_type=np.ndarray))})
        restored = mgr.restore(step, args=ocp.args.Composite(state=args))["state"][tree]
        yield tuple(slice(0, n) for n in shape), np.asarray(_get(restored, path), np.float32)
        return
    chunk = store.chunk_layout.read_chunk.shape
    for corner in itertools.product(*[range(0, n, c) for n, c in zip(shape, chunk)]):
        block = tuple(slice(a, min(a + c, n)) for a, c, n in zip(corner, chunk, shape))
        yield block, np.asarray(store[block].read().result(), np.float32)  # frozen leaves are stored bf16
        _return_freed_memory()  # the chunk's buffers, before the next chunk


def _chunked_store(mgr: ocp.CheckpointManager, step: int, path: str, shape: tuple, tree: str = "params"):
    """The tensorstore of one saved parameter in orbax's OCDBT + zarr layout, or None where the
    checkpoint does not hold it that way (the store cannot be opened, or holds another shape or
    a non-float dtype)."""
    import tensorstore as ts

    spec = {"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": f"file://{Path(mgr.directory) / str(step) / 'state'}",
                                          "path": f"{tree}." + path.replace("/", ".")}}
    try:
        store = ts.open(spec, open=True, read=True).result()
        dtype = store.dtype.numpy_dtype
    except Exception:  # noqa: BLE001 - tensorstore raises plain ValueErrors and more for a missing layout
        return None
    if tuple(store.shape) != tuple(shape) or not np.issubdtype(dtype, np.floating):
        return None
    return store


def _return_freed_memory() -> None:
    """Hand memory freed by the reader's threads back to the OS (glibc keeps it in per-thread
    arenas otherwise, and the next leaf would be read on top of it)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def _open_run(run_dir: Path, step: int | None):
    run_dir = Path(run_dir)
    if not (run_dir / "checkpoints").is_dir():
        raise ConfigError(f"{run_dir} holds no checkpoints/ directory; give a zerojax run directory")
    mgr = manager(run_dir, keep=1_000_000, create=False, writer=False)
    steps = mgr.all_steps()
    if not steps or (step is not None and step not in steps):
        raise ConfigError(f"{run_dir}/checkpoints has no step {step if step is not None else ''} "
                          f"(complete steps: {sorted(steps) or 'none'})")
    step = max(steps) if step is None else step
    return mgr, step, read_metadata(mgr, step)


def export(run_dir: Path, out: Path, dtype: str = "float32", step: int | None = None, fmt: str = "safetensors",
           max_shard_bytes: int = 5 * 10**9, merge: bool = False, weights: str | None = None,
           dataset: str | None = None) -> dict:
    """Write the weights of a checkpoint: `safetensors`, one file named by zerojax's parameter
    paths; `hf`, a Hugging Face directory (config.json, shards with HF names, index), of a LoRA
    run with its adapters merged (`merge`); `peft`, a LoRA run's adapters as PEFT writes them;
    `lerobot`, a policy run as LeRobot's from_pretrained loads it; `openpi`, as openpi's
    restore_params does; or a format of the registry's (`zerojax.checkpoints`).
    Each leaf is read a saved shard at a time and written into place, so host memory holds one
    shard of one leaf (and a kernel's adapters), not the model; what is written appears only
    once complete. `weights`: `ema` (the trained leaves' optim.ema average, beside the frozen
    ones), `raw`, or None: ema when the checkpoint holds one. `dataset`: of a mixture run, the
    dataset whose policy `lerobot` writes (a LeRobot policy holds one normalization)."""
    _check_out(fmt, out)
    mgr, step, meta = _open_run(run_dir, step)
    shapes = {p: tuple(s) for p, s in meta["param_shapes"].items()}
    saved = dict(shapes)
    weights = _weights_choice(run_dir, meta, weights)
    averaged = set(shapes) - set(meta.get("frozen", ())) if weights == "ema" else set()
    blocks_of = lambda path: _leaf_blocks(mgr, step, path, saved[path], "ema" if path in averaged else "params")
    _check_adapters(run_dir, fmt, merge, shapes, meta)
    if merge:
        blocks_of = _merged(blocks_of, shapes, _lora_settings(meta["config"]))
        shapes = {p: s for p, s in shapes.items() if not is_adapter(p)}
    written, count = _write(fmt, out, run_dir, meta["config"], step, shapes, dtype, max_shard_bytes, blocks_of,
                            dataset)
    mgr.close()
    return {"step": step, "format": fmt, "weights": weights, "tensors": count, "params": int(sum(math.prod(s) for s in shapes.values())),
            "bytes": written, "out": str(out), "largest_leaf_bytes": 4 * max(math.prod(s) for s in shapes.values())}


def _check_out(fmt: str, out: Path) -> None:
    """`--format` is one zerojax writes, and `--out` a new path where one can be made."""
    if fmt not in checkpoints.writable():
        raise ConfigError(f"--format {fmt!r} is not valid; choose one of {', '.join(checkpoints.writable())}")
    if out.exists():
        raise ConfigError(f"--out {str(out)!r} already exists; give a new path (export never overwrites)")
    in_the_way = file_in_the_way(out.parent)
    if in_the_way:
        raise ConfigError(f"--out {str(out)!r}: {in_the_way} is a file, not a directory")


def _check_adapters(run_dir: Path, fmt: str, merge: bool, shapes: dict, meta: dict) -> None:
    """The format (and `--merge`) can write what the checkpoint holds: its LoRA adapters, or none,
    as the format's record says (`CheckpointFormat.adapters`)."""
    adapters, held = any(is_adapter(p) for p in shapes), checkpoints.named(fmt).adapters
    by_kind = {kind: [f.name for f in checkpoints.formats() if f.write and f.adapters == kind]
               for kind in checkpoints.ADAPTERS}
    alone, merged = " or ".join(by_kind[checkpoints.ONLY]), ", ".join(by_kind[checkpoints.MERGED])
    if held == checkpoints.ONLY and not adapters:
        raise ConfigError(f"{run_dir} was trained without LoRA (optim.lora.rank=0): it has no adapters for --format "
                          f"{fmt}; export the model: --format {', '.join(by_kind[checkpoints.KEPT] + by_kind[checkpoints.MERGED])}")
    if merge and (held != checkpoints.MERGED or not adapters):
        raise ConfigError(f"--merge merges a LoRA run's adapters into the weights: it needs --format {merged} and a "
                          "run trained with optim.lora.rank > 0")
    if held == checkpoints.MERGED and adapters and not merge:
        alone = f"--format {alone} writes them, " if alone else ""
        raise ConfigError(f"{run_dir} holds LoRA adapters, which {fmt}'s checkpoint does not hold: {alone}--format "
                          f"{fmt} --merge writes the model with them merged in")
    trained_base = [p for p in shapes if not is_adapter(p) and p not in meta.get("frozen", shapes)]
    if held == checkpoints.ONLY and trained_base:
        raise ConfigError(f"{run_dir} trained {trained_base[0]} and {len(trained_base) - 1} more leaves beside its "
                          f"adapters (optim.lora.base=targets): {fmt}'s adapters would lose them; use --format "
                          f"{' or --format '.join(by_kind[checkpoints.KEPT])}, or --format {merged} --merge")


def _write(fmt: str, out: Path, run_dir: Path, config: dict, step: int, shapes: dict, dtype: str,
           max_shard_bytes: int, blocks_of, dataset: str | None = None) -> tuple[int, int]:
    """(bytes written, tensors) of the export of `shapes` in `fmt`, by its format's writer, each
    leaf's blocks from `blocks_of`."""
    job = checkpoints.ExportJob(out, Path(run_dir), config, step, shapes, dtype, max_shard_bytes, blocks_of,
                                stacked=lambda: _stacked(config["model"]), lora=lambda: _lora_settings(config),
                                carried=lambda: run_metadata(run_dir, config, step), dataset=dataset)
    return checkpoints.call(checkpoints.named(fmt).write, job)


def write_safetensors(job: checkpoints.ExportJob) -> tuple[int, int]:
    """zerojax's own export (`zerojax.checkpoints.safetensors`): one safetensors file of zerojax's
    parameter paths, the run's config and files in its metadata (`run_metadata`)."""
    tensors = [safetensors_io.Entry(path, path, None, shape) for path, shape in job.shapes.items()]
    tmp = job.out.with_name(job.out.name + ".tmp")
    job.out.parent.mkdir(parents=True, exist_ok=True)  # as the directory formats make their directory
    regions = safetensors_io.create_safetensors(tmp, tensors, job.dtype, run_metadata(job.run_dir, job.config, job.step))
    safetensors_io.fill(regions, tensors, job.blocks_of, job.dtype)
    tmp.replace(job.out)  # the file appears only once complete
    return job.out.stat().st_size, len(tensors)


def _weights_choice(run_dir: Path, meta: dict, weights: str | None) -> str:
    """`--weights` as asked, or ema when the checkpoint holds an EMA (optim.ema > 0), else raw."""
    if weights not in (None, *EXPORT_WEIGHTS):
        raise ConfigError(f"--weights {weights!r} is not valid; choose one of {', '.join(EXPORT_WEIGHTS)}")
    has_ema = bool(meta.get("ema", False))
    if weights == "ema" and not has_ema:
        raise ConfigError(f"{run_dir} holds no EMA of its weights (it trained with optim.ema=0); use --weights raw, "
                          "or train with optim.ema=0.99")
    return weights or ("ema" if has_ema else "raw")


CONFIG_KEY, STEP_KEY = "zerojax.config", "zerojax.step"  # a safetensors export's metadata (`run_metadata`)
RUN_FILE_KEY, TOKENIZER_KEY = "zerojax.run/{name}", "zerojax.tokenizer.json"
# the run's files a safetensors export carries: a policy's features and statistics (a mixture's: each dataset's)
RUN_FILES = ("lerobot.json", "mixture.json")


def run_metadata(run_dir: Path, config: dict, step: int) -> dict:
    """What a safetensors export carries in its metadata beside the weights, so that the file
    stands alone (`zerojax serve FILE.safetensors`, `load_exported`): the run's config and step,
    the run's files of RUN_FILES it has, and the text of its tokenizer (data.tokenizer) where it
    has one and the file is still there."""
    out = {CONFIG_KEY: json.dumps(config), STEP_KEY: str(step)}
    for name in RUN_FILES:
        if (Path(run_dir) / name).is_file():
            out[RUN_FILE_KEY.format(name=name)] = (Path(run_dir) / name).read_text()
    tokenizer = config["data"].get("tokenizer")
    if tokenizer:
        try:
            out[TOKENIZER_KEY] = corpus.tokenizer_file(tokenizer).read_text()
        except ConfigError:  # moved since training: the export carries none (serving it says so)
            pass
    return out


def read_export(path: Path):
    """(the run's config, the step, the metadata, the weights unread: a safetensors_io.Checkpoint)
    of a safetensors export (`export`, fmt="safetensors"), from its header alone; ConfigError for
    a file that is not one, or an export without the run's config (an older zerojax's)."""
    weights = safetensors_io.Checkpoint([Path(path)], str(path))
    (handle,) = weights.files.values()
    if CONFIG_KEY not in handle.metadata:
        raise ConfigError(f"{path}: a safetensors file without the run's config in its metadata; give a run "
                          "directory, or a file `zerojax export RUN_DIR --out FILE.safetensors` wrote (which keeps "
                          "the config there since zerojax serve reads exports)")
    return json.loads(handle.metadata[CONFIG_KEY]), int(handle.metadata.get(STEP_KEY, -1)), handle.metadata, weights


def exported_model(saved: dict, weights, where: str):
    """The model of `saved` (read_export's config) on one device in fp32 with the export's weights
    (bf16 exports widened); ConfigError, naming the first tensor, where they are not its shapes."""
    from flax import nnx

    model = _build_saved(saved)
    want = {"/".join(map(str, k)): tuple(v[...].shape)
            for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    if want != weights.shapes:
        name = sorted(set(want) ^ set(weights.shapes) or [k for k in want if want[k] != weights.shapes[k]])[0]
        raise ConfigError(f"{where}: its tensors are not those of the model its config builds (first: {name}, "
                          f"{weights.shapes.get(name, 'missing')} in the file, {want.get(name, 'not in the model')} "
                          "in the model)")
    params: dict = {}
    for name in want:
        leaf, keys = params, name.split("/")
        for key in keys[:-1]:
            leaf = leaf.setdefault(key, {})
        leaf[keys[-1]] = weights.read(name, ())
    nnx.update(model, params)
    return model


def _build_saved(saved: dict):
    """A saved config's model (its LoRA adapters too), on one device, fp32, initialised."""
    return model_lib.build_model(ModelConfig(**{**saved["model"], "init_from": ""}), Policy(), 0, _saved_lora(saved))


def saved_config(run_dir: Path, step: int | None = None) -> tuple[dict, int]:
    """(the run's config as checkpoint `step` (default: the newest) saved it, the step), its
    weights left unread: what a command checks before it loads a model."""
    mgr, step, meta = _open_run(run_dir, step)
    mgr.close()
    return meta["config"], step


def load_model(run_dir: Path, step: int | None = None):
    """(the run's config as saved, the step, its model on one device in fp32 with that
    checkpoint's weights, LoRA adapters included), each leaf read whole: `zerojax generate`."""
    from flax import nnx

    mgr, step, meta = _open_run(run_dir, step)
    saved = meta["config"]
    model = _build_saved(saved)
    params: dict = {}
    for path, shape in meta["param_shapes"].items():
        leaf, keys = params, path.split("/")
        for key in keys[:-1]:
            leaf = leaf.setdefault(key, {})
        leaf[keys[-1]] = _whole(_leaf_blocks(mgr, step, path, tuple(shape)))
    mgr.close()
    nnx.update(model, params)
    return saved, step, model


def _stacked(model: dict) -> tuple[str, ...]:
    """The stacks of a saved run's model (its config.yaml's model section)."""
    return Units.of(model_lib.abstract_model(ModelConfig(**model), Policy())).names


def _whole(blocks) -> np.ndarray:
    pieces = list(blocks)
    out = np.zeros([max(i[d].stop for i, _ in pieces) for d in range(len(pieces[0][0]))], np.float32)
    for index, block in pieces:
        out[index] = block
    return out


def _lora_settings(saved: dict) -> dict:
    """(rank, alpha) of each kernel a saved run's LoRA adapts (its rank_pattern, alpha_pattern)."""
    return model_lib.lora_settings(ModelConfig(**{**saved["model"], "init_from": ""}), _saved_lora(saved))


def _saved_lora(saved: dict) -> LoraConfig:
    """A saved config's optim.lora (one saved before rank_pattern existed: a single rank)."""
    return LoraConfig(**{**saved["optim"]["lora"], "targets": tuple(saved["optim"]["lora"]["targets"])})


def _merged(blocks_of, shapes: dict, settings: dict):
    """`blocks_of` with every adapted kernel's blocks W + (alpha / rank)·A·B (in fp32), each
    kernel's own rank and alpha (`settings`): the adapters of a kernel are read whole (they are
    small), its blocks one at a time."""

    def merged(path):
        layer = path.removesuffix("/kernel")
        if not path.endswith("/kernel") or f"{layer}/lora_a" not in shapes:
            yield from blocks_of(path)
            return
        rank, alpha = settings[path]
        scale = alpha / rank
        a, b = _whole(blocks_of(f"{layer}/lora_a")), _whole(blocks_of(f"{layer}/lora_b"))
        for index, block in blocks_of(path):
            lead, (rows, cols) = index[:-2], index[-2:]
            yield index, block + scale * np.matmul(a[lead + (rows, slice(None))], b[lead + (slice(None), cols)])

    return merged


def _nest(path: str, value):
    for key in reversed(path.split("/")):
        value = {key: value}
    return value


def _get(tree, path: str):
    for key in path.split("/"):
        tree = tree[key]
    return tree
