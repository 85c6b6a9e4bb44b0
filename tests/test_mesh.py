"""The mesh is the shape the user asked for: a -1 fills what the other axis leaves. The launch
(process id, count, coordinator) is what a launcher's environment says, read as JAX reads it."""

import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from conftest import ROOT
from zerojax.cli import build_parser
from zerojax.errors import ConfigError
from zerojax.parallel.mesh import Launch, MeshConfig, detect_launch, first_host, mesh_shape, resolve_launch, shape_note


def shape(data=-1, replica=-1, devices=8, processes=1):
    return mesh_shape(MeshConfig(data=data, replica=replica), devices, "cpu", processes)


@pytest.mark.parametrize("data, replica, devices, processes, expected", [
    # mesh.data given, replica=-1: replicas fill the devices
    (8, -1, 8, 2, (1, 8)),  # 2 processes x 4 devices, one FSDP group over all 8 (was 2 x 8: an error)
    (4, -1, 8, 2, (2, 4)),
    (2, -1, 8, 2, (4, 2)),
    (4, -1, 8, 1, (2, 4)),
    (1, -1, 8, 1, (8, 1)),  # DDP over 8 devices; one device is mesh.replica=1 mesh.data=1
    (16, -1, 16, 4, (1, 16)),
    # mesh.replica given, data=-1: the data axis fills the devices
    (-1, 1, 8, 2, (1, 8)),
    (-1, 2, 8, 1, (2, 4)),
    (-1, 4, 8, 2, (4, 2)),
    (-1, 8, 8, 1, (8, 1)),
    # both -1: one replica per process, data = each process's devices (unchanged)
    (-1, -1, 8, 1, (1, 8)),
    (-1, -1, 8, 2, (2, 4)),
    (-1, -1, 16, 4, (4, 4)),
    # both given: exactly that, on the first replica x data devices
    (4, 1, 8, 1, (1, 4)),
    (1, 1, 8, 2, (1, 1)),
    (4, 2, 8, 2, (2, 4)),
])
def test_each_rule(data, replica, devices, processes, expected):
    assert shape(data, replica, devices, processes) == expected


@pytest.mark.parametrize("data, replica, devices, message", [
    (3, -1, 8, "mesh.data=3 does not divide the 8 cpu devices; choose mesh.data from 1, 2, 4, 8 "
               "(mesh.replica=-1 fills the rest)"),
    (5, -1, 12, "mesh.data=5 does not divide the 12 cpu devices; choose mesh.data from 1, 2, 3, 4, 6, 12"),
    (16, -1, 8, "mesh.data=16 needs 16 devices but only 8 cpu devices exist; choose mesh.data from 1, 2, 4, 8"),
    (-1, 3, 8, "mesh.replica=3 does not divide the 8 cpu devices; choose mesh.replica from 1, 2, 4, 8 "
               "(mesh.data=-1 fills the rest)"),
    (8, 2, 8, "mesh.replica=2 x mesh.data=8 needs 16 devices but only 8 cpu devices exist"),
])
def test_a_shape_that_does_not_fit_names_the_valid_choices(data, replica, devices, message):
    with pytest.raises(ValueError) as err:
        shape(data, replica, devices)
    assert message in str(err.value)
    assert "mesh.cpu_devices, now 8" in str(err.value)  # on CPU the device count is a setting too


def test_the_startup_line_says_when_the_shape_was_chosen_per_process():
    assert "one replica per process" in shape_note(MeshConfig(), processes=2)
    assert shape_note(MeshConfig(), processes=1) == ""  # one process: one replica, nothing to explain
    assert shape_note(MeshConfig(data=8), processes=2) == ""  # the user chose


# Launch detection (mesh.distributed=auto), from faked environments only: the values JAX's own
# cluster detection would read (jax/_src/clusters/), and the errors where it could not start.

SRUN_STEP = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "4", "SLURM_PROCID": "3",
             "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_NODELIST": "gpu[007,009]",
             "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}


def test_an_srun_step_gives_slurms_process_id_count_and_first_node():
    launch = detect_launch(SRUN_STEP)
    # port 61440 + 4242 % 4096: JAX's for step 0
    assert (launch.coordinator, launch.num_processes, launch.process_id) == ("gpu007:61586", 4, 3)
    assert launch.local_device_ids == (1,)  # two tasks on this node: device SLURM_LOCALID, as in JAX
    assert "SLURM_PROCID=3" in launch.source and "SLURM_NTASKS=4" in launch.source


def test_one_task_per_node_sees_all_its_devices():
    # JAX's own detection would give local_device_ids=[SLURM_LOCALID] = [0]: one GPU of eight
    one_per_node = {**SRUN_STEP, "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
                    "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
    assert detect_launch(one_per_node).local_device_ids is None
    bound = {**SRUN_STEP, "CUDA_VISIBLE_DEVICES": "5"}  # Slurm bound one GPU to the task: it is its device 0
    assert detect_launch(bound).local_device_ids is None


def test_two_srun_steps_of_one_job_get_different_ports():
    ports = {detect_launch({**SRUN_STEP, "SLURM_STEP_ID": str(step)}).coordinator for step in range(3)}
    assert len(ports) == 3
    assert detect_launch({**SRUN_STEP, "SLURM_STEP_RESV_PORTS": "12000-12001"}).coordinator == "gpu007:12000"
    assert detect_launch({**SRUN_STEP, "JAX_COORDINATOR_PORT": "1234"}).coordinator == "gpu007:1234"


@pytest.mark.parametrize("nodelist, first", [("n1", "n1"), ("n[1-2]", "n1"), ("node[001,007-015],host2", "node001"),
                                             ("a,b", "a"), ("gpu[12-13]", "gpu12")])
def test_first_host_of_a_slurm_node_list(nodelist, first):
    assert first_host(nodelist) == first


def test_a_batch_script_is_one_process_or_an_error_naming_srun():
    batch = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}  # no STEP_NODELIST
    with pytest.raises(ConfigError, match=r"batch script of Slurm job 7 .*SLURM_NTASKS=2 .*srun zerojax train"):
        detect_launch(batch)
    assert detect_launch({**batch, "SLURM_NTASKS": "1"}) is None  # the allocation means one process
    assert resolve_launch(MeshConfig(distributed="off"), environ=batch) is None  # off: never
    assert detect_launch({**SRUN_STEP, "SLURM_NTASKS": "1"}) is None  # a one-task step


