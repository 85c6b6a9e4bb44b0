"""Checkpoints: resume on another mesh/stage/schedule, preemption, crashes, export."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import FAST_COMPILE, sigterm_during
from zerojax import cli, config, train
from zerojax.train import checkpoint
from zerojax.train import export as export_lib

# Padded on 8 and on 4 devices (vocab 300, d_model 36): restore must re-pad for the new size.
BASE = ["model.d_model=36", "model.vocab_size=300", "model.n_layers=2", "model.n_heads=2", "model.d_ff=72",
        "model.seq_len=16", "train.global_batch=16", "train.log_every=1", "train.eval_every=0", "train.sample_tokens=0",
        "zero.min_shard_size=64", "train.steps=12", "train.ckpt_every=3"]


def run(out, *extra):
    cfg = config.load(overrides=BASE + [f"train.out_dir={out}", *extra])
    return train.run(cfg, show_progress=False)


def losses(out):
    return np.array([json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    result = run(out, "zero.stage=3")
    return losses(out), result.state


@pytest.mark.parametrize("after", [
    ["mesh.replica=1", "mesh.data=4", "zero.stage=1"],
    ["mesh.replica=2", "mesh.data=4", "zero.stage=2"],
    ["zero.stage=3", "zero.schedule=gspmd"],
], ids=lambda a: " ".join(a))
def test_resume_on_another_mesh_stage_or_schedule(after, uninterrupted, tmp_path):
    with sigterm_during(6):
        first = run(tmp_path, "zero.stage=3")
    assert first.stopped == train.Stopped("SIGTERM", 6)
    assert checkpoint.complete_steps(tmp_path) == [3, 6]
    second = run(tmp_path, *after)
    assert second.resumed_from == 6
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 13))  # continued: no step missing or twice
    np.testing.assert_allclose(losses(tmp_path), uninterrupted[0], rtol=1e-5)  # fp32; sums reordered


def test_same_mesh_resume_is_bit_identical(uninterrupted, tmp_path):
    with sigterm_during(5):  # stopped between two periodic checkpoints
        assert run(tmp_path, "zero.stage=3").stopped == train.Stopped("SIGTERM", 5)
    result = run(tmp_path, "zero.stage=3")
    np.testing.assert_array_equal(losses(tmp_path), uninterrupted[0])
    for a, b in zip(jax.tree.leaves(result.state), jax.tree.leaves(uninterrupted[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert checkpoint.complete_steps(tmp_path)[-1] == 12


def test_only_the_run_removes_a_killed_saves_leftovers(tmp_path):
    # A killed save leaves `<step>.orbax-checkpoint-tmp` behind. Orbax removes it in a background
    # thread of each manager that cleans up; two doing it at once raced (one rmtree found the files
    # gone and the resumed run died). Checking the resume point must read, never clean.
    run(tmp_path, "train.steps=3")
    leftover = tmp_path / "checkpoints" / "6.orbax-checkpoint-tmp" / "state.orbax-checkpoint-tmp"
    for i in range(50):
        (leftover / f"d{i}").mkdir(parents=True)
        (leftover / f"d{i}" / "chunk").write_bytes(b"x" * 64)
    cfg = config.load(overrides=BASE + [f"train.out_dir={tmp_path}", "train.steps=6"])
    assert train.resume_step(cfg) == 3
    time.sleep(1.0)  # a cleanup thread started by the check would have removed it by now
    assert leftover.is_dir() and len(list(leftover.iterdir())) == 50
    train.run(cfg, show_progress=False)
    assert not leftover.parent.exists() and checkpoint.complete_steps(tmp_path) == [3, 6]


def test_export_has_true_shapes_and_the_models_logits(tmp_path):
    result = run(tmp_path, "zero.stage=3", "train.steps=4")
    out = tmp_path / "model.safetensors"
    assert cli.main(["export", str(tmp_path), "--out", str(out)]) == 0
    from safetensors.numpy import load_file

    tensors = load_file(out)
    setup = train.prepare(config.load(overrides=BASE + ["zero.stage=3", "train.steps=4", f"train.out_dir={tmp_path}"]))
    plan = {leaf.path: leaf for leaf in jax.tree.leaves(setup.engine.plan.leaves)}
    assert {name: tuple(t.shape) for name, t in tensors.items()} == {p: leaf.shape for p, leaf in plan.items()}
    assert [p for p, leaf in plan.items() if leaf.padded]  # vocab 300 is stored padded to 304 rows on 8 devices
    assert sum(x.size for x in tensors.values()) == sum(np.prod(leaf.shape) for leaf in jax.tree.leaves(setup.engine.plan.leaves))
    # a fresh single-device model with the exported weights computes the trained model's logits
    graphdef = setup.engine.units.graphdef
    params = {}
    for name, value in tensors.items():
        *parents, last = name.split("/")
        node = params
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    tokens = np.arange(32, dtype=np.int32).reshape(2, 16) % 256
    fresh = nnx.merge(graphdef, jax.device_put(params, jax.devices()[0])).logits(tokens)
    trained = jax.jit(lambda p: setup.engine.view(p).logits(tokens))(result.state.params)
    np.testing.assert_allclose(np.asarray(fresh), np.asarray(trained), rtol=1e-5, atol=1e-5)
    # and back: init_from starts a new run from exactly these weights (bf16 export rounds them)
    ft = train.prepare(config.load(
        overrides=BASE + ["zero.stage=1", "mesh.replica=1", "mesh.data=4", f"model.init_from={out}", f"train.out_dir={tmp_path / 'ft'}"]))
    start = train.start_state(ft, None, None, None)
    for name, value in tensors.items():
        np.testing.assert_array_equal(np.asarray(export_lib._get(start.params, name))[tuple(slice(0, s) for s in value.shape)], value)
    assert cli.main(["export", str(tmp_path), "--out", str(tmp_path / "half.safetensors"), "--dtype", "bfloat16"]) == 0
    assert (tmp_path / "half.safetensors").stat().st_size < 0.55 * out.stat().st_size


def test_not_a_checkpoint_exits_2(tmp_path, capsys):
    (tmp_path / "checkpoints" / "3").mkdir(parents=True)
    (tmp_path / "checkpoints" / "3" / "junk").write_text("not orbax")
    assert cli.main(["train", *BASE, f"train.out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zerojax: error: checkpoint") and "/checkpoints/3" in err and err.count("\n") == 1
    assert cli.main(["export", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x.safetensors")]) == 2
    assert "holds no checkpoints/ directory" in capsys.readouterr().err
    assert cli.main(["train", *BASE, f"train.out_dir={tmp_path}", "train.resume=never"]) == 2
    assert "already holds a run" in capsys.readouterr().err


def start(out, *extra):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = FAST_COMPILE  # no device count: the CLI must simulate its 8 CPU devices by itself
    args = [sys.executable, "-m", "zerojax", "train", "--no-progress", *BASE, "train.steps=24", "train.ckpt_every=2",
            f"train.out_dir={out}", *extra]
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_checkpoint(proc, out, step, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if step in checkpoint.complete_steps(out):
            return
        time.sleep(0.2)
    raise AssertionError(f"no checkpoint {step} in time: {proc.poll()} {proc.stderr.read() if proc.poll() else ''}")


@pytest.mark.slow
def test_killed_run_resumes_and_ends_where_an_unkilled_run_ends(tmp_path):
    reference = start(tmp_path / "ref")
    assert reference.wait(timeout=300) == 0
    victim = start(tmp_path / "run")
    wait_for_checkpoint(victim, tmp_path / "run", 4)
    victim.send_signal(signal.SIGKILL)  # possibly mid-save
    victim.wait(timeout=60)
    again = start(tmp_path / "run")
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    assert "resuming from the checkpoint at step" in out
    np.testing.assert_array_equal(losses(tmp_path / "run"), losses(tmp_path / "ref"))


@pytest.mark.slow
def test_sigterm_checkpoints_the_last_step_and_exits_0(tmp_path):
    proc = start(tmp_path)
    wait_for_checkpoint(proc, tmp_path, 4)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert f"stopped by SIGTERM after step {last}" in out and last < 24
    assert checkpoint.complete_steps(tmp_path)[-1] == last


def test_a_changed_model_or_a_bad_init_file_exits_2_and_leaves_the_run_alone(tmp_path, capsys):
    run(tmp_path / "run", "zero.stage=3", "train.steps=3")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert cli.main(["train", *BASE, "train.steps=6", "model.d_model=40", f"train.out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "holds a different model than the config asks for" in err and err.count("\n") == 1, err
    (tmp_path / "notes.safetensors").write_text("not a safetensors file")
    assert cli.main(["train", *BASE, f"model.init_from={tmp_path / 'notes.safetensors'}",
                     f"train.out_dir={tmp_path / 'new'}"]) == 2
    err = capsys.readouterr().err
    assert "is not a readable safetensors file" in err and err.count("\n") == 1, err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == sorted(before + [Path("notes.safetensors")])
    assert run(tmp_path / "run", "zero.stage=3", "train.steps=6").resumed_from == 3  # still usable
