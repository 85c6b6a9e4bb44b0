"""Accounting: what the design promises per device (docs/design.md §2), and what XLA measures.

Model states for mixed-precision Adam with Ψ parameters, N devices on the `data` axis and K
bytes of optimizer state per parameter (fp32 master + m + v: K = 12), Rajbhandari et al. 2019,
section 5:
    stage 0  (2 + 2 + K)·Ψ          stage 2  2·Ψ + (2 + K)·Ψ/N
    stage 1  (2 + 2)·Ψ + K·Ψ/N      stage 3  (2 + 2 + K)·Ψ/N
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
from flax import nnx

from zerojax import mesh as mesh_lib
from zerojax import step as step_lib
from zerojax import quant
from zerojax.config import QUANTIZED_GATHERS, ConfigError
from zerojax.mesh import DATA
from zerojax.models.protocol import REMAT_POLICIES

STAGES = (0, 1, 2, 3)
ALIASES = {0: "NO_SHARD (DDP)", 1: "-", 2: "SHARD_GRAD_OP", 3: "FULL_SHARD"}
FORMULAS = {0: "(2 + 2 + K)·Ψ", 1: "(2 + 2)·Ψ + K·Ψ/N", 2: "2·Ψ + (2 + K)·Ψ/N", 3: "(2 + 2 + K)·Ψ/N"}


def model_state_bytes(stage: int, params: float, devices: int, k: float = 12, trained: float | None = None,
                      frozen_bytes: float = 2) -> float:
    """Per-device bytes of model states under ZeRO `stage` (2-byte params and grads, K-byte Adam).

    With `trained` < `params` (frozen leaves, a LoRA base), only the trained Ψ_t pay the formula;
    the frozen Ψ_f = Ψ - Ψ_t are stored once, `frozen_bytes` each (no gradient, no master, no
    moments), sharded where the stage shards weights: b_f·Ψ_f at stages 0-2, b_f·Ψ_f/N at 3."""
    trained = params if trained is None else trained
    if devices < 1 or params < 0 or k < 0 or not 0 <= trained <= params:
        raise ConfigError(f"need params >= 0, devices >= 1, k >= 0 and 0 <= trainable <= params, got "
                          f"{params}, {devices}, {k}, {trained}")
    psi, n, frozen = trained, devices, params - trained
    states = {0: (2 + 2 + k) * psi, 1: (2 + 2) * psi + k * psi / n,
              2: 2 * psi + (2 + k) * psi / n, 3: (2 + 2 + k) * psi / n}[stage]
    return states + frozen_bytes * frozen / (n if stage == 3 else 1)


def host_state_bytes(stage: int, trained: float, devices: int, k: float = 12, offload: str = "none") -> float:
    """Per-device bytes `zero.offload` moves to host memory: Adam's m and v (K - 4 bytes per
    trained parameter: the fp32 master stays) or all K (the master too), sharded at stages 1-3."""
    moved = {"none": 0, "optimizer": max(k - 4, 0), "optimizer+master": k}[offload]
    return moved * trained / (devices if stage else 1)


def memory_report(params: float, devices: int, k: float = 12, trained: float | None = None,
                  frozen_bytes: float = 2, offload: str = "none") -> dict:
    """The `zerojax memory --json` document (docs/design.md §4): `stages` is what each device
    holds; with `offload`, `host_stages` what its host holds for it."""
    psi_t = params if trained is None else trained
    host = {str(s): host_state_bytes(s, psi_t, devices, k, offload) for s in STAGES}
    doc = {"params": params, "devices": devices, "k": k,
           "stages": {str(s): model_state_bytes(s, params, devices, k, trained, frozen_bytes) - host[str(s)]
                      for s in STAGES}}
    if trained is not None and trained != params:
        doc.update(trainable=trained, frozen_bytes_per_param=frozen_bytes)
    if offload != "none":
        doc.update(offload=offload, host_stages=host)
    return doc


def param_counts(cfg) -> tuple[int, int]:
    """(Ψ, Ψ_t) of a config's model from abstract shapes (nothing is allocated): every parameter
    (LoRA's adapters included), and those it trains (all but optim.freeze's and a LoRA base)."""
    from zerojax.models import protocol
    from zerojax.precision import Policy

    model = step_lib.abstract_model(cfg.model, Policy(), cfg.train.seed, cfg.optim.lora)
    leaves = jax.tree.leaves(step_lib.param_plan(cfg, model, protocol.check(model), 0, 1).leaves)
    return (sum(math.prod(leaf.shape) for leaf in leaves),
            sum(math.prod(leaf.shape) for leaf in leaves if not leaf.frozen))


def count_params(cfg) -> int:
    """Ψ of a config's model."""
    return param_counts(cfg)[0]


