"""`transient`: stage 3's transient memory, like for like with JAX's usual FSDP (BENCHMARKS.md).

The peer: the same model and AdamW under GSPMD, parameters and optimizer state sharded by
scalax's `FSDPShardingRule`, activations batch-sharded between blocks, `jax.checkpoint` per
block with `nothing_saveable`. scalax is not a zerojax dependency (`pip install scalax`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax

from zerojax import config as config_lib
from zerojax.analysis import measure as measure_lib
from zerojax.analysis import traced
from zerojax.parallel import mesh as mesh_lib
from zerojax.train import model as model_lib
from zerojax.train import step as step_lib

from benchlib import write_json
from benchlib.measure import device_info

TRANSIENT_SHAPES = {  # the shapes: 3.3M and 25.5M parameters
    "3.3M": ("model.d_model=256", "model.n_layers=4", "model.n_heads=4", "model.d_ff=1024", "model.seq_len=128",
             "train.global_batch=32"),
    "25.5M": ("model.d_model=512", "model.n_layers=8", "model.n_heads=8", "model.d_ff=2048", "model.seq_len=256",
              "train.global_batch=16"),
}
LIKE_FOR_LIKE = ("zero.stage=3", "precision.compute=bf16", "model.remat=full")
TRANSIENT_SCHEDULES = (("shard_map", 0), ("shard_map", 1), ("gspmd", None), ("peer", None))
DATA = "data"  # the mesh axis zerojax shards over (make_mesh's ("replica", "data"))


def fsdp_rule_class():
    """scalax's FSDPShardingRule, imported here: scalax is not a zerojax dependency."""
    try:
        from scalax.sharding import FSDPShardingRule
    except ImportError:
        raise SystemExit("bench.py transient: the peer schedule needs scalax, which zerojax does not depend on: "
                         "pip install scalax") from None
    return FSDPShardingRule


def abstract_params(engine):
    """The model's fp32 parameters as a nested dict of shapes (true shapes, no padding)."""
    from flax import nnx

    model = model_lib.abstract_model(engine.model, engine.policy, engine.seed)
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def peer_step(cfg):
    """JAX's usual FSDP on `cfg`'s model, mesh and optimizer: (Engine, the jitted step, its
    abstract state and batch, shardings included). Nothing is allocated.

    Every leaf of the train state (fp32 master weights, AdamW moments) is sharded by scalax's
    FSDPShardingRule: the largest dim divisible by the data axis, leaves under
    `zero.min_shard_size` elements whole. The step is jax.value_and_grad of the model's loss
    (blocks in a lax.scan, each under jax.checkpoint with nothing_saveable, the activations
    constrained to be batch-sharded between blocks), then the optimizer's update, jitted with
    the state donated; XLA places every collective."""
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    engine = step_lib.make_engine(cfg, mesh_lib.make_mesh(cfg.mesh))
    m, units = engine.mesh, engine.units
    rows = mesh_lib.batch_sharding(m)
    constrain = lambda x: jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, rows), x)

    def loss(params, batch_BS):
        outer = units.outer_of(params)
        x = constrain(units.enter(outer, batch_BS))
        for k, name in enumerate(units.names):
            if k:
                x = constrain(units.between(outer, name, x, batch_BS))

            def block(x, layer, name=name):
                return constrain(units.block(name, layer, x)), None

            body = jax.checkpoint(block, policy=jax.checkpoint_policies.nothing_saveable)
            x, _ = jax.lax.scan(body, x, params[name])
        return units.exit(outer, x, batch_BS)[0]  # the mean loss over the whole batch

    def train_step(state, batch_BS):
        params, opt_state = state
        value, grads = jax.value_and_grad(loss)(params, batch_BS)
        updates, opt_state = engine.optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    params = abstract_params(engine)
    state = (params, jax.eval_shape(engine.optimizer.init, params))
    rule = fsdp_rule_class()(DATA, fsdp_axis_size=m.shape[DATA], min_fsdp_size=cfg.zero.min_shard_size)
    shardings = jax.tree.map(lambda spec: NamedSharding(m, spec), rule.apply(state),
                             is_leaf=lambda x: isinstance(x, P))
    abstract = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), state, shardings)
    batch = step_lib.batch_shape(cfg, sharding=rows)
    jitted = jax.jit(train_step, in_shardings=(shardings, rows), out_shardings=(shardings, NamedSharding(m, P())),
                     donate_argnums=0)
    return engine, jitted, abstract, batch


def compile_peer(cfg):
    """(Engine, the peer's compiled step)."""
    engine, jitted, state, batch = peer_step(cfg)
    return engine, jitted.lower(state, batch).compile()


def transient_rows(base_overrides, shapes) -> list[dict]:
    """Per shape, every schedule's temp and argument bytes, with ratios to the peer's temp and
    the excess over it in gathered units (the largest unit, in the bytes XLA's all-gather moves)."""
    rows = []
    fsdp_rule_class()  # before anything is compiled
    for shape in shapes:
        cfg = config_lib.load(None, [*TRANSIENT_SHAPES[shape], *LIKE_FOR_LIKE, *base_overrides])
        found = []
        for schedule, prefetch in TRANSIENT_SCHEDULES:
            if schedule == "peer":
                engine, compiled = compile_peer(cfg)
            else:
                this = dataclasses.replace(cfg, zero=dataclasses.replace(cfg.zero, schedule=schedule,
                                                                         prefetch=prefetch or 0))
                engine, compiled = measure_lib.compile_step(this)
            mem = measure_lib.measure_memory(compiled)
            row = {"shape": shape, "params": measure_lib.count_params(cfg), "schedule": schedule, "prefetch": prefetch,
                   "temp_bytes": mem["temp_bytes"], "argument_bytes": mem["argument_bytes"]}
            if schedule == "shard_map" and prefetch == 0:  # the unit, as this backend gathers it
                b_g = measure_lib.stage_report(this, engine, compiled, row["params"])["gather_bytes_per_element"]
                unit = max(traced.unit_size(engine, name) for name in engine.units.names)
                row.update(unit_elements=unit, gather_bytes_per_element=b_g)
            found.append(row)
            print(json.dumps(row), flush=True)
        peer = found[-1]["temp_bytes"]
        unit_bytes = found[0]["unit_elements"] * found[0]["gather_bytes_per_element"]
        for row in found:
            row.update(over_peer=row["temp_bytes"] / peer, units_over_peer=(row["temp_bytes"] - peer) / unit_bytes)
        rows += found
    return rows


def transient_markdown(rows: list[dict]) -> str:
    lines = ["| shape | parameters | schedule | zero.prefetch | temp / device | / peer | above peer, gathered units | "
             "persistent args |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        name = {"peer": "peer (GSPMD + scalax FSDPShardingRule)", "gspmd": "gspmd (zerojax)"}.get(r["schedule"],
                                                                                                 r["schedule"])
        prefetch = "-" if r["prefetch"] is None else str(r["prefetch"])
        lines.append(f"| {r['shape']} | {r['params']:,} | {name} | {prefetch} | {r['temp_bytes'] / 1e6:.2f} MB "
                     f"| {r['over_peer']:.3f} | {r['units_over_peer']:+.2f} | {r['argument_bytes'] / 1e6:.2f} MB |")
    return "\n".join(lines)


def transient_main(opts) -> int:
    rows = transient_rows(opts.overrides, opts.shapes.split(","))
    doc = {"rows": rows, "overrides": opts.overrides, **device_info()}
    print(transient_markdown(rows))
    if opts.out:
        write_json(Path(opts.out), doc)
    return 0
