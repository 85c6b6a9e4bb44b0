"""Orbax checkpoints of the sharded train state: save, resume, reshard on restore, export.

What is saved is the state without padding (fp32 master weights and Adam moments in their true
shapes, the step, the loss-scale state) plus JSON metadata (resolved config, parameter shapes,
zerojax version). Each device writes its own shards (a leaf whose true shape does not divide
the data axis is written replicated). Restoring builds the abstract state of the *current*
run's plan (mesh, stage, schedule may all differ) and lets orbax read every array straight
into its new sharding; padding for the new data size is applied afterwards. There is no RNG
state to save: batches depend only on (seed, step) and the model has no dropout.

The run loop in `train.py` calls this module with what each call needs (the plan, the mesh, the
state); it imports nothing from `step.py` or `train.py`.

Orbax writes a step into a temporary directory and renames it when complete, so a run killed
mid-save leaves no half checkpoint that could be mistaken for a complete one.
"""

from __future__ import annotations

import ctypes
import itertools
import math
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import PartitionSpec as P

import zerojax
from zerojax.config import ConfigError, file_in_the_way
from zerojax import sharding as sharding_lib
from zerojax.lora import is_adapter
from zerojax.optim import is_frozen


def manager(run_dir: Path, keep: int, create: bool = True, writer: bool = True) -> ocp.CheckpointManager:
    """The run's checkpoint manager. Only the writer (the run loop's one manager) removes the
    temporary directories a killed save left: orbax does it in a background thread, and two
    managers doing it at once race on the same files (one's rmtree finds them gone)."""
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=writer, create=create,
                                           cleanup_tmp_directories=writer)
    return ocp.CheckpointManager(Path(run_dir).absolute() / "checkpoints", options=options)


def _savable_spec(leaf: sharding_lib.LeafPlan, sharded: bool) -> P:
    """The leaf's spec for its true shape; replicated if that shape does not divide evenly."""
    spec = leaf.spec(sharded)
    return spec if leaf.dim is None or not leaf.padded else P()


def saved_state(plan: sharding_lib.Plan, mesh, state):
    """The state as saved (padding sliced off, each leaf in a layout its true shape allows): the
    function that makes it from a TrainState, its shardings, and its abstract value."""
    sharded = plan.layout.master

    def view(state):
        return {"step": state.step, "params": plan.unpad(state.params), "skipped": state.skipped,
                "opt_state": sharding_lib.map_like_params(state.opt_state, plan, lambda leaf, x: leaf.unpad(x)),
                "loss_scale": state.loss_scale}

    abstract = jax.eval_shape(view, state)
    kind = lambda x: getattr(getattr(x, "sharding", None), "memory_kind", None) or "device"
    kinds = {"step": "device", "skipped": "device", "loss_scale": jax.tree.map(lambda _: "device", state.loss_scale),
             "params": jax.tree.map(kind, state.params), "opt_state": jax.tree.map(kind, state.opt_state)}
    specs = {"step": P(), "skipped": P(), "loss_scale": jax.tree.map(lambda _: P(), abstract["loss_scale"]),
             "params": jax.tree.map(lambda leaf: _savable_spec(leaf, sharded), plan.leaves),
             "opt_state": sharding_lib.map_like_params(abstract["opt_state"], plan,
                                                       lambda leaf, _: _savable_spec(leaf, sharded),
                                                       lambda _: P(), stored=False)}
    # Saved from, and restored into, the memory the state lives in (zero.offload: pinned host),
    # never through the device as a whole.
    shardings = jax.tree.map(lambda s, k: s.with_memory_kind(k) if k != "device" else s,
                             sharding_lib.named(mesh, specs), kinds)
    return view, shardings, abstract


def param_shapes(plan: sharding_lib.Plan) -> dict:
    return {leaf.path: list(leaf.shape) for leaf in jax.tree.leaves(plan.leaves)}


def metadata(plan: sharding_lib.Plan, step: int, config: dict) -> dict:
    return {"format": "zerojax-checkpoint", "zerojax_version": zerojax.__version__, "step": step,
            "config": config, "param_shapes": param_shapes(plan)}


def save(mgr: ocp.CheckpointManager, plan: sharding_lib.Plan, mesh, state, step: int, config: dict) -> None:
    """Start an asynchronous save of `state` as checkpoint `step` (training goes on); `config`
    is the resolved config, kept in the metadata."""
    view, shardings, _ = saved_state(plan, mesh, state)
    saved = jax.jit(view, out_shardings=shardings)(state)
    mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(saved),
                                           meta=ocp.args.JsonSave(metadata(plan, step, config))), force=True)


def read_metadata(mgr: ocp.CheckpointManager, step: int) -> dict:
    where = Path(mgr.directory) / str(step)
    try:
        meta = mgr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as err:  # noqa: BLE001 - orbax raises many kinds; all mean "unreadable"
        raise ConfigError(f"checkpoint {where} is unreadable ({type(err).__name__}); delete that directory "
                          "to resume from the one before, or set train.resume=never in a new train.out_dir") from None
    if not isinstance(meta, dict) or meta.get("format") != "zerojax-checkpoint":
        raise ConfigError(f"{where} is not a zerojax checkpoint (no zerojax metadata)")
    return meta


