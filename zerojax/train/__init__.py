"""Training: the state and its step, the run loop, checkpoints, export and sampling.

    model.py       the model a config names (LoRA attached), its parameter plan
    state.py       TrainState: born sharded, placed where zero.offload says
    step.py        the Engine (everything the compiled step needs) and the jitted step
    loop.py        prepare (set-up, where bad input surfaces) and run (the loop)
    metrics.py     metrics.jsonl, continued on resume
    checkpoint.py  orbax save / restore / reshard
    export.py      a checkpoint as safetensors, a Hugging Face or a PEFT directory
    sample.py      generation, progress bar

The package names the loop's set-up and run (`prepare`, `run` and what they hand around), so
importing any of its modules imports the loop too; the rest is `train.MODULE.NAME`.
"""

from zerojax.train.loop import (RunResult, Setup, Stopped, evaluate, global_batch, prepare, resume_step, run,
                                start_state)

__all__ = ["RunResult", "Setup", "Stopped", "evaluate", "global_batch", "prepare", "resume_step", "run", "start_state"]
