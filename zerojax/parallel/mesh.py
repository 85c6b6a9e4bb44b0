"""Processes, devices and the ("replica", "data") mesh.

Several processes (TPU pod hosts, GPU nodes, or processes on one machine for tests) form one
mesh through JAX's own multi-controller runtime, `jax.distributed.initialize`: explicitly
(`--coordinator HOST:PORT --num-processes P --process-id I`) or, with `mesh.distributed=auto`,
from the environment a launcher sets (an srun step, Open MPI, a GKE TPU slice), read as JAX's
own cluster detection reads it (`detect_launch`). On CPU the processes talk through gloo.

On a CPU backend the run simulates `mesh.cpu_devices` devices through the public
`jax_num_cpu_devices` option, set before the backend starts (never through `XLA_FLAGS`, and
never at import time). On GPU/TPU the option is harmless: it only concerns the CPU client.
"""

from __future__ import annotations

import inspect
import os
import re
import socket
import time
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Launch:
    """How this process joins a multi-process run, and the variables each value came from."""

    coordinator: str | None  # HOST:PORT of process 0; None: JAX finds it (Open MPI's URI)
    num_processes: int
    process_id: int
    source: str  # e.g. "SLURM_PROCID=1, SLURM_NTASKS=2, SLURM_STEP_NODELIST=n[1-2]", for errors
    local_device_ids: tuple[int, ...] | None = None  # None: every device this process sees


SLURM_PORT_BASE = 65536 - 4096  # JAX's Slurm coordinator port is SLURM_PORT_BASE + job id % 4096
TPU_COORDINATOR_PORT = 8482  # JAX's, for TPU slices (jax/_src/clusters/cloud_tpu_cluster.py)


def detect_launch(environ=os.environ) -> Launch | None:
    """The multi-process launch this environment describes, read as JAX's own cluster detection
    reads it (jax/_src/clusters/: slurm, ompi, GKE TPU); None for a single process. An
    environment that asks for several processes but where JAX could not start them (a Slurm
    batch script run without srun, Open MPI without its URI) is a ConfigError saying what to do."""
    if "SLURM_JOB_ID" in environ:
        return _slurm(environ)
    if "OMPI_COMM_WORLD_SIZE" in environ:
        return _open_mpi(environ)
    if "TPU_WORKER_HOSTNAMES" in environ or "TPU_PROCESS_ADDRESSES" in environ:
        return _tpu(environ)
    return None


def _int(environ, name: str, default: int | None = None) -> int:
    value = environ.get(name)
    if value is None and default is not None:
        return default
    if value is None or not value.isdigit():
        raise ConfigError(f"{name}={value!r} in the environment is not a count or index; the launcher "
                          "(srun, mpirun, the TPU runtime) sets it: start the run through it, or pass "
                          "--coordinator, --num-processes and --process-id")
    return int(value)


def _slurm(environ) -> Launch | None:
    tasks = _int(environ, "SLURM_NTASKS", 1)
    if "SLURM_STEP_NODELIST" not in environ:  # the batch script (or salloc's shell), not an srun step
        if tasks > 1:
            raise ConfigError(
                f"zerojax runs in the batch script of Slurm job {environ['SLURM_JOB_ID']} as one process, but the job "
                f"asked for SLURM_NTASKS={tasks} tasks (SLURM_STEP_NODELIST is unset: not an srun step); start "
                "them with srun, as scripts/slurm/train.sbatch does (srun zerojax train ...), or set "
                "mesh.distributed=off to train as one process here")
        return None
    if tasks == 1:
        return None
    job, step = _int(environ, "SLURM_JOB_ID"), _int(environ, "SLURM_STEP_ID", 0)
    port, port_from = _slurm_port(environ, job, step)
    nodes = environ["SLURM_STEP_NODELIST"]
    source = (f"SLURM_PROCID={environ.get('SLURM_PROCID')}, SLURM_NTASKS={tasks}, "
              f"SLURM_STEP_NODELIST={nodes}, {port_from}")
    return Launch(f"{first_host(nodes)}:{port}", tasks, _int(environ, "SLURM_PROCID"), source,
                  _slurm_local_devices(environ))


