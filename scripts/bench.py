"""Benchmarks of the train step: the plan run on the first GPU, and the per-stage table.

    python scripts/bench.py plan [--dry-run] [--out FILE] [--deadline-s S] [--only NAME,...]
                                 [--steps 5] [--warmup 2] [--peak-tflops 989] [--xla-preset gpu]
                                 [--fit-budget-gb G] [--fit-max-steps K]
    python scripts/bench.py measure NAME --result FILE [the same options]   (what `plan` runs)
    python scripts/bench.py summary FILE                  (the Markdown summary of a plan's JSON)
    python scripts/bench.py stages [--config PATH] [--steps 20] [--stages 0,1,2,3]
                                   [--schedules shard_map,gspmd] [--peak-tflops T] [KEY=VALUE ...]
    python scripts/bench.py transient [--shapes 3.3M,25.5M] [--out FILE] [KEY=VALUE ...]

`plan` is what scripts/bench_gpu.sh runs: the measurements of PLAN below, in order, each in a
fresh process, because a process's peak device memory (`memory_stats()["peak_bytes_in_use"]`)
cannot be reset, and because an out-of-memory error or a hung compile then costs one entry, not
the run. After every measurement the whole JSON document is rewritten atomically, so a run cut
short by its time limit keeps everything measured so far. A measurement whose feature has not
landed in zerojax (its config does not load, or preparing it says "not implemented") is
skipped with that reason. `--dry-run` runs the same plan on CPU with tiny shapes (CI).

`stages` is the per-stage table of BENCHMARKS.md's CPU section (one process; on CPU absolute
times are noise, compare the ratios).

`transient` is BENCHMARKS.md's like-for-like table of transient memory (XLA's `temp_size_in_bytes`
of the compiled step, nothing allocated) at stage 3, bf16 compute, `model.remat=full`: the
explicit schedule at `zero.prefetch=0` and `1`, zerojax's gspmd schedule, and the peer, JAX's
usual FSDP: the same model and AdamW under GSPMD, parameters and optimizer state sharded by
scalax's `FSDPShardingRule`, activations batch-sharded between blocks, `jax.checkpoint` per
block with `nothing_saveable`. The peer needs scalax (`pip install scalax`), which is not a
zerojax dependency.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's zerojax, installed or not (the GPU image has it not)
from zerojax import config
from zerojax.parallel import mesh
from zerojax.schedules import quant
from zerojax.analysis import formulas
from zerojax.analysis import measure
from zerojax.analysis import traced

# ---------------------------------------------------------------------------------------------
# The library, reached only through these few names: when zerojax's modules move, only this
# section should have to follow them.

load_config = config.load  # (path, overrides) -> Config; ValueError (ConfigError) on bad input
count_params, peak_bytes = measure.count_params, formulas.peak_bytes
largest_fitting = measure.largest_fitting  # `zerojax analyze --budget-gb`
apply_xla_preset = mesh.apply_xla_preset


@dataclasses.dataclass(frozen=True)
class Setup:
    """A config and its compiled step's Step (mesh, plan, policy, units)."""

    cfg: object
    step: object

    @property
    def mesh(self):
        return self.step.mesh


def compile_step(cfg):
    """Config -> (Setup, compiled step), nothing allocated."""
    step, compiled = measure.compile_step(cfg)
    return Setup(cfg, step), compiled


def stage_report(setup, compiled, params: int) -> dict:  # `zerojax analyze`'s row
    return measure.stage_report(setup.cfg, setup.step, compiled, params)


def flops_per_token(cfg) -> float:  # the model's own count (GPT, Llama: PaLM's formula)
    return measure.model_flops_per_token(cfg)


def make_engine(cfg):
    """The Step of a config (mesh, plan, policy, units), nothing compiled."""
    from zerojax.train.step import make_engine as make

    return make(cfg, mesh.make_mesh(cfg.mesh))