def compile_step(cfg):
    """The compiled train step of `cfg` and its Step, from abstract inputs (nothing allocated)."""
    step = step_lib.make_step(cfg, mesh_lib.make_mesh(cfg.mesh))
    state = step_lib.init_state(step, abstract=True)
    shape = step_lib.batch_shape(cfg)
    batch = jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=mesh_lib.batch_sharding(step.mesh))
    return step, step_lib.make_train_step(step, state).lower(state, batch).compile()


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


HOST_MEMORY_SPACE = 5  # XLA's memory space of pinned host memory: `S(5)` in a layout
_ARGUMENT = re.compile(r"(\w+)\[([\d,]*)\](?:\{([^}]*)\})?")


def argument_bytes_by_memory(hlo_text: str, outputs: bool = False) -> dict:
    """Per-device bytes of the compiled program's parameters (or results), by the memory space
    their layout names in the module's entry_computation_layout (`{1,0:S(5)}`: host; none: device)."""
    start = hlo_text.find("entry_computation_layout={")
    if start < 0:
        raise ValueError("no entry_computation_layout in the compiled HLO module")
    depth, at = 0, start + len("entry_computation_layout=")
    for end in range(at, len(hlo_text)):  # to the brace that closes the layout
        depth += {"{": 1, "}": -1}.get(hlo_text[end], 0)
        if depth == 0:
            break
    params, _, results = hlo_text[at + 1 : end].partition(")->")
    out = {"device": 0, "host": 0}
    for element, dims, layout in _ARGUMENT.findall(results if outputs else params):
        if element not in DTYPE_BYTES:
            continue
        space = re.search(r"S\((\d+)\)", layout or "")
        where = "host" if space and int(space.group(1)) == HOST_MEMORY_SPACE else "device"
        out[where] += DTYPE_BYTES[element] * math.prod(int(d) for d in dims.split(",") if d)
    return out


def supported_stages(cfg) -> tuple[int, ...]:
    """The stages `cfg` can be compiled at: a quantized gather needs a gather (stages 1-3)."""
    return STAGES[1:] if cfg.precision.gather in QUANTIZED_GATHERS else STAGES


def analyze(cfg, stages_wanted=None, budget_gb: float | None = None) -> dict:
    """The `zerojax analyze --json` document: per stage (default: every stage `cfg` supports),
    measured bytes next to the formulas, and with a budget the largest scaling of the model
    that fits per device."""
    params, stages, step = count_params(cfg), {}, None
    stages_wanted = supported_stages(cfg) if stages_wanted is None else stages_wanted
    for stage in stages_wanted:
        staged = dataclasses.replace(cfg, zero=dataclasses.replace(cfg.zero, stage=stage))
        step, compiled = compile_step(staged)
        stages[str(stage)] = stage_report(staged, step, compiled, params)
        stages[str(stage)]["peak_bytes"] = peak_bytes(stages[str(stage)])
    doc = {"params": params, "devices": step.mesh.shape[DATA], "mesh": dict(step.mesh.shape),
           "family": cfg.model.family, "schedule": cfg.zero.schedule, "regime": regime(cfg, step),
           "flops_per_token": model_flops_per_token(cfg), "stages": stages,
           "plan": step.plan.rows()}  # of the last stage analyzed
    if budget_gb is not None:
        doc["fits"] = {"budget_bytes": budget_gb * 1e9,
                       "stages": {str(s): largest_fitting(cfg, s, budget_gb * 1e9) for s in stages_wanted}}
    return doc


