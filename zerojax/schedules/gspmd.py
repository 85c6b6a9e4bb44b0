"""The annotation-only schedule (`zero.schedule=gspmd`), with the same signature as `fsdp`'s.

The forward/backward sees a compute view of the master weights (unpadded, cast to the gather
dtype, placed in the stage's compute layout), runs the model's units in order through the unit
protocol (`zerojax.models.protocol.forward`), and is differentiated by `jax.grad`; the gradient
is constrained to the stage's gradient layout and the activations between units are kept
batch-sharded, as MaxText does. XLA places every collective (on CPU it all-reduces and slices
the gradients instead of reduce-scattering them). It is the baseline the explicit schedule is
measured against, and the path for eval and sampling.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from zerojax.schedules import quant
from zerojax.schedules.options import StepOptions
from zerojax.parallel.mesh import BATCH_AXES
from zerojax.models import protocol
from zerojax.models.protocol import Units
from zerojax.precision import Policy
from zerojax.parallel.plan import Plan
from zerojax.parallel.trees import combine, constrain, frozen_part, microbatches, trained


def compute_view(master, mesh, plan: Plan, policy: Policy):
    """What the forward/backward sees: unpadded, cast to the gather dtype, in the compute layout.
    A quantized gather dtype is the explicit schedule's alone: eval and sampling, which come
    here, see the master weights in the compute dtype."""
    dtype = policy.compute if quant.is_quantized(policy.gather) else policy.gather
    params = jax.tree.map(lambda x: x.astype(dtype), plan.unpad(master))
    # A padded leaf, sliced back to its true shape, stays sharded (unevenly: XLA pads inside).
    return constrain(params, mesh, plan.compute_specs)


def batch_sharded(mesh):
    """Keep activations split over the batch between units (every leaf's leading dim)."""
    rows = NamedSharding(mesh, P(BATCH_AXES))
    return lambda x: jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, rows), x)


def make_loss(mesh, plan: Plan, policy: Policy, units: Units, remat: str = "none"):
    """(master, batch) -> (mean loss, weight) of the whole batch (eval; the step's forward)."""

    def loss(master, batch_BS):
        params = compute_view(master, mesh, plan, policy)
        return protocol.forward(units, params, batch_BS, remat, batch_sharded(mesh))

    return loss


def make_loss_and_grads(mesh, plan: Plan, policy: Policy, units: Units, options: StepOptions):
    """(master, batch, scale) -> (loss, fp32 gradient of scale x loss in the plan's grad layout),
    over `options.grad_accum` microbatches in a lax.scan with an fp32 accumulator in the stage's
    accumulator layout (losses weighted as `protocol` says: Σ w·l / Σ w)."""
    loss_of = make_loss(mesh, plan, policy, units, options.remat)
    k = options.grad_accum

    frozen = plan.frozen

    def grads_of(master, micro_BS, scale):
        def scaled(p):  # differentiated with respect to the trained leaves only
            loss, weight = loss_of(combine(p, frozen_part(master, frozen)), micro_BS)
            return loss * weight / k * scale, (loss * weight / k, weight / k)

        grads, (loss, weight) = jax.grad(scaled, has_aux=True)(trained(master, frozen))
        return loss, weight, grads

    def loss_and_grads(master, batch_BS, scale):
        if k == 1:
            loss, weight, grads = grads_of(master, batch_BS, scale)
        else:
            micro_kBS = jax.lax.with_sharding_constraint(microbatches(batch_BS, k),
                                                         NamedSharding(mesh, P(None, BATCH_AXES)))

            def body(acc, micro_BS):
                acc = jax.tree.map(jnp.add, acc, grads_of(master, micro_BS, scale))
                return (*acc[:2], constrain(acc[2], mesh, plan.accum_specs)), None

            zero = jnp.zeros((), jnp.float32)
            grads = constrain(jax.tree.map(jnp.zeros_like, trained(master, frozen)), mesh, plan.accum_specs)
            (loss, weight, grads), _ = jax.lax.scan(body, (zero, zero, grads), micro_kBS)
        grads = jax.tree.map(lambda g: g / weight, grads)
        return loss / weight, constrain(grads, mesh, plan.grad_specs)

    return loss_and_grads
