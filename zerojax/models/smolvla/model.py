"""SmolVLA in Flax NNX (`model.family=smolvla`): LeRobot's small vision-language-action model, as
LeRobot 0.6.1's `VLAFlowMatching` (`smolvla/modeling_smolvla.py`) computes it, so that its
checkpoints map one to one (`smolvla.lerobot`).

A SmolVLM (a SigLIP-style tower, pixel shuffle and a linear connector, a Llama truncated to
model.n_layers) reads the cameras, the prompt and the state (the *prefix*); an action expert, a
Llama of the same depth, heads and head dim at model.expert.d_model (0.75 of the VLM's width),
reads the noisy action chunk (the *suffix*). Its layers alternate self-attention over both
streams with cross-attention to the VLM's keys and values (`smolvla.layers`).

The flow-matching policy (`vla.flow`: the loss, the sampler) and the shared adapter
(`vla.batch`: the state as a vector, as π0's); SmolVLA's own:

    the prefix    per camera its image tokens: the tower's output post-layernormed, pixel-shuffled
                  by model.smolvla.pixel_shuffle, projected (no bias) and scaled by sqrt(D); then
                  the prompt's embeddings x sqrt(D); then state_proj(state), one token of width D
                  that starts a block (the images and prompt do not see it)
    the suffix    H action tokens, action_time_mlp(action_in_proj(x_t) ++ sin/cos time), each
                  starting a block of its own: causal among themselves
    the units     `smolvla.layers.Block`: model.smolvla.self_attn_every_n_layers VLM layers and
                  the expert layers that read them
    sampling      LeRobot 0.6.1's Euler grid (t = 1 + k·dt in float64), model.smolvla.num_steps

Two stacks (the unit protocol): `vision` (the tower's layers) and `layers` (the blocks).

Shapes: B batch, P prefix, H action horizon, A max_action_dim, D VLM width, W expert width, E
vision width, N patches.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from zerojax.errors import ConfigError
from zerojax.models import attention, decoder, siglip
from zerojax.models.family import POLICY, Family
from zerojax.models.smolvla import lerobot
from zerojax.models.smolvla.layers import Block
from zerojax.models.vla import batch as vla_batch
from zerojax.models.vla.flow import FlowMatchingPolicy, Shape, shape_of
from zerojax.models.vla import layers
from zerojax.models.vla.layers import linear
from zerojax.precision import Policy

TOWER = ("vision", "vision_embeddings", "vision_post_layernorm")
LANGUAGE = ("embed_tokens", "norm", "layers/vlm_*")  # the text model: embeddings, final norm, each unit's VLM layers
EXPERT = ("expert_norm", "layers/expert_*")  # the expert: its final norm and each unit's expert layers
ACTION = ("state_proj", "action_in_proj", "action_out_proj", "action_time_mlp_in", "action_time_mlp_out")
# Named components (`optim.components`), for the fine-tuning recipes as one key each:
#   optim.freeze=vlm      LeRobot's train_expert_only (its default): the SmolVLM frozen, the expert,
#                         the state and action projections trained
#   optim.freeze=vision   LeRobot's freeze_vision_encoder
#   optim.lora.targets=lerobot_lora optim.lora.rank=8 optim.lora.alpha=8
#                         LeRobot's LoRA (`--peft.method_type=lora`: SmolVLAPolicy's default PEFT
#                         targets, the expert's q and v projections and the state and action
#                         projections, at PEFT's default rank and alpha; everything else frozen)
COMPONENTS = {"vision": TOWER, "language": LANGUAGE, "vlm": (*TOWER, "connector", *LANGUAGE),
              "expert": EXPERT, "action": ACTION,
              "lerobot_lora": ("layers/expert_*/q_proj", "layers/expert_*/v_proj", *ACTION)}


def pixel_shuffle(x_BNE: jax.Array, scale: int) -> jax.Array:
    """SmolVLMConnector.pixel_shuffle: [B, N, E] -> [B, N / scale², E·scale²], each s x s block of
    patches concatenated (transformers' view/permute sequence, step by step)."""
    B, N, E = x_BNE.shape
    side = int(round(N ** 0.5))
    x = x_BNE.reshape(B, side, side // scale, E * scale).transpose(0, 2, 1, 3)
    x = x.reshape(B, side // scale, side // scale, E * scale * scale).transpose(0, 2, 1, 3)
    return x.reshape(B, N // (scale * scale), E * scale * scale)


class SmolVLA(FlowMatchingPolicy):
    """SmolVLA (module docstring): the flow-matching policy over SmolVLA's prefix, suffix and units."""

    COMPONENTS = COMPONENTS

    def __init__(self, *, shape: Shape, vision: siglip.Shape, policy: Policy = Policy(), rngs: nnx.Rngs,
                 spec: attention.Spec = attention.Spec(), num_steps: int = 10):
        s, self.shape, self.num_steps = shape, shape, num_steps
        self.init_tower(vision, policy, rngs, spec)
        self.connector = nnx.Linear(vision.d_model * s.pixel_shuffle ** 2, s.d_model, use_bias=False,
                                    dtype=policy.compute, param_dtype=policy.param, rngs=rngs,
                                    kernel_init=nnx.initializers.normal(decoder.STD))
        self.embed_tokens = nnx.Embed(s.vocab_size, s.d_model, dtype=policy.compute, param_dtype=policy.param,
                                      embedding_init=nnx.initializers.normal(decoder.STD), rngs=rngs)

        @nnx.split_rngs(splits=s.n_layers // s.every)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(rngs: nnx.Rngs) -> Block:
            return Block(s, policy, rngs, spec)

        self.layers = make_layers(rngs)
        self.norm = decoder.rms_norm(s.d_model, s.norm_eps, policy, rngs)  # the VLM's final norm (output unused)
        self.expert_norm = decoder.rms_norm(s.expert_d_model, s.norm_eps, policy, rngs)
        W = s.expert_d_model
        self.state_proj = linear(s.max_state_dim, s.d_model, policy, rngs)
        self.init_action_time_heads(s.max_action_dim, W, policy, rngs)

    def image_features(self, x_ENE: jax.Array, cameras: int) -> jax.Array:
        """Each camera's image tokens, [B, cameras·N/s², D], scaled by sqrt(D) as LeRobot's embed_prefix."""
        shuffled = pixel_shuffle(self.vision_post_layernorm(x_ENE), self.shape.pixel_shuffle)
        features = self.connector(shuffled)
        D = features.shape[-1]
        features = features * jnp.asarray(D ** 0.5, features.dtype)
        return features.reshape(-1, cameras * features.shape[1], D)

    def embed_prefix(self, x_ENE: jax.Array, batch: dict):
        """The prefix's embeddings [B, P, D] (images, prompt, state) and which tokens are real [B, P]."""
        images, pad = super().embed_prefix(x_ENE, batch)
        state = self.state_proj(batch["state"])[:, None].astype(images.dtype)
        return jnp.concatenate([images, state], axis=1), jnp.concatenate([pad, jnp.ones_like(pad[:, :1])], axis=1)

    @staticmethod
    def prefix_ar(P: int) -> list[int]:
        """The prefix's autoregressive flags: the state token (last) starts a block."""
        return [0] * (P - 1) + [1]

    def suffix_ar(self) -> list[int]:
        """Every action token starts a block (LeRobot's [1] * chunk_size): causal among themselves."""
        return [1] * self.shape.horizon

    def suffix_of(self, batch: dict, x_t_BHA: jax.Array, time_B: jax.Array) -> dict:
        """The action tokens [B, H, W]: each a block of its own."""
        return {"suffix": self.action_time_tokens(x_t_BHA, time_B)}

    @property
    def prefix_len(self) -> int:
        v = self.vision_shape
        return self.shape.cameras * v.n_patches // self.shape.pixel_shuffle ** 2 + self.shape.prompt_len + 1

    def flops_per_row(self) -> float:
        """Training FLOPs of one row (PaLM appendix B: 6 per parameter per token it is applied to,
        plus attention): the tower on every camera's N patches, the connector and the VLM's layers
        on the P prefix tokens, the expert's layers and the action heads on the H suffix tokens,
        and attention's 12·(queries·keys)·Q·K: the self-attention layers over P + H keys, the
        cross-attention layers' prefix over P keys and suffix over P keys."""
        s, P, H = self.shape, self.prefix_len, self.shape.horizon
        vlm = self.param_size(*(f"layers/vlm_{j}" for j in range(s.every)), "connector")
        expert = self.param_size(*(f"layers/expert_{j}" for j in range(s.every)), "expert_norm", *ACTION)
        tower = self.param_size(*TOWER)
        self_layers = s.n_layers // s.every
        pairs = self_layers * (P + H) ** 2 + (s.n_layers - self_layers) * (P * P + H * P)
        return (s.cameras * siglip.flops_per_image(tower, self.vision_shape) + 6 * vlm * P + 6 * expert * H
                + 12 * pairs * s.n_heads * s.head_dim)


def build(*, cfg, policy: Policy, rngs: nnx.Rngs) -> SmolVLA:
    """The `model.family=smolvla` factory."""
    shape = shape_of(cfg, every=cfg.smolvla.self_attn_every_n_layers, pixel_shuffle=cfg.smolvla.pixel_shuffle)
    return SmolVLA(shape=shape, vision=siglip.shape_of(cfg.vision), policy=policy, rngs=rngs,
                   spec=attention.spec_of(cfg), num_steps=cfg.smolvla.num_steps)


def check_config(cfg) -> None:
    """SmolVLA's rules: its blocks tile the depth, the patches tile the pixel shuffle, and the
    expert's width holds its time embedding (even)."""
    every, scale = cfg.smolvla.self_attn_every_n_layers, cfg.smolvla.pixel_shuffle
    if cfg.n_layers % every:
        raise ConfigError(f"model.n_layers={cfg.n_layers} is not a multiple of model.smolvla.self_attn_every_n_layers="
                          f"{every}: each unit holds one self-attention layer and {every - 1} cross-attention ones")
    if every > 8:
        raise ConfigError(f"model.smolvla.self_attn_every_n_layers={every}: zerojax holds at most 8 layers a unit")
    side = cfg.vision.image_size // cfg.vision.patch_size
    if side % scale:
        raise ConfigError(f"model.vision.image_size / patch_size = {side} patches a side is not divisible by "
                          f"model.smolvla.pixel_shuffle={scale}; the pixel shuffle groups {scale} x {scale} patches")
    layers.check_time_width(cfg)


FAMILY = Family(kind=POLICY, build=build, check_config=check_config, lerobot=lerobot.LEROBOT,
                adapter=dataclasses.replace(vla_batch.ADAPTER, pad_before=True),  # LeRobot's resize_with_pad
                recipe=lerobot.RECIPE)
