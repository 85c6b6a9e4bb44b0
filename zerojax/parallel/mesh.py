"""Processes, devices and the ("replica", "data") mesh.

Several processes (TPU pod hosts, GPU nodes, or processes on one machine for tests) form one
mesh through JAX's own multi-controller runtime, `jax.distributed.initialize`: explicitly
(`--coordinator HOST:PORT --num-processes P --process-id I`) or, with `mesh.distributed=auto`,
by JAX's detection of a TPU pod or a SLURM job. On CPU the processes talk through gloo.

On a CPU backend the run simulates `mesh.cpu_devices` devices through the public
`jax_num_cpu_devices` option, set before the backend starts (never through `XLA_FLAGS`, and
never at import time). On GPU/TPU the option is harmless: it only concerns the CPU client.
"""

from __future__ import annotations

import inspect
import os
import socket
import time
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
from zerojax.errors import ConfigError
from zerojax.config import MeshConfig
from zerojax.errors import DistributedError


REPLICA, DATA = "replica", "data"  # the mesh axes: replicate (hybrid sharding) and shard (ZeRO)
AXES = (REPLICA, DATA)
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
        raise ConfigError(f"--xla-preset {name!r} is not known; choose one of {', '.join(XLA_PRESETS)}")
    flags = " ".join(XLA_PRESETS[name])
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()
    return flags


CLUSTER_ENV = ("SLURM_JOB_ID", "TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS", "OMPI_COMM_WORLD_SIZE")


def cluster_detected() -> bool:
    """A multi-process launch that `jax.distributed.initialize()` can configure by itself."""
    many = lambda name: os.environ.get(name, "1").isdigit() and int(os.environ.get(name, "1")) > 1
    if "SLURM_JOB_ID" in os.environ:
        return many("SLURM_NTASKS")
    if "OMPI_COMM_WORLD_SIZE" in os.environ:
        return many("OMPI_COMM_WORLD_SIZE")
    return "," in os.environ.get("TPU_WORKER_HOSTNAMES", "") or "MEGASCALE_COORDINATOR_ADDRESS" in os.environ


