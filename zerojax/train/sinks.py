"""Where a logged metrics line goes besides metrics.jsonl, and what the loop adds to it:

    TensorBoard   event files in the run directory (tensorboardX), `tensorboard --logdir runs/`
    W&B           train.wandb=PROJECT, the optional extra zerojax[wandb] (WANDB_MODE=offline works)
    mfu           model FLOPs per token (the family's PaLM formula) x tokens/s over the devices'
                  peak, where the device kind is in config.devices
    memory        device_memory_gb and peak_memory_gb where the backend reports memory_stats()
    profile       train.profile=START:STOP: a jax.profiler trace into <run dir>/plugins/profile
"""

from __future__ import annotations

import contextlib
import jax
from zerojax.config import devices as devices_lib
from zerojax.config import rules
from zerojax.errors import ConfigError
from zerojax.precision import Policy
from zerojax.train import model as model_lib

TAGS = {"loss": "train/loss", "eval_loss": "eval/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
        "loss_scale": "train/loss_scale", "skipped": "train/skipped", "tokens_per_sec": "perf/tokens_per_sec",
        "mfu": "perf/mfu", "device_memory_gb": "memory/device_gb", "peak_memory_gb": "memory/peak_gb"}
WANDB_INSTALL = "pip install 'zerojax[wandb]'"


def check(cfg) -> None:
    """Before anything is written: train.wandb needs the extra installed."""
    if cfg.train.wandb:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ConfigError(f"train.wandb={cfg.train.wandb!r} needs the W&B client: {WANDB_INSTALL} "
                              "(or train.wandb='' to log without it)") from None


class Sinks:
    """The writers of one run (process 0's; the others get none)."""

    def __init__(self, cfg, resume_step: int, lead: bool):
        self.tb = self.wandb = None
        if lead and cfg.train.tensorboard:
            from tensorboardX import SummaryWriter

            # purge_step: a resumed run drops the events of the steps it runs again
            self.tb = SummaryWriter(logdir=str(cfg.run_dir), purge_step=resume_step + 1 if resume_step else None)
        if lead and cfg.train.wandb:
            import wandb

            self.wandb = wandb.init(project=cfg.train.wandb, name=cfg.name, dir=str(cfg.run_dir), resume="allow")

    def write(self, line: dict) -> None:
        scalars = {TAGS[k]: float(v) for k, v in line.items() if k in TAGS and v is not None}
        if self.tb:
            for tag, value in scalars.items():
                self.tb.add_scalar(tag, value, line["step"])
            self.tb.flush()
        if self.wandb:
            self.wandb.log(scalars, step=line["step"])

    def close(self) -> None:
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()


@contextlib.contextmanager
def open_sinks(cfg, resume_step: int, lead: bool):
    sinks = Sinks(cfg, resume_step, lead)
    try:
        yield sinks
    finally:
        sinks.close()


def mfu_of(cfg, mesh):
    """tokens/s -> MFU for this run's devices, or None where the kind or the model's FLOPs are
    unknown (a model of your own without `flops_per_token`, the CPU)."""
    device = devices_lib.from_device_kind(mesh.devices.flat[0].device_kind)
    model = model_lib.abstract_model(cfg.model, Policy(), cfg.train.seed, cfg.optim.lora)
    if device is None or not callable(getattr(model, "flops_per_token", None)):
        return None
    peak = device.peak_flops * mesh.devices.size
    per_token = float(model.flops_per_token(cfg.model.seq_len))
    return lambda tokens_per_sec: per_token * tokens_per_sec / peak


def memory_gb() -> dict:
    """This process's first device: bytes in use and the peak so far, where reported."""
    stats = jax.local_devices()[0].memory_stats() or {}
    out = {}
    if "bytes_in_use" in stats:
        out["device_memory_gb"] = round(stats["bytes_in_use"] / 1e9, 3)
    if "peak_bytes_in_use" in stats:
        out["peak_memory_gb"] = round(stats["peak_bytes_in_use"] / 1e9, 3)
    return out


class Profile:
    """jax.profiler around the steps START+1..STOP of train.profile (the trace ends after STOP's
    results are ready, so its device work is inside it)."""

    def __init__(self, cfg):
        self.bounds, self.dir, self.on = rules.profile_range(cfg.train.profile, cfg.train.steps), cfg.run_dir, False

    def before(self, step: int) -> None:
        if self.bounds and step == self.bounds[0] and not self.on:
            jax.profiler.start_trace(str(self.dir))
            self.on = True

    def after(self, step: int, result) -> None:
        if self.on and step >= self.bounds[1]:
            jax.block_until_ready(result)
            jax.profiler.stop_trace()
            self.on = False
