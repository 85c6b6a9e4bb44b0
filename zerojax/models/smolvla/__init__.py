"""SmolVLA (`model.family=smolvla`): a SmolVLM with a Llama action expert, self- and cross-attention.

    model.py     `SmolVLA`: prefix (images, prompt, state token), suffix, heads; FAMILY, its record
    layers.py    its unit: `every` VLM layers and the expert layers that read them
    config.py    model.smolvla.* (no jax)
    lerobot.py   its LeRobot 0.6 checkpoints: tensors, model keys (from the SmolVLM directory), config.json
"""