def init_distributed(cfg: MeshConfig, coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None) -> bool:
    """Join the other processes of the run (before any device work); False for a single process.

    A process that cannot reach the coordinator within `mesh.timeout_s` gets a clear error, and
    once running, a process whose peers stop heart-beating is stopped by JAX's coordination
    service within the same bound, instead of hanging in a collective."""
    explicit = coordinator is not None or num_processes is not None or process_id is not None
    if explicit and None in (coordinator, num_processes, process_id):
        raise ConfigError("--coordinator HOST:PORT, --num-processes P and --process-id I go together")
    if explicit and not 0 <= process_id < num_processes:
        raise ConfigError(f"--process-id {process_id} must be in [0, {num_processes})")
    if not explicit and (cfg.distributed == "off" or not cluster_detected()):
        return False
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # only the CPU client uses it
    processes = num_processes or int(os.environ.get("SLURM_NTASKS", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))
    if cfg.cpu_devices % processes:
        raise ConfigError(f"mesh.cpu_devices={cfg.cpu_devices} must be divisible by the {processes} processes")
    _set_cpu_devices(cfg.cpu_devices // processes)  # before the backend starts (it starts below)
    wanted = {"initialization_timeout": cfg.timeout_s, "heartbeat_timeout_seconds": cfg.timeout_s,
              "shutdown_timeout_seconds": cfg.timeout_s}
    accepted = inspect.signature(jax.distributed.initialize).parameters
    if coordinator and process_id:  # JAX aborts the process when it cannot register: check first
        _wait_for_coordinator(coordinator, cfg.timeout_s, process_id, num_processes)
    try:
        jax.distributed.initialize(coordinator, num_processes, process_id,
                                   **{k: v for k, v in wanted.items() if k in accepted})
    except Exception as err:  # noqa: BLE001 - JAX raises several kinds for "no coordinator"
        where = coordinator or "the detected coordinator"
        raise DistributedError(f"could not join {where} as process {process_id} of {num_processes} within "
                               f"mesh.timeout_s={cfg.timeout_s}s ({type(err).__name__}: "
                               f"{str(err).splitlines()[0][:200]})") from None
    return True


def _wait_for_coordinator(address: str, timeout_s: int, process_id: int, num_processes: int) -> None:
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except (OSError, ValueError) as err:
            if time.monotonic() > deadline or isinstance(err, ValueError):
                raise DistributedError(
                    f"process {process_id} of {num_processes} found no coordinator at {address} within "
                    f"mesh.timeout_s={timeout_s}s; start process 0 there (or fix --coordinator)") from None
            time.sleep(0.5)


def _set_cpu_devices(n: int) -> None:
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        pass  # backend already initialised (e.g. tests set the count via XLA_FLAGS): keep it


def setup_devices(cfg: MeshConfig) -> list[jax.Device]:
    """Ask for `cfg.cpu_devices` simulated CPU devices if the backend has not started yet (with
    several processes, `init_distributed` has split them between the processes already)."""
    if not jax.distributed.is_initialized():
        _set_cpu_devices(cfg.cpu_devices)
    return jax.devices()


def mesh_shape(cfg: MeshConfig, n_devices: int, platform: str, processes: int = 1) -> tuple[int, int]:
    """(replica, data) sizes over `n_devices` (all processes' devices). A -1 fills what the other
    axis leaves, so the shape is the one asked for:

        mesh.data=D, replica=-1     replica = devices / D  (D = devices: one FSDP group over all)
        mesh.replica=R, data=-1     data = devices / R
        both -1                     one replica per process, data = each process's devices
                                    (hybrid sharding: the gathers stay inside a host)
        both given                  R x D, the first R*D devices in JAX's order
    """
    if cfg.replica == -1 and cfg.data == -1:
        return processes, n_devices // processes
    if cfg.replica == -1 or cfg.data == -1:
        given, size, other = (("mesh.data", cfg.data, "mesh.replica") if cfg.replica == -1
                              else ("mesh.replica", cfg.replica, "mesh.data"))
        if n_devices % size:
            problem = _too_big(size, n_devices, platform) or f"does not divide the {n_devices} {platform} devices"
            subset = f", or set {other} as well to use fewer devices" if size < n_devices else ""
            raise ConfigError(
                f"{given}={size} {problem}; choose {given} from {', '.join(map(str, divisors(n_devices)))} "
                f"({other}=-1 fills the rest){subset}{_cpu_hint(cfg, platform)}")
        return (n_devices // size, size) if cfg.replica == -1 else (size, n_devices // size)
    if cfg.replica * cfg.data > n_devices:
        raise ConfigError(
            f"mesh.replica={cfg.replica} x mesh.data={cfg.data} "
            f"{_too_big(cfg.replica * cfg.data, n_devices, platform)}; use a smaller mesh, or -1 for one "
            f"of them to fill the devices{_cpu_hint(cfg, platform)}")
    return cfg.replica, cfg.data


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _too_big(need: int, n_devices: int, platform: str) -> str:
    return f"needs {need} devices but only {n_devices} {platform} devices exist" if need > n_devices else ""


def _cpu_hint(cfg: MeshConfig, platform: str) -> str:
    return f" (or change mesh.cpu_devices, now {cfg.cpu_devices})" if platform == "cpu" else ""


def shape_note(cfg: MeshConfig, processes: int | None = None) -> str:
    """For the startup line: how the shape was chosen where the user did not choose it (the
    default's per-process split)."""
    processes = jax.process_count() if processes is None else processes
    if cfg.replica == -1 and cfg.data == -1 and processes > 1:
        return " (default: one replica per process; mesh.data=N to shard over N devices)"
    return ""


def make_mesh(cfg: MeshConfig) -> Mesh:
    devices = setup_devices(cfg)
    shape = mesh_shape(cfg, len(devices), devices[0].platform, jax.process_count())
    # Devices in JAX's order (process by process), so that when mesh.data is a process's device
    # count (the default with several processes) each row of `replica` is one process's devices:
    # hybrid sharding shards inside a host and replicates across hosts. Auto axes: the gspmd
    # schedule is annotations that XLA propagates.
    grid = np.array(devices[: shape[0] * shape[1]]).reshape(shape)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows of a batch split over every device of the mesh: the leading (batch) axis of every
    leaf of the batch pytree, whatever its rank."""
    return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def data_parallel_size(mesh: Mesh) -> int:
    return mesh.shape[REPLICA] * mesh.shape[DATA]
