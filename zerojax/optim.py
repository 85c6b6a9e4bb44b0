"""The optimizer: an optax chain of global-norm clipping and AdamW on the fp32 master weights.

Weight decay is decoupled (AdamW) and masked off norms' scales and all biases: decaying them
only pulls LayerNorm gains towards zero. The learning rate warms up linearly and then follows
a cosine down to a tenth of its peak at the last step (or stays constant). Frozen parameters
(`optim.freeze` patterns) go through `optax.set_to_zero` in a `multi_transform`: no optimizer
state, no update. The chain is elementwise apart from the clipping norm, so on sharded master
weights each device updates its own shard; under jit the norm is the norm of the whole
gradient (XLA adds the cross-device sum).
"""

from __future__ import annotations

import fnmatch

import jax
import optax

from zerojax.config import ConfigError, OptimConfig
from zerojax.sharding import path_name

NO_DECAY = ("bias", "scale")


def make_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    warmup = min(cfg.warmup_steps, total_steps)
    if cfg.schedule == "constant":
        after = optax.constant_schedule(cfg.lr)
    else:
        after = optax.cosine_decay_schedule(cfg.lr, max(total_steps - warmup, 1), alpha=0.1)
    return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, warmup), after], [warmup])


def decay_mask(params):
    """True for leaves that get weight decay: every weight matrix, not norms or biases."""
    return jax.tree_util.tree_map_with_path(lambda path, _: path_name(path).split("/")[-1] not in NO_DECAY, params)


def is_frozen(path: str, patterns: tuple[str, ...]) -> bool:
    """A pattern matches a parameter path (`head/*`, `*/ln1/*`) or names a top-level part (`embed`)."""
    return any(fnmatch.fnmatchcase(path, p) or fnmatch.fnmatchcase(path, p.rstrip("/") + "/*") for p in patterns)


def frozen_mask(params, patterns: tuple[str, ...]):
    return jax.tree_util.tree_map_with_path(lambda path, _: is_frozen(path_name(path), patterns), params)


def check_freeze(params, patterns: tuple[str, ...]) -> None:
    paths = [path_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    for pattern in patterns:
        if not any(is_frozen(path, (pattern,)) for path in paths):
            raise ConfigError(f"optim.freeze pattern {pattern!r} matches no parameter; paths look like "
                             f"{', '.join(paths[:3])} (a top-level name such as {paths[0].split('/')[0]!r} freezes all of it)")
    if all(is_frozen(path, patterns) for path in paths):
        raise ConfigError(f"optim.freeze={list(patterns)} freezes every parameter; nothing would train")


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    adamw = optax.adamw(make_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay, mask=decay_mask)
    chain = optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw) if cfg.clip_norm > 0 else adamw
    if not cfg.freeze:
        return chain
    labels = lambda params: jax.tree.map(lambda f: "frozen" if f else "trained", frozen_mask(params, cfg.freeze))
    return optax.multi_transform({"trained": chain, "frozen": optax.set_to_zero()}, labels)
