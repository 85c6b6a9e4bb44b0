"""Compile and measure: `zerojax analyze`'s orchestration. Each stage's train step is compiled
from abstract inputs (nothing allocated); XLA's memory_analysis() and the collectives of the
optimized HLO (`hlo`) are set next to the formulas (`formulas`) and to what the model's units
hold, traced (`traced`)."""

from __future__ import annotations

import dataclasses
import math
import jax
import jax.numpy as jnp
from flax import nnx
from zerojax.config import rules
from zerojax.models import protocol
from zerojax.parallel import mesh as mesh_lib
from zerojax.parallel.mesh import DATA
from zerojax.precision import Policy
from zerojax.schedules import quant
from zerojax.schedules.explicit import UnitPasses
from zerojax.train import model as model_lib
from zerojax.train import state as state_lib
from zerojax.train import step as step_lib
from zerojax.analysis.formulas import EMA_BYTES, comm_theory_bytes, host_state_bytes, model_state_bytes, peak_bytes
from zerojax.analysis.hlo import DTYPE_BYTES, argument_bytes_by_memory, collective_bytes
from zerojax.analysis.traced import regime, transient_estimate


def param_counts(cfg) -> tuple[int, int]:
    """(Ψ, Ψ_t) of a config's model from abstract shapes (nothing is allocated): every parameter
    (LoRA's adapters included), and those it trains (all but optim.freeze's and a LoRA base)."""
    model = model_lib.abstract_model(cfg.model, Policy(), cfg.train.seed, cfg.optim.lora)
    leaves = jax.tree.leaves(model_lib.param_plan(cfg, model, protocol.check(model), 0, 1).leaves)
    return (sum(math.prod(leaf.shape) for leaf in leaves),
            sum(math.prod(leaf.shape) for leaf in leaves if not leaf.frozen))


def count_params(cfg) -> int:
    """Ψ of a config's model."""
    return param_counts(cfg)[0]


def compile_step(cfg, measured_only: bool = False):
    """The compiled train step of `cfg` and its Engine, from abstract inputs (nothing allocated);
    `measured_only`: a step that is measured and never run (`analysis_options`)."""
    engine = step_lib.make_engine(cfg, mesh_lib.make_mesh(cfg.mesh))  # the mesh starts the backend
    state = state_lib.init_state(engine, abstract=True)
    batch = step_lib.batch_shape(cfg, sharding=mesh_lib.batch_sharding(engine.mesh))
    lowered = step_lib.make_train_step(engine, state).lower(state, batch)
    return engine, lowered.compile(analysis_options() if measured_only else None)