def abstract_params(setup):
    """The model's fp32 parameters as a nested dict of shapes (true shapes, no padding)."""
    from flax import nnx

    from zerojax.train.model import abstract_model

    step = setup.step
    return nnx.to_pure_dict(nnx.state(abstract_model(step.model, step.policy, step.seed), nnx.Param))


def init_state(setup):
    """The real (allocated) train state of a compiled setup."""
    from zerojax.train.state import init_state as init

    return init(setup.step)


def batch_shape(cfg):
    """The global batch: int32 tokens [B, T+1]."""
    from zerojax.train.step import batch_shape as shape

    return shape(cfg)


def batch_sharding(setup):
    return mesh.batch_sharding(setup.mesh)


def gathered_units(setup) -> list[tuple[int, int]]:
    """(elements, count) of the units a stage-3 step gathers: the outer unit, each stack's layers."""
    step = setup.step
    depth = lambda name: jax.tree.leaves(step.plan.leaves[name])[0].shape[0]
    return [(traced.unit_size(step, None), 1)] + [(traced.unit_size(step, name), depth(name))
                                                      for name in step.units.names]


# zerojax.quant's four steps, as one device runs them for a gather (quantize and encode its
# shard; decode and dequantize what arrives), and a gather's plain cast to the compute dtype.
quantize_blocks, encode_blocks = quant.quantize, quant.encode
decode_blocks, dequantize_blocks, blocks_of = quant.decode, quant.dequantize, quant.blocks


# ---------------------------------------------------------------------------------------------
# The plan: what the first GPU measures, with an estimate of each measurement's seconds on one
# H200 (process start ~8 s, compile of a 1B step ~25 s, the timed steps a few seconds). The
# estimates are guesses until the first run; its JSON has each measurement's wall_s.

GPT_1B, LLAMA_1B, S3 = "configs/gpt-1b.yaml", "configs/llama-1b.yaml", "gpt1b_s3_shard_map"
SETUP_S = 10  # bench_gpu.sh before the plan: the GPU check, nvidia-smi
BASE = ("train.global_batch=8", "train.grad_accum=1")  # 16k tokens per step
DRY = ("model.vocab_size=256", "model.d_model=64", "model.n_layers=2", "model.n_heads=2",
       "model.d_ff=256", "model.seq_len=32", "train.global_batch=16",
       "zero.min_shard_size=1024")  # so that the tiny blocks are still sharded and gathered


@dataclasses.dataclass(frozen=True)
class Measurement:
    name: str
    what: str  # one line, for BENCHMARKS.md
    h200_s: int  # estimated seconds on one H200, process start and compile included
    overrides: tuple[str, ...] = ()
    config: str = GPT_1B
    feature: str | None = None  # a feature that may not have landed yet: skipped (named) if so
    baseline: str | None = None  # its step time is compared with this measurement's
    fit_stage: int | None = None  # instead of throughput: the largest scaling that fits
    quant_overhead: bool = False  # also time the quantized gathers' own work (no network)
    dry: tuple[str, ...] = ()  # more overrides for the CPU rehearsal


