"""The checkpoint formats zerojax reads and writes, each one record (`format.CheckpointFormat`), as
a model family is one `Family`: how its files are recognised (from the files alone, no jax), and
where its model keys, its run keys, its reader, its writer and its server are. `model.init_from`,
`zerojax export --format` and `zerojax serve` ask the registry (`format.FORMATS`) and never name a
format; adding one is one module that declares `FORMAT` plus its line in the registry.

    format.py       the record, the export's request (`ExportJob`) and the registry
    safetensors.py  zerojax's own export: one safetensors file, the run's config in its metadata
    hf.py           a Hugging Face model directory (config.json with architectures, safetensors)
    peft.py         a PEFT adapter directory (adapter_config.json, adapter_model.safetensors)
    lerobot.py      a LeRobot policy directory (config.json with "type"; 0.3.x and 0.4+/0.6)
    openpi.py       an openpi checkpoint directory (params/, an orbax tree, and assets/)

The package names nothing: import the module (`from zerojax.checkpoints import format`).
"""
