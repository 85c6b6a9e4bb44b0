"""Training: the state and its step, the run loop, checkpoints, export and sampling.

    model.py       the model a config names (LoRA attached), its parameter plan
    state.py       TrainState: born sharded, placed where zero.offload says
    step.py        the Engine (everything the compiled step needs) and the jitted step
    loop.py        prepare (set-up, where bad input surfaces) and run (the loop)
    metrics.py     metrics.jsonl, continued on resume
    checkpoint.py  orbax save / restore / reshard
    export.py      a checkpoint as safetensors, a Hugging Face or a PEFT directory
    sample.py      generation, progress bar

`zerojax.train.run`, `prepare` and the loop's other names are imported on first use, so
`zerojax.train.step` does not import the loop.
"""

import importlib


def __getattr__(name: str):
    loop = importlib.import_module("zerojax.train.loop")
    try:
        return getattr(loop, name)
    except AttributeError:
        raise AttributeError(f"module 'zerojax.train' has no attribute {name!r}") from None
