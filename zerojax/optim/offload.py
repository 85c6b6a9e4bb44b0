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
which the streamed update writes from the new master. A step whose gradient is not finite
writes every piece back unchanged (a select per piece, not a `cond` around host buffers).
"""

from __future__ import annotations

from dataclasses import dataclass
import jax
import jax.numpy as jnp
import optax
from zerojax.errors import ConfigError
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


def streamed_update(elementwise: optax.GradientTransformation, offload: Offload, grads, state, params,
                    finite, stacked: tuple[str, ...], weights=None, weights_dtype=None):
    """The elementwise optimizer applied unit by unit: (new params, new state, new weights).

    `grads`, `params`: the trained leaves (nested dicts, master layout); `state`: the
    elementwise optimizer's state, whose copies of a parameter (dicts shaped like `params`)
    live on the host (and `params` too with `offload.master`); `stacked`: the stacks, updated
    layer by layer. `weights`: with `offload.master`, the device copy of the trained weights in
    `weights_dtype` (a 2-byte float kept as its bits, `fsdp.stored_weights`), rewritten in place
    from the new master (else None)."""
    flat, treedef = jax.tree.flatten(state, is_leaf=lambda x: isinstance(x, dict))
    structure = jax.tree.structure(params)
    copies = [i for i, x in enumerate(flat) if isinstance(x, dict)]
    for i in copies:
        if jax.tree.structure(flat[i]) != structure:
            raise NotImplementedError("zero.offload streams optimizer states whose dicts are copies of the "
                                      "parameters (as optax's Adam moments are); this state holds another dict")
    scalars = [x for i, x in enumerate(flat) if i not in copies]

    def update(g, p, moments, scalars):
        """One piece on the device: its gradient, params and moments (dicts of the same keys)."""
        it = iter(moments), iter(scalars)
        piece_state = treedef.unflatten([next(it[0]) if i in copies else next(it[1]) for i in range(len(flat))])
        updates, new_state = elementwise.update(g, piece_state, p)
        new_p = optax.apply_updates(p, updates)
        new_flat = jax.tree.flatten(new_state, is_leaf=lambda x: isinstance(x, dict))[0]
        new = (new_p, [new_flat[i] for i in copies], [x for i, x in enumerate(new_flat) if i not in copies])
        # A non-finite step writes every piece back as it was (bit-identical).
        return jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, (p, list(moments), list(scalars)))

    def params_in(p):
        return to_device(p) if offload.master else p

    def params_out(p):
        return to_host(p) if offload.master else p

    pick = lambda tree, keys: {k: tree[k] for k in keys}
    moments = [flat[i] for i in copies]
    new_params, new_moments, new_weights, new_scalars = {}, [{} for _ in copies], {}, scalars

    outer = [k for k in params if k not in stacked]
    if outer:
        p, m, new_scalars = update(pick(grads, outer), params_in(pick(params, outer)),
                                   to_device([pick(x, outer) for x in moments]), scalars)
        new_params.update(params_out(p))
        for out, x in zip(new_moments, to_host(m)):
            out.update(x)
        if offload.master:
            new_weights.update(stored_weights(p, weights_dtype))

    for name in [k for k in params if k in stacked]:
        def layer(i, carry, name=name):
            p_all, m_all, w_all, _ = carry
            p, m, s = update(layer_at(grads[name], i), params_in(layer_at(p_all, i)), to_device(layer_at(m_all, i)),
                             scalars)
            w_all = layer_put(w_all, stored_weights(p, weights_dtype), i) if offload.master else w_all
            return layer_put(p_all, params_out(p), i), layer_put(m_all, to_host(m), i), w_all, s

        w0 = weights[name] if offload.master else None
        p, m, w, new_scalars = jax.lax.fori_loop(
            0, jax.tree.leaves(params[name])[0].shape[0], layer,
            (params[name], [x[name] for x in moments], w0, scalars))
        new_params[name] = p
        for out, x in zip(new_moments, m):
            out[name] = x
        if offload.master:
            new_weights[name] = w

    it = iter(new_moments), iter(new_scalars)
    new_state = treedef.unflatten([next(it[0]) if i in copies else next(it[1]) for i in range(len(flat))])
    return new_params, new_state, (new_weights if offload.master else None)