PLAN = (
    Measurement("gpt1b_s0_shard_map", "gpt-1b, stage 0, shard_map: MFU, tokens/s, peak memory", 40,
                ("zero.stage=0", "zero.schedule=shard_map")),
    Measurement(S3, "gpt-1b, stage 3, shard_map", 40, ("zero.stage=3", "zero.schedule=shard_map")),
    Measurement("gpt1b_s0_gspmd", "gpt-1b, stage 0, gspmd", 40, ("zero.stage=0", "zero.schedule=gspmd")),
    Measurement("gpt1b_s3_gspmd", "gpt-1b, stage 3, gspmd", 40, ("zero.stage=3", "zero.schedule=gspmd")),
    Measurement("llama1b_s3", "llama-1b, stage 3, shard_map", 40, ("zero.stage=3",), config=LLAMA_1B,
                feature="model.family=llama (configs/llama-1b.yaml)", dry=("model.n_kv_heads=1",)),
    Measurement("offload_optimizer_s3", "gpt-1b, stage 3, zero.offload=optimizer: step time vs none", 45,
                ("zero.stage=3", "zero.offload=optimizer"), feature="zero.offload=optimizer", baseline=S3),
    Measurement("offload_optimizer_master_s3", "gpt-1b, stage 3, zero.offload=optimizer+master", 50,
                ("zero.stage=3", "zero.offload=optimizer+master"), feature="zero.offload=optimizer+master",
                baseline=S3),
    Measurement("gather_int8_s3", "gpt-1b, stage 3, precision.gather=int8: step time vs bf16 gathers, and the "
                "quantize + dequantize time of every unit's two gathers per step vs a plain cast (one device "
                "shards nothing: its step gathers nothing)", 45, ("zero.stage=3", "precision.gather=int8"),
                baseline=S3, quant_overhead=True),
    Measurement("fit_s3", "largest depth x width scaling of gpt-1b that fits, stage 3 (compile only), "
                "then one real step of it", 95, ("zero.stage=3",), fit_stage=3),
    Measurement("fit_s0", "the same for stage 0 (on one device, N = 1, stages shard nothing: "
                "skipped, named)", 10, ("zero.stage=0",), fit_stage=0),
)
# Not in the 8-minute plan (it would not fit): run with `--only fit_s3_offload` on a later lease.
EXTRA = (
    Measurement("fit_s3_offload", "largest scaling of gpt-1b that fits at stage 3 with zero.offload="
                "optimizer+master (host bytes not counted against the device), then one real step of it", 95,
                ("zero.stage=3", "zero.offload=optimizer+master"), fit_stage=3, feature="zero.offload=optimizer+master"),
)
BY_NAME = {m.name: m for m in PLAN + EXTRA}


def overrides(m: Measurement, dry_run: bool) -> list[str]:
    return [*BASE, *m.overrides, *((*DRY, *m.dry) if dry_run else ())]


def unavailable(m: Measurement, dry_run: bool) -> str | None:
    """Why `m` cannot run with this zerojax (None: it can). Only a measurement of a feature may
    be skipped; for the others a config that does not load is an error (ValueError)."""
    try:
        if not (ROOT / m.config).is_file():
            raise ValueError(f"{m.config} does not exist")
        load_config(ROOT / m.config, overrides(m, dry_run))
    except ValueError as err:
        if m.feature is None:
            raise
        return f"{m.feature}: not in zerojax yet ({err})"
    return None


# ---------------------------------------------------------------------------------------------
# One measurement, in its own process.

REPORT_KEYS = ("argument_bytes", "temp_bytes", "output_bytes", "comm_bytes", "comm_theory_bytes")


def measure(m: Measurement, opts) -> dict:
    if opts.xla_preset:
        apply_xla_preset(opts.xla_preset)  # before the backend starts
    cfg = load_config(ROOT / m.config, overrides(m, opts.dry_run))
    try:
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
    setup, compiled = compile_step(cfg)  # includes preparing the setup
    compile_s = time.perf_counter() - start
    params = count_params(cfg)
    report = stage_report(setup, compiled, params)
    step_s, loss = timed_steps(setup, compiled, init_state(setup), opts.steps, opts.warmup)
    return {"status": "ok", "params": params, "compile_s": compile_s, **rates(setup, params, step_s, opts),
            "loss": loss, "analyze_peak_bytes": peak_bytes(report), **{k: report[k] for k in REPORT_KEYS},
            "all_gather_dtype": report["comm_dtypes"].get("all-gather"),  # None: nothing gathered (N = 1)
            **device_memory()}