def stage_report(cfg, step, compiled, params: int) -> dict:
    stage, n, z = step.plan.stage, step.mesh.shape[DATA], cfg.zero
    comm = collective_bytes(compiled.as_text(), step.mesh.devices.size)
    # b_g and b_r as XLA communicates them (the CPU backend moves bf16 as f32), else the policy's.
    b_g = DTYPE_BYTES.get(comm["dtypes"].get("all-gather"), step.policy.gather.itemsize)
    if quant.is_quantized(step.policy.gather):  # payload and scales in one byte buffer
        b_g *= quant.bytes_per_element(step.policy.quant_block, step.policy.quant_scale)
    b_r = DTYPE_BYTES.get(comm["dtypes"].get("reduce-scatter", comm["dtypes"].get("all-reduce")),
                          step.policy.reduce.itemsize)
    explicit = z.schedule == "shard_map"
    leaves = jax.tree.leaves(step.plan.leaves)
    trained = sum(math.prod(leaf.shape) for leaf in leaves if not leaf.frozen)
    b_f = jnp.dtype(cfg.precision.frozen).itemsize
    frozen = {} if trained == params else {
        "trainable": trained, "frozen_bytes_per_param": b_f,
        # What the step keeps between steps: the frozen leaves as stored (b_f·Ψ_f, /N at stage 3)
        # and the trained leaves' fp32 master, m and v (12·Ψ_t, /N at stages 1-3).
        "state_formula_bytes": b_f * (params - trained) / (n if stage == 3 else 1) + 12 * trained / (n if stage else 1),
        "state_bytes": state_bytes(step.plan),
    }
    return {
        **measure_memory(compiled),
        "formula_bytes": model_state_bytes(stage, params, n, trained=trained, frozen_bytes=b_f),
        "unsharded_bytes": step.plan.unsharded_bytes() if stage else 0,
        **frozen,
        # zero.offload: what the formula moves to the host (12·Ψ_t or 8·Ψ_t, /N at stages 1-3)
        **({"offload": z.offload, "host_formula_bytes": host_state_bytes(stage, trained, n, 12, z.offload)}
           if z.offload != "none" else {}),
        "schedule": z.schedule, "remat": cfg.model.remat, "prefetch": z.prefetch,
        "comm_bytes": sum(comm["bytes"].values()),
        "comm_theory_bytes": comm_theory_bytes(stage, params, n, b_g, b_r, z.reshard_after_forward, trained,
                                               cfg.train.grad_accum),
        "comm": comm["bytes"], "comm_counts": comm["counts"], "comm_dtypes": comm["dtypes"],
        "gather_bytes_per_element": b_g, **quantized_gather(step.policy, comm["dtypes"].get("all-gather")),
        **({"transient_estimate": transient_estimate(cfg, step, b_g, b_r)} if stage == 3 and explicit else {}),
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


# ---------------------------------------------------------------------------------------------
# What a model's units hold and do, traced from the model itself on abstract values.


def local_rows(cfg, step) -> int:
    """Rows of one microbatch on one device."""
    return cfg.train.global_batch // cfg.train.grad_accum // step.mesh.devices.size


def unit_params(step, name: str | None, dtype):
    """Abstract parameters (true shapes) of the outer unit (None) or of one layer of a stack."""
    if name is None:
        return jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, dtype), step.units.outer_of(step.plan.leaves))
    return jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape[1:], dtype), step.plan.leaves[name])


def unit_size(step, name: str | None) -> int:
    """Parameters in the outer unit (None) or in one layer of stack `name`."""
    return sum(math.prod(p.shape) for p in jax.tree.leaves(unit_params(step, name, jnp.float32)))


def stack_inputs(cfg, step, rows: int) -> dict:
    """Per stack, the (abstract) activations a layer takes, for `rows` rows on one device."""
    units, compute = step.units, step.policy.compute
    shape = step_lib.batch_shape(cfg)
    batch = jax.ShapeDtypeStruct((rows,) + shape.shape[1:], shape.dtype)

    def trace(outer, batch):
        x, xs = units.enter(outer, batch), {}
        for k, name in enumerate(units.names):
            x = units.between(outer, name, x, batch) if k else x
            xs[name] = x  # a block keeps its input's shapes: the next stack's glue takes the same
        return xs

    return jax.eval_shape(trace, unit_params(step, None, compute), batch)


def nbytes(tree) -> int:
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def compiled_temp(fn, *args) -> int:
    """XLA's temporary bytes for `fn` on one device: a unit's working set, measured."""
    return int(jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes)


