"""zerojax under a real Slurm: slurmctld and two slurmd (nodes n1 and n2) on this host, started by
scripts/slurm/local_cluster.sh, run scripts/slurm/train.sbatch as a user would submit it: the
`sbatch` line of docs/tutorials/slurm.md, read from the page with its tiny overlay, so the page
cannot rot."""

import os
import shlex
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import FAST_COMPILE, ROOT
from test_distributed import TINY, losses
from test_tutorials import commands, overlay
from zerojax import config, train
from zerojax.train import checkpoint

CLUSTER = ROOT / "scripts" / "slurm" / "local_cluster.sh"
SBATCH = ROOT / "scripts" / "slurm" / "train.sbatch"
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol")
TUTORIAL = ROOT / "docs" / "tutorials" / "slurm.md"


def submission() -> tuple[list[str], list[str]]:
    """The tutorial's `sbatch` line: (sbatch's options, `zerojax train`'s arguments followed by the
    page's tiny overlay)."""
    page = TUTORIAL.read_text()
    (line,) = [line for line in commands(page) if line.startswith("sbatch ")]
    words = shlex.split(line, comments=True)
    at = words.index(str(SBATCH.relative_to(ROOT)))
    return words[1:at], words[at + 1:] + overlay(page).split()


def one_process(out, *args):
    """The page's run as one process here (its config file and keys, then `args`): the losses."""
    _, arguments = submission()
    path = arguments[arguments.index("--config") + 1]
    keys = [a for a in arguments if "=" in a]
    train.run(config.load(ROOT / path, overrides=[*keys, f"train.out_dir={out}", *args]), show_progress=False)
    return losses(out)


def test_the_tutorial_submits_the_script_with_a_config_that_loads():
    """Without Slurm: the page's line names the batch script, two nodes, a config file that loads with
    the page's keys, and no test-only key outside the overlay."""
    options, arguments = submission()
    assert "--nodes=2" in options
    at = arguments.index("--config")
    assert (ROOT / arguments[at + 1]).is_file()
    page_keys = arguments[at + 2:len(arguments) - len(overlay(TUTORIAL.read_text()).split())]
    assert page_keys and all("=" in k for k in page_keys) and not any("min_shard_size" in k for k in page_keys)
    cfg = config.load(ROOT / arguments[at + 1], overrides=[a for a in arguments if "=" in a])
    assert cfg.model.d_model == 32 and cfg.train.steps == 5  # the overlay is read and applied


def why_no_slurm() -> str | None:
    if os.geteuid() != 0:
        return "Slurm's daemons need root here (slurmd starts tasks as their user); not root"
    missing = [exe for exe in DAEMONS if shutil.which(exe) is None]
    if missing:
        return (f"{', '.join(missing)} not installed (apt-get install slurmctld slurmd slurm-client munge; "
                ".ci/run does)")
    return None


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A two-node Slurm for this module's tests; its environment (SLURM_CONF, and the interpreter
    and code under test for the batch jobs). Stopped afterwards, /etc/hosts as it was."""
    if reason := why_no_slurm():
        pytest.skip(reason)
    state = tmp_path_factory.mktemp("slurm")
    start = subprocess.run(["bash", str(CLUSTER), "start", str(state)], capture_output=True, text=True, timeout=120)
    if start.returncode != 0:
        subprocess.run(["bash", str(CLUSTER), "stop", str(state)], timeout=120)
        pytest.skip(f"the local Slurm did not start here: {start.stderr.strip()[-500:]}")
    env = {**os.environ, "SLURM_CONF": str(state / "slurm.conf"), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": FAST_COMPILE,
           "ZEROJAX_PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    try:
        yield env
    finally:
        subprocess.run(["scancel", "--user=root"], env=env, timeout=60)
        subprocess.run(["bash", str(CLUSTER), "stop", str(state)], timeout=120)


def sbatch(env, tmp_path, *args, wait=True, script=SBATCH):
    """Submit `script` on 2 nodes x 1 task; (job id, its output file)."""
    output = tmp_path / "job.out"
    options, _ = submission()  # the page's (--nodes=2), then the test's
    cmd = ["sbatch", *options, "--parsable", "--ntasks-per-node=1", "--time=6", f"--chdir={tmp_path}",
           f"--output={output}", *(["--wait"] if wait else []), str(script), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    job = proc.stdout.strip().split(";")[0]
    if wait:
        assert proc.returncode == 0, f"sbatch: {proc.returncode}\n{proc.stderr}\n{read(output)}"
    return job, output


def read(path):
    return path.read_text() if path.exists() else "(no output)"


def job_state(env, job) -> str:
    """The job's state while the controller knows it ("" once it has finished)."""
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env, capture_output=True, text=True)
    return out.stdout.strip()