def quant_overhead(cfg, step_s: float, opts) -> dict:
    """What a quantized gather adds to a device's step, the network left out: for every unit,
    twice (stage 3 gathers each unit in the forward and again in the backward), quantize and
    encode the unit, then decode and dequantize it into the compute dtype, against casting it
    to the compute dtype (what an unquantized bf16 gather does to its shard). Each unit is done
    whole: on one device (N = 1) exactly the step's work, on N devices the dequantize exactly
    and the quantize N times over (each device quantizes only its 1/N). On one device the step
    itself gathers nothing (nothing is sharded), so this is the overhead to read there."""
    setup = Setup(cfg, make_engine(cfg))
    policy, units = setup.step.policy, gathered_units(setup)

    def roundtrip(x_n):
        count, length = blocks_of(x_n.shape[0], policy.quant_block)
        sent = encode_blocks(*quantize_blocks(x_n, policy.quant_block, policy.gather))
        return dequantize_blocks(*decode_blocks(sent, count, length, policy.gather), x_n.shape[0], policy.compute)

    cast = lambda x_n: x_n.astype(policy.compute)
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


def rates(setup, params: int, step_s: float, opts) -> dict:
    cfg = setup.cfg
    tokens_per_sec = cfg.train.global_batch * cfg.model.seq_len / step_s
    out = {"step_s": step_s, "tokens_per_sec": tokens_per_sec}
    if opts.peak_tflops:  # model FLOPs utilisation, summed over the devices (PaLM appendix B)
        flops = flops_per_token(cfg)
        out["mfu"] = tokens_per_sec * flops / (opts.peak_tflops * 1e12 * setup.mesh.devices.size)
    return out


def timed_steps(setup, compiled, state, steps: int, warmup: int) -> tuple[float, float]:
    """Seconds per step after `warmup` steps, and the last loss (random tokens: only a sanity check)."""
    cfg = setup.cfg
    shape = (cfg.train.global_batch, cfg.model.seq_len + 1)
    make = jax.jit(lambda key: jax.random.randint(key, shape, 0, cfg.model.vocab_size, jnp.int32),
                   out_shardings=batch_sharding(setup))
    batches = [make(jax.random.key(i)) for i in range(warmup + steps)]
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
    setup, _ = compile_step(staged)  # starts the backend with the mesh's devices; cached for the search
    if stage != 3 and setup.mesh.shape["data"] == 1:
        return {"status": "skipped", "reason": "one device on the data axis (N = 1): every stage holds "
                "the same model states, so stage 0 fits what stage 3 fits"}
    budget = opts.fit_budget_gb * 1e9 if opts.fit_budget_gb else device_memory().get("bytes_limit")
    if not budget:
        raise ValueError("the device reports no memory limit: give --fit-budget-gb")
    found = largest_fitting(staged, stage, budget, max_steps=opts.fit_max_steps)
    row = {"status": "ok", "stage": stage, "budget_bytes": budget, "found": found}
    if found is None:  # not even the unscaled model fits
        return row
    model = dataclasses.replace(cfg.model, **{k: found[k] for k in ("d_model", "d_ff", "n_layers")})
    big = dataclasses.replace(staged, model=model)
    setup, compiled = compile_step(big)  # a hit in the compilation cache: the search compiled it
    try:
        step_s, loss = timed_steps(setup, compiled, init_state(setup), steps=1, warmup=0)
    except jax.errors.JaxRuntimeError as err:  # out of memory: the estimate was wrong, say so
        return {**row, "confirmed": False, "error": first_line(err), **device_memory()}
    return {**row, "confirmed": True, "loss": loss, **rates(setup, found["params"], step_s, opts),
            **device_memory()}


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


def measure_main(opts) -> int:
    """`bench.py measure NAME`: write one entry to --result, whatever happens."""
    try:
        entry = measure(BY_NAME[opts.name], opts)
    except Exception as err:  # noqa: BLE001 - any failure is this entry's result, not the run's
        entry = {"status": "error", "error": f"{type(err).__name__}: {first_line(err)}"}
        traceback.print_exc()  # into the plan's log
    write_json(Path(opts.result), entry)
    return 0 if entry["status"] != "error" else 1


# ---------------------------------------------------------------------------------------------
# The plan, run measurement by measurement.

MIN_START_S = 15  # a measurement is not started with less time left before the deadline


class CutShort(Exception):
    """SIGTERM (the shell's hard timeout): record what is left as skipped, and stop."""


def cut_short(signum, frame):
    raise CutShort()


