"""`zerojax plan`: which zero.stage, zero.offload, model.remat, train.grad_accum, precision.gather
and zero.prefetch to train a config with on N devices of a kind, from compiled steps.

The search (docs/design.md §4):
  1. the space: every combination of those six keys that the config's rules allow, the global
     batch kept (the model, data, batch and LoRA/freeze settings are the user's);
  2. formulas order it by estimated step time and drop the candidates whose model states
     alone (docs/design.md §2) exceed the budget;
  3. in that order each candidate's step is compiled for N simulated CPU devices and its peak
     read from XLA (`measure`); a candidate that saves no memory on any key over one that did
     not fit is not compiled (each key's effect on memory is monotone);
  4. the search stops once the next candidate's formula estimate is no faster than the
     fastest fit's compiled estimate. The winner is the fastest compiled fit.

Step times come from the compiled step: its dots' FLOPs and its collectives' bytes (`hlo`),
the state its update reads and writes, the offloaded bytes its host link carries, through a
roofline per device kind (`devices.step_seconds`).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
import jax
from zerojax.config import rules
from zerojax.analysis import hlo, measure
from zerojax.config.devices import GB, Device, step_seconds
from zerojax.analysis.formulas import comm_theory_bytes, host_state_bytes, model_state_bytes, peak_bytes

REMAT_SAVING = {"none": 0, "dots": 1, "full": 2}  # higher keeps less for the backward
REMAT_FLOPS = {"none": 1.0, "dots": 1.0, "full": 4 / 3}  # full recomputes the forward (1 of 3 passes)
MAX_COMPILES = 12  # a bound on the search's cost; the table says when it was reached


@dataclass(frozen=True)
class Candidate:
    stage: int
    offload: str
    remat: str
    grad_accum: int
    gather: str
    prefetch: int

    def overrides(self) -> list[str]:
        return [f"zero.stage={self.stage}", f"zero.offload={self.offload}", f"model.remat={self.remat}",
                f"train.grad_accum={self.grad_accum}", f"precision.gather={self.gather}",
                f"zero.prefetch={self.prefetch}"]

    def apply(self, cfg):
        return dataclasses.replace(
            cfg, zero=dataclasses.replace(cfg.zero, stage=self.stage, offload=self.offload, prefetch=self.prefetch),
            model=dataclasses.replace(cfg.model, remat=self.remat),
            train=dataclasses.replace(cfg.train, grad_accum=self.grad_accum),
            precision=dataclasses.replace(cfg.precision, gather=self.gather))

    def saving(self) -> tuple:
        """Each key's memory saving, larger = less device memory (the partial order of step 3)."""
        return (self.stage, rules.OFFLOADS.index(self.offload), REMAT_SAVING[self.remat], self.grad_accum,
                int(self.gather in rules.QUANTIZED_GATHERS), -self.prefetch)

    def needs_no_less_than(self, other: Candidate) -> bool:
        return all(a <= b for a, b in zip(self.saving(), other.saving()))


def space(cfg, dp: int) -> list[Candidate]:
    """Every candidate `cfg`'s rules allow on `dp` data-parallel devices."""
    rows = cfg.train.global_batch
    accums = [k for k in range(1, rows + 1) if rows % (k * dp) == 0]
    # the gather dtype and the prefetch depth shape the collectives, of which one device has none:
    # there the user's are kept (int8 would only cost the weights precision), not compiled again
    gathers = dict.fromkeys((cfg.precision.gather, "int8")) if dp > 1 else (cfg.precision.gather,)
    out = []
    for stage, offload, remat, accum, gather in itertools.product(rules.STAGES, rules.OFFLOADS, rules.REMATS,
                                                                 accums, gathers):
        if stage not in rules.gather_stages(gather, cfg.zero.schedule):
            continue
        if offload != "none" and cfg.zero.schedule != "shard_map":
            continue
        prefetches = dict.fromkeys((cfg.zero.prefetch, 0)) if stage == 3 and dp > 1 else (cfg.zero.prefetch,)
        out += [Candidate(stage, offload, remat, accum, gather, p) for p in prefetches]
    return out


@dataclass(frozen=True)
class Target:
    """What the plan is for: N devices of a kind, over `hosts` hosts, and the bytes a step may peak at."""

    device: Device
    devices: int
    budget_bytes: float
    hosts: int = 1


def for_target(cfg, target: Target):
    """`cfg` as the target runs it: one group of N devices, and bf16 compute where `auto` would
    pick it on the accelerator (on the CPU it would mean float32)."""
    n = target.devices
    precision = cfg.precision
    if precision.compute == "auto":
        precision = dataclasses.replace(precision, compute="bfloat16")
    return dataclasses.replace(cfg, precision=precision,
                               mesh=dataclasses.replace(cfg.mesh, cpu_devices=max(n, cfg.mesh.cpu_devices),
                                                        replica=1, data=n))


