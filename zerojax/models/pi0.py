"""π0 in Flax NNX: a vision-language-action model trained by flow matching, as LeRobot's
`PI0FlowMatching` (and openpi's π0) computes it, so that checkpoints map one to one.

A PaliGemma (SigLIP tower, linear projector, Gemma decoder) reads the cameras and the prompt
(the *prefix*); an action expert, a second and narrower Gemma of the same depth, heads and head
dim (model.expert.*), reads the robot state and the noisy action chunk (the *suffix*). In
every layer the two streams share one attention: each stream's norm and q/k/v projections,
queries, keys and values concatenated over the sequence, attention once, then each stream's own
output projection and MLP. So one *joint layer* (both experts' weights for that depth) is the
unit the ZeRO-3 schedule gathers, which PyTorch FSDP cannot wrap block by block.

Two stacks, run in order (the unit protocol):

    enter(batch)           each camera's patch embeddings: [B·cameras, N, E]
    vision                 SigLIP's encoder layers (one unit each)
    between("layers")      the post-layernorm and projector; the prefix (image features, then the
                           language embeddings x sqrt(d_model)) and the suffix (state_proj(state),
                           then action_time_mlp(action_in_proj(x_t) ++ sin/cos time embedding))
    layers                 the joint layers (one unit each); attention as LeRobot's
                           make_att_2d_masks builds it: the prefix attends within itself both
                           ways, the state token to the prefix and itself, the action tokens to
                           everything (padding never attended)
    exit(x, batch)         the expert's final norm, action_out_proj: v_t; the loss is the mean of
                           (u_t - v_t)^2 over the real action dimensions of steps inside the episode

Flow matching: x_t = t·noise + (1 - t)·actions, u_t = noise - actions. The batch (`BATCH`, made
by `pi0_batch`) carries `noise` and `time`, drawn by the data pipeline from (seed, step, row), so
the loss is the same on any mesh and any train.grad_accum. `flow_loss` returns LeRobot's
unreduced losses [B, H, max_action_dim]; `sample_actions` integrates from t = 1 to 0 with Euler
steps (real-time chunking's guidance, `rtc`, optional), the prefix's keys and values computed once.

Shapes: B batch, P prefix, S suffix (1 + H), H action horizon, A max_action_dim, D VLM width,
W expert width, E vision width, G kv heads, Q query heads, K head dim, L layers.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zerojax.errors import ConfigError
from zerojax.models import attention, gemma, pi0_batch, pi0_lerobot, pi0_openpi, protocol, rtc, siglip
from zerojax.models.vla import linear as _linear, time_embedding
from zerojax.models.family import POLICY, Family
from zerojax.models.llama import MLP, _dense, rope
from zerojax.precision import Policy

BATCH = ("images", "image_masks", "tokens", "token_mask", "state", "actions", "action_is_pad", "noise", "time")
TOWER = ("vision", "vision_embeddings", "vision_post_layernorm")  # the vision tower's parameters
LANGUAGE = ("embed_tokens", "norm", "layers/vlm")  # PaliGemma's Gemma: its embeddings, final norm, joint-layer halves
EXPERT = ("layers/expert", "expert_norm")  # the action expert's Gemma: its joint-layer halves and final norm
ACTION = ("state_proj", "action_in_proj", "action_out_proj", "action_time_mlp_in", "action_time_mlp_out")
# Named components (`optim.components`), for the fine-tuning recipes as one key each:
#   optim.freeze=vision                 LeRobot's freeze_vision_encoder (its default)
#   optim.freeze=vlm                    LeRobot's train_expert_only: all of PaliGemma frozen
#   optim.lora.targets=language         LoRA on the VLM's Gemma (with optim.lora.base=targets: openpi's
#   optim.lora.targets=language,expert  gemma_2b_lora / gemma_300m_lora, the rest trained)
COMPONENTS = {"vision": TOWER, "language": LANGUAGE, "vlm": (*TOWER, "multi_modal_projector", *LANGUAGE),
              "expert": EXPERT, "action": ACTION}


class Shape(NamedTuple):
    """The sizes of a π0 (model.*, model.expert.*, model.action.*)."""

    vocab_size: int
    d_model: int  # the VLM's width
    n_layers: int  # both experts' depth
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


class Stream(nnx.Module):
    """One expert's half of a joint layer: Gemma's norms, projections and GeGLU MLP."""

    def __init__(self, width: int, n_heads: int, n_kv_heads: int, head_dim: int, d_ff: int, eps: float,
                 policy: Policy, rngs: nnx.Rngs):
        self.input_layernorm = gemma.RMSNorm(width, eps, policy)
        self.q_proj = _dense(width, n_heads * head_dim, policy, rngs)
        self.k_proj = _dense(width, n_kv_heads * head_dim, policy, rngs)
        self.v_proj = _dense(width, n_kv_heads * head_dim, policy, rngs)
        self.o_proj = _dense(n_heads * head_dim, width, policy, rngs)
        self.post_attention_layernorm = gemma.RMSNorm(width, eps, policy)
        self.mlp = MLP(width, d_ff, policy, rngs, activation=gemma.gelu_tanh)
        self.head_dim = head_dim

    def qkv(self, h_BLW: jax.Array):
        B, L, _ = h_BLW.shape
        x = self.input_layernorm(h_BLW)
        split = lambda proj: proj(x).reshape(B, L, -1, self.head_dim)
        return split(self.q_proj), split(self.k_proj), split(self.v_proj)

    def finish(self, h_BLW: jax.Array, attended_BLQK: jax.Array) -> jax.Array:
        B, L = h_BLW.shape[:2]
        h_BLW = h_BLW + self.o_proj(attended_BLQK.reshape(B, L, -1).astype(h_BLW.dtype))
        return h_BLW + self.mlp(self.post_attention_layernorm(h_BLW))


def attend(q_BTQK: jax.Array, k_BSGK: jax.Array, v_BSGK: jax.Array, mask: attention.Mask,
           spec: attention.Spec) -> jax.Array:
    """Grouped-query attention under `mask`, scores (from fp32 queries and keys, as openpi's) and
    softmax in fp32: [B, T, Q, K]. A masked score is fp32's lowest, openpi's -2.38e38: either
    underflows to a zero weight, and a row with no key left averages every key under both."""
    return attention.attend(q_BTQK.astype(jnp.float32), k_BSGK.astype(jnp.float32), v_BSGK, mask, spec)


class JointLayer(nnx.Module):
    """Both experts' weights for one depth: the unit a ZeRO-3 schedule gathers at a time.

    Its input and output is the dict {"prefix": [B, P, D], "suffix": [B, S, W], "pad": bool
    [B, P+S], "ar": int32 [B, P+S]}: the two streams and what their attention mask is made of."""

    def __init__(self, shape: Shape, policy: Policy, rngs: nnx.Rngs, spec: attention.Spec = attention.Spec()):
        s = shape
        self.spec = spec
        self.vlm = Stream(s.d_model, s.n_heads, s.n_kv_heads, s.head_dim, s.d_ff, s.norm_eps, policy, rngs)
        self.expert = Stream(s.expert_d_model, s.n_heads, s.n_kv_heads, s.head_dim, s.expert_d_ff, s.norm_eps,
                             policy, rngs)
        self.theta = s.rope_theta

    def __call__(self, x: dict) -> dict:
        prefix, suffix = x["prefix"], x["suffix"]
        out = self.joint(x, self.vlm.qkv(prefix), self.expert.qkv(suffix))
        P = prefix.shape[1]
        return {**x, "prefix": self.vlm.finish(prefix, out[:, :P]), "suffix": self.expert.finish(suffix, out[:, P:])}

    def joint(self, x: dict, vlm_qkv, expert_qkv) -> jax.Array:
        """The one attention of both streams' queries, keys and values, [B, P+S, Q, K]."""
        (qp, kp, vp), (qs, ks, vs) = vlm_qkv, expert_qkv
        positions_BL = jnp.cumsum(x["pad"].astype(jnp.int32), axis=1) - 1
        q = rope(jnp.concatenate([qp, qs.astype(qp.dtype)], axis=1), self.theta, positions_BL)
        k = rope(jnp.concatenate([kp, ks.astype(kp.dtype)], axis=1), self.theta, positions_BL)
        v = jnp.concatenate([vp, vs.astype(vp.dtype)], axis=1)
        return attend(q, k, v, attention.blocks(x["pad"], x["ar"]), self.spec)

    def prefix_kv(self, prefix: jax.Array, positions_BP: jax.Array, mask: attention.Mask):
        """The prefix alone through the VLM's half (sampling): its output and its keys and values."""
        q, k, v = self.vlm.qkv(prefix)
        q, k = rope(q, self.theta, positions_BP), rope(k, self.theta, positions_BP)
        return self.vlm.finish(prefix, attend(q, k, v, mask, self.spec)), (k, v)

    def suffix_step(self, x: dict, kv, positions_BS: jax.Array, mask: attention.Mask) -> dict:
        """The suffix ({"suffix": [B, S, W]}) through the expert's half, attending to the cached
        prefix and to itself."""
        suffix = x["suffix"]
        return {**x, "suffix": self.expert.finish(suffix, self.cached(self.expert.qkv(suffix), kv, positions_BS, mask))}

    def cached(self, qkv, kv, positions_BS: jax.Array, mask: attention.Mask) -> jax.Array:
        """The suffix's queries over the cached prefix's keys and values and its own."""
        q, k, v = qkv
        q, k = rope(q, self.theta, positions_BS), rope(k, self.theta, positions_BS)
        k = jnp.concatenate([kv[0], k.astype(kv[0].dtype)], axis=1)
        v = jnp.concatenate([kv[1], v.astype(kv[1].dtype)], axis=1)
        return attend(q, k, v, mask, self.spec)


class Pi0(nnx.Module):
    STACKED = ("vision", "layers")
    COMPONENTS = COMPONENTS
    LAYER = JointLayer  # the joint layer's class (π0.5's has adaptive norms)

    def __init__(self, *, shape: Shape, vision: siglip.Shape, policy: Policy = Policy(), rngs: nnx.Rngs,
                 spec: attention.Spec = attention.Spec()):
        s, self.shape, self.vision_shape = shape, shape, vision
        self.vision_embeddings = siglip.Embeddings(vision, policy, rngs)
        self.vision = siglip.make_stack(vision, policy, rngs, spec)
        self.vision_post_layernorm = siglip.layer_norm(vision.d_model, vision.norm_eps, policy, rngs)
        self.multi_modal_projector = nnx.Linear(vision.d_model, s.d_model, dtype=policy.compute,
                                                param_dtype=policy.param, rngs=rngs,
                                                kernel_init=nnx.initializers.normal(gemma.STD))
        self.embed_tokens = nnx.Embed(s.vocab_size, s.d_model, dtype=policy.compute, param_dtype=policy.param,
                                      embedding_init=nnx.initializers.normal(gemma.STD), rngs=rngs)

        @nnx.split_rngs(splits=s.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(rngs: nnx.Rngs) -> JointLayer:
            return type(self).LAYER(s, policy, rngs, spec)

        self.layers = make_layers(rngs)
        self.norm = gemma.RMSNorm(s.d_model, s.norm_eps, policy)  # the VLM's final norm (its output is unused)
        self.init_heads(s, policy, rngs)

    def init_heads(self, s: Shape, policy: Policy, rngs: nnx.Rngs) -> None:
        """The expert's final norm and the action heads (`ACTION`)."""
        self.expert_norm = gemma.RMSNorm(s.expert_d_model, s.norm_eps, policy)
        W = s.expert_d_model
        self.state_proj = _linear(s.max_state_dim, W, policy, rngs)
        self.action_in_proj = _linear(s.max_action_dim, W, policy, rngs)
        self.action_out_proj = _linear(W, s.max_action_dim, policy, rngs)
        self.action_time_mlp_in = _linear(2 * W, W, policy, rngs)
        self.action_time_mlp_out = _linear(W, W, policy, rngs)

    # -- the unit protocol --------------------------------------------------------------------

    def enter(self, batch: dict) -> jax.Array:
        images = batch["images"]
        B, C = images.shape[:2]
        return self.vision_embeddings(images.reshape(B * C, *images.shape[2:]))

    def between(self, name: str, x_ENE: jax.Array, batch: dict) -> dict:
        prefix, prefix_pad = self.embed_prefix(x_ENE, batch)
        x_t = self.noisy_actions(batch)
        suffix = self.embed_suffix(batch["state"], x_t, batch["time"])
        B, P, S = prefix.shape[0], prefix.shape[1], suffix.shape[1]
        pad = jnp.concatenate([prefix_pad, jnp.ones((B, S), bool)], axis=1)
        ar = jnp.broadcast_to(jnp.asarray([0] * P + self.suffix_ar(), jnp.int32), (B, P + S))
        return {"prefix": prefix, "suffix": suffix, "pad": pad, "ar": ar}

    def exit(self, x: dict, batch: dict):
        losses_BHA = self.losses(x, batch)
        keep_BHA = self.loss_mask(batch, losses_BHA.shape)
        count = keep_BHA.sum()
        return (losses_BHA * keep_BHA).sum() / jnp.maximum(count, 1.0), count

    # -- the pieces ---------------------------------------------------------------------------

    def image_features(self, x_ENE: jax.Array, cameras: int) -> jax.Array:
        """The tower's output post-layernormed and projected, [B, cameras·N, D], scaled as LeRobot
        with transformers 4.5x does: divided by sqrt(D) in get_image_features, then multiplied by it."""
        features = self.multi_modal_projector(self.vision_post_layernorm(x_ENE))
        D = features.shape[-1]
        features = (features / D ** 0.5) * jnp.asarray(D ** 0.5, features.dtype)
        return features.reshape(-1, cameras * features.shape[1], D)

    def embed_prefix(self, x_ENE: jax.Array, batch: dict):
        """The prefix's embeddings [B, P, D] and which of its tokens are real [B, P]."""
        image_masks = batch["image_masks"]
        B, C = image_masks.shape
        images = self.image_features(x_ENE, C)
        N = images.shape[1] // C
        lang = self.embed_tokens(batch["tokens"])
        lang = lang * jnp.asarray(math.sqrt(lang.shape[-1]), lang.dtype)
        pad = jnp.concatenate([jnp.repeat(image_masks.astype(bool), N, axis=1), batch["token_mask"].astype(bool)],
                              axis=1)
        return jnp.concatenate([images, lang.astype(images.dtype)], axis=1), pad

    def embed_suffix(self, state_BA: jax.Array, x_t_BHA: jax.Array, time_B: jax.Array) -> jax.Array:
        """The state token and the action tokens, [B, 1 + H, W]."""
        state = self.state_proj(state_BA)[:, None]
        actions = self.action_in_proj(x_t_BHA)
        times = jnp.broadcast_to(time_embedding(time_B, actions.shape[-1])[:, None].astype(actions.dtype),
                                 actions.shape)
        fused = self.action_time_mlp_out(jax.nn.silu(self.action_time_mlp_in(jnp.concatenate([actions, times], -1))))
        return jnp.concatenate([state, fused.astype(state.dtype)], axis=1)

    def suffix_ar(self) -> list[int]:
        """The suffix's autoregressive flags: the state token starts a block (the prefix does not
        see it), the first action token starts another (state and prefix do not see actions)."""
        return [1, 1] + [0] * (self.shape.horizon - 1)

    @staticmethod
    def noisy_actions(batch: dict) -> jax.Array:
        t = batch["time"][:, None, None]
        return t * batch["noise"] + (1 - t) * batch["actions"]

    def velocity(self, x: dict) -> jax.Array:
        """v_t [B, H, max_action_dim] fp32 from the last joint layer's output (its "suffix")."""
        out = self.expert_norm(x["suffix"])[:, -self.shape.horizon:]
        return self.action_out_proj(out.astype(jnp.float32)).astype(jnp.float32)

    def losses(self, x: dict, batch: dict) -> jax.Array:
        """LeRobot's unreduced flow-matching losses (u_t - v_t)^2, [B, H, max_action_dim]."""
        u_t = batch["noise"] - batch["actions"]
        return jnp.square(u_t.astype(jnp.float32) - self.velocity(x))

    def loss_mask(self, batch: dict, shape) -> jax.Array:
        """1 on the real action dimensions of the steps inside the episode, else 0 (fp32)."""
        real_A = jnp.arange(shape[-1]) < self.shape.action_dim
        inside_BH = ~batch["action_is_pad"].astype(bool) if "action_is_pad" in batch else jnp.ones(shape[:2], bool)
        return (inside_BH[..., None] & real_A).astype(jnp.float32)

    # -- one device: checks against LeRobot, sampling -----------------------------------------

    def flow_loss(self, batch: dict, noise: jax.Array, time: jax.Array) -> jax.Array:
        """LeRobot's `PI0FlowMatching.forward(...)`: the unreduced losses [B, H, max_action_dim]."""
        batch = {**batch, "noise": noise, "time": time}
        x = protocol.apply_stack(self.vision, self.enter(batch))
        x = protocol.apply_stack(self.layers, self.between("layers", x, batch))
        return self.losses(x, batch)

    def sample_actions(self, batch: dict, noise: jax.Array, num_steps: int = 10,
                       guide: rtc.Guide | None = None) -> jax.Array:
        """Actions [B, H, max_action_dim] (normalized space): Euler steps from t = 1 to 0 of the
        learnt velocity, the prefix's keys and values computed once (LeRobot's sample_actions);
        with a `guide`, each step's velocity is real-time chunking's (`zerojax.models.rtc`)."""
        prefix, prefix_pad = self.embed_prefix(protocol.apply_stack(self.vision, self.enter(batch)), batch)
        B, P = prefix_pad.shape
        prefix_positions = jnp.cumsum(prefix_pad.astype(jnp.int32), axis=1) - 1
        prefix_mask = attention.blocks(prefix_pad, jnp.zeros((B, P), jnp.int32))
        graphdef, stacked = nnx.split(self.layers)

        def prefix_layer(h, layer):
            h, kv = nnx.merge(graphdef, layer).prefix_kv(h, prefix_positions, prefix_mask)
            return h, kv

        _, cache = jax.lax.scan(prefix_layer, prefix, stacked)  # per layer: keys and values [B, P, G, K]
        S = len(self.suffix_ar())
        suffix_pad = jnp.ones((B, S), bool)
        suffix_group = jnp.broadcast_to(jnp.cumsum(jnp.asarray(self.suffix_ar(), jnp.int32)), (B, S))  # from 1
        # the suffix sees the real prefix (group 0) and itself as make_att_2d_masks would
        mask = attention.Mask(suffix_group, jnp.concatenate([jnp.zeros((B, P), jnp.int32), suffix_group], axis=1),
                              k_valid=jnp.concatenate([prefix_pad.astype(bool), suffix_pad], axis=1))
        positions = prefix_pad.sum(axis=1, keepdims=True) + jnp.cumsum(suffix_pad.astype(jnp.int32), axis=1) - 1

        def velocity(x_t, time):
            def suffix_layer(h, xs):
                layer, kv = xs
                return nnx.merge(graphdef, layer).suffix_step(h, kv, positions, mask), None

            out, _ = jax.lax.scan(suffix_layer, self.suffix_of(batch, x_t, jnp.broadcast_to(time, (B,))),
                                  (stacked, cache))
            return self.velocity(out)

        return rtc.integrate(velocity, noise, self.euler_times(num_steps), guide)

    def suffix_of(self, batch: dict, x_t: jax.Array, time_B: jax.Array) -> dict:
        """What the suffix layers carry while sampling: {"suffix": [B, S, W]}."""
        return {"suffix": self.embed_suffix(batch["state"], x_t, time_B)}

    @staticmethod
    def euler_times(num_steps: int) -> np.ndarray:
        """LeRobot 0.3.3's (and openpi's) loop: t from 1, `t += dt` in fp32 while t >= -dt / 2."""
        return np.cumsum([np.float32(1.0)] + [np.float32(-1.0 / num_steps)] * (num_steps - 1), dtype=np.float32)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token of the joint sequence (prefix + suffix): `flops_per_row`
        divided by the row's P + S tokens (seq_len is not a π0 length: unused)."""
        return self.flops_per_row() / (self.prefix_len + len(self.suffix_ar()))

    @property
    def prefix_len(self) -> int:
        return self.shape.cameras * self.vision_shape.n_patches + self.shape.prompt_len

    def flops_per_row(self) -> float:
        """Training FLOPs of one row (PaLM appendix B: 6 per parameter per token it is applied to,
        plus attention): the tower on every camera's N patches, the projector and the VLM's half
        of each joint layer on the P prefix tokens, the expert's half and the action projections
        on the S suffix tokens, and the joint attention of P + S queries over P + S keys
        (12·L·(P+S)·Q·K per token)."""
        params = nnx.to_pure_dict(nnx.state(self, nnx.Param))
        size = lambda tree: sum(x.size for x in jax.tree.leaves(tree))
        s, P, S = self.shape, self.prefix_len, len(self.suffix_ar())
        tower = sum(size(params[k]) for k in TOWER)
        vlm = size(params["layers"]["vlm"]) + size(params["multi_modal_projector"])
        heads = ("expert_norm", *self.COMPONENTS["action"])
        expert = size(params["layers"]["expert"]) + sum(size(params[k]) for k in heads)
        return (s.cameras * siglip.flops_per_image(tower, self.vision_shape) + 6 * vlm * P + 6 * expert * S
                + 12 * s.n_layers * (P + S) ** 2 * s.n_heads * s.head_dim)


def shape_of(cfg) -> Shape:
    """The Shape of a ModelConfig (model.*, model.expert.*, model.action.*)."""
    a = cfg.action
    return Shape(vocab_size=cfg.vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                 n_kv_heads=cfg.n_kv_heads or cfg.n_heads, head_dim=gemma.head_dim_of(cfg), d_ff=cfg.d_ff,
                 expert_d_model=cfg.expert.d_model, expert_d_ff=cfg.expert.d_ff, horizon=a.horizon,
                 max_state_dim=a.max_state_dim, max_action_dim=a.max_action_dim,
                 action_dim=a.action_dim or a.max_action_dim, cameras=a.cameras, prompt_len=a.prompt_len,
                 norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta)


def build(*, cfg, policy: Policy, rngs: nnx.Rngs) -> Pi0:
    """The `model.family=pi0` factory."""
    return Pi0(shape=shape_of(cfg), vision=siglip.shape_of(cfg.vision), policy=policy, rngs=rngs,
               spec=attention.spec_of(cfg))


def check_config(cfg) -> None:
    """π0's rules: both experts' heads are Gemma's (an even head dim, no untied head: the VLM's
    embedding is its lm_head), and the expert's width must hold its time embedding (even)."""
    gemma.check_config(cfg)
    if cfg.expert.d_model % 2:
        raise ConfigError(f"model.expert.d_model={cfg.expert.d_model} must be even: the action tokens' sine-cosine "
                          "time embedding has one sine and one cosine per frequency")


FAMILY = Family(kind=POLICY, build=build, check_config=check_config, lerobot=pi0_lerobot.LEROBOT,
                openpi=pi0_openpi.OPENPI, adapter=pi0_batch.ADAPTER)
