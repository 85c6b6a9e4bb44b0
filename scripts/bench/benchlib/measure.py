"""`measure NAME`: one measurement of the plan, in the process `plan` starts for it; its entry
is written to --result whatever happens. Also the timed steps `stages` reuses."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp

from zerojax import config as config_lib
from zerojax.analysis import formulas
from zerojax.analysis import measure as measure_lib
from zerojax.analysis import traced
from zerojax.parallel import mesh as mesh_lib
from zerojax.schedules import quant as quant_lib
from zerojax.train import model as model_lib
from zerojax.train import state as state_lib
from zerojax.train import step as step_lib

from benchlib import ROOT, write_json
from benchlib.plan import BY_NAME, Measurement, overrides

REPORT_KEYS = ("argument_bytes", "temp_bytes", "output_bytes", "comm_bytes", "comm_theory_bytes")


def measure_main(opts) -> int:
    """`bench.py measure NAME`: write one entry to --result, whatever happens."""
    try:
        entry = measure(BY_NAME[opts.name], opts)
    except Exception as err:  # noqa: BLE001 - any failure is this entry's result, not the run's
        entry = {"status": "error", "error": f"{type(err).__name__}: {first_line(err)}"}
        traceback.print_exc()  # into the plan's log
    write_json(Path(opts.result), entry)
    return 0 if entry["status"] != "error" else 1


def measure(m: Measurement, opts) -> dict:
    if opts.xla_preset:
        mesh_lib.apply_xla_preset(opts.xla_preset)  # before the backend starts
    cfg = config_lib.load(ROOT / m.config, overrides(m, opts.dry_run))
    try:
        if m.plan_check:
            row = plan_check(cfg, m, opts)
        else:
            row = fit(cfg, m.fit_stage, opts) if m.fit_stage is not None else throughput(cfg, opts)
        if m.quant_overhead:
            row.update(quant_overhead(cfg, row["step_s"], opts))
    except ValueError as err:  # prepare's "not implemented in zerojax yet"
        if m.feature and "not implemented" in str(err):
            return {"status": "skipped", "reason": f"{m.feature}: {err}"}
        raise
    return {**row, **device_info()}


def throughput(cfg, opts) -> dict:
    start = time.perf_counter()
    engine, compiled = measure_lib.compile_step(cfg)  # includes building the engine
    compile_s = time.perf_counter() - start
    params = measure_lib.count_params(cfg)
    report = measure_lib.stage_report(cfg, engine, compiled, params)
    step_s, loss = timed_steps(cfg, engine, compiled, state_lib.init_state(engine), opts.steps, opts.warmup)
    return {"status": "ok", "params": params, "compile_s": compile_s, **rates(cfg, engine, params, step_s, opts),
            "loss": loss, "analyze_peak_bytes": formulas.peak_bytes(report), **{k: report[k] for k in REPORT_KEYS},
            "all_gather_dtype": report["comm_dtypes"].get("all-gather"),  # None: nothing gathered (N = 1)
            **device_memory()}


def gathered_units(engine) -> list[tuple[int, int]]:
    """(elements, count) of the units a stage-3 step gathers: the outer unit, each stack's layers."""
    depth = lambda name: jax.tree.leaves(engine.plan.leaves[name])[0].shape[0]
    return [(traced.unit_size(engine, None), 1)] + [(traced.unit_size(engine, name), depth(name))
                                                     for name in engine.units.names]


def quant_overhead(cfg, step_s: float, opts) -> dict:
    """What a quantized gather adds to a device's step, the network left out: for every unit,
    twice (stage 3 gathers each unit in the forward and again in the backward), quantize and
    encode the unit, then decode and dequantize it into the compute dtype, against casting it
    to the compute dtype (what an unquantized bf16 gather does to its shard). Each unit is done
    whole: on one device (N = 1) exactly the step's work, on N devices the dequantize exactly
    and the quantize N times over (each device quantizes only its 1/N). On one device the step
    itself gathers nothing (nothing is sharded), so this is the overhead to read there."""
    engine = step_lib.make_engine(cfg, mesh_lib.make_mesh(cfg.mesh))
    policy, units, quant = engine.policy, gathered_units(engine), quant_lib

    def roundtrip(x_n):  # zerojax.schedules.quant's four steps, as one device runs them for a gather
        count, length = quant.blocks(x_n.shape[0], policy.quant_block)
        sent = quant.encode(*quant.quantize(x_n, policy.quant_block, policy.gather))
        return quant.dequantize(*quant.decode(sent, count, length, policy.gather), x_n.shape[0], policy.compute)

    cast = lambda x_n: x_n.astype(policy.compute)  # a gather's plain cast to the compute dtype
    seconds = {"quant_s_per_step": 0.0, "cast_s_per_step": 0.0}
    for n, count in units:  # a lax.map over a stack's layers writes every layer's result (none is skipped)
        x = jax.random.normal(jax.random.key(0), (count, n), jnp.float32)
        for key, fn in (("quant_s_per_step", roundtrip), ("cast_s_per_step", cast)):
            seconds[key] += 2 * best_time(jax.jit(lambda x, fn=fn: jax.lax.map(fn, x)), x, opts.steps)
        del x
    return {**seconds, "gather_format": policy.gather.name, "quant_block": policy.quant_block,
            "quant_overhead_of_step": (seconds["quant_s_per_step"] - seconds["cast_s_per_step"]) / step_s}


