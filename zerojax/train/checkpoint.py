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

from pathlib import Path
import jax
import orbax.checkpoint as ocp
from jax.sharding import PartitionSpec as P
import zerojax
from zerojax.errors import ConfigError
from zerojax.optim.lora import is_adapter
from zerojax.optim import is_frozen
from zerojax.parallel import plan as plan_lib
from zerojax.parallel import trees


def manager(run_dir: Path, keep: int, create: bool = True, writer: bool = True) -> ocp.CheckpointManager:
    """The run's checkpoint manager. Only the writer (the run loop's one manager) removes the
    temporary directories a killed save left: orbax does it in a background thread, and two
    managers doing it at once race on the same files (one's rmtree finds them gone)."""
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=writer, create=create,
                                           cleanup_tmp_directories=writer)
    return ocp.CheckpointManager(Path(run_dir).absolute() / "checkpoints", options=options)


def _savable_spec(leaf: plan_lib.LeafPlan, sharded: bool) -> P:
    """The leaf's spec for its true shape; replicated if that shape does not divide evenly."""
    spec = leaf.spec(sharded)
    return spec if leaf.dim is None or not leaf.padded else P()


def saved_state(plan: plan_lib.Plan, mesh, state):
    """The state as saved (padding sliced off, each leaf in a layout its true shape allows): the
    function that makes it from a TrainState, its shardings, and its abstract value."""
    sharded = plan.layout.master

    def view(state):
        saved = {"step": state.step, "params": plan.unpad(state.params), "skipped": state.skipped,
                 "opt_state": plan_lib.map_like_params(state.opt_state, plan, lambda leaf, x: leaf.unpad(x)),
                 "loss_scale": state.loss_scale}
        if state.ema is not None:  # optim.ema: the trained leaves' average, laid out as their master
            saved["ema"] = plan.unpad(state.ema)
        return saved

    abstract = jax.eval_shape(view, state)
    kind = lambda x: getattr(getattr(x, "sharding", None), "memory_kind", None) or "device"
    kinds = {"step": "device", "skipped": "device", "loss_scale": jax.tree.map(lambda _: "device", state.loss_scale),
             "params": jax.tree.map(kind, state.params), "opt_state": jax.tree.map(kind, state.opt_state)}
    specs = {"step": P(), "skipped": P(), "loss_scale": jax.tree.map(lambda _: P(), abstract["loss_scale"]),
             "params": jax.tree.map(lambda leaf: _savable_spec(leaf, sharded), plan.leaves),
             "opt_state": plan_lib.map_like_params(abstract["opt_state"], plan,
                                                       lambda leaf, _: _savable_spec(leaf, sharded),
                                                       lambda _: P(), stored=False)}
    if state.ema is not None:
        kinds["ema"] = jax.tree.map(kind, state.ema)
        specs["ema"] = jax.tree.map(lambda leaf: _savable_spec(leaf, sharded), plan.trained_leaves)
    # Saved from, and restored into, the memory the state lives in (zero.offload: pinned host),
    # never through the device as a whole.
    shardings = jax.tree.map(lambda s, k: s.with_memory_kind(k) if k != "device" else s,
                             trees.named(mesh, specs), kinds)
    return view, shardings, abstract


def param_shapes(plan: plan_lib.Plan) -> dict:
    return {leaf.path: list(leaf.shape) for leaf in jax.tree.leaves(plan.leaves)}


def frozen_paths(plan: plan_lib.Plan) -> list[str]:
    return sorted(leaf.path for leaf in jax.tree.leaves(plan.leaves) if leaf.frozen)


def metadata(plan: plan_lib.Plan, step: int, config: dict, ema: bool = False) -> dict:
    """The checkpoint's JSON: the resolved config, the parameters' true shapes, which of them
    were frozen (what the optimizer state covers), and whether it holds an EMA (`ema`, the
    trained leaves' average, beside `params`)."""
    return {"format": "zerojax-checkpoint", "zerojax_version": zerojax.__version__, "step": step,
            "config": config, "param_shapes": param_shapes(plan), "frozen": frozen_paths(plan), "ema": ema}


def save(mgr: ocp.CheckpointManager, plan: plan_lib.Plan, mesh, state, step: int, config: dict) -> None:
    """Start an asynchronous save of `state` as checkpoint `step` (training goes on); `config`
    is the resolved config, kept in the metadata."""
    view, shardings, _ = saved_state(plan, mesh, state)
    saved = jax.jit(view, out_shardings=shardings)(state)
    mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(saved),
                                           meta=ocp.args.JsonSave(metadata(plan, step, config, state.ema is not None))),
             force=True)


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


