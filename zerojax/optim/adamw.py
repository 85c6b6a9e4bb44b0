"""The optimizer: an optax chain of global-norm clipping and AdamW on the fp32 master weights
(`Optimizer`, which knows the chain's two parts and how its state splits), and its update on
the device (`Optimizer.in_place`; `offload.streamed` is the same update through host memory).

Weight decay is decoupled (AdamW) and masked off norms' scales and all biases: decaying them
only pulls LayerNorm gains towards zero (optim.decay_mask=matrices). LeRobot's policies (torch's
AdamW over every parameter) and openpi (optax's, with no mask) decay them all, and their recipes
say so (optim.decay_mask=all). The learning rate warms up linearly and then follows
a cosine down to optim.final_lr (a tenth of its peak) at the last step (or stays constant); with
optim.decay_steps, LeRobot's cosine_decay_with_warmup (`lerobot_cosine`). Frozen parameters
(`optim.freeze` patterns, a LoRA base) are not the optimizer's at all: the step hands it the
trained leaves only, so frozen ones have no optimizer state, no master copy and no update.

The chain is elementwise apart from the clipping norm, so on sharded master weights each device
updates its own shard; under jit the norm is the norm of the whole gradient (XLA adds the
cross-device sum).
"""

from __future__ import annotations

from dataclasses import dataclass
import fnmatch
from typing import Any, Callable
import jax
import jax.numpy as jnp
import optax
from zerojax.errors import ConfigError
from zerojax.config import OptimConfig, policy_keys
from zerojax.optim.components import expand, names_hint
from zerojax.parallel.trees import path_name


NO_DECAY = ("bias", "scale")


def make_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    if cfg.decay_steps:
        return lerobot_cosine(cfg, total_steps)
    warmup = min(cfg.warmup_steps, total_steps)
    if cfg.schedule == "constant":
        after = optax.constant_schedule(cfg.lr)
    else:
        alpha = 0.1 if cfg.final_lr is None else cfg.final_lr / cfg.lr if cfg.lr else 0.0
        after = optax.cosine_decay_schedule(cfg.lr, max(total_steps - warmup, 1), alpha=alpha)
    return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, warmup), after], [warmup])