def write_json(path: Path, doc) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)  # readers never see half a document


def child_flags(opts) -> list[str]:
    flags = ["--steps", str(opts.steps), "--warmup", str(opts.warmup)]
    for name in ("peak_tflops", "xla_preset", "fit_budget_gb", "fit_max_steps"):
        if getattr(opts, name):
            flags += [f"--{name.replace('_', '-')}", str(getattr(opts, name))]
    return flags + (["--dry-run"] if opts.dry_run else [])


def run_child(m: Measurement, opts, limit_s: float, workdir: Path, log) -> dict:
    result = workdir / f"{m.name}.json"
    cmd = [sys.executable, __file__, "measure", m.name, "--result", str(result), *child_flags(opts)]
    print(f"== {m.name}: {' '.join(cmd[1:])}", file=log, flush=True)
    child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        child.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "reason": f"killed after {limit_s:.0f} s"}
    finally:
        if child.poll() is None:  # timed out, or SIGTERM reached us: end its process group
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    if result.is_file():
        return json.loads(result.read_text())
    return {"status": "error", "error": f"exited {child.returncode} without a result (see the log)"}


def run_one(m: Measurement, opts, deadline: float, workdir: Path, log) -> dict:
    try:
        reason = unavailable(m, opts.dry_run)
    except ValueError as err:
        return {"status": "error", "error": str(err)}
    if reason:
        return {"status": "skipped", "reason": reason}
    left = deadline - time.monotonic()
    if left < MIN_START_S:
        return {"status": "skipped", "reason": f"no time left ({left:.0f} s before the deadline)"}
    start = time.monotonic()
    entry = run_child(m, opts, min(left, max(3 * m.h200_s, 120)), workdir, log)
    return {**entry, "wall_s": round(time.monotonic() - start, 1)}


def plan_main(opts) -> int:
    chosen = [m for m in PLAN + EXTRA if m.name in opts.only.split(",")] if opts.only else list(PLAN)
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"meta": meta(opts), "plan": [plan_row(m) for m in chosen], "results": {}}
    write_json(out, doc)
    started, deadline = time.monotonic(), time.monotonic() + opts.deadline_s
    signal.signal(signal.SIGTERM, cut_short)
    with tempfile.TemporaryDirectory(prefix="zerojax-bench-") as workdir, open(out.with_suffix(".log"), "a") as log:
        # One compilation cache for the plan: the fit search and its real step share programs.
        os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(workdir) / "jax-cache"))
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        cut = False
        try:
            for m in chosen:
                doc["results"][m.name] = run_one(m, opts, deadline, Path(workdir), log)
                record(out, doc, m.name, started)
        except CutShort:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the cleanup
            cut = True
            for m in chosen:
                doc["results"].setdefault(m.name, {"status": "skipped", "reason": "cut short by the hard time limit"})
    doc["meta"].update(elapsed_s=round(time.monotonic() - started, 1), finished=True, cut_short=cut)
    doc["summary"] = summary(doc)
    write_json(out, doc)
    print(markdown(doc))
    return 124 if cut else 0  # as timeout(1) says it


def record(out: Path, doc: dict, name: str, started: float) -> None:
    doc["meta"]["elapsed_s"] = round(time.monotonic() - started, 1)
    doc["summary"] = summary(doc)
    write_json(out, doc)
    entry = doc["results"][name]
    said = entry.get("reason") or entry.get("error") or (f"{entry['tokens_per_sec']:,.0f} tokens/s"
                                                          if "tokens_per_sec" in entry else "")
    print(f"[{doc['meta']['elapsed_s']:6.1f} s] {name}: {entry['status']} {said}", flush=True)


def meta(opts) -> dict:
    try:  # the GPU machine gets a copy of the working tree, maybe without git
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv), "dry_run": opts.dry_run, "deadline_s": opts.deadline_s,
            "commit": commit or None, "python": sys.version.split()[0],
            "finished": False, "estimated_h200_s": SETUP_S + sum(m.h200_s for m in PLAN)}