def best_time(fn, x, repeats: int) -> float:
    """The fastest of `repeats` timed calls of `fn(x)`, after one to compile."""
    jax.block_until_ready(fn(x))
    times = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - start)
    return min(times)


def rates(cfg, engine, params: int, step_s: float, opts) -> dict:
    """Step time, tokens/s and MFU. A text model's row is seq_len tokens; a policy's is its joint
    sequence (prefix + suffix: π0's state and actions, π0.5's actions), and its samples/s is the
    rate robot users compare."""
    model = model_lib.abstract_model(cfg.model, engine.policy)
    row_flops = model.flops_per_row() if callable(getattr(model, "flops_per_row", None)) else None
    row_tokens = model.prefix_len + len(model.suffix_ar()) if row_flops else cfg.model.seq_len
    out = {"step_s": step_s, "tokens_per_sec": cfg.train.global_batch * row_tokens / step_s}
    if row_flops:
        out["samples_per_sec"] = cfg.train.global_batch / step_s
    if opts.peak_tflops:  # model FLOPs utilisation, summed over the devices (PaLM appendix B)
        flops = row_flops / row_tokens if row_flops else measure_lib.model_flops_per_token(cfg)
        out["mfu"] = out["tokens_per_sec"] * flops / (opts.peak_tflops * 1e12 * engine.mesh.devices.size)
    return out


def random_batch(cfg, key, sharding):
    """One global batch of the config's shapes (`zerojax.train.step.batch_shape`), made on the devices:
    token ids below the vocabulary, masks all set (no `*_is_pad` flag set: every action is
    real), a flow's time in (0, 1), other floats uniform in [-1, 1] (images are in [-1, 1];
    noise, states and actions any values)."""
    shapes = step_lib.batch_shape(cfg)
    paths, tree = jax.tree_util.tree_flatten_with_path(shapes)

    def make(key):
        out = []
        for i, (path, s) in enumerate(paths):
            k = jax.random.fold_in(key, i)
            if jnp.issubdtype(s.dtype, jnp.integer):
                out.append(jax.random.randint(k, s.shape, 0, cfg.model.vocab_size, s.dtype))
            elif s.dtype == jnp.bool_:
                out.append(jnp.full(s.shape, not jax.tree_util.keystr(path).endswith("_is_pad']"), jnp.bool_))
            else:
                low = 0.001 if len(s.shape) == 1 else -1.0  # [B]: the flow's time
                out.append(jax.random.uniform(k, s.shape, s.dtype, low, 1.0))
        return jax.tree.unflatten(tree, out)

    return jax.jit(make, out_shardings=jax.tree.map(lambda _: sharding, shapes))(key)


def timed_steps(cfg, engine, compiled, state, steps: int, warmup: int) -> tuple[float, float]:
    """Seconds per step after `warmup` steps, and the last loss (random batches: only a sanity check)."""
    sharding = mesh_lib.batch_sharding(engine.mesh)
    batches = [random_batch(cfg, jax.random.key(i), sharding) for i in range(warmup + steps)]
    for batch in batches[:warmup]:
        state, metrics = compiled(state, batch)
    jax.block_until_ready((state, batches))
    start = time.perf_counter()
    for batch in batches[warmup:]:
        state, metrics = compiled(state, batch)
    jax.block_until_ready((state, metrics))
    return (time.perf_counter() - start) / steps, float(metrics["loss"])