def lerobot_cosine(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """LeRobot 0.6.1's cosine_decay_with_warmup (optim/schedulers.py, the π0/π0.5/SmolVLA
    preset), step k being the k-th update: a linear warmup from lr/(W+1) at step 0 to lr at step
    W, and from step W on a cosine over steps 0..D from lr to final_lr (lr/10 if unset), flat
    after D; W and D scaled as `config.policy_keys.scaled` does for a run shorter than D."""
    warmup, decay = policy_keys.scaled(cfg.warmup_steps, cfg.decay_steps, total_steps)
    peak, final = cfg.lr, cfg.lr / 10 if cfg.final_lr is None else cfg.final_lr

    def schedule(count):
        count = jnp.asarray(count, jnp.float32)
        cosine = final + (peak - final) * 0.5 * (1 + jnp.cos(jnp.pi * jnp.minimum(count, decay) / decay))
        start = 1 / (warmup + 1)  # LeRobot's (start - 1)(1 - k/W) + 1, without its cancellation in float32
        warm = peak * (start + (1 - start) * count / max(warmup, 1))
        return jnp.where(count < warmup, warm, cosine)

    return schedule


def decay_mask(params):
    """True for leaves that get weight decay: every weight matrix, not norms or biases."""
    return jax.tree_util.tree_map_with_path(lambda path, _: path_name(path).split("/")[-1] not in NO_DECAY, params)


def is_frozen(path: str, patterns: tuple[str, ...]) -> bool:
    """A pattern matches a parameter path (`head/*`, `*/ln1/*`) or names a top-level part (`embed`)."""
    return any(fnmatch.fnmatchcase(path, p) or fnmatch.fnmatchcase(path, p.rstrip("/") + "/*") for p in patterns)


def check_freeze(params, patterns: tuple[str, ...], frozen, lora: bool = False, components=None) -> None:
    """Every pattern (or named component, `optim.components`) matches a parameter, and something
    is left to train (`frozen`: the mask the run will use, LoRA's base included)."""
    components = components or {}
    paths = [path_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    for pattern in patterns:
        if not any(is_frozen(path, expand(pattern, components)) for path in paths):
            raise ConfigError(f"optim.freeze pattern {pattern!r} matches no parameter; paths look like "
                             f"{', '.join(paths[:3])} (a top-level name such as {paths[0].split('/')[0]!r} freezes all "
                             f"of it){names_hint(components)}")
    if all(jax.tree.leaves(frozen)):
        with_lora = " together with LoRA (which trains only the adapters)" if lora else ""
        raise ConfigError(f"optim.freeze={list(patterns)}{with_lora} freezes every parameter; nothing would train")


# An update, on device or streamed (`offload.streamed`): (grads, opt_state, params, weights,
# finite, ema) -> (params, opt_state, weights, ema), of the trained leaves; `weights` is the
# device copy that zero.offload=optimizer+master keeps (else None), `ema` optim.ema's average
# of the new params (`moving_average`; None without one). A step whose gradient is not `finite`
# gives back params, state, weights and ema as they were.
Update = Callable[..., tuple[Any, Any, Any, Any]]


def moving_average(decay: float, ema, params, finite):
    """openpi's EMA after an optimizer step: decay·ema + (1 - decay)·params, leaf by leaf
    (elementwise: on each device's shard, no collective); a skipped step leaves it as it was.
    None (no EMA kept) stays None."""
    if ema is None:
        return None
    average = lambda ema, new: jax.tree.map(lambda e, p: decay * e + (1 - decay) * p, ema, new)
    return jax.lax.cond(finite, average, lambda ema, _: ema, ema, params)


@dataclass(frozen=True)
class Optimizer:
    """AdamW with global-norm clipping, as its two parts: `clip`, which needs the whole gradient
    (its global norm; None with optim.clip_norm=0), and `elementwise`, the rest (AdamW), which
    `zero.offload` applies one unit at a time. Its state is `chain`'s, what optax.chain(clip,
    elementwise) makes (a (clip's, elementwise's) pair), or elementwise's alone without clipping;
    `split` and `join` are the one place that knows that layout, which checkpoints keep."""

    clip: optax.GradientTransformation | None
    elementwise: optax.GradientTransformation
    ema: float = 0.0  # optim.ema: the decay of the trained weights' moving average (0: none kept)

    @property
    def chain(self) -> optax.GradientTransformation:
        return self.elementwise if self.clip is None else optax.chain(self.clip, self.elementwise)

    def init(self, params):
        return self.chain.init(params)

    def update(self, grads, state, params):
        return self.chain.update(grads, state, params)

    def split(self, state) -> tuple[Any, Any]:
        """(clip's state or None, elementwise's state) of the chain's state."""
        return (None, state) if self.clip is None else tuple(state)

    def join(self, clip_state, elementwise_state):
        """The chain's state of its two parts' (`split`'s inverse)."""
        return elementwise_state if self.clip is None else (clip_state, elementwise_state)

    def in_place(self, grads, state, params, weights, finite, ema=None):
        """The `Update` on the device: the whole chain at once (`weights` pass through), then
        the EMA of the new params."""
        def apply(params, state):
            updates, state = self.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        # A cond, not a select between new and old: the update then runs in place on the
        # donated buffers (a select keeps the old state alive next to the new one).
        params, state = jax.lax.cond(finite, apply, lambda *old: old, params, state)
        return params, state, weights, moving_average(self.ema, ema, params, finite)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> Optimizer:
    adamw = optax.adamw(make_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay, mask=decay_mask if cfg.decay_mask == "matrices" else None)
    return Optimizer(optax.clip_by_global_norm(cfg.clip_norm) if cfg.clip_norm > 0 else None, adamw, cfg.ema)