def analysis_options() -> dict | None:
    """Compiler options for a step that is only measured, never run: on the CPU, LLVM's
    optimisations (XLA's backend at level 0) change no buffer and no collective, and cost a
    third of llama3-8b's compile (7.0 -> 4.9 s for its stage-3 step on 8 devices, 2026-12-01;
    tests/test_fsdp.py checks the bytes agree).
    Elsewhere the options of the step that runs, so that it is a cache hit."""
    return {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else None


def measure_memory(compiled) -> dict:
    """Per-device bytes from XLA's own accounting of the compiled step, the arguments split by
    the memory they live in (`zero.offload`; the CPU backend's memory_analysis lumps them)."""
    m = compiled.memory_analysis()
    text = compiled.as_text()
    args, outs = argument_bytes_by_memory(text), argument_bytes_by_memory(text, outputs=True)
    return {"argument_bytes": int(m.argument_size_in_bytes), "temp_bytes": int(m.temp_size_in_bytes),
            "output_bytes": int(m.output_size_in_bytes), "alias_bytes": int(m.alias_size_in_bytes),
            "device_argument_bytes": args["device"], "host_argument_bytes": args["host"],
            "device_output_bytes": outs["device"], "host_output_bytes": outs["host"]}


def supported_stages(cfg) -> tuple[int, ...]:
    """The stages `cfg` can be compiled at (`rules.gather_stages`: a quantized gather needs a
    gather, stages 1-3)."""
    return rules.gather_stages(cfg.precision.gather, cfg.zero.schedule)


def analyze(cfg, stages_wanted=None, budget_gb: float | None = None) -> dict:
    """The `zerojax analyze --json` document: per stage (default: every stage `cfg` supports),
    measured bytes next to the formulas, and with a budget the largest scaling of the model
    that fits per device."""
    params, stages, engine = count_params(cfg), {}, None
    stages_wanted = supported_stages(cfg) if stages_wanted is None else stages_wanted
    for stage in stages_wanted:
        staged = dataclasses.replace(cfg, zero=dataclasses.replace(cfg.zero, stage=stage))
        engine, compiled = compile_step(staged, measured_only=True)
        stages[str(stage)] = stage_report(staged, engine, compiled, params)
        stages[str(stage)]["peak_bytes"] = peak_bytes(stages[str(stage)])
    doc = {"params": params, "devices": engine.mesh.shape[DATA], "mesh": dict(engine.mesh.shape),
           "family": cfg.model.family, "schedule": cfg.zero.schedule, "regime": regime(cfg, engine),
           "flops_per_token": model_flops_per_token(cfg), "stages": stages,
           "plan": engine.plan.rows()}  # of the last stage analyzed
    if budget_gb is not None:
        doc["fits"] = {"budget_bytes": budget_gb * 1e9,
                       "stages": {str(s): largest_fitting(cfg, s, budget_gb * 1e9) for s in stages_wanted}}
    return doc


def stage_report(cfg, engine, compiled, params: int) -> dict:
    stage, n, z = engine.plan.stage, engine.mesh.shape[DATA], cfg.zero
    comm = collective_bytes(compiled.as_text(), engine.mesh.devices.size)
    # b_g and b_r as XLA communicates them (the CPU backend moves bf16 as f32), else the policy's.
    b_g = DTYPE_BYTES.get(comm["dtypes"].get("all-gather"), engine.policy.gather.itemsize)
    if quant.is_quantized(engine.policy.gather):  # payload and scales in one byte buffer
        b_g *= quant.bytes_per_element(engine.policy.quant_block, engine.policy.quant_scale)
    b_r = DTYPE_BYTES.get(comm["dtypes"].get("reduce-scatter", comm["dtypes"].get("all-reduce")),
                          engine.policy.reduce.itemsize)
    explicit = z.schedule == "shard_map"
    leaves = jax.tree.leaves(engine.plan.leaves)
    trained = sum(math.prod(leaf.shape) for leaf in leaves if not leaf.frozen)
    b_f, ema = jnp.dtype(cfg.precision.frozen).itemsize, cfg.optim.ema > 0
    frozen = {} if trained == params else {
        "trainable": trained, "frozen_bytes_per_param": b_f,
        # What the step keeps between steps: the frozen leaves as stored (b_f·Ψ_f, /N at stage 3)
        # and the trained leaves' fp32 master, m and v (12·Ψ_t, /N at stages 1-3), and an EMA (4·Ψ_t).
        "state_formula_bytes": b_f * (params - trained) / (n if stage == 3 else 1)
        + (12 + EMA_BYTES * ema) * trained / (n if stage else 1),
        "state_bytes": state_bytes(engine.plan, ema),
    }
    return {
        **measure_memory(compiled),
        "formula_bytes": model_state_bytes(stage, params, n, trained=trained, frozen_bytes=b_f, ema=ema),
        "unsharded_bytes": engine.plan.unsharded_bytes() if stage else 0,
        **frozen,
        # zero.offload: what the formula moves to the host (12·Ψ_t (+ the EMA's 4·Ψ_t) or 8·Ψ_t, /N at stages 1-3)
        **({"offload": z.offload, "host_formula_bytes": host_state_bytes(stage, trained, n, 12, z.offload, ema)}
           if z.offload != "none" else {}),
        "schedule": z.schedule, "remat": cfg.model.remat, "prefetch": z.prefetch,
        "comm_bytes": sum(comm["bytes"].values()),
        "comm_theory_bytes": comm_theory_bytes(stage, params, n, b_g, b_r, z.reshard_after_forward, trained,
                                               cfg.train.grad_accum,
                                               outer_gathered_once(cfg, engine) if explicit and stage == 3 else 0),
        "comm": comm["bytes"], "comm_counts": comm["counts"], "comm_dtypes": comm["dtypes"],
        "gather_bytes_per_element": b_g, **quantized_gather(engine.policy, comm["dtypes"].get("all-gather")),
        **({"transient_estimate": transient_estimate(cfg, engine, b_g, b_r)} if stage == 3 and explicit else {}),
    }


def quantized_gather(policy, moved: str | None) -> dict:
    """What a block-quantized gather sends, for the report (nothing for an unquantized one)."""
    if not quant.is_quantized(policy.gather):
        return {}
    name = policy.gather.name
    scale = jnp.dtype(policy.quant_scale).name
    note = (f"{name} payload and {scale} scales (one per block of <= {policy.quant_block} elements) travel as one "
            f"byte buffer, moved as {moved}")
    if name != "int8":  # the CPU backend's fp8 collectives are f16 (DESIGN §8): say why bytes travel
        note += "; an fp8-typed all-gather would be moved as f16 by XLA's CPU backend (2 bytes per element)"
    return {"gather_quantized": {"format": name, "quant_block": policy.quant_block, "scale": scale,
                                 "moved_as": moved, "note": note}}


def state_bytes(plan, ema: bool = False) -> int:
    """Per-device bytes of the state a step keeps, from the plan: per leaf its stored copy, and for
    trained leaves two fp32 Adam moments beside it (and an EMA, with `ema`), divided by N where
    the leaf is sharded."""
    total = 0
    for leaf in jax.tree.leaves(plan.leaves):
        per_copy = math.prod(leaf.stored) * leaf.itemsize
        sharded = leaf.dim is not None and (plan.layout.master or leaf.frozen)
        total += per_copy * (1 if leaf.frozen else 3 + ema) // (plan.data_size if sharded else 1)
    return total


def scaled(cfg, factor: float):
    """`cfg` with depth and width both multiplied by `factor` (widths rounded to 8 x heads)."""
    m, quantum = cfg.model, 8 * cfg.model.n_heads
    d_model = max(quantum, round(m.d_model * factor / quantum) * quantum)
    model = dataclasses.replace(m, d_model=d_model, d_ff=max(8, round(m.d_ff * d_model / m.d_model)),
                                n_layers=max(1, round(m.n_layers * factor)))
    return dataclasses.replace(cfg, model=model)


def largest_fitting(cfg, stage: int, budget_bytes: float, max_steps: int = 12) -> dict | None:
    """The largest depth x width scaling of `cfg` whose compiled step's peak fits `budget_bytes`
    per device under `stage`: factors 2^(k/3) (about 2x the parameters per step), compile only."""
    best = None
    for k in range(max_steps):
        trial = scaled(dataclasses.replace(cfg, zero=dataclasses.replace(cfg.zero, stage=stage)), 2 ** (k / 3))
        _, compiled = compile_step(trial, measured_only=True)
        peak = peak_bytes(measure_memory(compiled))
        if peak > budget_bytes:
            break
        best = {"scale": round(2 ** (k / 3), 3), "d_model": trial.model.d_model, "d_ff": trial.model.d_ff,
                "n_layers": trial.model.n_layers, "params": count_params(trial), "peak_bytes": peak}
    return best


def model_flops_per_token(cfg) -> float:
    """Training FLOPs per token for MFU: the model's own `flops_per_token(seq_len)` where it has
    one (GPT, Llama: PaLM's formula), else 3x the forward's FLOPs in XLA's cost analysis of the
    traced loss (forward + backward ≈ 3 forwards), per token of the batch."""
    policy = Policy()
    model = model_lib.abstract_model(cfg.model, policy)
    if callable(getattr(model, "flops_per_token", None)):
        return float(model.flops_per_token(cfg.model.seq_len))
    units = protocol.Units.of(model)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    batch = step_lib.batch_shape(cfg, rows=1)
    cost = jax.jit(lambda p, b: protocol.forward(units, p, b)[0]).lower(params, batch).cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return 3 * float(cost["flops"]) / cfg.model.seq_len


def outer_gathered_once(cfg, engine) -> int:
    """Parameters of the outer unit that only `enter` (with the glue) or only `exit` reads: the
    explicit schedule gathers them once per microbatch, not twice (schedules/outer.py)."""
    split = UnitPasses(engine.units, engine.plan, engine.policy, None, 1).split(step_lib.batch_shape(cfg))
    plans = engine.units.outer_of(engine.plan.leaves)
    flags = zip(jax.tree.leaves(plans), jax.tree.leaves(split.front), jax.tree.leaves(split.back))
    return sum(math.prod(p.shape) for p, front, back in flags if front != back)