def check_matches(run_dir: Path, step: int, plan: plan_lib.Plan, ema: bool = False) -> None:
    """Checkpoint `step` of `run_dir` can be restored into `plan` (with an EMA, `ema`), judged
    from its metadata."""
    reader = manager(run_dir, keep=1, create=False, writer=False)
    try:
        meta = read_metadata(reader, step)
    finally:
        reader.close()
    _check_meta(meta, plan, Path(run_dir) / "checkpoints" / str(step), ema)


def _check_meta(meta: dict, plan: plan_lib.Plan, where: Path, ema: bool) -> None:
    """The checkpoint holds the plan's parameters, in their true shapes, trained the same ones
    (the optimizer state it holds covers only those), and holds an EMA if the run keeps one."""
    fix = "use the saved run's settings (its config.yaml) or a new train.out_dir"
    saved = {path: list(shape) for path, shape in meta["param_shapes"].items()}
    want = param_shapes(plan)
    for path in sorted(saved.keys() | want.keys()):
        if saved.get(path) != want.get(path):
            there = f"{path} is {saved[path]} there" if path in saved else f"it has no {path}"
            here = f"{want[path]} in the config's model" if path in want else "not in the config's model"
            if is_adapter(path) and path in saved and path in want:  # lora_a [.., in, r], lora_b [.., r, out]
                axis = -1 if path.endswith("lora_a") else -2
                here += (f" (LoRA rank {saved[path][axis]} there, {want[path][axis]} in the config: optim.lora.rank "
                         "and optim.lora.rank_pattern)")
            raise ConfigError(f"checkpoint {where} holds a different model than the config asks for: {there}, "
                              f"{here}; {fix}")
    optim = meta.get("config", {}).get("optim", {})
    freeze, lora = tuple(optim.get("freeze", ())), bool(optim.get("lora", {}).get("rank", 0))
    frozen = set(meta["frozen"]) if "frozen" in meta else None  # older checkpoints: from their config
    for leaf in jax.tree.leaves(plan.leaves):
        was_frozen = (leaf.path in frozen if frozen is not None else
                      is_frozen(leaf.path, freeze) or (lora and not is_adapter(leaf.path)))
        if was_frozen != leaf.frozen:
            did, does = ("froze", "trains") if was_frozen else ("trained", "freezes")
            raise ConfigError(f"checkpoint {where} {did} {leaf.path}, which the config {does} (the saved run had "
                              f"optim.freeze={list(freeze)}, optim.lora.rank {'> 0' if lora else '= 0'}): it holds "
                              f"optimizer state for the parameters it trained only; {fix}")
    if bool(meta.get("ema", False)) != ema:
        has = "holds an EMA of the weights" if not ema else "holds no EMA of the weights"
        asks = "keeps none (optim.ema=0)" if not ema else "keeps one (optim.ema > 0)"
        raise ConfigError(f"checkpoint {where} {has} (the saved run had optim.ema={optim.get('ema', 0)}) and the "
                          f"config {asks}; {fix}")


def restore(mgr: ocp.CheckpointManager, plan: plan_lib.Plan, mesh, step: int, abstract_state, shardings,
            finish=lambda state: state):
    """Checkpoint `step` read straight into `plan` on `mesh` (any mesh, stage or schedule), as a
    state like `abstract_state` (a TrainState) laid out by `shardings` (host memory included);
    `finish(state)` completes what is not saved (a device copy of the weights)."""
    _check_meta(read_metadata(mgr, step), plan, Path(mgr.directory) / str(step), abstract_state.ema is not None)
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
            opt_state=plan_lib.map_like_params(saved["opt_state"], plan, lambda leaf, x: leaf.pad(x), stored=False),
            loss_scale=saved["loss_scale"], ema=plan.pad(saved["ema"]) if "ema" in saved else None))

    return jax.jit(into_plan, out_shardings=shardings)(saved)


def complete_steps(run_dir: Path) -> list[int]:
    """Steps with a complete checkpoint (orbax renames a step's directory to its number only
    once every file is written; temporary directories carry a suffix)."""
    folder = Path(run_dir) / "checkpoints"
    return sorted(int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit()) if folder.is_dir() else []