def plan_row(m: Measurement) -> dict:
    return {"name": m.name, "what": m.what, "h200_s": m.h200_s, "config": m.config,
            "overrides": list(m.overrides), "feature": m.feature, "baseline": m.baseline}


# ---------------------------------------------------------------------------------------------
# What a plan's JSON says, as ratios and as Markdown for BENCHMARKS.md.


def summary(doc: dict) -> dict:
    res = doc["results"]
    ok = lambda name: res.get(name, {}).get("status") == "ok" and "step_s" in res[name]
    ratio = lambda a, b, key: res[a][key] / res[b][key] if ok(a) and ok(b) else None
    out = {f"{s}_stage3_over_stage0_tokens_per_sec": ratio(f"gpt1b_s3_{s}", f"gpt1b_s0_{s}", "tokens_per_sec")
           for s in ("shard_map", "gspmd")}
    out["shard_map_over_gspmd_stage3_tokens_per_sec"] = ratio(S3, "gpt1b_s3_gspmd", "tokens_per_sec")
    for m in PLAN:
        if m.baseline:
            out[f"{m.name}_step_s_over_{m.baseline}"] = ratio(m.name, m.baseline, "step_s")
        if m.quant_overhead:
            out[f"{m.name}_quant_overhead_of_step"] = res[m.name].get("quant_overhead_of_step") if ok(m.name) else None
    return out


def markdown(doc: dict) -> str:
    meta, res = doc["meta"], doc["results"]
    device = next((f"{e['devices']} x {e['device_kind']}, jax {e['jax']}" for e in res.values() if "jax" in e), "?")
    dry = " (dry run: CPU, tiny shapes; a rehearsal, not results)" if meta["dry_run"] else ""
    lines = [f"{meta['date']}, {device}, commit {meta['commit']}, {meta.get('elapsed_s', 0)} s{dry}",
             f"`{meta['command']}`", "",
             "| measurement | tokens/s | step | MFU | peak (memory_stats) | analyze peak | compile | wall |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [table_row(name, e) for name, e in res.items()]
    ratios = [f"- {k}: {v:.3f}" for k, v in doc.get("summary", {}).items() if v is not None]
    return "\n".join(lines + ([""] + ratios if ratios else []))


def human(n: float, unit: str = "B") -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g} {prefix}{unit}"
    return f"{n:.3g} {unit}"


def cell(value, form) -> str:
    return "-" if value is None else form(value) if callable(form) else form.format(value)


def table_row(name: str, e: dict) -> str:
    if e["status"] != "ok":
        return f"| {name} | {e['status']}: {e.get('reason') or e.get('error')} |" + " |" * 6
    found = e.get("found") or {}
    if found:
        name += (f" (fits: d_model {found['d_model']}, {found['n_layers']} layers, "
                 f"{found['params']:,} parameters; real step {'ran' if e.get('confirmed') else 'failed'})")
    cells = [name, cell(e.get("tokens_per_sec"), "{:,.0f}"), cell(e.get("step_s"), "{:.3f} s"),
             cell(e.get("mfu"), "{:.1%}"), cell(e.get("peak_bytes_in_use"), human),
             cell(e.get("analyze_peak_bytes", found.get("peak_bytes")), human),
             cell(e.get("compile_s"), "{:.1f} s"), cell(e.get("wall_s"), "{:.0f} s")]
    return "| " + " | ".join(cells) + " |"


# ---------------------------------------------------------------------------------------------
# `stages`: every stage and schedule in one process (BENCHMARKS.md's CPU table).


def stages_main(opts) -> int:
    cfg = load_config(opts.config, opts.overrides)
    rows = []
    for schedule in opts.schedules.split(","):
        for stage in (int(s) for s in opts.stages.split(",")):
            zero = dataclasses.replace(cfg.zero, stage=stage, schedule=schedule)
            row = throughput(dataclasses.replace(cfg, zero=zero), opts)
            row.pop("peak_bytes_in_use")  # the process's peak so far, not this configuration's
            rows.append({"schedule": schedule, "stage": stage, **row})
            print(json.dumps(rows[-1]), flush=True)
    doc = {"rows": rows, "summary": stages_summary(cfg, rows), "overrides": opts.overrides, **device_info()}
    print(json.dumps(doc["summary"], indent=1))
    if opts.out:
        write_json(Path(opts.out), doc)
    return 0