def transient_estimate(cfg, step, b_gather: int, b_reduce: int) -> dict:
    """Stage 3 under the explicit schedule: what its temporaries should be made of, per device,
    from the model's own units (an estimate to read next to XLA's measured temp_bytes)."""
    rows, units, compute = local_rows(cfg, step), step.units, step.policy.compute
    xs = stack_inputs(cfg, step, rows)
    depth = {name: jax.tree.leaves(step.plan.leaves[name])[0].shape[0] for name in units.names}
    layer = max(unit_size(step, name) for name in units.names)
    shape = step_lib.batch_shape(cfg)
    batch = jax.ShapeDtypeStruct((rows,) + shape.shape[1:], shape.dtype)

    def block_vjp(name):
        return lambda w, x: jax.vjp(lambda w, x: units.block(name, w, x), w, x)[1](x)

    exit_grad = jax.grad(lambda w, x, batch: units.exit(w, x, batch)[0], argnums=(0, 1))
    last = units.names[-1]
    # One block's backward working set, or the loss's: XLA never holds both at once.
    work = max([compiled_temp(block_vjp(name), unit_params(step, name, compute), xs[name]) for name in units.names]
               + [compiled_temp(exit_grad, unit_params(step, None, compute), xs[last], batch)])
    saved = sum(depth[name] * saved_per_block(cfg, step, name, xs[name]) for name in units.names)
    keep_outer = 0 if cfg.zero.reshard_after_forward else unit_size(step, None)
    if quant.is_quantized(step.policy.gather):  # a unit arrives as bytes, then is dequantized
        b_gather += step.policy.compute.itemsize
    return {
        "activations": saved + work,  # what the blocks keep, plus one block's or the loss's working set
        # in the backward: the unit and its prefetched successors (and, kept from the forward
        # with reshard_after_forward=false, the outer unit)
        "gathered_units": round(((1 + cfg.zero.prefetch) * layer + keep_outer) * b_gather),
        "unit_gradient": 2 * layer * b_reduce,  # the unit's gradient and its flat layout
        # the fp32 gradient shards of the trained leaves, alive from the backward until the in-place Adam update
        "optimizer": 4 * sum(math.prod(x.stored) for x in jax.tree.leaves(step.plan.trained_leaves)) // step.plan.data_size,
    }


def saved_per_block(cfg, step, name: str, x) -> int:
    """Bytes one layer of stack `name` keeps for its backward under `model.remat` in the explicit
    schedule: its input (full), or its vjp's residuals without the weights (dots, none), traced
    from the block itself on abstract values."""
    from zerojax import fsdp

    if cfg.model.remat == "full":
        return nbytes(x)
    w = unit_params(step, name, step.policy.compute)
    apply = lambda w, x: step.units.block(name, w, x)
    frozen = step.plan.frozen[name]
    residuals = jax.eval_shape(
        lambda w, x: fsdp.block_residuals(apply, REMAT_POLICIES[cfg.model.remat], w, frozen, x)[1], w, x)
    return nbytes(residuals)


def regime(cfg, step) -> dict:
    """Which bytes a unit should move: its weights (ZeRO-3) or its activations.

    Per unit and step, ZeRO-3 sends about 3 x its weights (two gathers and a reduce-scatter).
    Moving activations instead (tensor-parallel style, which GSPMD may pick on its own) sends
    about 3 passes x 4 matmul inputs x the data group's activations. With few tokens per device
    the second is smaller, and ZeRO-3 is the wrong schedule for that shape."""
    rows = local_rows(cfg, step)
    xs = stack_inputs(cfg, step, rows)
    name = max(step.units.names, key=lambda n: unit_size(step, n))  # the largest unit decides
    policy = step.policy
    b_g = (quant.bytes_per_element(policy.quant_block, policy.quant_scale) if quant.is_quantized(policy.gather)
           else policy.gather.itemsize)
    weight_bytes = round(3 * unit_size(step, name) * b_g)
    x_elements = sum(x.size for x in jax.tree.leaves(xs[name]))
    activation_bytes = 3 * 4 * step.mesh.shape[DATA] * x_elements * step.policy.compute.itemsize
    tokens = rows * cfg.model.seq_len
    moving_weights = weight_bytes <= activation_bytes
    return {"unit_weight_bytes": weight_bytes, "unit_activation_bytes": activation_bytes,
            "tokens_per_device": tokens,
            "regime": "weight-gathering" if moving_weights else "activation-moving",
            "advice": (f"ZeRO-3 / FSDP is the right schedule: a unit's weights ({weight_bytes:,} B per step) "
                       f"move fewer bytes than its activations would ({activation_bytes:,} B)")
            if moving_weights else
            (f"few tokens per device ({tokens}): moving a unit's activations ({activation_bytes:,} B per step) "
             f"sends less than gathering its weights ({weight_bytes:,} B); tensor parallelism (or GSPMD's own "
             "choice, zero.schedule=gspmd) fits this shape better, or raise train.global_batch")}


