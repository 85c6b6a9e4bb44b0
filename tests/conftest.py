"""8 simulated CPU devices for every test, set before jax is imported."""

import contextlib
import os
import signal

# Most of the suite's time is compiling tiny programs: LLVM's optimisations (XLA's CPU backend at
# level 0) cost more than they save on them, and change no result (the tests compare programs
# compiled alike, or against tolerances). Subprocesses that must simulate their own devices get
# FAST_COMPILE as their XLA_FLAGS.
FAST_COMPILE = "--xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8 {FAST_COMPILE}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import yaml  # noqa: E402

# Repeated runs of the suite (and the CLI subprocesses) reuse compiled programs.
CACHE = Path(__file__).resolve().parent.parent / ".jax_cache"
jax.config.update("jax_compilation_cache_dir", str(CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def tiny_overrides(tmp_path):
    """A model and run small enough to compile and train in seconds (no checkpoints, so two
    runs into the same directory start afresh instead of resuming)."""
    return [
        "model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64",
        "model.seq_len=16", "train.global_batch=16", "train.steps=5", "train.log_every=1",
        "train.eval_every=0", "train.sample_tokens=0", "train.ckpt_every=0", f"train.out_dir={tmp_path / 'run'}",
    ]


def load_config_file(path: Path):
    """A configs/ file as a run loads it. A fine-tuning recipe that augments its images
    (data.augment) leaves the LeRobot dataset to the command line, and refuses to load without
    one: it gets the tiny fixture's."""
    from zerojax import config

    data = (yaml.safe_load(path.read_text()) or {}).get("data") or {}
    given = data.get("augment", "none") != "none" and "source" not in data
    return config.load(path, overrides=[f"data.source=lerobot:{ROOT / 'tests/fixtures/lerobot/tiny'}"] * given)


# A tiny GPT run of 5 steps on 32 rows (divisible by 8 devices x grad_accum 4); min_shard_size
# 64 shards nearly every leaf. Tests add train.out_dir and what they vary.
TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64", "model.seq_len=16",
        "train.steps=5", "train.log_every=1", "train.eval_every=0", "train.sample_tokens=0", "train.ckpt_every=0"]
SMALL = ["train.global_batch=32", "zero.min_shard_size=64"]


def run(overrides):
    """(losses, result) of a run of these overrides, without a progress bar."""
    from zerojax import config, train

    result = train.run(config.load(overrides=overrides), show_progress=False)
    return np.array([line["loss"] for line in result.history]), result


@contextlib.contextmanager
def sigterm_during(step: int):
    """A real SIGTERM to this process while the loop builds the batch of `step` (1-based, a
    train batch), as a preemption would send it: the loop's own handler runs, the loop finishes
    that step, checkpoints it and returns. The first step of a run is built before the loop
    installs its handlers, so `step` must be a later one."""
    from zerojax import data
    from zerojax.train import loop

    real = loop.global_batch

    def global_batch(setup, split, index):
        if split == data.TRAIN and index == step - 1:
            # Without the loop's handler, SIGTERM would end pytest itself: say so instead.
            assert callable(signal.getsignal(signal.SIGTERM)), f"no SIGTERM handler while step {step} is built"
            os.kill(os.getpid(), signal.SIGTERM)
        return real(setup, split, index)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop, "global_batch", global_batch)
        yield


def export_initial_state(setup, state, run_dir, out, fmt: str = "hf"):
    """Save `state` (a prepared run's initial state) as checkpoint 0 of `run_dir` and export it
    with `zerojax export --format fmt` into `out` (import-then-export round trips)."""
    from zerojax import cli, config
    from zerojax.train import checkpoint

    mgr = checkpoint.manager(run_dir, 1)
    checkpoint.save(mgr, setup.engine.plan, setup.engine.mesh, state, 0, config.to_dict(setup.cfg))
    mgr.wait_until_finished()
    mgr.close()
    assert cli.main(["export", str(run_dir), "--format", fmt, "--out", str(out)]) == 0
    return out


def one_error_line(argv, capsys) -> str:
    """`zerojax argv` refused as bad input: exit 2, one `zerojax: error:` line (returned)."""
    from zerojax import cli

    code = cli.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("zerojax: error: "), (code, err)
    return err[0]


def robot_observation(served, seed=0):
    """A robot's observation for a served policy: a random state and a random uint8 frame of each
    camera it reads, in the shapes of its dataset's features, and the prompt "pick"."""
    rng = np.random.default_rng(seed)
    obs = {"observation.state": rng.standard_normal(served.state_dim).astype(np.float32), "prompt": "pick"}
    features = served.observations.features
    obs.update({c: rng.integers(0, 256, features[c]["shape"], dtype=np.uint8) for c in served.cameras})
    return obs