def stages_summary(cfg, rows: list[dict]) -> dict:
    by = {(r["schedule"], r["stage"]): r for r in rows}
    ratio = lambda a, b, key: by[a][key] / by[b][key] if a in by and b in by else None
    compile_s = {}
    for n in (2, 16):  # the blocks are a lax.scan: compile time should not grow with depth
        start = time.perf_counter()
        compile_step(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layers=n)))
        compile_s[n] = time.perf_counter() - start
    return {"compile_s_2_layers": compile_s[2], "compile_s_16_layers": compile_s[16],
            "compile_16_over_2": compile_s[16] / compile_s[2],
            **{f"{s}_stage3_over_stage0_tokens_per_sec": ratio((s, 3), (s, 0), "tokens_per_sec")
               for s in ("shard_map", "gspmd")},
            "shard_map_over_gspmd_stage3_bytes": ratio(("shard_map", 3), ("gspmd", 3), "comm_bytes"),
            "shard_map_over_gspmd_stage3_temp": ratio(("shard_map", 3), ("gspmd", 3), "temp_bytes")}


# ---------------------------------------------------------------------------------------------
# `transient`: stage 3's transient memory, like for like with JAX's usual FSDP (BENCHMARKS.md).

TRANSIENT_SHAPES = {  # the shapes: 3.3M and 25.5M parameters
    "3.3M": ("model.d_model=256", "model.n_layers=4", "model.n_heads=4", "model.d_ff=1024", "model.seq_len=128",
             "train.global_batch=32"),
    "25.5M": ("model.d_model=512", "model.n_layers=8", "model.n_heads=8", "model.d_ff=2048", "model.seq_len=256",
              "train.global_batch=16"),
}
LIKE_FOR_LIKE = ("zero.stage=3", "precision.compute=bf16", "model.remat=full")
TRANSIENT_SCHEDULES = (("shard_map", 0), ("shard_map", 1), ("gspmd", None), ("peer", None))


def fsdp_rule_class():
    """scalax's FSDPShardingRule, imported here: scalax is not a zerojax dependency."""
    try:
        from scalax.sharding import FSDPShardingRule
    except ImportError:
        raise SystemExit("bench.py transient: the peer schedule needs scalax, which zerojax does not depend on: "
                         "pip install scalax") from None
    return FSDPShardingRule


def peer_step(cfg):
    """JAX's usual FSDP on `cfg`'s model, mesh and optimizer: (Setup, the jitted step, its
    abstract state and batch, shardings included). Nothing is allocated.

    Every leaf of the train state (fp32 master weights, AdamW moments) is sharded by scalax's
    FSDPShardingRule: the largest dim divisible by the data axis, leaves under
    `zero.min_shard_size` elements whole. The step is jax.value_and_grad of the model's loss
    (blocks in a lax.scan, each under jax.checkpoint with nothing_saveable, the activations
    constrained to be batch-sharded between blocks), then the optimizer's update, jitted with
    the state donated; XLA places every collective."""
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    setup = Setup(cfg, make_engine(cfg))
    step, m, units = setup.step, setup.mesh, setup.step.units
    rows = mesh.batch_sharding(m)
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
        updates, opt_state = step.optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    params = abstract_params(setup)
    state = (params, jax.eval_shape(step.optimizer.init, params))
    rule = fsdp_rule_class()(mesh.DATA, fsdp_axis_size=m.shape[mesh.DATA], min_fsdp_size=cfg.zero.min_shard_size)
    shardings = jax.tree.map(lambda spec: NamedSharding(m, spec), rule.apply(state),
                             is_leaf=lambda x: isinstance(x, P))
    abstract = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), state, shardings)
    shape = batch_shape(cfg)
    batch = jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=rows)
    jitted = jax.jit(train_step, in_shardings=(shardings, rows), out_shardings=(shardings, mesh.replicated(m)),
                     donate_argnums=0)
    return setup, jitted, abstract, batch


