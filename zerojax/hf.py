"""Moved to `zerojax.interop.hf`; this path (`zerojax.hf.load`, in the README) re-exports it."""

from zerojax.interop.hf import *  # noqa: F401,F403
