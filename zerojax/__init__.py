"""zerojax: ZeRO stages and the FSDP unit schedule over a named jax.sharding.Mesh."""

__version__ = "0.1.0"