@pytest.mark.slow
def test_sbatch_on_two_nodes_gives_one_process_losses(slurm, tmp_path):
    reference = one_process(tmp_path / "one", "train.ckpt_every=0", "zero.stage=3")
    out = tmp_path / "two"
    _, arguments = submission()
    (tmp_path / "configs").symlink_to(ROOT / "configs")  # the page's --config, from the job's directory
    _, output = sbatch(slurm, tmp_path, "--no-progress", *arguments, f"train.out_dir={out}", "zero.stage=3")
    text = read(output)
    assert "on n[1-2]: 2 tasks" in text and "8 cpu devices, mesh {'replica': 2, 'data': 4}" in text, text
    assert text.count("zerojax: done") == 1, text  # process 0 speaks for the run
    np.testing.assert_allclose(losses(out), reference, rtol=1e-5)
    assert checkpoint.complete_steps(out) == [5]


@pytest.mark.slow
def test_requeue_mid_run_ends_with_the_uninterrupted_losses(slurm, tmp_path):
    steps = ["train.steps=40", "train.ckpt_every=10"]
    reference = one_process(tmp_path / "one", *steps)
    out = tmp_path / "two"
    _, arguments = submission()
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    job, output = sbatch(slurm, tmp_path, "--no-progress", *arguments, *steps, f"train.out_dir={out}", wait=False)
    deadline = time.time() + 400
    while not (out / "metrics.jsonl").exists() or len((out / "metrics.jsonl").read_text().splitlines()) < 12:
        assert job_state(slurm, job) in ("PENDING", "RUNNING"), f"the job ended before the requeue:\n{read(output)}"
        assert time.time() < deadline, read(output)
        time.sleep(0.2)
    subprocess.run(["scontrol", "requeue", job], env=slurm, check=True, timeout=60)
    # Slurm holds a requeued job back for a while (its begin time); release it once it is pending
    while job_state(slurm, job) != "PENDING":
        assert time.time() < deadline, read(output)
        time.sleep(0.5)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=slurm, check=True, timeout=60)
    while job_state(slurm, job):
        assert time.time() < deadline, f"the requeued job did not end:\n{read(output)}"
        time.sleep(0.5)
    text = read(output)
    stopped = [line for line in text.splitlines() if "zerojax: stopped by SIGTERM after step" in line]
    assert len(stopped) == 1 and "(restart 1)" in text, text
    assert "resuming from the checkpoint at step" in text and "zerojax: done" in text, text
    np.testing.assert_allclose(losses(out), reference, rtol=1e-5)


@pytest.mark.slow
def test_a_batch_script_without_srun_exits_2_naming_srun(slurm, tmp_path):
    script = tmp_path / "no_srun.sh"
    args = " ".join([*TINY, "train.steps=1", f"train.out_dir={tmp_path / 'run'}"])
    script.write_text(f'#!/bin/bash\n"$ZEROJAX_PYTHON" -m zerojax train --no-progress {args}\necho "exit $?"\n')
    _, output = sbatch(slurm, tmp_path, script=script)
    lines = read(output).splitlines()
    assert lines[-1] == "exit 2", lines
    errors = [line for line in lines if line.startswith("zerojax: error:")]
    assert len(errors) == 1 and "srun" in errors[0] and "SLURM_NTASKS=2" in errors[0], lines
    assert not (tmp_path / "run").exists()  # nothing written before the error
