"""Host offload (`zero.offload`): Adam's moments, and optionally the fp32 master weights, live in
pinned host memory, and the optimizer update streams them through the device one unit at a time.

    zero.offload       fp32 master   Adam m, v   on the device between steps
    none               device        device      master + m + v (12·Ψ/N at stages 1-3)
    optimizer          device        host        master (4·Ψ/N)
    optimizer+master   host          host        the weights in the gather dtype (b_g·Ψ/N)

Placement is a memory kind on the state's shardings (`NamedSharding(..., memory_kind=
"pinned_host")`); the forward and backward never read host memory. The update runs after the
gradient is complete: the global part (clipping by the global norm, which needs only the
gradient, on the device) first, then the elementwise rest (AdamW) for the outer unit, and for
each stack layer by layer in a `fori_loop`: that layer's master, m and v are brought to the
device, updated, and written back in place, so the device holds one layer's offloaded state at
a time (ZeRO-Offload streams the same way, by parameter group, on the CPU; here the arithmetic
stays on the accelerator and only the bytes move). With `optimizer+master` the device keeps,
for the forward and backward, the master's shard in the gather dtype (`TrainState.weights`),
which the streamed update writes from the new master. optim.ema's average lives where the
master lives: with `optimizer+master` on the host too, each unit's piece brought to the device
beside its master's, averaged with the new master there and written back. A step whose gradient
is not finite writes every piece back unchanged (a select per piece, not a `cond` around host
buffers).

`streamed` is that update: a wrapper around the same `Optimizer` (the same optax chain, the same
state) that the device path applies whole, so a checkpoint saved with offload resumes without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple
import jax
import jax.numpy as jnp
import optax
from zerojax.errors import ConfigError
from zerojax.optim.adamw import Optimizer, Update, moving_average
from zerojax.schedules.prefetch import layer_at, layer_put
from zerojax.schedules.storage import stored_weights


HOST = "pinned_host"


@dataclass(frozen=True)
class Offload:
    mode: str = "none"  # zero.offload

    @property
    def moments(self) -> bool:
        """Adam's m and v (every optimizer-state copy of a parameter) live on the host."""
        return self.mode != "none"

    @property
    def master(self) -> bool:
        """The trained leaves' fp32 master weights live on the host too."""
        return self.mode == "optimizer+master"


def check_backend(mesh, mode: str) -> None:
    """The devices have the pinned host memory that `mode` places state in."""
    if mode == "none":
        return
    device = mesh.devices.flat[0]
    kinds = sorted({m.kind for m in device.addressable_memories()})
    if HOST not in kinds:
        raise ConfigError(f"zero.offload={mode} places state in {HOST} memory, which the {device.platform} backend "
                          f"does not have (its memory kinds: {', '.join(kinds)}); use zero.offload=none")


def on_host(sharding):
    return sharding.with_memory_kind(HOST)


def to_device(tree):
    return jax.device_put(tree, jax.memory.Space.Device)


def to_host(tree):
    return jax.device_put(tree, jax.memory.Space.Host)


def streamed(optimizer: Optimizer, offload: Offload, stacked: tuple[str, ...], weights_dtype) -> Update:
    """`optimizer`'s update with its elementwise part streamed unit by unit (an `Update`, like
    `Optimizer.in_place`): clipping on the device, then the outer unit, then each of the
    `stacked` stacks layer by layer in a `fori_loop`. The state's copies of a parameter live on
    the host (and the trained leaves too with `offload.master`), and come to the device one
    piece at a time; `weights` (with `offload.master`, the device copy in `weights_dtype`, kept
    as `storage.stored_weights` keeps it) is rewritten in place from the new master."""

    def update(grads, opt_state, params, weights, finite, ema=None):
        clip_state, state = optimizer.split(opt_state)
        if optimizer.clip is not None:  # needs the whole gradient: on the device, before any piece
            grads, new_clip_state = optimizer.clip.update(grads, clip_state)
            clip_state = _select(finite, new_clip_state, clip_state)
        # The EMA lives where the master does: with `optimizer+master`, on the host, streamed too.
        step = _Step(optimizer, offload, weights_dtype, finite, streams_ema=offload.master and ema is not None)
        counts = _counts(state, params)
        new_params, new_weights, new_ema = {}, {}, {}
        outer = [k for k in params if k not in stacked]
        if outer:
            state, p, w, e = _update_outer(step, outer, grads, params, state, ema)
            new_params.update(p)
            new_weights.update(w)
            new_ema.update(e)
        for name in [k for k in params if k in stacked]:
            state, new_params[name], new_weights[name], new_ema[name] = _update_stack(
                step, name, grads, params, state, counts, weights, ema)
        # The EMA beside a master on the device: averaged whole, as the device path does.
        ema = new_ema if step.streams_ema else moving_average(optimizer.ema, ema, new_params, finite)
        return new_params, optimizer.join(clip_state, state), (new_weights if offload.master else None), ema

    return update