def _slurm_port(environ, job: int, step: int) -> tuple[int, str]:
    """The coordinator's port: JAX_COORDINATOR_PORT if set; else the first port Slurm reserved for
    the step (srun --resv-ports, or MpiParams=ports=...: unique by construction); else JAX's
    SLURM_PORT_BASE + job id % 4096, plus the step id, so that two srun steps of one job (one
    after the other, or at once) do not share a port. (Job J's step s meets job J+s's step 0 only
    if both jobs' first nodes are the same host.)"""
    if environ.get("JAX_COORDINATOR_PORT"):
        return _int(environ, "JAX_COORDINATOR_PORT"), f"JAX_COORDINATOR_PORT={environ['JAX_COORDINATOR_PORT']}"
    reserved = environ.get("SLURM_STEP_RESV_PORTS", "")
    if reserved[:1].isdigit():
        port = int(re.match(r"\d+", reserved).group())
        return port, f"port from SLURM_STEP_RESV_PORTS={reserved}"
    port = SLURM_PORT_BASE + (job + step) % 4096
    return port, f"port {SLURM_PORT_BASE} + (SLURM_JOB_ID={job} + SLURM_STEP_ID={step}) % 4096"


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: "n1" of "n[1-2]", "gpu007" of "gpu[007,009-010],cpu1"."""
    match = re.match(r"([^,\[]*)(?:\[([^,\-\]]*))?", nodelist)
    return match.group(1) + (match.group(2) or "")


def _slurm_local_devices(environ) -> tuple[int, ...] | None:
    """One task on this node: every device (JAX's own detection would keep device 0 only). Several:
    device SLURM_LOCALID, as JAX does, unless Slurm already bound one GPU to the task
    (CUDA_VISIBLE_DEVICES names one device, which the task sees as its device 0)."""
    counts = expand_counts(environ.get("SLURM_STEP_TASKS_PER_NODE", environ.get("SLURM_TASKS_PER_NODE", "1")))
    node = int(environ.get("SLURM_NODEID", "0"))
    here = counts[node] if node < len(counts) else max(counts)
    if here == 1 or len(environ.get("CUDA_VISIBLE_DEVICES", "x,y").split(",")) == 1:
        return None
    return (_int(environ, "SLURM_LOCALID"),)


def expand_counts(spec: str) -> list[int]:
    """Slurm's tasks-per-node notation: "2(x3),1" is [2, 2, 2, 1]."""
    counts = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match:
            counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts or [1]


def _open_mpi(environ) -> Launch | None:
    size = _int(environ, "OMPI_COMM_WORLD_SIZE")
    if size == 1:
        return None
    rank = _int(environ, "OMPI_COMM_WORLD_RANK")
    source = f"OMPI_COMM_WORLD_RANK={rank}, OMPI_COMM_WORLD_SIZE={size}"
    if "OMPI_MCA_orte_hnp_uri" not in environ:  # JAX finds the coordinator only through this
        raise ConfigError(
            f"an Open MPI launch ({source}) without OMPI_MCA_orte_hnp_uri (Open MPI 5 does not set it), "
            "where JAX cannot find a coordinator; pass --coordinator HOST:PORT --num-processes "
            "$OMPI_COMM_WORLD_SIZE --process-id $OMPI_COMM_WORLD_RANK")
    return Launch(None, size, rank, source + ", coordinator from OMPI_MCA_orte_hnp_uri")


def _tpu(environ) -> Launch | None:
    """A GKE TPU slice (or several, MEGASCALE_*): workers listed in TPU_PROCESS_ADDRESSES or
    TPU_WORKER_HOSTNAMES, this one TPU_WORKER_ID; process id = worker + slice x workers per slice."""
    name = "TPU_PROCESS_ADDRESSES" if "TPU_PROCESS_ADDRESSES" in environ else "TPU_WORKER_HOSTNAMES"
    workers = [w for w in environ[name].split(",") if w]
    slices, slice_id = _int(environ, "MEGASCALE_NUM_SLICES", 1), _int(environ, "MEGASCALE_SLICE_ID", 0)
    if len(workers) * slices == 1:
        return None
    worker = _int(environ, "TPU_WORKER_ID")
    host = environ.get("MEGASCALE_COORDINATOR_ADDRESS") or workers[0]
    source = (f"TPU_WORKER_ID={worker}, {name}={environ[name]}, MEGASCALE_NUM_SLICES={slices}, "
              f"MEGASCALE_SLICE_ID={slice_id}")
    return Launch(f"{host.split(':')[0]}:{TPU_COORDINATOR_PORT}", len(workers) * slices,
                  worker + slice_id * len(workers), source)


def resolve_launch(cfg: MeshConfig, coordinator: str | None = None, num_processes: int | None = None,
                   process_id: int | None = None, environ=os.environ) -> Launch | None:
    """The launch the flags give, else the one the environment describes (mesh.distributed=auto),
    else None: a single process. Checks what it can before any process waits on another."""
    explicit = coordinator is not None or num_processes is not None or process_id is not None
    if explicit and None in (coordinator, num_processes, process_id):
        raise ConfigError("--coordinator HOST:PORT, --num-processes P and --process-id I go together")
    if explicit:
        launch = Launch(coordinator, num_processes, process_id, "--coordinator, --num-processes, --process-id")
    else:
        launch = detect_launch(environ) if cfg.distributed == "auto" else None
    if launch is None:
        return None
    if not 0 <= launch.process_id < launch.num_processes:
        raise ConfigError(f"process id {launch.process_id} must be in [0, {launch.num_processes}) "
                          f"(from {launch.source})")
    if cfg.cpu_devices % launch.num_processes and platforms()[:1] == ["cpu"]:  # see make_mesh for the rest
        raise ConfigError(_cpu_split(cfg, launch.num_processes) + f" (from {launch.source})")
    return launch


def platforms() -> list[str]:
    """The backends asked for (JAX_PLATFORMS), known before any backend starts; [] if unset."""
    return [p for p in (jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS") or "").split(",") if p]


def _cpu_split(cfg: MeshConfig, processes: int) -> str:
    return (f"mesh.cpu_devices={cfg.cpu_devices} must be divisible by the {processes} processes (it is split "
            "between them on a CPU backend)")


def init_distributed(cfg: MeshConfig, coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None) -> bool:
    """Join the other processes of the run (before any device work); False for a single process.

    A process that cannot reach the coordinator within `mesh.timeout_s` gets a clear error, and
    once running, a process whose peers stop heart-beating is stopped by JAX's coordination
    service within the same bound, instead of hanging in a collective."""
    launch = resolve_launch(cfg, coordinator, num_processes, process_id)
    if launch is None:
        return False
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # only the CPU client uses it
    # Before the backend starts (it starts below). Only a CPU backend uses it: 16 GPU nodes with the
    # default mesh.cpu_devices=8 are not an error (make_mesh checks a CPU run it did not divide).
    _set_cpu_devices(max(1, cfg.cpu_devices // launch.num_processes))
    wanted = {"initialization_timeout": cfg.timeout_s, "heartbeat_timeout_seconds": cfg.timeout_s,
              "shutdown_timeout_seconds": cfg.timeout_s, "local_device_ids": launch.local_device_ids}
    accepted = inspect.signature(jax.distributed.initialize).parameters
    if launch.coordinator and "cluster_detection_method" in accepted:
        wanted["cluster_detection_method"] = "deactivate"  # every value is given: JAX guesses none
    if launch.coordinator and launch.process_id:  # JAX aborts the process when it cannot register: check first
        _wait_for_coordinator(launch, cfg.timeout_s)
    try:
        jax.distributed.initialize(launch.coordinator, launch.num_processes, launch.process_id,
                                   **{k: v for k, v in wanted.items() if k in accepted})
    except Exception as err:  # noqa: BLE001 - JAX raises several kinds for "no coordinator"
        raise DistributedError(
            f"could not join {launch.coordinator or 'the detected coordinator'} as process {launch.process_id} "
            f"of {launch.num_processes} within mesh.timeout_s={cfg.timeout_s}s ({type(err).__name__}: "
            f"{str(err).splitlines()[0][:200]}) (process id, count and coordinator from {launch.source})") from None
    return True


def _wait_for_coordinator(launch: Launch, timeout_s: int) -> None:
    host, _, port = launch.coordinator.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except (OSError, ValueError) as err:
            if time.monotonic() > deadline or isinstance(err, ValueError):
                raise DistributedError(
                    f"process {launch.process_id} of {launch.num_processes} found no coordinator at "
                    f"{launch.coordinator} within mesh.timeout_s={timeout_s}s; start process 0 there (or fix "
                    f"--coordinator) (process id, count and coordinator from {launch.source})") from None
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
    if devices[0].platform == "cpu" and cfg.cpu_devices % jax.process_count():
        raise ConfigError(_cpu_split(cfg, jax.process_count()))
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