def test_open_mpi_needs_the_uri_jax_reads():
    mpi = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"}
    with pytest.raises(ConfigError, match="OMPI_MCA_orte_hnp_uri .*--process-id \\$OMPI_COMM_WORLD_RANK"):
        detect_launch(mpi)
    launch = detect_launch({**mpi, "OMPI_MCA_orte_hnp_uri": "123.0;tcp://10.0.0.1:5000"})
    assert (launch.coordinator, launch.num_processes, launch.process_id) == (None, 2, 1)


def test_tpu_slices_number_processes_worker_plus_slice_times_workers():
    one = {"TPU_WORKER_HOSTNAMES": "t-w0,t-w1,t-w2,t-w3", "TPU_WORKER_ID": "2"}
    assert detect_launch(one) == Launch("t-w0:8482", 4, 2, detect_launch(one).source)
    two = {**one, "MEGASCALE_NUM_SLICES": "2", "MEGASCALE_SLICE_ID": "1", "MEGASCALE_COORDINATOR_ADDRESS": "c0:8080"}
    assert (detect_launch(two).coordinator, detect_launch(two).num_processes, detect_launch(two).process_id) == \
        ("c0:8482", 8, 6)
    assert detect_launch({"TPU_WORKER_HOSTNAMES": "solo", "TPU_WORKER_ID": "0"}) is None


def test_a_process_id_out_of_range_names_its_variables():
    with pytest.raises(ConfigError, match=r"process id 5 must be in \[0, 4\) \(from SLURM_PROCID=5, SLURM_NTASKS=4"):
        resolve_launch(MeshConfig(), environ={**SRUN_STEP, "SLURM_PROCID": "5"})


def expand(arg: str, environ: dict) -> str:
    """Kubernetes' $(VAR) expansion of a container's args."""
    for name, value in environ.items():
        arg = arg.replace(f"$({name})", value)
    return arg


def test_the_kubernetes_indexed_job_gives_each_pod_its_process_id():
    service, job = yaml.safe_load_all((ROOT / "scripts" / "k8s" / "indexed-job.yaml").read_text())
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    assert pod["subdomain"] == service["metadata"]["name"]
    [container] = pod["containers"]
    assert container["command"] == ["zerojax", "train"]
    for index in range(spec["completions"]):
        argv = [expand(arg, {"JOB_COMPLETION_INDEX": str(index)}) for arg in container["args"]]
        args = build_parser().parse_args(["train", *argv])
        launch = resolve_launch(MeshConfig(), args.coordinator, args.num_processes, args.process_id, environ={})
        assert (launch.process_id, launch.num_processes) == (index, spec["completions"])
        # pod 0's name in the Service's domain, as JAX's Kubernetes detection forms it
        assert launch.coordinator.split(":")[0] == f"{job['metadata']['name']}-0.{pod['subdomain']}"


class Metadata(BaseHTTPRequestHandler):
    """A TPU VM's metadata server, as far as scripts/tpu/pod_train.sh asks it (worker 1 of 4)."""

    values = {"agent-worker-number": "1",
              "worker-network-endpoints": "w0:0:10.0.0.2,w1:1:10.0.0.3,w2:2:10.0.0.4,w3:3:10.0.0.5"}

    def do_GET(self):  # noqa: N802 - the http.server name
        key = self.path.rsplit("/", 1)[-1]
        ok = key in self.values and self.headers.get("Metadata-Flavor") == "Google"
        self.send_response(200 if ok else 404)
        self.end_headers()
        self.wfile.write(self.values.get(key, "").encode() if ok else b"")

    def log_message(self, *args):
        pass


def test_the_tpu_pod_script_makes_zerojax_see_its_worker():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Metadata)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TPU_", "SLURM_", "OMPI_"))}
        env.update(GCE_METADATA_IP=f"127.0.0.1:{server.server_port}", ZEROJAX_PYTHON=sys.executable,
                   JAX_PLATFORMS="cpu")
        # mesh.cpu_devices=6 does not divide between 4 processes: zerojax stops, naming what it detected
        proc = subprocess.run(["bash", str(ROOT / "scripts" / "tpu" / "pod_train.sh"), "mesh.cpu_devices=6"], env=env,
                              capture_output=True, text=True, timeout=120)
    finally:
        server.shutdown()
    assert proc.returncode == 2, proc.stderr
    assert ("zerojax: error: mesh.cpu_devices=6 must be divisible by the 4 processes (it is split between them on "
            "a CPU backend) (from TPU_WORKER_ID=1, "
            "TPU_WORKER_HOSTNAMES=10.0.0.2,10.0.0.3,10.0.0.4,10.0.0.5") in proc.stderr
