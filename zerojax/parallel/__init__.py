"""Devices and where each copy of a parameter lives: the mesh, the stages, the sharding plans.

    mesh.py     jax.distributed, the ("replica", "data") mesh, simulated CPU devices, XLA presets
    stages.py   a ZeRO stage as four booleans (what is split over `data`)
    plan.py     LeafPlan / Plan / make_plan: each leaf's dim, padding and PartitionSpecs
    trees.py    nested-dict parameter trees: paths, trained and frozen parts, microbatches

The package names nothing: import the module (`from zerojax.parallel import mesh`).
"""
