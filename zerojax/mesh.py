"""Devices and the ("replica", "data") mesh.

On a CPU backend the run simulates `mesh.cpu_devices` devices through the public
`jax_num_cpu_devices` option, set before the backend starts (never through `XLA_FLAGS`, and
never at import time). On GPU/TPU the option is harmless: it only concerns the CPU client.
"""

from __future__ import annotations

import os

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from zerojax.config import MeshConfig

AXES = ("replica", "data")
BATCH_AXES = AXES  # the batch is split over both axes


# XLA flags that let the GPU backend overlap the FSDP schedule's collectives with compute:
# the latency-hiding scheduler, collective pipelining across loop iterations (the next unit's
# all-gather during this unit's compute, the reduce-scatter during the next), loop double
# buffering, and combining of small collectives. MaxText and JAX's GPU performance guide use
# the same set. Applied only by `--xla-preset gpu`, before the backend starts; never on import.
XLA_PRESETS = {
    "gpu": (
        "--xla_gpu_enable_latency_hiding_scheduler=true",
        "--xla_gpu_enable_pipelined_all_gather=true",
        "--xla_gpu_enable_pipelined_reduce_scatter=true",
        "--xla_gpu_enable_pipelined_all_reduce=true",
        "--xla_gpu_enable_while_loop_double_buffering=true",
        "--xla_gpu_enable_highest_priority_async_stream=true",
        "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
        "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
    ),
}


def apply_xla_preset(name: str) -> str:
    """Append a preset's flags to XLA_FLAGS (effective only before the backend starts)."""
    if name not in XLA_PRESETS:
        raise ValueError(f"--xla-preset {name!r} is not known; choose one of {', '.join(XLA_PRESETS)}")
    flags = " ".join(XLA_PRESETS[name])
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()
    return flags


def setup_devices(cfg: MeshConfig) -> list[jax.Device]:
    """Ask for `cfg.cpu_devices` simulated CPU devices if the backend has not started yet."""
    try:
        jax.config.update("jax_num_cpu_devices", cfg.cpu_devices)
    except RuntimeError:
        pass  # backend already initialised (e.g. tests set the count via XLA_FLAGS): keep it
    return jax.devices()


def mesh_shape(cfg: MeshConfig, n_devices: int, platform: str) -> tuple[int, int]:
    """(replica, data) sizes; `data=-1` takes every device the replicas leave."""
    data = cfg.data if cfg.data != -1 else n_devices // cfg.replica
    if data < 1 or cfg.replica * data > n_devices:
        need = cfg.replica * max(data, 1)
        hint = f" (or raise mesh.cpu_devices, now {cfg.cpu_devices})" if platform == "cpu" else ""
        raise ValueError(
            f"mesh.replica={cfg.replica} x mesh.data={cfg.data} needs {need} devices but only "
            f"{n_devices} {platform} devices exist; use mesh.data=-1 or a smaller mesh{hint}"
        )
    return cfg.replica, data


def make_mesh(cfg: MeshConfig) -> Mesh:
    devices = setup_devices(cfg)
    shape = mesh_shape(cfg, len(devices), devices[0].platform)
    # Auto axes: stages are written as sharding annotations that XLA (GSPMD) propagates.
    return jax.make_mesh(
        shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices[: shape[0] * shape[1]]
    )


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows of a [B, T] batch split over every device of the mesh."""
    return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def data_parallel_size(mesh: Mesh) -> int:
    return mesh.shape["replica"] * mesh.shape["data"]