def formula_estimate(cfg, cand: Candidate, counts: tuple, flops_per_token: float, target: Target) -> dict:
    """The formulas' model states and step time of a candidate, for ordering and pruning."""
    params, trained = counts
    n, b_f = target.devices, 2 if cfg.precision.frozen != "float32" else 4
    b_g = 1 + 4 / cfg.zero.quant_block if cand.gather in rules.QUANTIZED_GATHERS else 2
    b_r = 4 if cfg.precision.reduce == "float32" else 2
    host = host_state_bytes(cand.stage, trained, n, 12, cand.offload, cfg.optim.ema > 0)
    states = model_state_bytes(cand.stage, params, n, trained=trained, frozen_bytes=b_f, ema=cfg.optim.ema > 0) - host
    flops = flops_per_token * cfg.train.global_batch * cfg.model.seq_len / n * REMAT_FLOPS[cand.remat]
    comm = comm_theory_bytes(cand.stage, params, n, b_g, b_r, cfg.zero.reshard_after_forward, trained, cand.grad_accum)
    time = step_seconds(target.device, flops, comm, 2 * states, 2 * host, overlaps(cfg, cand), target.hosts)
    return {"state_bytes": states, **time}


def overlaps(cfg, cand: Candidate) -> bool:
    """The explicit unit schedule with prefetch issues collectives beside another unit's compute."""
    return cfg.zero.schedule == "shard_map" and cand.prefetch >= 1


_MEASURED: dict = {}  # config -> what its compiled step measured: a second plan of it compiles nothing


def measured(cfg, devices: int) -> tuple[dict, float, dict]:
    """(memory, dot FLOPs, collectives) of `cfg`'s compiled step per device."""
    if cfg not in _MEASURED:
        _, compiled = measure.compile_step(cfg, measured_only=True)
        text = compiled.as_text()
        _MEASURED[cfg] = measure.measure_memory(compiled), hlo.dot_flops(text), hlo.collective_bytes(text, devices)
    return _MEASURED[cfg]


def compiled_estimate(cfg, cand: Candidate, flops_per_token: float, target: Target) -> dict:
    """Compile the candidate's step; its peak per device and its estimated step time."""
    memory, flops, comm = measured(cand.apply(cfg), target.devices)
    time = step_seconds(target.device, flops, device_comm_bytes(comm, cfg, cand),
                        memory["device_argument_bytes"] + memory["device_output_bytes"],
                        memory["host_argument_bytes"] + memory["host_output_bytes"], overlaps(cfg, cand), target.hosts)
    tokens_per_sec = cfg.train.global_batch * cfg.model.seq_len / time["step_s"]
    return {"peak_bytes": peak_bytes(memory), "flops": flops, **time, "tokens_per_sec": tokens_per_sec,
            "mfu": flops_per_token * tokens_per_sec / (target.devices * target.device.peak_flops)}


def device_comm_bytes(comm: dict, cfg, cand: Candidate) -> float:
    """Bytes sent, as the accelerator sends them: XLA's CPU backend moves 2-byte collectives as
    f32 (docs/design.md §8), so those of a bf16 gather or reduce count half."""
    wanted = {"all-gather": 2 if cand.gather not in rules.QUANTIZED_GATHERS else None,
              "reduce-scatter": 4 if cfg.precision.reduce == "float32" else 2}
    wanted["all-reduce"] = wanted["reduce-scatter"]
    total = 0.0
    for kind, sent in comm["bytes"].items():
        moved = hlo.DTYPE_BYTES.get(comm["dtypes"].get(kind), 0)
        want = wanted.get(kind)
        total += sent * want / moved if want and moved == 4 and want < moved else sent
    return total


def search(cfg, target: Target, log=lambda message: None, max_compiles: int = MAX_COMPILES) -> dict:
    """The plan document (`zerojax plan --json`): the winner, every candidate, the budget."""
    cfg = for_target(cfg, target)
    counts, flops_per_token = measure.param_counts(cfg), measure.model_flops_per_token(cfg)
    rows = []
    for cand in space(cfg, target.devices):
        est = formula_estimate(cfg, cand, counts, flops_per_token, target)
        rows.append({"candidate": cand, "formula": est, "step_s": est["step_s"], "fits": False, "peak_bytes": None})
    rows.sort(key=lambda r: (r["step_s"], tuple(-s for s in r["candidate"].saving())))
    best, failed, compiles = None, [], 0
    # The candidate that saves the most on every key first: if it does not fit, nothing does.
    floor = max(rows, key=lambda r: r["candidate"].saving())
    for row in [floor] + [r for r in rows if r is not floor]:
        cand = row["candidate"]
        if row["formula"]["state_bytes"] > target.budget_bytes:
            row["why"] = f"its model states alone are {row['formula']['state_bytes'] / GB:.1f} GB (formula)"
        elif best and row["step_s"] >= best["step_s"]:
            row["why"] = "not compiled: the formulas estimate it no faster than the winner"
        elif (worse := next((f for f in failed if cand.needs_no_less_than(f["candidate"])), None)):
            row["why"] = (f"not compiled: it saves no memory over {' '.join(worse['candidate'].overrides())}, "
                          f"which peaked at {worse['peak_bytes'] / GB:.1f} GB")
        elif compiles >= max_compiles:
            row["why"] = f"not compiled: the search stops after {max_compiles} compiles"
        else:
            compiles += 1
            log(f"checking {' '.join(cand.overrides())}")
            row.update(compiled_estimate(cfg, cand, flops_per_token, target), compiled=True)
            row["fits"] = row["peak_bytes"] <= target.budget_bytes
            if row["fits"] and (best is None or row["step_s"] < best["step_s"]):
                best = row
            elif not row["fits"]:
                row["why"] = f"compiled peak {row['peak_bytes'] / GB:.1f} GB"
                failed.append(row)
    return document(cfg, target, rows, best, compiles)


