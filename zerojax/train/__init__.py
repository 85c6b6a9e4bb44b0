"""Training: the state and its step, the run's set-up and loop, checkpoints, export and sampling.

    model.py       the model a config names (LoRA attached), its parameter plan
    state.py       TrainState: born sharded, placed where zero.offload says, and its views
    step.py        the Engine (everything the compiled step needs) and the jitted step
    setup.py       prepare (where bad input surfaces) and build: the Run, set up in one pass
    loop.py        run: the loop over a built Run
    metrics.py     metrics.jsonl, continued on resume
    checkpoint.py  orbax save / restore / reshard
    export.py      a checkpoint as safetensors, a Hugging Face or a PEFT directory
    sample.py      generation, progress bar
    answer.py      greedy answers of a vision-language run to its held-out examples, exact match
    sinks.py       where a logged metrics line goes besides metrics.jsonl (TensorBoard, W&B)

The package names the run's set-up and loop (`prepare`, `build`, `run` and what they hand
around), so importing any of its modules imports the loop too; the rest is `train.MODULE.NAME`.
"""

from zerojax.train.loop import RunResult, Stopped, evaluate, run
from zerojax.train.setup import Run, Setup, build, global_batch, prepare, resume_step, start_state

__all__ = ["Run", "RunResult", "Setup", "Stopped", "build", "evaluate", "global_batch", "prepare", "resume_step",
           "run", "start_state"]
