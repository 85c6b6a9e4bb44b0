"""The optimizer: an optax chain of global-norm clipping and AdamW on the fp32 master weights.

Weight decay is decoupled (AdamW) and masked off norms' scales and all biases: decaying them
only pulls LayerNorm gains towards zero. The learning rate warms up linearly and then follows
a cosine down to a tenth of its peak at the last step (or stays constant).
"""

from __future__ import annotations

import jax
import optax

from zerojax.config import OptimConfig

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
    return jax.tree_util.tree_map_with_path(lambda path, _: _leaf_name(path) not in NO_DECAY, params)


def _leaf_name(path) -> str:
    last = path[-1]
    return str(getattr(last, "key", getattr(last, "name", last)))


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    adamw = optax.adamw(make_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay, mask=decay_mask)
    if cfg.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw)
    return adamw
