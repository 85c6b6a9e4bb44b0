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
    params_in = to_device if offload.master else (lambda p: p)
    params_out = to_host if offload.master else (lambda p: p)

    def update(grads, opt_state, params, weights, finite, ema=None):
        clip_state, state = optimizer.split(opt_state)
        streams_ema = offload.master and ema is not None  # the EMA lives where the master does: the host
        if optimizer.clip is not None:  # needs the whole gradient: on the device, before any piece
            grads, new_clip_state = optimizer.clip.update(grads, clip_state)
            clip_state = _select(finite, new_clip_state, clip_state)
        counts = cut(state, params, lambda _: None)  # what every piece's update starts from
        if any(jnp.ndim(x) for x in jax.tree.leaves(counts)):
            raise NotImplementedError("zero.offload streams optimizer states made of copies of the parameters "
                                      "(as optax's Adam moments are) and scalars; this state holds other arrays")

        def apply(g, p, s, e=None):
            """One piece's update on the device: its gradient, parameters and state (its copies cut
            to the piece, `counts` as they were before the step), and with the EMA on the host its
            piece `e`, averaged with the new parameters as `moving_average` does. A non-finite step
            gives the piece back as it was, bit-identical (a select per piece, not a `cond` around
            host buffers)."""
            p = params_in(p)
            updates, new = optimizer.elementwise.update(g, s, p)
            p_new = optax.apply_updates(p, updates)
            if e is None:
                return (*_select(finite, (p_new, new), (p, s)), None)
            e = to_device(e)
            e_new = jax.tree.map(lambda a, b: optimizer.ema * a + (1 - optimizer.ema) * b, e, p_new)
            return _select(finite, (p_new, new, e_new), (p, s, e))

        new_params, new_weights, new_ema = {}, {}, {}
        outer = [k for k in params if k not in stacked]
        if outer:
            pick = lambda tree: {k: tree[k] for k in outer}
            p, s, e = apply(pick(grads), pick(params), cut(state, params, lambda c: to_device(pick(c))),
                            pick(ema) if streams_ema else None)
            state = paste(state, params, s, lambda c, new: {**c, **to_host(new)})
            new_params.update(params_out(p))
            if offload.master:
                new_weights.update(stored_weights(p, weights_dtype))
            if streams_ema:
                new_ema.update(to_host(e))

        for name in [k for k in params if k in stacked]:
            def layer(i, carry, name=name, like=params[name]):
                p_all, s_all, w_all, e_all = carry  # s_all: `state` with its copies cut to this stack
                piece = paste(s_all, like, counts, lambda c, _: to_device(layer_at(c, i)))
                p, s, e = apply(layer_at(grads[name], i), layer_at(p_all, i), piece,
                                layer_at(e_all, i) if streams_ema else None)
                s_all = paste(s_all, like, s, lambda c, new: layer_put(c, to_host(new), i))
                w_all = layer_put(w_all, stored_weights(p, weights_dtype), i) if offload.master else w_all
                e_all = layer_put(e_all, to_host(e), i) if streams_ema else e_all
                return layer_put(p_all, params_out(p), i), s_all, w_all, e_all

            p, s, w, e = jax.lax.fori_loop(0, jax.tree.leaves(params[name])[0].shape[0], layer,
                                           (params[name], cut(state, params, lambda c: c[name]),
                                            weights[name] if offload.master else None,
                                            ema[name] if streams_ema else None))
            state = paste(state, params, s, lambda c, new: {**c, name: new})
            new_params[name], new_weights[name], new_ema[name] = p, w, e

        # The EMA beside a master on the device: averaged whole, as the device path does.
        ema = new_ema if streams_ema else moving_average(optimizer.ema, ema, new_params, finite)
        return new_params, optimizer.join(clip_state, state), (new_weights if offload.master else None), ema

    return update


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
