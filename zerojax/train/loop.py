"""The run loop: resume, checkpoints, signals, progress, metrics, the sample.

`run` steps the `Run` that `train.setup` builds (`prepare`, where bad input surfaces, then
`build`: the state, the checkpoint manager, the compiled step, the run directory) and reaches
back into none of it: it logs, evaluates, checkpoints, stops on a signal and samples at the
end. The step itself (the Engine, the jitted train step under either schedule) lives in
`zerojax.train.step`, the state in `zerojax.train.state`.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass
import jax
import numpy as np
from jax.experimental import multihost_utils
from zerojax import config as config_lib
from zerojax import data as data_lib
from zerojax.config import Config
from zerojax.errors import TrainingError
from zerojax.train import checkpoint
from zerojax.train import sinks as sinks_lib
from zerojax.train import state as state_lib
from zerojax.train.metrics import metrics_line, open_metrics, write_line
from zerojax.train.sample import Generator, Progress, sample_reply, sample_text
from zerojax.train.setup import Run, Setup, build, global_batch, prepare


def evaluate(setup: Setup, eval_step, params) -> float:
    losses = [eval_step(params, global_batch(setup, data_lib.EVAL, i))
              for i in range(setup.cfg.train.eval_batches)]
    return float(np.mean([float(x) for x in losses]))


@dataclass(frozen=True)
class Stopped:
    """A run cut short by a signal: it finished `step`, checkpointed it and returned."""

    signal: str  # "SIGTERM" or "SIGINT"
    step: int


@dataclass(frozen=True)
class RunResult:
    """What one call of `run` did."""

    history: list[dict]  # the metrics lines this call wrote (a resumed run: only its own)
    sample: str  # the text sampled at the end ("" if stopped, or the model has no `logits`)
    run_dir: str
    state: state_lib.TrainState  # the final state
    stopped: Stopped | None  # None: the run reached train.steps
    resumed_from: int  # the checkpoint step this call continued from (0: a fresh start)


def run(cfg: Config, *, show_progress: bool = True, setup: Setup | None = None) -> RunResult:
    """Train per `cfg`, writing the run directory (and resuming from its newest checkpoint).
    SIGTERM or SIGINT during a step: the loop finishes it, checkpoints and returns."""
    built = build(setup or prepare(cfg))
    start, lead, steps, out = built.setup.resume_step, built.lead, cfg.train.steps, cfg.run_dir
    state, history, saved_at, stopped = built.state, [], start, None
    with open_metrics(out / "metrics.jsonl", start, lead) as log, sinks_lib.open_sinks(cfg, start, lead) as sinks, \
            Progress(steps, show_progress and lead, start) as bar, StopSignals() as signals:
        tick, since, pending = time.perf_counter(), 0, None
        for i in range(start, steps):
            batch = built.first if i == start else global_batch(built.setup, data_lib.TRAIN, i)
            built.profile.before(i)
            state, metrics = built.train_step(state, batch)
            built.profile.after(i + 1, metrics)
            since += 1
            check_skipped(cfg, pending)
            pending = metrics["skipped_in_a_row"]  # read next step: keeps one step in flight
            step = i + 1
            if evals_at(cfg, step) or (cfg.train.log_every and step % cfg.train.log_every == 0):
                line = log_line(built, state, step, metrics, since, tick)
                write_line(log, line)
                sinks.write(line)
                history.append(line)
                bar.update(step, line)
                tick, since = time.perf_counter(), 0
            else:
                bar.update(step)
            received = signals.stop_after(step)
            if built.ckpt and (received or (cfg.train.ckpt_every and step % cfg.train.ckpt_every == 0)):
                save(built, state, step)
                saved_at = step
            if received:
                stopped = Stopped(received, step)
                break
    finish_checkpoints(built, state, stopped, saved_at)
    sample = "" if stopped else write_sample(built.setup, state, lead)
    return RunResult(history, sample, str(out), state, stopped, start)


def check_skipped(cfg: Config, pending) -> None:
    """TrainingError once precision.max_skipped_steps steps in a row had non-finite gradients
    (`pending`: that count after the step before, read a step late)."""
    if pending is not None and int(pending) >= cfg.precision.max_skipped_steps:
        raise TrainingError(
            f"{int(pending)} consecutive steps had non-finite gradients (precision.max_skipped_steps"
            f"={cfg.precision.max_skipped_steps}); lower optim.lr or check the data")


def evals_at(cfg: Config, step: int) -> bool:
    """train.eval_every's steps, and the last."""
    return bool(cfg.train.eval_every and (step % cfg.train.eval_every == 0 or step == cfg.train.steps))


