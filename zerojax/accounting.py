"""Accounting: what the design promises per device (DESIGN §2), and what XLA measures.

Model states for mixed-precision Adam with Ψ parameters, N devices on the `data` axis and K
bytes of optimizer state per parameter (fp32 master + m + v: K = 12), Rajbhandari et al. 2019,
section 5:
    stage 0  (2 + 2 + K)·Ψ          stage 2  2·Ψ + (2 + K)·Ψ/N
    stage 1  (2 + 2)·Ψ + K·Ψ/N      stage 3  (2 + 2 + K)·Ψ/N
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
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


def compile_step(cfg):
    """The compiled train step of `cfg` and its setup, from abstract inputs (nothing allocated)."""
    from zerojax import mesh as mesh_lib, train

    setup = train.prepare(cfg)
    state = train.init_state(setup, abstract=True)
    batch = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.model.seq_len + 1), jnp.int32,
                                 sharding=mesh_lib.batch_sharding(setup.mesh))
    return setup, train.make_train_step(setup, state).lower(state, batch).compile()


def measure_memory(compiled) -> dict:
    """Per-device bytes from XLA's own accounting of the compiled step."""
    m = compiled.memory_analysis()
    return {"argument_bytes": int(m.argument_size_in_bytes), "temp_bytes": int(m.temp_size_in_bytes),
            "output_bytes": int(m.output_size_in_bytes), "alias_bytes": int(m.alias_size_in_bytes)}


def analyze(cfg, stages_wanted=STAGES) -> dict:
    """The `zerojax analyze --json` document: per stage, measured bytes next to the formulas."""
    import dataclasses

    params, stages, n, mesh = count_params(cfg), {}, None, None
    for stage in stages_wanted:
        staged = dataclasses.replace(cfg, zero=dataclasses.replace(cfg.zero, stage=stage))
        setup, compiled = compile_step(staged)
        n, mesh = setup.mesh.shape["data"], dict(setup.mesh.shape)
        stages[str(stage)] = {
            **measure_memory(compiled),
            "formula_bytes": model_state_bytes(stage, params, n),
            "unsharded_bytes": setup.plan.unsharded_bytes() if stage else 0,
            "schedule": staged.zero.schedule if stage >= 2 else "gspmd",
        }
    return {"params": params, "devices": n, "mesh": mesh, "stages": stages}
