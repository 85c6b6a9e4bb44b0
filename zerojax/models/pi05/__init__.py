"""π0.5 (`model.family=pi05`): PaliGemma with an adaptive-norm action expert, the state in the prompt.

    model.py     `Pi05`: its suffix, time condition and heads; FAMILY, its record
    batch.py     its adapter: the state's 256 bins written into the prompt
    lerobot.py   its LeRobot 0.6 checkpoints: tensors, model keys, config.json, processors
    openpi.py    its openpi `params/` tree (pi05=True)

Its body is `paligemma_expert`'s, with adaptive expert norms.
"""