def compile_peer(cfg):
    """(Setup, the peer's compiled step)."""
    setup, jitted, state, batch = peer_step(cfg)
    return setup, jitted.lower(state, batch).compile()


def transient_rows(base_overrides, shapes) -> list[dict]:
    """Per shape, every schedule's temp and argument bytes, with ratios to the peer's temp and
    the excess over it in gathered units (the largest unit, in the bytes XLA's all-gather moves)."""
    rows = []
    fsdp_rule_class()  # before anything is compiled
    for shape in shapes:
        cfg = load_config(None, [*TRANSIENT_SHAPES[shape], *LIKE_FOR_LIKE, *base_overrides])
        found = []
        for schedule, prefetch in TRANSIENT_SCHEDULES:
            if schedule == "peer":
                setup, compiled = compile_peer(cfg)
            else:
                zero = dataclasses.replace(cfg.zero, schedule=schedule, prefetch=prefetch or 0)
                setup, compiled = compile_step(dataclasses.replace(cfg, zero=zero))
            mem = measure.measure_memory(compiled)
            row = {"shape": shape, "params": count_params(cfg), "schedule": schedule, "prefetch": prefetch,
                   "temp_bytes": mem["temp_bytes"], "argument_bytes": mem["argument_bytes"]}
            if schedule == "shard_map" and prefetch == 0:  # the unit, as this backend gathers it
                b_g = stage_report(setup, compiled, row["params"])["gather_bytes_per_element"]
                unit = max(traced.unit_size(setup.step, name) for name in setup.step.units.names)
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


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    plan, one = sub.add_parser("plan"), sub.add_parser("measure")
    stages = sub.add_parser("stages")
    for p in (plan, one, stages):
        p.add_argument("--steps", type=int, default=5)
        p.add_argument("--warmup", type=int, default=2)
        p.add_argument("--peak-tflops", type=float, help="the device's dense peak, for MFU (H200 bf16: 989)")
        p.add_argument("--xla-preset", help="e.g. gpu (zerojax.mesh.XLA_PRESETS)")
    for p in (plan, one):
        p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: the CI rehearsal")
        p.add_argument("--fit-budget-gb", type=float, help="the fit search's budget (default: the device's limit)")
        p.add_argument("--fit-max-steps", type=int, default=12, help="the fit search's most scalings (x2 parameters each)")
    plan.add_argument("--out", default="runs/bench_gpu/bench_gpu.json")
    plan.add_argument("--deadline-s", type=float, default=470, help="start nothing that cannot end by then")
    plan.add_argument("--only", help="comma-separated measurement names")
    one.add_argument("name", choices=list(BY_NAME))
    one.add_argument("--result", required=True)
    sub.add_parser("summary").add_argument("file")
    stages.add_argument("--config")
    stages.add_argument("--stages", default="0,1,2,3")
    stages.add_argument("--schedules", default="shard_map,gspmd")
    stages.add_argument("--out")
    stages.add_argument("overrides", nargs="*")
    transient = sub.add_parser("transient")
    transient.add_argument("--shapes", default=",".join(TRANSIENT_SHAPES), help="of " + ", ".join(TRANSIENT_SHAPES))
    transient.add_argument("--out")
    transient.add_argument("overrides", nargs="*")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    opts = parse_args(argv)
    if opts.command == "summary":
        print(markdown(json.loads(Path(opts.file).read_text())))
        return 0
    if opts.command == "stages" and opts.xla_preset:
        apply_xla_preset(opts.xla_preset)
    return {"plan": plan_main, "measure": measure_main, "stages": stages_main,
            "transient": transient_main}[opts.command](opts)


if __name__ == "__main__":
    sys.exit(main())
