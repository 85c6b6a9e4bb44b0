"""What the vision-language-action families (π0, π0.5, SmolVLA) share.

    flow.py      `FlowMatchingPolicy`: the unit protocol, the loss, `sample_actions`, the Euler grid, Shape
    layers.py    the joint attention of two streams, masks, the time embedding, torch's Linear
    rtc.py       real-time chunking's guidance of the sampler
    batch.py     the adapter from a robot dataset's features to a policy's batch (no jax)
    config.py    model.expert.* and model.action.* (no jax)
    lerobot.py   what the families' LeRobot layouts share: shapes and config.json to model keys (no jax)
"""
