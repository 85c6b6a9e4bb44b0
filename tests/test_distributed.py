"""Several processes on this machine form one mesh through jax.distributed (gloo on CPU)."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import FAST_COMPILE, ROOT
from zerojax import config, train
from zerojax.train import checkpoint

pytestmark = pytest.mark.slow

TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64", "model.seq_len=16",
        "train.global_batch=16", "train.log_every=1", "train.eval_every=0", "train.sample_tokens=0", "zero.min_shard_size=64",
        "optim.schedule=constant", "optim.warmup_steps=0"]  # constant lr: a 6-step run is a 12-step run's start


def env():
    # launch_local.sh runs zerojax with the interpreter running these tests (not $PYTHON, which
    # `make test PYTHON=python3.13` sets to the bare Python that created .venv)
    e = {**os.environ, "JAX_PLATFORMS": "cpu", "ZEROJAX_PYTHON": sys.executable}
    e["XLA_FLAGS"] = FAST_COMPILE  # no device count: the CLI must simulate its 8 CPU devices by itself
    return e


def launch(processes, out, *args, timeout=300):
    """launch_local.sh in a session of its own: past `timeout` the whole group is killed (the
    script and every zerojax process it started), so a stuck run never outlives its test and
    starves the next ones of CPU."""
    cmd = ["bash", str(ROOT / "scripts" / "bench" / "launch_local.sh"), str(processes), "--no-progress", *TINY,
           f"train.out_dir={out}", *args]
    with subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as popen:
        try:
            stdout, stderr = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGKILL)
            stdout, stderr = popen.communicate()
            pytest.fail(f"{processes} processes did not finish in {timeout} s:\n{stderr[-3000:]}")
    proc = subprocess.CompletedProcess(cmd, popen.returncode, stdout, stderr)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def losses(out):
    return np.array([json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()])


def one_process(out, *args):
    train.run(config.load(overrides=TINY + [f"train.out_dir={out}", *args]), show_progress=False)
    return losses(out)


# (overrides, the mesh the startup line shows on 2 processes x 4 devices). mesh.replica=2 mesh.data=4
# given explicitly is the first case's mesh, and its run the same one: not run again here.
TWO_PROCESS_CASES = [
    (["zero.stage=3", "zero.schedule=shard_map"], "{'replica': 2, 'data': 4} (default: one replica per process"),
    (["zero.stage=1", "zero.schedule=gspmd"], "{'replica': 2, 'data': 4}"),
    (["zero.stage=3", "mesh.data=8"], "{'replica': 1, 'data': 8},"),  # one FSDP group over both processes
]


@pytest.mark.parametrize("extra, mesh", TWO_PROCESS_CASES, ids=[" ".join(e) for e, _ in TWO_PROCESS_CASES])
def test_two_processes_equal_one(extra, mesh, tmp_path):
    reference = one_process(tmp_path / "one", "train.steps=5", "train.ckpt_every=0", *extra)
    proc = launch(2, tmp_path / "two", "train.steps=5", *extra)
    assert "8 cpu devices" in proc.stdout and proc.stdout.count("zerojax: done") == 1  # process 0 speaks
    assert f"mesh {mesh}" in proc.stdout, proc.stdout
    np.testing.assert_allclose(losses(tmp_path / "two"), reference, rtol=1e-5)


def test_checkpoints_move_between_process_counts(tmp_path):
    reference = one_process(tmp_path / "ref", "train.steps=12", "train.ckpt_every=0")
    launch(2, tmp_path / "a", "train.steps=6")  # written by two processes ...
    one_process(tmp_path / "a", "train.steps=12")  # ... resumed by one
    np.testing.assert_allclose(losses(tmp_path / "a"), reference, rtol=1e-5)
    one_process(tmp_path / "b", "train.steps=6")  # and the reverse
    launch(2, tmp_path / "b", "train.steps=12", "zero.stage=1")
    np.testing.assert_allclose(losses(tmp_path / "b"), reference, rtol=1e-5)


def test_a_dead_process_stops_the_other_and_the_run_resumes(tmp_path):
    port = 23456 + os.getpid() % 1000
    args = ["--no-progress", *TINY, "train.steps=30", "train.ckpt_every=2", f"train.out_dir={tmp_path}",
            "mesh.timeout_s=20", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
    procs = [subprocess.Popen([sys.executable, "-m", "zerojax", "train", *args, "--process-id", str(i)], env=env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(2)]
    deadline = time.time() + 240
    while 4 not in checkpoint.complete_steps(tmp_path) and time.time() < deadline:
        assert procs[0].poll() is None, procs[0].stderr.read()[-2000:]
        time.sleep(0.2)
    procs[1].send_signal(signal.SIGKILL)
    start = time.time()
    code = procs[0].wait(timeout=120)  # never a silent hang
    assert code != 0 and time.time() - start < 100
    procs[1].wait()
    done = checkpoint.complete_steps(tmp_path)[-1]
    launch(2, tmp_path, "train.steps=30", "train.ckpt_every=2", "mesh.timeout_s=20", timeout=600)
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 31)) and done >= 4


def test_sigterm_to_one_process_stops_both_after_the_same_step_and_the_run_resumes(tmp_path):
    """Slurm signals every task, but never at the same instant: a process that stopped alone
    would leave the other waiting in a collective. Here only process 1 hears SIGTERM."""
    reference = one_process(tmp_path / "ref", "train.steps=30", "train.ckpt_every=0")
    port = 23456 + (os.getpid() + 500) % 1000
    out = tmp_path / "two"
    args = ["--no-progress", *TINY, "train.steps=30", "train.ckpt_every=1000", f"train.out_dir={out}",
            "mesh.timeout_s=20", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
    procs = [subprocess.Popen([sys.executable, "-m", "zerojax", "train", *args, "--process-id", str(i)], env=env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        deadline = time.time() + 240
        while not (out / "metrics.jsonl").exists() or len((out / "metrics.jsonl").read_text().splitlines()) < 3:
            assert procs[0].poll() is None and time.time() < deadline, procs[0].stderr.read()[-2000:]
            time.sleep(0.1)
        procs[1].send_signal(signal.SIGTERM)
        outputs = [p.communicate(timeout=120) for p in procs]  # a process stopping alone hangs the other
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outputs]
    stopped = [line for line in outputs[0][0].splitlines() if "zerojax: stopped by SIGTERM after step" in line]
    assert len(stopped) == 1, outputs[0][0]
    step = checkpoint.complete_steps(out)[-1]
    assert f"after step {step}" in stopped[0] and 3 <= step < 30
    launch(2, out, "train.steps=30", "train.ckpt_every=1000", timeout=600)
    np.testing.assert_allclose(losses(out), reference, rtol=1e-5)


def test_no_coordinator_is_a_clear_error_not_a_hang(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "zerojax", "train", "--coordinator", "127.0.0.1:9", "--num-processes",
                           "2", "--process-id", "1", "mesh.timeout_s=2", f"train.out_dir={tmp_path}"], env=env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "zerojax: error: process 1 of 2 found no coordinator at 127.0.0.1:9 within mesh.timeout_s=2s" in proc.stderr
