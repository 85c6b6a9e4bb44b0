"""What a run reports besides metrics.jsonl: TensorBoard event files read back by TensorBoard's
own EventAccumulator (their scalars equal metrics.jsonl's), a jax.profiler trace of
train.profile's steps, and the input errors of train.profile and train.wandb."""

import json

import pytest
from conftest import TINY
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from zerojax import config, train
from zerojax.config import devices
from zerojax.errors import ConfigError
from zerojax.train import sinks


def test_tensorboard_scalars_equal_the_metrics_and_the_profile_is_written(tmp_path):
    out = tmp_path / "run"
    cfg = config.load(overrides=TINY + ["train.global_batch=16", "train.eval_every=5", "train.sample_tokens=0", f"train.out_dir={out}",
                                        "train.profile=2:4", "train.report=false"])
    train.run(cfg, show_progress=False)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(out))
    events.Reload()
    for key, tag in (("loss", "train/loss"), ("lr", "train/lr"), ("grad_norm", "train/grad_norm"),
                     ("tokens_per_sec", "perf/tokens_per_sec"), ("eval_loss", "eval/loss")):
        logged = [(line["step"], line[key]) for line in lines if key in line]
        scalars = events.Scalars(tag)
        assert logged and [e.step for e in scalars] == [step for step, _ in logged]
        assert [e.value for e in scalars] == pytest.approx([value for _, value in logged], rel=1e-6)
    assert list((out / "plugins" / "profile").rglob("*.xplane.pb"))  # what TensorBoard's profile tab reads


@pytest.mark.parametrize("profile", ["5:9", "3:3", "x", "4"])
def test_a_profile_outside_the_run_is_refused(profile):
    with pytest.raises(ConfigError, match="train.profile=.* is not a range of the run's steps"):
        config.load(overrides=TINY + [f"train.profile={profile}"])


def test_wandb_without_the_extra_names_the_install(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"pip install 'zerojax\[wandb\]'"):
        sinks.check(config.load(overrides=TINY + ["train.wandb=my-project"]))


def test_device_kinds_for_mfu():
    assert devices.from_device_kind("NVIDIA H100 80GB HBM3").name == "h100"
    assert devices.from_device_kind("NVIDIA A100-SXM4-40GB").name == "a100-40"
    assert devices.from_device_kind("NVIDIA A100-SXM4-80GB").name == "a100-80"
    assert devices.from_device_kind("TPU v5 lite").name == "tpu-v5e"
    assert devices.from_device_kind("cpu") is None
