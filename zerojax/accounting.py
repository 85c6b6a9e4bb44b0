"""Accounting: what the design promises per device (DESIGN §2), from the ZeRO paper.

Model states for mixed-precision Adam with Ψ parameters, N devices on the `data` axis and K
bytes of optimizer state per parameter (fp32 master + m + v: K = 12), Rajbhandari et al. 2019,
section 5:
    stage 0  (2 + 2 + K)·Ψ          stage 2  2·Ψ + (2 + K)·Ψ/N
    stage 1  (2 + 2)·Ψ + K·Ψ/N      stage 3  (2 + 2 + K)·Ψ/N
"""

from __future__ import annotations

import jax
from flax import nnx

STAGES = (0, 1, 2, 3)
ALIASES = {0: "NO_SHARD (DDP)", 1: "-", 2: "SHARD_GRAD_OP", 3: "FULL_SHARD"}
FORMULAS = {0: "(2 + 2 + K)·Ψ", 1: "(2 + 2)·Ψ + K·Ψ/N", 2: "2·Ψ + (2 + K)·Ψ/N", 3: "(2 + 2 + K)·Ψ/N"}


def model_state_bytes(stage: int, params: float, devices: int, k: float = 12) -> float:
    """Per-device bytes of model states under ZeRO `stage` (2-byte params and grads, K-byte Adam)."""
    if devices < 1 or params < 0 or k < 0:
        raise ValueError(f"need params >= 0, devices >= 1 and k >= 0, got {params}, {devices}, {k}")
    psi, n = params, devices
    return {0: (2 + 2 + k) * psi, 1: (2 + 2) * psi + k * psi / n,
            2: 2 * psi + (2 + k) * psi / n, 3: (2 + 2 + k) * psi / n}[stage]


def memory_report(params: float, devices: int, k: float = 12) -> dict:
    """The `zerojax memory --json` document (DESIGN §4)."""
    return {"params": params, "devices": devices, "k": k,
            "stages": {str(s): model_state_bytes(s, params, devices, k) for s in STAGES}}


def count_params(cfg) -> int:
    """Ψ of a config's model, from abstract shapes (nothing is allocated)."""
    from zerojax.precision import Policy
    from zerojax.train import build_model

    abstract = nnx.eval_shape(lambda: build_model(cfg, Policy()))
    return sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