def fit(cfg, stage: int, opts) -> dict:
    """`zerojax analyze --budget-gb`'s search for `stage`, then one real step of what it found."""
    staged = dataclasses.replace(cfg, zero=dataclasses.replace(cfg.zero, stage=stage))
    engine, _ = measure_lib.compile_step(staged)  # starts the backend with the mesh's devices; cached for the search
    if stage != 3 and engine.mesh.shape["data"] == 1:
        return {"status": "skipped", "reason": "one device on the data axis (N = 1): every stage holds "
                "the same model states, so stage 0 fits what stage 3 fits"}
    budget = budget_bytes(opts)
    found = measure_lib.largest_fitting(staged, stage, budget, max_steps=opts.fit_max_steps)
    row = {"status": "ok", "stage": stage, "budget_bytes": budget, "found": found}
    if found is None:  # not even the unscaled model fits
        return row
    model = dataclasses.replace(cfg.model, **{k: found[k] for k in ("d_model", "d_ff", "n_layers")})
    big = dataclasses.replace(staged, model=model)
    engine, compiled = measure_lib.compile_step(big)  # a hit in the compilation cache: the search compiled it
    try:
        step_s, loss = timed_steps(big, engine, compiled, state_lib.init_state(engine), steps=1, warmup=0)
    except jax.errors.JaxRuntimeError as err:  # out of memory: the estimate was wrong, say so
        return {**row, "confirmed": False, "error": first_line(err), **device_memory()}
    return {**row, "confirmed": True, "loss": loss, **rates(big, engine, found["params"], step_s, opts),
            **device_memory()}


def budget_bytes(opts) -> float:
    """The fit search's and plan_check's budget: --fit-budget-gb, else the allocator's limit."""
    budget = opts.fit_budget_gb * 1e9 if opts.fit_budget_gb else device_memory().get("bytes_limit")
    if not budget:
        raise ValueError("the device reports no memory limit: give --fit-budget-gb")
    return budget


def plan_check(cfg, m: Measurement, opts) -> dict:
    """`zerojax plan --json` in a CPU process of its own, as a user runs it before renting the
    GPU (N devices, this device's memory limit as the budget: fraction 1, no margin), then its
    winner's step run here: the measured peak against the plan's compiled peak and the budget,
    the measured step time against the plan's estimate."""
    devices = cfg.mesh.cpu_devices if opts.dry_run else jax.device_count()
    budget = budget_bytes(opts)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_PYTHON_CLIENT_MEM_FRACTION": "1"}
    cmd = [sys.executable, "-m", "zerojax", "plan", "--config", str(ROOT / m.config), "--devices", str(devices),
           "--device", PLAN_DEVICE, "--device-memory", f"{budget / 1e9!r}GB", "--margin", "0", "--json",
           *overrides(m, opts.dry_run)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    plan_s = time.perf_counter() - start
    if proc.returncode not in (0, 2):
        raise RuntimeError(f"zerojax plan exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
    doc = json.loads(proc.stdout)
    row = {"status": "ok", "budget_bytes": budget, "plan_s": plan_s, "plan_compiles": doc["compiles"],
           "winner": doc["winner"]}
    if doc["winner"] is None:  # the plan says nothing fits: nothing to run
        return {**row, "nothing_fits": doc["nothing_fits"]}
    planned = [*overrides(m, opts.dry_run), "mesh.replica=1", f"mesh.data={devices}", *doc["winner"]["overrides"]]
    cfg = config_lib.load(ROOT / m.config, planned)  # the mesh the plan compiled for: one group of N
    ran = throughput(cfg, opts)
    peak = ran["peak_bytes_in_use"]
    return {**ran, **row, "plan_peak_bytes": doc["winner"]["peak_bytes"], "plan_step_s": doc["winner"]["step_s"],
            "step_s_over_plan": ran["step_s"] / doc["winner"]["step_s"],
            "peak_over_plan": peak / doc["winner"]["peak_bytes"] if peak else None,
            "peak_within_budget": peak <= budget if peak else None}


PLAN_DEVICE = "h200"  # the device kind the plan estimates for: this benchmark's GPU


def device_memory() -> dict:
    """The device allocator's peak since the process started (None where the backend keeps none)."""
    device = jax.local_devices()[0]
    stats = device.memory_stats()
    if not stats:
        return {"peak_bytes_in_use": None, "memory_stats": f"memory_stats() is None on {device.platform}"}
    return {"peak_bytes_in_use": stats.get("peak_bytes_in_use"), "bytes_limit": stats.get("bytes_limit")}


def device_info() -> dict:
    device = jax.devices()[0]
    return {"platform": device.platform, "device_kind": device.device_kind,
            "devices": jax.device_count(), "jax": jax.__version__}


def first_line(err: Exception) -> str:
    return (str(err).splitlines() or [""])[0][:500]