# ---------------------------------------------------------------------------------------------
# Communication: bytes each device sends per step, read from the optimized HLO.

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2,
               "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_OP = re.compile(r"=\s*(\(.*?\)|[\w]+\[[\d,]*\](?:\{[^}]*\})?)\s+(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"(?:branch_computations|called_computations)=\{([^}]*)\}")
_TRIP = re.compile(r'known_trip_count"?\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')


def _shape_bytes(text: str) -> tuple[int, str]:
    """Bytes of an HLO shape (tuples summed) and its (first) element type."""
    total, dtype = 0, None
    for element, dims in _SHAPE.findall(text):
        if element in DTYPE_BYTES:
            total += DTYPE_BYTES[element] * math.prod(int(d) for d in dims.split(",") if d)
            dtype = dtype or element
    return total, dtype


def _group_size(line: str, n_devices: int) -> int:
    """Devices per replica group, in each syntax XLA prints."""
    if m := re.search(r"replica_groups=\{\{([\d,]*)\}", line):
        return len(m.group(1).split(","))
    if m := re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line):
        return int(m.group(2))
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line):
        sizes = dict(re.findall(r"'?(\w+)'?=(\d+)", m.group(1)))
        return math.prod(int(sizes[a.strip(" '")]) for a in m.group(2).split(",") if a.strip(" '"))
    return n_devices  # replica_groups={} or absent: every device


def _sent_bytes(kind: str, result_bytes: int, group: int) -> float:
    """Ring algorithms: what one device sends (docs/design.md §2)."""
    g = (group - 1) / group
    if kind == "all-gather":
        return g * result_bytes
    if kind == "reduce-scatter":
        return (group - 1) * result_bytes  # the operand is `group` times the result
    if kind == "all-reduce":
        return 2 * g * result_bytes
    if kind == "all-to-all":
        return g * result_bytes
    return result_bytes  # collective-permute: the whole buffer


@dataclass
class Hlo:
    """The parts of an optimized HLO module that accounting needs."""

    entry: str = ""
    ops: dict = field(default_factory=dict)  # computation -> [(kind, bytes sent, dtype)]
    calls: dict = field(default_factory=dict)  # computation -> [(callee, times, is_loop_body)]
    loop_results: list = field(default_factory=list)  # result shape text of every while loop


def parse_hlo(hlo: str, n_devices: int) -> Hlo:
    out, current = Hlo(), None
    for line in hlo.splitlines():
        if not line.startswith(" ") and (m := _COMPUTATION.match(line.strip())):
            current = m.group(1)
            out.ops[current], out.calls[current] = [], []
            out.entry = current if line.startswith("ENTRY") else out.entry
            continue
        if current is None:
            continue
        if m := _OP.search(line):
            nbytes, dtype = _shape_bytes(m.group(1))
            if m.group(3) and m.group(2) != "reduce-scatter":  # async start: (operand, result)
                nbytes //= 2
            out.ops[current].append((m.group(2), _sent_bytes(m.group(2), nbytes, _group_size(line, n_devices)), dtype))
        trip = int(t.group(1)) if (t := _TRIP.search(line)) else 1
        if " while(" in line:
            out.loop_results.append(line.split("=", 1)[1].split(" while(")[0])
        for callee in _CALLS.findall(line):
            body = bool(re.search(rf"body=%?{re.escape(callee)}\b", line))
            out.calls[current].append((callee, trip if body else 1, body))
        for group in _BRANCHES.findall(line):
            out.calls[current] += [(c.strip().lstrip("%"), 1, False) for c in group.split(",") if c.strip()]
    return out


def _walk(hlo: Hlo, name: str, times: int, visit, inside_loop: bool = False):
    for kind, sent, dtype in hlo.ops.get(name, []):
        visit(kind, sent, dtype, times, inside_loop)
    for callee, trip, body in hlo.calls.get(name, []):
        _walk(hlo, callee, times * trip, visit, inside_loop or body)


def collective_bytes(hlo_text: str, n_devices: int) -> dict:
    """Per-device bytes sent by each collective kind in one run of the module, with ops inside
    while loops multiplied by their known trip count; their counts (in and outside loops) and
    the dtypes they move."""
    hlo = parse_hlo(hlo_text, n_devices)
    totals = {kind: 0.0 for kind in COLLECTIVES}
    counts = {kind: 0 for kind in COLLECTIVES}
    outside = {kind: 0 for kind in COLLECTIVES}
    dtypes: dict[str, str] = {}

    def visit(kind, sent, dtype, times, inside_loop):
        totals[kind] += sent * times
        counts[kind] += times
        outside[kind] += 0 if inside_loop else times
        dtypes.setdefault(kind, dtype)

    _walk(hlo, hlo.entry, 1, visit)
    return {"bytes": totals, "counts": counts, "outside_loops": outside, "dtypes": dtypes}


