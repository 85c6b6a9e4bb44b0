"""What the design promises per device, and what XLA measures of a compiled step:

    formulas.py   memory, communication and FLOPs formulas (docs/design.md §2); no jax
    hlo.py        collectives and memory spaces read from the optimized HLO text
    traced.py     what a model's units hold, traced on abstract values (transient estimate, regime)
    measure.py    compile a step, measure it next to the formulas, the fit search (`zerojax analyze`)
    plan.py       `zerojax plan`: the stage, offload, remat, accumulation and gather a config trains with

The package names nothing: import the module (`from zerojax.analysis import measure`).
"""
