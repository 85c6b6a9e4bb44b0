"""π0 (`model.family=pi0`): PaliGemma with an action expert that reads the state as a token.

    model.py     `Pi0`: its suffix (state token, action-time MLP) and heads; FAMILY, its record
    lerobot.py   its LeRobot checkpoints (0.3 and 0.6): tensors, model keys, config.json, processors
    openpi.py    its openpi `params/` tree

Its batch is the shared adapter's (`vla.batch`); its body is `paligemma_expert`'s.
"""