class _Step(NamedTuple):
    """What every piece of one step's streamed update shares."""

    optimizer: Optimizer
    offload: Offload
    weights_dtype: Any  # the device copy's dtype (`offload.master`)
    finite: jax.Array  # the step's gradient is finite; else every piece goes back as it was
    streams_ema: bool  # the EMA is on the host beside the master, and streams with it

    def params_in(self, p):
        return to_device(p) if self.offload.master else p

    def params_out(self, p):
        return to_host(p) if self.offload.master else p


def _counts(state, params):
    """What every piece's update starts from: the state's scalars (its copies of `params` cut out)."""
    counts = cut(state, params, lambda _: None)
    if any(jnp.ndim(x) for x in jax.tree.leaves(counts)):
        raise NotImplementedError("zero.offload streams optimizer states made of copies of the parameters "
                                  "(as optax's Adam moments are) and scalars; this state holds other arrays")
    return counts


def _apply(step: _Step, g, p, s, e=None):
    """One piece's update on the device: its gradient, parameters and state (its copies cut to
    the piece, the counts as they were before the step), and with the EMA on the host its piece
    `e`, averaged with the new parameters as `moving_average` does. A non-finite step gives the
    piece back as it was, bit-identical (a select per piece, not a `cond` around host buffers)."""
    optimizer = step.optimizer
    p = step.params_in(p)
    updates, new = optimizer.elementwise.update(g, s, p)
    p_new = optax.apply_updates(p, updates)
    if e is None:
        return (*_select(step.finite, (p_new, new), (p, s)), None)
    e = to_device(e)
    e_new = jax.tree.map(lambda a, b: optimizer.ema * a + (1 - optimizer.ema) * b, e, p_new)
    return _select(step.finite, (p_new, new, e_new), (p, s, e))


def _update_outer(step: _Step, keys, grads, params, state, ema):
    """The outer unit (the leaves of `keys`, outside every stack) in one piece: (the state with
    its piece written back, its new parameters, their device copy, their EMA; {} where none)."""
    pick = lambda tree: {k: tree[k] for k in keys}
    p, s, e = _apply(step, pick(grads), pick(params), cut(state, params, lambda c: to_device(pick(c))),
                     pick(ema) if step.streams_ema else None)
    state = paste(state, params, s, lambda c, new: {**c, **to_host(new)})
    return (state, step.params_out(p), stored_weights(p, step.weights_dtype) if step.offload.master else {},
            to_host(e) if step.streams_ema else {})


def _update_stack(step: _Step, name: str, grads, params, state, counts, weights, ema):
    """Stack `name` layer by layer in a `fori_loop`, each layer's pieces brought to the device,
    updated and written back in place: (the state, the stack's new parameters, their device copy,
    their EMA; None where none)."""
    like = params[name]

    def layer(i, carry):
        p_all, s_all, w_all, e_all = carry  # s_all: `state` with its copies cut to this stack
        piece = paste(s_all, like, counts, lambda c, _: to_device(layer_at(c, i)))
        p, s, e = _apply(step, layer_at(grads[name], i), layer_at(p_all, i), piece,
                         layer_at(e_all, i) if step.streams_ema else None)
        s_all = paste(s_all, like, s, lambda c, new: layer_put(c, to_host(new), i))
        w_all = layer_put(w_all, stored_weights(p, step.weights_dtype), i) if step.offload.master else w_all
        e_all = layer_put(e_all, to_host(e), i) if step.streams_ema else e_all
        return layer_put(p_all, step.params_out(p), i), s_all, w_all, e_all

    p, s, w, e = jax.lax.fori_loop(0, jax.tree.leaves(like)[0].shape[0], layer,
                                   (like, cut(state, params, lambda c: c[name]),
                                    weights[name] if step.offload.master else None,
                                    ema[name] if step.streams_ema else None))
    return paste(state, params, s, lambda c, new: {**c, name: new}), p, w, e


# An elementwise optimizer's state holds copies of the parameters (Adam's mu and nu), each a
# subtree with the parameters' tree structure, and scalars beside them (step counts) that every
# piece's update advances alike. `cut` and `paste` map over such a state with each copy as one
# leaf (`is_leaf`), so the state's own structure (what optax makes, what checkpoints hold)
# is never rebuilt by hand.


def _copies_of(like):
    structure = jax.tree.structure(like)
    return lambda x: jax.tree.structure(x) == structure


def cut(state, like, fn):
    """`state` with each copy of `like` replaced by fn(copy) (a piece of it, moved); the rest as is."""
    is_copy = _copies_of(like)
    return jax.tree.map(lambda x: fn(x) if is_copy(x) else x, state, is_leaf=is_copy)


def paste(state, like, piece, fn):
    """`state` with each copy of `like` replaced by fn(copy, `piece`'s copy there) and the rest by
    `piece`'s (`piece`: a state of the same structure down to the copies, which may differ)."""
    is_copy = _copies_of(like)
    return jax.tree.map(lambda x, new: fn(x, new) if is_copy(x) else new, state, piece, is_leaf=is_copy)


def _select(finite, new, old):
    return jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
