"""Tests never read or write the user's files: each test runs in its own temporary directory.

A config without `train.out_dir` runs in `runs/<config name>`, relative to the working
directory; run from the repository, a test would resume (or refuse) the user's `make train`
run, and leave its own run behind. Paths a test needs from the repository are absolute
(`conftest.ROOT`). Loaded as a plugin by pyproject.toml (`addopts = ["-p", "_isolation"]`).
"""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session", autouse=True)
def _session_cwd(tmp_path_factory):
    """Module- and session-scoped fixtures run before any test's own directory exists.

    Subprocesses (`python -m zerojax`, scripts/bench/launch_local.sh) no longer start in the checkout,
    so `python -m` would import whichever zerojax the interpreter has installed: put the
    checkout under test first on their PYTHONPATH."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        mp.chdir(tmp_path_factory.mktemp("cwd"))
        mp.setenv("ZEROJAX_CACHE", str(tmp_path_factory.mktemp("cache")))  # tokenized corpora: not ~/.cache
        # The subprocesses' compiled programs go to the suite's compilation cache too (jax reads
        # these at startup): the 2-process runs of several tests compile the same steps.
        mp.setenv("JAX_COMPILATION_CACHE_DIR", str(ROOT / ".jax_cache"))
        mp.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
        yield


@pytest.fixture(autouse=True)
def _test_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def _no_realtime_left_behind():
    """A test that leaves this worker on a real-time scheduling policy (a library that raised it,
    as SVT-AV1 does as root) errors here and the worker is put back: left so, every later
    subprocess inherits it and a spin-waiting one never yields its core."""
    yield
    from zerojax.sim import video

    raised = video.realtime_threads()
    for tid in raised:
        try:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        except OSError:  # the thread ended meanwhile
            pass
    assert not raised, f"the test left {len(raised)} of this worker's threads on a real-time scheduling policy"
