"""Devices and the ("replica", "data") mesh.

On a CPU backend the run simulates `mesh.cpu_devices` devices through the public
`jax_num_cpu_devices` option, set before the backend starts (never through `XLA_FLAGS`, and
never at import time). On GPU/TPU the option is harmless: it only concerns the CPU client.
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from zerojax.config import MeshConfig

AXES = ("replica", "data")
BATCH_AXES = AXES  # the batch is split over both axes


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
