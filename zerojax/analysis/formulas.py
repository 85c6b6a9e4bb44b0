"""The formulas of docs/design.md §2: model-state bytes per device, host-offloaded bytes, bytes
sent per step, training FLOPs. Pure arithmetic: this module imports no jax.

Model states for mixed-precision Adam with Ψ parameters, N devices on the `data` axis and K
bytes of optimizer state per parameter (fp32 master + m + v: K = 12), Rajbhandari et al. 2019,
section 5:
    stage 0  (2 + 2 + K)·Ψ          stage 2  2·Ψ + (2 + K)·Ψ/N
    stage 1  (2 + 2)·Ψ + K·Ψ/N      stage 3  (2 + 2 + K)·Ψ/N"""

from __future__ import annotations

from zerojax.config.rules import STAGES
from zerojax.errors import ConfigError
from zerojax.models.flops import palm_flops_per_token as flops_per_token  # noqa: F401  (the one formula)

ALIASES = {0: "NO_SHARD (DDP)", 1: "-", 2: "SHARD_GRAD_OP", 3: "FULL_SHARD"}
FORMULAS = {0: "(2 + 2 + K)·Ψ", 1: "(2 + 2)·Ψ + K·Ψ/N", 2: "2·Ψ + (2 + K)·Ψ/N", 3: "(2 + 2 + K)·Ψ/N"}


EMA_BYTES = 4  # optim.ema: an fp32 average of each trained parameter, laid out as its master


def model_state_bytes(stage: int, params: float, devices: int, k: float = 12, trained: float | None = None,
                      frozen_bytes: float = 2, ema: bool = False) -> float:
    """Per-device bytes of model states under ZeRO `stage` (2-byte params and grads, K-byte Adam).

    With `trained` < `params` (frozen leaves, a LoRA base), only the trained Ψ_t pay the formula;
    the frozen Ψ_f = Ψ - Ψ_t are stored once, `frozen_bytes` each (no gradient, no master, no
    moments), sharded where the stage shards weights: b_f·Ψ_f at stages 0-2, b_f·Ψ_f/N at 3.
    With `ema` (optim.ema > 0), 4 more bytes per trained parameter, sharded like the master
    (4·Ψ_t, /N at stages 1-3)."""
    trained = params if trained is None else trained
    if devices < 1 or params < 0 or k < 0 or not 0 <= trained <= params:
        raise ConfigError(f"need params >= 0, devices >= 1, k >= 0 and 0 <= trainable <= params, got "
                          f"{params}, {devices}, {k}, {trained}")
    psi, n, frozen = trained, devices, params - trained
    states = {0: (2 + 2 + k) * psi, 1: (2 + 2) * psi + k * psi / n,
              2: 2 * psi + (2 + k) * psi / n, 3: (2 + 2 + k) * psi / n}[stage]
    return states + frozen_bytes * frozen / (n if stage == 3 else 1) + EMA_BYTES * ema * psi / (n if stage else 1)


def host_state_bytes(stage: int, trained: float, devices: int, k: float = 12, offload: str = "none",
                     ema: bool = False) -> float:
    """Per-device bytes `zero.offload` moves to host memory: Adam's m and v (K - 4 bytes per
    trained parameter: the fp32 master stays) or all K (the master too, and with `ema` the EMA's
    4 bytes, which live where the master does), sharded at stages 1-3."""
    moved = {"none": 0, "optimizer": max(k - 4, 0), "optimizer+master": k + EMA_BYTES * ema}[offload]
    return moved * trained / (devices if stage else 1)


def memory_report(params: float, devices: int, k: float = 12, trained: float | None = None,
                  frozen_bytes: float = 2, offload: str = "none", ema: bool = False) -> dict:
    """The `zerojax memory --json` document (docs/design.md §4): `stages` is what each device
    holds (the EMA's 4 bytes per trained parameter included with `ema`); with `offload`,
    `host_stages` what its host holds for it."""
    psi_t = params if trained is None else trained
    host = {str(s): host_state_bytes(s, psi_t, devices, k, offload, ema) for s in STAGES}
    doc = {"params": params, "devices": devices, "k": k,
           "stages": {str(s): model_state_bytes(s, params, devices, k, trained, frozen_bytes, ema) - host[str(s)]
                      for s in STAGES}}
    if ema:
        doc["ema_bytes_per_param"] = EMA_BYTES
    if trained is not None and trained != params:
        doc.update(trainable=trained, frozen_bytes_per_param=frozen_bytes)
    if offload != "none":
        doc.update(offload=offload, host_stages=host)
    return doc


def comm_theory_bytes(stage: int, params: float, n: int, b_gather: float, b_reduce: float,
                      reshard_after_forward: bool = True, trained: float | None = None, grad_accum: int = 1,
                      once: float = 0) -> float:
    """docs/design.md §2: bytes each device sends per step over the data axis (ring, g = (N-1)/N).

    `trained` (Ψ_t, default Ψ): only trained leaves have gradients to reduce; frozen ones are
    gathered at stage 3 and replicated (never sent) below it. With `grad_accum` k microbatches,
    stages 2 and 3 reduce-scatter each microbatch's gradient and stage 3 gathers per microbatch
    (XLA may hoist a unit's gathers out of the microbatch loop where they do not change: the
    outer unit's; then it sends less). `once`: parameters stage 3 gathers once per microbatch, not
    twice (the explicit schedule's outer-unit leaves that only `enter` or only `exit` reads, such
    as an untied embedding and head: schedules/outer.py)."""
    g, t, k = (n - 1) / n, params if trained is None else trained, grad_accum
    if stage == 0:
        return 2 * g * t * b_reduce
    if stage == 1:
        return g * t * (b_reduce + b_gather)
    if stage == 2:
        return g * t * (k * b_reduce + b_gather)
    if not reshard_after_forward:
        return k * g * (params * b_gather + t * b_reduce)
    return k * g * ((2 * params - once) * b_gather + t * b_reduce)


def peak_bytes(memory: dict) -> int:
    """Per-device peak of a compiled step: what it reads, makes and returns (donated buffers once).
    Host-memory arguments and results (zero.offload) are not the device's (each host result is
    a donated host argument's buffer: the aliased bytes less those are the device's)."""
    if "device_argument_bytes" not in memory:
        return memory["argument_bytes"] + memory["temp_bytes"] + memory["output_bytes"] - memory["alias_bytes"]
    return (memory["device_argument_bytes"] + memory["temp_bytes"] + memory["device_output_bytes"]
            - (memory["alias_bytes"] - memory["host_output_bytes"]))
