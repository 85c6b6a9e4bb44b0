"""The flow-matching policy π0, π0.5 and SmolVLA are: one base, each family filling in hooks, as
openpi's one `Pi0` serves π0 and π0.5.

A vision tower reads the cameras; a prefix (the images, the prompt, for some the state) and a
suffix (the noisy action chunk, and for π0 the state) run through one stack of units in which
the two streams meet in attention; the suffix's output is the velocity of the flow.

Flow matching: x_t = t·noise + (1 - t)·actions, u_t = noise - actions. The batch (made by the
family's adapter, `vla.batch`) carries `noise` and `time`, drawn by the data pipeline from (seed,
step, row), so the loss is the same on any mesh and any train.grad_accum. The loss is the mean of
(u_t - v_t)^2 over the real action dimensions of the steps inside the episode; `flow_loss`
returns LeRobot's unreduced losses [B, H, max_action_dim]. `sample_actions` integrates from t = 1
to 0 with Euler steps (real-time chunking's guidance, `rtc`, optional), the prefix's keys and
values computed once.

Two stacks, run in order (the unit protocol):

    enter(batch)           each camera's patch embeddings: [B·cameras, N, E]
    vision                 the tower's encoder layers (one unit each)
    between("layers")      the prefix (`embed_prefix`), the suffix (`suffix_of`), the pad and
                           autoregressive flags their mask is made of (`prefix_ar`, `suffix_ar`)
    layers                 the family's units: __call__ on the carried dict; while sampling,
                           prefix_kv (the prefix alone, its keys and values) and suffix_step
    exit(x, batch)         `velocity`, then the loss

What a family fills in: `embed_prefix` (or just `image_features`), `prefix_ar`, `suffix_ar`,
`suffix_of`, `prefix_len`, `flops_per_row`, `ACCUMULATED_TIME` (the Euler grid of the code it
follows), `num_steps`, and `velocity` where its final norm is not a plain one.

Shapes: B batch, P prefix, S suffix, H action horizon, A max_action_dim, D VLM width, E vision width.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zerojax.models import attention, protocol, siglip
from zerojax.models.vla import rtc
from zerojax.models.vla.layers import linear, time_embedding
from zerojax.precision import Policy


class Shape(NamedTuple):
    """The sizes of a flow-matching policy (model.*, model.expert.*, model.action.*, and SmolVLA's
    model.smolvla.*)."""

    vocab_size: int
    d_model: int  # the VLM's width
    n_layers: int  # both streams' depth
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    expert_d_model: int
    expert_d_ff: int
    horizon: int  # H: actions per chunk (LeRobot's chunk_size = n_action_steps in training)
    max_state_dim: int = 32
    max_action_dim: int = 32
    action_dim: int = 32  # the real action dimensions (the loss's; the rest is padding)
    cameras: int = 1  # images per row (a missing camera is masked)
    prompt_len: int = 48  # prompt tokens per row (LeRobot's tokenizer_max_length)
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    every: int = 1  # layers a unit holds (SmolVLA's self_attn_every_n_layers)
    pixel_shuffle: int = 1  # SmolVLA's connector's pixel-shuffle factor


def shape_of(cfg, **family) -> Shape:
    """The Shape of a ModelConfig (model.*, model.expert.*, model.action.*), with a family's own
    sizes (`family`: every, pixel_shuffle)."""
    a = cfg.action
    return Shape(vocab_size=cfg.vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                 n_kv_heads=cfg.n_kv_heads or cfg.n_heads, head_dim=cfg.head_dim or cfg.d_model // cfg.n_heads,
                 d_ff=cfg.d_ff, expert_d_model=cfg.expert.d_model, expert_d_ff=cfg.expert.d_ff, horizon=a.horizon,
                 max_state_dim=a.max_state_dim, max_action_dim=a.max_action_dim,
                 action_dim=a.action_dim or a.max_action_dim, cameras=a.cameras, prompt_len=a.prompt_len,
                 norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, **family)


def euler_times(num_steps: int, accumulated: bool) -> np.ndarray:
    """The times of the Euler steps from t = 1 towards 0, dt = -1 / num_steps, float32. Accumulated
    (LeRobot 0.3.3's and openpi's loop): t from 1, `t += dt` in fp32 while t >= -dt / 2. Otherwise
    (LeRobot 0.6.1's `euler_integrate`): t = 1 + k·dt in float64, then fp32."""
    if accumulated:
        return np.cumsum([np.float32(1.0)] + [np.float32(-1.0 / num_steps)] * (num_steps - 1), dtype=np.float32)
    return np.asarray([1.0 + k * (-1.0 / num_steps) for k in range(num_steps)], np.float32)


class FlowMatchingPolicy(nnx.Module):
    """The base (module docstring). A family's __init__ builds the tower (`init_tower`), the
    language embedding, its `layers` stack and its heads; the rest is here."""

    STACKED = ("vision", "layers")
    ACCUMULATED_TIME = False  # the Euler grid (`euler_times`)
    num_steps = 10  # Euler steps of `sample_actions` by default

    def init_tower(self, vision: siglip.Shape, policy: Policy, rngs: nnx.Rngs, spec: attention.Spec) -> None:
        """The SigLIP tower: patch embeddings, encoder layers (the `vision` stack), post-layernorm."""
        self.vision_shape = vision
        self.vision_embeddings = siglip.Embeddings(vision, policy, rngs)
        self.vision = siglip.make_stack(vision, policy, rngs, spec)
        self.vision_post_layernorm = siglip.layer_norm(vision.d_model, vision.norm_eps, policy, rngs)

    # -- the family's hooks ------------------------------------------------------------------

    def image_features(self, x_ENE: jax.Array, cameras: int) -> jax.Array:
        """The tower's output made the prefix's image tokens, [B, cameras·N', D]."""
        raise NotImplementedError

    def prefix_ar(self, P: int) -> list[int]:
        """The prefix's autoregressive flags: one block, attended both ways."""
        return [0] * P

    def suffix_ar(self) -> list[int]:
        """The suffix's autoregressive flags (1 starts a block the tokens before it do not see)."""
        raise NotImplementedError

    def suffix_of(self, batch: dict, x_t_BHA: jax.Array, time_B: jax.Array) -> dict:
        """What the units carry for the suffix: {"suffix": [B, S, W], and any condition}."""
        raise NotImplementedError

    def velocity(self, x: dict) -> jax.Array:
        """v_t [B, H, max_action_dim] fp32 from the last unit's output: the expert's final norm and
        action_out_proj on the last H suffix tokens."""
        out = self.expert_norm(x["suffix"])[:, -self.shape.horizon:]
        return self.action_out_proj(out.astype(jnp.float32)).astype(jnp.float32)

    # -- heads several families have ----------------------------------------------------------

    def init_action_time_heads(self, max_action_dim: int, W: int, policy: Policy, rngs: nnx.Rngs) -> None:
        """action_in_proj, action_out_proj and the action-time MLP (π0's and SmolVLA's)."""
        self.action_in_proj = linear(max_action_dim, W, policy, rngs)
        self.action_out_proj = linear(W, max_action_dim, policy, rngs)
        self.action_time_mlp_in = linear(2 * W, W, policy, rngs)
        self.action_time_mlp_out = linear(W, W, policy, rngs)

    def action_time_tokens(self, x_t_BHA: jax.Array, time_B: jax.Array) -> jax.Array:
        """The H action tokens action_time_mlp(action_in_proj(x_t) ++ sin/cos time), [B, H, W]."""
        actions = self.action_in_proj(x_t_BHA)
        times = jnp.broadcast_to(time_embedding(time_B, actions.shape[-1])[:, None].astype(actions.dtype),
                                 actions.shape)
        return self.action_time_mlp_out(jax.nn.silu(self.action_time_mlp_in(jnp.concatenate([actions, times], -1))))

    # -- the unit protocol --------------------------------------------------------------------

    def enter(self, batch: dict) -> jax.Array:
        images = batch["images"]
        B, C = images.shape[:2]
        return self.vision_embeddings(images.reshape(B * C, *images.shape[2:]))

    def between(self, name: str, x_ENE: jax.Array, batch: dict) -> dict:
        prefix, prefix_pad = self.embed_prefix(x_ENE, batch)
        suffix = self.suffix_of(batch, self.noisy_actions(batch), batch["time"])
        B, P, S = prefix.shape[0], prefix.shape[1], suffix["suffix"].shape[1]
        pad = jnp.concatenate([prefix_pad, jnp.ones((B, S), bool)], axis=1)
        ar = jnp.broadcast_to(jnp.asarray(self.prefix_ar(P) + self.suffix_ar(), jnp.int32), (B, P + S))
        return {**suffix, "prefix": prefix, "pad": pad, "ar": ar}

    def exit(self, x: dict, batch: dict):
        losses_BHA = self.losses(x, batch)
        keep_BHA = self.loss_mask(batch, losses_BHA.shape)
        count = keep_BHA.sum()
        return (losses_BHA * keep_BHA).sum() / jnp.maximum(count, 1.0), count

    # -- the pieces ---------------------------------------------------------------------------

    def embed_prefix(self, x_ENE: jax.Array, batch: dict):
        """The prefix's embeddings [B, P, D]: the image tokens, then the prompt's embeddings
        x sqrt(D); and which of its tokens are real [B, P]."""
        image_masks = batch["image_masks"]
        B, C = image_masks.shape
        images = self.image_features(x_ENE, C)
        N = images.shape[1] // C
        lang = self.embed_tokens(batch["tokens"])
        lang = lang * jnp.asarray(math.sqrt(lang.shape[-1]), lang.dtype)
        pad = jnp.concatenate([jnp.repeat(image_masks.astype(bool), N, axis=1), batch["token_mask"].astype(bool)],
                              axis=1)
        return jnp.concatenate([images, lang.astype(images.dtype)], axis=1), pad

    @staticmethod
    def noisy_actions(batch: dict) -> jax.Array:
        t = batch["time"][:, None, None]
        return t * batch["noise"] + (1 - t) * batch["actions"]

    def losses(self, x: dict, batch: dict) -> jax.Array:
        """LeRobot's unreduced flow-matching losses (u_t - v_t)^2, [B, H, max_action_dim]."""
        u_t = batch["noise"] - batch["actions"]
        return jnp.square(u_t.astype(jnp.float32) - self.velocity(x))

    def loss_mask(self, batch: dict, shape) -> jax.Array:
        """1 on the real action dimensions of the steps inside the episode, else 0 (fp32)."""
        real_A = jnp.arange(shape[-1]) < self.shape.action_dim
        inside_BH = ~batch["action_is_pad"].astype(bool) if "action_is_pad" in batch else jnp.ones(shape[:2], bool)
        return (inside_BH[..., None] & real_A).astype(jnp.float32)

    # -- one device: checks against the reference, sampling -----------------------------------

    def flow_loss(self, batch: dict, noise: jax.Array, time: jax.Array) -> jax.Array:
        """LeRobot's `forward(...)`: the unreduced losses [B, H, max_action_dim]."""
        batch = {**batch, "noise": noise, "time": time}
        x = protocol.apply_stack(self.vision, self.enter(batch))
        x = protocol.apply_stack(self.layers, self.between("layers", x, batch))
        return self.losses(x, batch)

    def sample_actions(self, batch: dict, noise: jax.Array, num_steps: int | None = None,
                       guide: rtc.Guide | None = None) -> jax.Array:
        """Actions [B, H, max_action_dim] (normalized space): Euler steps from t = 1 to 0 of the
        learnt velocity (`euler_times`), the prefix's keys and values computed once (LeRobot's
        sample_actions); with a `guide`, each step's velocity is real-time chunking's (`rtc`)."""
        prefix, prefix_pad = self.embed_prefix(protocol.apply_stack(self.vision, self.enter(batch)), batch)
        B, P = prefix_pad.shape
        prefix_positions = jnp.cumsum(prefix_pad.astype(jnp.int32), axis=1) - 1
        prefix_mask = attention.blocks(prefix_pad, jnp.broadcast_to(jnp.asarray(self.prefix_ar(P), jnp.int32), (B, P)))
        graphdef, stacked = nnx.split(self.layers)
        _, cache = jax.lax.scan(lambda h, layer: nnx.merge(graphdef, layer).prefix_kv(h, prefix_positions, prefix_mask),
                                prefix, stacked)  # per unit: the prefix's keys and values
        S = len(self.suffix_ar())
        group = jnp.broadcast_to(jnp.cumsum(jnp.asarray(self.suffix_ar(), jnp.int32)), (B, S))  # from 1
        # the suffix sees the real prefix (group 0) and itself as make_att_2d_masks would
        mask = attention.Mask(group, jnp.concatenate([jnp.zeros((B, P), jnp.int32), group], axis=1),
                              k_valid=jnp.concatenate([prefix_pad.astype(bool), jnp.ones((B, S), bool)], axis=1))
        positions = prefix_pad.sum(axis=1, keepdims=True) + jnp.arange(S)[None]

        def velocity(x_t, time):
            carried = {**self.suffix_of(batch, x_t, jnp.broadcast_to(time, (B,))), "prefix_pad": prefix_pad}
            out, _ = jax.lax.scan(lambda h, xs: (nnx.merge(graphdef, xs[0]).suffix_step(h, xs[1], positions, mask),
                                                 None), carried, (stacked, cache))
            return self.velocity(out)

        times = euler_times(num_steps or self.num_steps, self.ACCUMULATED_TIME)
        return rtc.integrate(velocity, noise, times, guide)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token of the joint sequence (prefix + suffix): the family's
        `flops_per_row` divided by the row's P + S tokens (seq_len is not a policy's length: unused)."""
        return self.flops_per_row() / (self.prefix_len + len(self.suffix_ar()))

    def param_size(self, *paths: str) -> int:
        """The parameters under these top-level paths ("layers/vlm" reaches into a stack)."""
        params = nnx.to_pure_dict(nnx.state(self, nnx.Param))
        total = 0
        for path in paths:
            tree = params
            for part in path.split("/"):
                tree = tree[part]
            total += sum(x.size for x in jax.tree.leaves(tree))
        return total