def check_matches(run_dir: Path, step: int, plan: sharding_lib.Plan) -> None:
    """Checkpoint `step` of `run_dir` can be restored into `plan`, judged from its metadata."""
    reader = manager(run_dir, keep=1, create=False, writer=False)
    try:
        meta = read_metadata(reader, step)
    finally:
        reader.close()
    _check_meta(meta, plan, Path(run_dir) / "checkpoints" / str(step))


def _check_meta(meta: dict, plan: sharding_lib.Plan, where: Path) -> None:
    """The checkpoint holds the plan's parameters, in their true shapes, and trained the same
    ones (the optimizer state it holds covers only those)."""
    fix = "use the saved run's settings (its config.yaml) or a new train.out_dir"
    saved = {path: list(shape) for path, shape in meta["param_shapes"].items()}
    want = param_shapes(plan)
    for path in sorted(saved.keys() | want.keys()):
        if saved.get(path) != want.get(path):
            there = f"{path} is {saved[path]} there" if path in saved else f"it has no {path}"
            here = f"{want[path]} in the config's model" if path in want else "not in the config's model"
            raise ConfigError(f"checkpoint {where} holds a different model than the config asks for: {there}, "
                              f"{here}; {fix}")
    optim = meta.get("config", {}).get("optim", {})
    freeze, lora = tuple(optim.get("freeze", ())), bool(optim.get("lora", {}).get("rank", 0))
    for leaf in jax.tree.leaves(plan.leaves):
        was_frozen = is_frozen(leaf.path, freeze) or (lora and not is_adapter(leaf.path))
        if was_frozen != leaf.frozen:
            did, does = ("froze", "trains") if was_frozen else ("trained", "freezes")
            raise ConfigError(f"checkpoint {where} {did} {leaf.path}, which the config {does} (the saved run had "
                              f"optim.freeze={list(freeze)}, optim.lora.rank {'> 0' if lora else '= 0'}): it holds "
                              f"optimizer state for the parameters it trained only; {fix}")


def restore(mgr: ocp.CheckpointManager, plan: sharding_lib.Plan, mesh, step: int, abstract_state, shardings,
            finish=lambda state: state):
    """Checkpoint `step` read straight into `plan` on `mesh` (any mesh, stage or schedule), as a
    state like `abstract_state` (a TrainState) laid out by `shardings` (host memory included);
    `finish(state)` completes what is not saved (a device copy of the weights)."""
    _check_meta(read_metadata(mgr, step), plan, Path(mgr.directory) / str(step))
    _, saved_layout, abstract = saved_state(plan, mesh, abstract_state)
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, saved_layout)
    try:
        saved = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))["state"]
    except Exception as err:  # noqa: BLE001
        raise ConfigError(f"checkpoint {Path(mgr.directory) / str(step)} cannot be restored ({type(err).__name__}: "
                          f"{str(err).splitlines()[0][:200]}); delete it to resume from the one before") from None

    def into_plan(saved):
        return finish(abstract_state._replace(
            step=saved["step"], params=plan.pad(saved["params"]), skipped=saved["skipped"],
            opt_state=sharding_lib.map_like_params(saved["opt_state"], plan, lambda leaf, x: leaf.pad(x), stored=False),
            loss_scale=saved["loss_scale"]))

    return jax.jit(into_plan, out_shardings=shardings)(saved)


# ---------------------------------------------------------------------------------------------
# Export: one consolidated safetensors file, or a Hugging Face directory, written leaf by leaf.

FORMATS = ("safetensors", "hf", "peft")