def log_line(built: Run, state, step: int, metrics, since: int, tick: float) -> dict:
    """The metrics line of `step`: the step's metrics, the throughput over the `since` steps
    from `tick`, MFU, memory, and at an eval step the eval loss."""
    cfg = built.cfg
    metrics = jax.device_get(metrics)  # waits for this step: the time below includes it
    tokens_per_step = cfg.train.global_batch * cfg.model.seq_len
    line = metrics_line(step, metrics, since * tokens_per_step / (time.perf_counter() - tick))
    line.update(({"mfu": round(built.mfu(line["tokens_per_sec"]), 4)} if built.mfu else {}), **sinks_lib.memory_gb())
    if evals_at(cfg, step):
        line["eval_loss"] = evaluate(built.setup, built.eval_step, state_lib.forward_params(built.engine, state))
    return line


def save(built: Run, state, step: int) -> None:
    checkpoint.save(built.ckpt, built.engine.plan, built.engine.mesh, state, step, config_lib.to_dict(built.cfg))


def finish_checkpoints(built: Run, state, stopped: Stopped | None, saved_at: int) -> None:
    """The last step saved (unless a signal stopped the run, which saved its own), and every
    save complete before the run returns."""
    if not built.ckpt:
        return
    if stopped is None and saved_at != built.cfg.train.steps:
        save(built, state, built.cfg.train.steps)
    built.ckpt.wait_until_finished()  # never exit before the last save is complete
    built.ckpt.close()


def write_sample(setup: Setup, state, lead: bool) -> str:
    """The end-of-run sample of `train.sample_tokens` tokens (every process samples: SPMD; a model
    without `logits`, or sample_tokens=0, has none), written to sample.txt by process 0."""
    cfg, engine = setup.cfg, setup.engine
    sample = ""
    chat = getattr(setup.source, "sample_messages", None)  # a chat source: a reply to its last conversation
    n_new = cfg.train.sample_tokens
    if n_new and engine.units.has_logits and (setup.corpus is not None or chat):
        generator = Generator(engine.view, state_lib.forward_params(engine, state), cfg.model.seq_len, engine.units.has_decode,
                              vocab=setup.source.vocab_size)
        sample = sample_text(generator, setup.corpus, cfg.train.seed, n_new=n_new) if setup.corpus is not None else \
            sample_reply(generator, setup.source, cfg.train.seed, n_new)
    if lead:
        (cfg.run_dir / "sample.txt").write_text(sample)
    return sample


class StopSignals:
    """SIGTERM and SIGINT ask the loop to finish its step, checkpoint and return; a second
    SIGINT aborts at once (KeyboardInterrupt).

    With several processes every one must stop after the same step, or the one still stepping
    waits forever in a collective the other never joins. SIGTERM there is JAX's preemption
    notice (`jax.distributed` catches it): whichever processes receive it, all agree on the
    step after the furthest one (`multihost_utils.reached_preemption_sync_point`, asked once a
    step), as orbax and MaxText do. SIGINT, typed at one terminal, stays local."""

    received: str | None = None

    def __enter__(self):
        self.previous = {}
        self.preemption = jax.process_count() > 1 and jax.config.jax_enable_preemption_service
        if threading.current_thread() is threading.main_thread():
            # JAX's own SIGTERM handler stays in place where it agrees the step
            for sig in (signal.SIGINT,) if self.preemption else (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def stop_after(self, step: int) -> str | None:
        """The signal that stops the run after `step`, or None to go on; call once every step."""
        if self.preemption and multihost_utils.reached_preemption_sync_point(step):
            return "SIGTERM"
        return self.received

    def _handle(self, signum, frame):
        self.received = signal.Signals(signum).name
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
