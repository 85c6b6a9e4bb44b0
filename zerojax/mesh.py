"""Moved to `zerojax.parallel.mesh`; this path (`zerojax.mesh.XLA_PRESETS`, in the README) re-exports it."""

from zerojax.parallel.mesh import *  # noqa: F401,F403