def _leaf_blocks(mgr: ocp.CheckpointManager, step: int, path: str, shape: tuple):
    """One parameter of checkpoint `step`, as (index, fp32 numpy block) pieces.

    Read chunk by chunk (the shards it was saved in) with tensorstore from orbax's OCDBT + zarr
    layout, so host memory holds one chunk at a time; where that layout is not found (another
    orbax version), the whole leaf at once through orbax's own restore."""
    import tensorstore as ts

    spec = {"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": f"file://{Path(mgr.directory) / str(step) / 'state'}",
                                          "path": "params." + path.replace("/", ".")}}
    try:
        store = ts.open(spec, open=True, read=True).result()
        assert tuple(store.shape) == tuple(shape) and np.issubdtype(store.dtype.numpy_dtype, np.floating)
    except Exception:  # noqa: BLE001 - any other layout: let orbax read it
        item = _nest(path, jax.ShapeDtypeStruct(shape, np.float32))
        args = ocp.args.PyTreeRestore({"params": item}, partial_restore=True,
                                      restore_args={"params": _nest(path, ocp.RestoreArgs(restore_type=np.ndarray))})
        restored = mgr.restore(step, args=ocp.args.Composite(state=args))["state"]["params"]
        yield tuple(slice(0, n) for n in shape), np.asarray(_get(restored, path), np.float32)
        return
    chunk = store.chunk_layout.read_chunk.shape
    for corner in itertools.product(*[range(0, n, c) for n, c in zip(shape, chunk)]):
        block = tuple(slice(a, min(a + c, n)) for a, c, n in zip(corner, chunk, shape))
        yield block, np.asarray(store[block].read().result(), np.float32)  # frozen leaves are stored bf16
        _return_freed_memory()  # the chunk's buffers, before the next chunk


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
           max_shard_bytes: int = 5 * 10**9, merge: bool = False) -> dict:
    """Write the weights of a checkpoint: `safetensors`, one file named by zerojax's parameter
    paths; `hf`, a Hugging Face directory (config.json, shards with HF names, index), of a LoRA
    run with its adapters merged (`merge`); `peft`, a LoRA run's adapters as PEFT writes them.
    Each leaf is read a saved shard at a time and written into place, so host memory holds one
    shard of one leaf (and a kernel's adapters), not the model; what is written appears only
    once complete."""
    from zerojax import hf

    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r} is not valid; choose one of {', '.join(FORMATS)}")
    if out.exists():
        raise ConfigError(f"--out {str(out)!r} already exists; give a new path (export never overwrites)")
    in_the_way = file_in_the_way(out.parent)
    if in_the_way:
        raise ConfigError(f"--out {str(out)!r}: {in_the_way} is a file, not a directory")
    mgr, step, meta = _open_run(run_dir, step)
    shapes = {p: tuple(s) for p, s in meta["param_shapes"].items()}
    saved = dict(shapes)
    blocks_of = lambda path: _leaf_blocks(mgr, step, path, saved[path])
    adapters = any(is_adapter(p) for p in shapes)
    if fmt == "peft" and not adapters:
        raise ConfigError(f"{run_dir} was trained without LoRA (optim.lora.rank=0): it has no adapters; "
                          "use --format hf or --format safetensors")
    if merge and (fmt != "hf" or not adapters):
        raise ConfigError("--merge merges a LoRA run's adapters into a Hugging Face export: it needs --format hf "
                          "and a run trained with optim.lora.rank > 0")
    if fmt == "hf" and adapters and not merge:
        raise ConfigError(f"{run_dir} holds LoRA adapters: --format peft writes them, --format hf --merge writes the "
                          "model with them merged in")
    if merge:
        blocks_of = _merged(blocks_of, shapes, meta["config"]["optim"]["lora"])
        shapes = {p: s for p, s in shapes.items() if not is_adapter(p)}
    if fmt == "peft":
        stacked = _stacked(meta["config"]["model"])
        written, count = hf.save_peft(out, meta["config"], shapes, stacked, blocks_of, dtype=dtype)
    elif fmt == "safetensors":
        tensors = [(path, path, None, shape, False) for path, shape in shapes.items()]
        tmp = out.with_name(out.name + ".tmp")
        out.parent.mkdir(parents=True, exist_ok=True)  # as the hf and peft exports make their directory
        hf.fill(hf.create_safetensors(tmp, tensors, dtype), tensors, blocks_of, dtype)
        tmp.replace(out)  # the file appears only once complete
        written, count = out.stat().st_size, len(tensors)
    else:
        written, count = _export_hf(out, meta["config"]["model"], shapes, dtype, max_shard_bytes, blocks_of,
                                    meta["config"]["data"].get("tokenizer", ""))
    mgr.close()
    return {"step": step, "format": fmt, "tensors": count, "params": int(sum(math.prod(s) for s in shapes.values())),
            "bytes": written, "out": str(out), "largest_leaf_bytes": 4 * max(math.prod(s) for s in shapes.values())}


def _stacked(model: dict) -> tuple[str, ...]:
    from zerojax import step as step_lib
    from zerojax.config import ModelConfig
    from zerojax.models import Units

    return Units.of(step_lib.abstract_model(ModelConfig(**model), step_lib.Policy())).names


def _export_hf(out: Path, model: dict, shapes: dict, dtype: str, max_shard_bytes: int, blocks_of,
               tokenizer: str = "") -> tuple[int, int]:
    from zerojax import hf

    return hf.save(out, model, shapes, _stacked(model), blocks_of, dtype=dtype, max_shard_bytes=max_shard_bytes,
                   tokenizer=tokenizer)


def _whole(blocks) -> np.ndarray:
    pieces = list(blocks)
    out = np.zeros([max(i[d].stop for i, _ in pieces) for d in range(len(pieces[0][0]))], np.float32)
    for index, block in pieces:
        out[index] = block
    return out


def _merged(blocks_of, shapes: dict, lora: dict):
    """`blocks_of` with every adapted kernel's blocks W + (alpha / rank)·A·B (in fp32): the
    adapters of a kernel are read whole (they are small), its blocks one at a time."""
    scale = lora["alpha"] / lora["rank"]

    def merged(path):
        layer = path.removesuffix("/kernel")
        if not path.endswith("/kernel") or f"{layer}/lora_a" not in shapes:
            yield from blocks_of(path)
            return
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


def complete_steps(run_dir: Path) -> list[int]:
    """Steps with a complete checkpoint (orbax renames a step's directory to its number only
    once every file is written; temporary directories carry a suffix)."""
    folder = Path(run_dir) / "checkpoints"
    return sorted(int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit()) if folder.is_dir() else []