def document(cfg, target: Target, rows: list, best: dict | None, compiles: int) -> dict:
    def public(row):
        out = {"overrides": row["candidate"].overrides(), "fits": row["fits"], "peak_bytes": row["peak_bytes"],
               "step_s": row["step_s"], "compiled": bool(row.get("compiled"))}
        out.update({k: row[k] for k in ("tokens_per_sec", "mfu", "compute_s", "comm_s", "update_s", "host_s")
                    if k in row and row.get("compiled")})
        return out | ({"why": row["why"]} if "why" in row else {})

    doc = {"config": cfg.name, "device": target.device.name, "devices": target.devices, "hosts": target.hosts,
           "budget_bytes": target.budget_bytes, "compiles": compiles,
           "winner": public(best) if best else None, "candidates": [public(r) for r in rows]}
    if best is None:
        doc["nothing_fits"] = what_would_fit(cfg, target, rows) | lora_that_fits(cfg, target, rows)
    return doc


def what_would_fit(cfg, target: Target, rows: list) -> dict:
    """When nothing fits: the smallest compiled peak, and the fewest devices of this kind at
    which its sharded model states (formula) would leave it within the budget."""
    compiled = [r for r in rows if r.get("compiled")]
    if not compiled:
        least = min(rows, key=lambda r: r["formula"]["state_bytes"])
        return {"smallest_peak_bytes": None, "smallest_state_bytes": least["formula"]["state_bytes"],
                "overrides": least["candidate"].overrides(), "devices": None}
    least = min(compiled, key=lambda r: r["peak_bytes"])
    cand, n = least["candidate"], target.devices
    states = least["formula"]["state_bytes"]
    shard = states if cand.stage == 3 else 0  # what divides by N: stage 3's states, all of them
    rest = least["peak_bytes"] - shard
    devices = next((m for m in range(n + 1, 100 * n + 1) if cfg.train.global_batch % m == 0
                    and rest + shard * n / m <= target.budget_bytes), None) if shard else None
    return {"smallest_peak_bytes": least["peak_bytes"], "overrides": cand.overrides(), "devices": devices}


LORA_RANKS = (4, 16)  # tried when a full fine-tune fits nowhere: the smallest first (if it does not fit, none does)


def lora_that_fits(cfg, target: Target, rows: list) -> dict:
    """When a full fine-tune fits nowhere: the largest rank of LORA_RANKS (adapters on
    optim.lora.targets, a frozen base) at which the least-memory compiled candidate fits,
    compiled; {"lora": None, "lora_why": ...} where none does. (No formula prunes this: a frozen
    base also drops the weight gradients' temporaries, more than its model states say.)"""
    compiled = [r for r in rows if r.get("compiled")]
    if cfg.optim.lora.rank or cfg.optim.freeze or not compiled:
        return {}
    cand = min(compiled, key=lambda r: r["peak_bytes"])["candidate"]
    fits = None
    for rank in LORA_RANKS:
        lora = dataclasses.replace(cfg, optim=dataclasses.replace(
            cfg.optim, lora=dataclasses.replace(cfg.optim.lora, rank=rank)))
        peak = peak_bytes(measured(cand.apply(lora), target.devices)[0])
        if peak > target.budget_bytes:
            break
        fits = {"overrides": [f"optim.lora.rank={rank}", *cand.overrides()], "peak_bytes": peak}
    if fits:
        return {"lora": fits}
    return {"lora": None, "lora_why": f"with optim.lora.rank={LORA_RANKS[0]} it peaks at {peak / GB:.3g} GB"}


def simulate_on_cpu() -> None:
    """Compile for the CPU, where N devices are simulated (before any backend starts)."""
    try:
        jax.config.update("jax_platforms", "cpu")
    except RuntimeError:
        pass  # a backend is running already (tests force the CPU's): keep it
