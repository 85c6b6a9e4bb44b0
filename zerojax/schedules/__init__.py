"""The loss and gradient of one step under a stage's plan, with one signature,
`make_loss_and_grads(mesh, plan, policy, units, options)`:

    explicit.py    zero.schedule=shard_map: the unit schedule written out in jax.shard_map
    flat.py        UnitLayout: a unit's sharded leaves as one flat buffer (one gather, one scatter)
    prefetch.py    queued_scan: the gather of unit i+k issued before unit i computes
    residuals.py   what a block keeps for its backward, without its gathered weights
    storage.py     2-byte floats kept as their bits (the CPU backend's bf16 upcast)
    options.py     StepOptions: what a schedule needs of the config
    gspmd.py       zero.schedule=gspmd: the same stage as sharding annotations
    quant.py       block-quantized (int8, fp8) weight gathers
    outer.py       the outer unit split by use: which of its leaves `enter` and `exit` read

Schedules never name a model's attributes: they see the model through `models.protocol.Units`.

The package names nothing: import the module (`from zerojax.schedules import explicit`).
"""