def loop_collectives(hlo_text: str, n_devices: int) -> list[dict]:
    """For each while loop: its trip count and the collectives one iteration issues."""
    hlo = parse_hlo(hlo_text, n_devices)
    loops = []
    for caller, callees in hlo.calls.items():
        for callee, trip, body in callees:
            if body:
                per_iteration = {kind: 0 for kind in COLLECTIVES}
                _walk(hlo, callee, 1, lambda kind, sent, dtype, times, _: per_iteration.__setitem__(
                    kind, per_iteration[kind] + times))
                loops.append({"body": callee, "trip_count": trip, "per_iteration": per_iteration})
    return loops


def comm_theory_bytes(stage: int, params: float, n: int, b_gather: float, b_reduce: float,
                      reshard_after_forward: bool = True, trained: float | None = None, grad_accum: int = 1) -> float:
    """docs/design.md §2: bytes each device sends per step over the data axis (ring, g = (N-1)/N).

    `trained` (Ψ_t, default Ψ): only trained leaves have gradients to reduce; frozen ones are
    gathered at stage 3 and replicated (never sent) below it. With `grad_accum` k microbatches,
    stages 2 and 3 reduce-scatter each microbatch's gradient and stage 3 gathers per microbatch
    (XLA may hoist a unit's gathers out of the microbatch loop where they do not change: the
    outer unit's; then it sends less)."""
    g, t, k = (n - 1) / n, params if trained is None else trained, grad_accum
    if stage == 0:
        return 2 * g * t * b_reduce
    if stage == 1:
        return g * t * (b_reduce + b_gather)
    if stage == 2:
        return g * t * (k * b_reduce + b_gather)
    if not reshard_after_forward:
        return k * g * (params * b_gather + t * b_reduce)
    return k * g * (2 * params * b_gather + t * b_reduce)


def state_bytes(plan) -> int:
    """Per-device bytes of the state a step keeps, from the plan: per leaf its stored copy, and for
    trained leaves two fp32 Adam moments beside it, divided by N where the leaf is sharded."""
    total = 0
    for leaf in jax.tree.leaves(plan.leaves):
        per_copy = math.prod(leaf.stored) * leaf.itemsize
        sharded = leaf.dim is not None and (plan.layout.master or leaf.frozen)
        total += per_copy * (1 if leaf.frozen else 3) // (plan.data_size if sharded else 1)
    return total


def peak_bytes(memory: dict) -> int:
    """Per-device peak of a compiled step: what it reads, makes and returns (donated buffers once).
    Host-memory arguments and results (zero.offload) are not the device's (each host result is
    a donated host argument's buffer: the aliased bytes less those are the device's)."""
    if "device_argument_bytes" not in memory:
        return memory["argument_bytes"] + memory["temp_bytes"] + memory["output_bytes"] - memory["alias_bytes"]
    return (memory["device_argument_bytes"] + memory["temp_bytes"] + memory["device_output_bytes"]
            - (memory["alias_bytes"] - memory["host_output_bytes"]))


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
        _, compiled = compile_step(trial)
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
    policy = step_lib.Policy()
    model = step_lib.abstract_model(cfg.model, policy)
    if callable(getattr(model, "flops_per_token", None)):
        return float(model.flops_per_token(cfg.model.seq_len))
    from zerojax.models import protocol

    units = protocol.Units.of(model)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    shape = step_lib.batch_shape(cfg)
    batch = jax.ShapeDtypeStruct((1,) + shape.shape[1:], shape.dtype)
    cost = jax.jit(lambda p, b: protocol.forward(units, p, b)[0]).lower(params, batch).cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return 3 * float(cost["flops"]) / cfg.model.seq_len


def flops_per_token(params: float, n_layers: int, seq_len: int, d_model: int) -> float:
    """Training FLOPs per token: 6 per parameter (forward + backward) plus attention's
    12·L·T·D (PaLM, Chowdhery et al. 2022, appendix B). Recomputation is not counted (MFU)."""
    return 6 * params + 12 * n_layers * seq_len * d_model
