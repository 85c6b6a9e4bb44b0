"""The field's files in and out, driven by a family's declared layouts (`models.family.HfLayout`,
`LeRobotLayout`, `OpenpiLayout`):

    safetensors.py         a lazy reader (slices by positioned reads) and an in-place writer
    hf.py                  Hugging Face checkpoints: into the sharded master layout, and out as shards
    peft.py                LoRA adapters in PEFT's names and files
    lerobot.py             LeRobot policy directories (0.3.x, 0.4+/0.6): config.json, model.safetensors
                           and the statistics, read for init_from and serve
    lerobot_export.py      a run written as a LeRobot policy directory (zerojax export --format lerobot)
    lerobot_processors.py  LeRobot 0.4+'s processor files (pre/post-processor steps, normalizer
                           statistics), written for an export in the 0.6 layout
    openpi.py              openpi checkpoints (params/ and assets/' norm_stats.json) in and out
    openpi_tree.py         an openpi params/ tree seen as zerojax's leaves, for init_from

Nothing here names a model family.

The package names nothing: import the module (`from zerojax.interop import hf`).
"""
