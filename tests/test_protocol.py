"""Bring your own model: a model written only against the unit protocol (tests/twostack_model.py:
two stacks, neither called `blocks`, an untied read-out, an outer unit with no `embed` or
`head`, a masked loss) trains at every stage and schedule as on one device, resumes on another
mesh, and every way a `model.family` can be wrong is one line and exit code 2."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import FAST_COMPILE, ROOT, run, sigterm_during
from zerojax import cli, config, train
from zerojax.train import checkpoint

TESTS = ROOT / "tests"
FAMILY = "model.family=twostack_model:build"
TINY = [FAMILY, "model.d_model=32", "model.n_layers=2", "model.seq_len=16", "train.global_batch=32",
        "zero.min_shard_size=64", "train.steps=4", "train.log_every=1", "train.eval_every=0", "train.sample_tokens=0", "train.ckpt_every=0"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run(TINY + ["mesh.replica=1", "mesh.data=1", "zero.stage=0", "zero.schedule=gspmd",
                       f"train.out_dir={tmp_path_factory.mktemp('ref')}"])[0]


@pytest.mark.parametrize("extra", [
    ["zero.stage=3", "zero.schedule=shard_map"],
    ["zero.stage=3", "zero.schedule=gspmd"],
    ["zero.stage=0", "zero.schedule=shard_map"],
    ["zero.stage=2", "zero.schedule=shard_map", "mesh.replica=2", "mesh.data=4", "train.grad_accum=2"],
    ["zero.stage=3", "zero.schedule=shard_map", "model.remat=dots", "zero.prefetch=2"],
], ids=lambda e: " ".join(e))
def test_a_model_of_your_own_matches_one_device(extra, reference, tmp_path):
    # The masked loss gives each device's rows a different weight: only the weighted mean of
    # protocol.py (Σ w·l / Σ w) makes 8 devices and 2 microbatches equal one device.
    losses, result = run(TINY + extra + ["train.sample_tokens=200", f"train.out_dir={tmp_path}"])
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    assert set(result.state.params) == {"tok", "tower", "bridge", "decoder", "final", "readout"}
    assert result.sample == ""  # no `logits` method: nothing to sample


def test_the_weights_matter(tmp_path):
    """Control for the test above: with a bare mean per device (weights dropped), 8 devices
    would not equal one device. Here the same run's per-device weights really differ."""
    setup = train.prepare(config.load(overrides=TINY + [f"train.out_dir={tmp_path}"]))
    batch = np.asarray(train.global_batch(setup, 0, 0))
    counts = [(rows[:, 1:] != ord(" ")).sum() for rows in np.split(batch, 8)]
    assert len(set(counts)) > 1, counts


def test_a_checkpoint_of_it_resumes_on_another_mesh(tmp_path):
    common = TINY + ["train.steps=6", "train.ckpt_every=3", "optim.warmup_steps=2"]
    whole, _ = run(common + ["zero.stage=3", f"train.out_dir={tmp_path / 'whole'}"])
    with sigterm_during(3):
        first = train.run(config.load(overrides=common + ["zero.stage=3", f"train.out_dir={tmp_path / 'run'}"]),
                          show_progress=False)
    assert first.stopped == train.Stopped("SIGTERM", 3) and checkpoint.complete_steps(tmp_path / "run") == [3]
    second = train.run(config.load(overrides=common + ["zero.stage=1", "mesh.replica=2", "mesh.data=4",
                                                       f"train.out_dir={tmp_path / 'run'}"]), show_progress=False)
    assert second.resumed_from == 3
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    np.testing.assert_allclose([x["loss"] for x in lines], whole, rtol=1e-5)
    # and it exports, under its own parameter paths, with its true shapes
    assert cli.main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "model.safetensors")]) == 0
    from safetensors.numpy import load_file

    tensors = load_file(tmp_path / "model.safetensors")
    params = second.state.params
    assert tensors["decoder/attn/query/kernel"].shape == params["decoder"]["attn"]["query"]["kernel"].shape
    assert {name.split("/")[0] for name in tensors} == {"tok", "tower", "bridge", "decoder", "final", "readout"}
    np.testing.assert_array_equal(tensors["readout/kernel"], np.asarray(params["readout"]["kernel"]))


@pytest.mark.parametrize("family, message", [
    ("mystery", "model.family='mystery' is not valid; choose one of gpt, llama, gemma, paligemma, pi0, pi05, smolvla, or module:factory"),
    ("no_such_module:build", "model.family=no_such_module:build: cannot import no_such_module (ModuleNotFoundError"),
    ("twostack_model:nothing", "model.family=twostack_model:nothing: module twostack_model has no callable 'nothing'"),
    ("twostack_model:no_exit", "model.family=twostack_model:no_exit: the model has no `exit` method"),
    ("twostack_model:not_a_module", "model.family=twostack_model:not_a_module: the factory returned a dict"),
    ("twostack_model:wrong_signature", "cannot be called as factory(cfg=..., policy=..., rngs=...)"),
])
def test_a_bad_family_is_one_line_and_exit_2(family, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(TESTS))
    assert cli.main(["train", f"model.family={family}", "train.steps=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zerojax: error: ") and err.count("\n") == 1, err
    assert message in err, err
    assert list(tmp_path.iterdir()) == []


def test_the_old_key_points_to_the_new_one(capsys):
    assert cli.main(["train", "model.name=gpt"]) == 2
    assert "model.name was replaced by model.family (gpt | llama | module:factory)" in capsys.readouterr().err


def zerojax(*args, cwd):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = FAST_COMPILE  # no device count: the CLI must simulate its 8 CPU devices by itself
    return subprocess.run([sys.executable, "-m", "zerojax", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_an_import_error_in_the_users_module_is_bad_input(tmp_path):
    (tmp_path / "broken.py").write_text("import not_installed_anywhere\n")
    proc = zerojax("train", "model.family=broken:build", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr == ("zerojax: error: model.family=broken:build: cannot import broken (ModuleNotFoundError: "
                           "No module named 'not_installed_anywhere')\n")


def test_config_and_the_registry_import_no_jax():
    """The families' modules (and jax) are imported when a family is first asked for, not before."""
    code = ("import sys, zerojax.config, zerojax.models.registry, zerojax.models.family; "
            "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if m.startswith(('jax', 'flax')))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_a_bug_in_the_users_model_shows_its_traceback(tmp_path):
    (tmp_path / "twostack_model.py").write_text((TESTS / "twostack_model.py").read_text())
    proc = zerojax("train", "model.family=twostack_model:buggy", cwd=tmp_path)
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "ZeroDivisionError: a bug in the user's model" in proc.stderr


def readme_example() -> str:
    """The Python block of the guide "Bring your own model" (docs/guides/bring-your-own-model.md)."""
    text = (ROOT / "docs" / "guides" / "bring-your-own-model.md").read_text()
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


@pytest.mark.slow
def test_the_readme_example_trains_through_the_cli(tmp_path):
    code = readme_example()
    assert len(code.splitlines()) <= 60
    (tmp_path / "my_model.py").write_text(code)
    proc = zerojax("train", "--no-progress", "model.family=my_model:build", "train.steps=30", "train.eval_every=30",
                   "train.ckpt_every=0", "model.seq_len=32", "train.global_batch=16", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "(my_model:build)" in proc.stdout and "zerojax: done" in proc.stdout
    lines = [json.loads(x) for x in (tmp_path / "runs" / "tiny" / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["eval_loss"] < lines[0]["loss"] - 0.5, lines  # it learns
