"""PaliGemma with an action expert: the body π0 and π0.5 share, as LeRobot's
`PaliGemmaWithExpertModel` and openpi's one `Pi0` (with its `pi05` flag) compute it, so that
checkpoints map one to one. Each family's model (`pi0.model`, `pi05.model`) adds its heads and
suffix to this base; neither is built on the other.

A PaliGemma (SigLIP tower, linear projector, Gemma decoder) reads the cameras and the prompt (the
*prefix*); an action expert, a second and narrower Gemma of the same depth, heads and head dim
(model.expert.*), reads the suffix. In every layer the two streams share one attention
(`vla.layers.joint_attention`): each stream's norm and q/k/v projections, one attention, then
each stream's own output projection and MLP. So one *joint layer* (both experts' weights for that
depth) is the unit the ZeRO-3 schedule gathers, which PyTorch FSDP cannot wrap block by block.

The expert's norms are Gemma's RMSNorm (π0), or adaptive (π0.5: `AdaRMSNorm`, no scale of their
own: a dense W -> 3W, zero-initialised, of the flow's time condition gives scale, shift and gate;
the norm's output is rmsnorm(x)·(1 + scale) + shift in fp32, and each residual adds y·gate). The
carried dict is {"prefix": [B, P, D], "suffix": [B, S, W], "pad": bool [B, P+S], "ar": int32
[B, P+S]}, and "cond" [B, W] with adaptive norms.

Shapes: B batch, P prefix, S suffix, H action horizon, A max_action_dim, D VLM width, W expert
width, E vision width, Q query heads, K head dim, L layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from zerojax.models import attention, decoder, gemma, siglip
from zerojax.models.vla import layers
from zerojax.models.vla.flow import FlowMatchingPolicy, Shape, shape_of
from zerojax.precision import Policy

TOWER = ("vision", "vision_embeddings", "vision_post_layernorm")  # the vision tower's parameters
LANGUAGE = ("embed_tokens", "norm", "layers/vlm")  # PaliGemma's Gemma: its embeddings, final norm, joint-layer halves
EXPERT = ("layers/expert", "expert_norm")  # the action expert's Gemma: its joint-layer halves and final norm


def components(action: tuple[str, ...]) -> dict:
    """Named components (`optim.components`), for the fine-tuning recipes as one key each:
        optim.freeze=vision                 LeRobot's freeze_vision_encoder (its default)
        optim.freeze=vlm                    LeRobot's train_expert_only: all of PaliGemma frozen
        optim.lora.targets=language         LoRA on the VLM's Gemma (with optim.lora.base=targets: openpi's
        optim.lora.targets=language,expert  gemma_2b_lora / gemma_300m_lora, the rest trained)
    `action`: the family's heads."""
    return {"vision": TOWER, "language": LANGUAGE, "vlm": (*TOWER, "multi_modal_projector", *LANGUAGE),
            "expert": EXPERT, "action": action}


class AdaRMSNorm(nnx.Module):
    """LeRobot's `PiGemmaRMSNorm` with a condition (openpi's adaptive `RMSNorm`): (rmsnorm(x)·(1 +
    scale) + shift, gate), scale, shift and gate from a zero-initialised dense layer of cond."""

    def __init__(self, width: int, eps: float, policy: Policy, rngs: nnx.Rngs):
        self.eps = eps
        self.dense = nnx.Linear(width, 3 * width, dtype=policy.compute, param_dtype=policy.param,
                                kernel_init=nnx.initializers.zeros, bias_init=nnx.initializers.zeros, rngs=rngs)

    def __call__(self, x_BLW: jax.Array, cond_BW: jax.Array) -> tuple[jax.Array, jax.Array]:
        x = x_BLW.astype(jnp.float32)
        normed = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        scale, shift, gate = jnp.split(self.dense(cond_BW)[:, None], 3, axis=-1)
        out = normed * (1 + scale.astype(jnp.float32)) + shift.astype(jnp.float32)
        return out.astype(x_BLW.dtype), gate.astype(x_BLW.dtype)


def gemma_stream(width: int, d_ff: int, s: Shape, policy: Policy, rngs: nnx.Rngs, adaptive: bool) -> decoder.Stream:
    """One expert's half of a joint layer: Gemma's norms (or adaptive ones), projections and GeGLU.
    The adaptive norms' dense layers draw their initial keys after the layer's projections and
    MLP, as they did when π0.5 was first written here, so that a π0.5 trained from scratch starts
    from the same weights as the runs BENCHMARKS.md reports."""
    norm = (lambda d: None) if adaptive else (lambda d: decoder.GemmaRMSNorm(d, s.norm_eps, policy))
    stream = decoder.Stream(width, s.n_heads, s.n_kv_heads, s.head_dim, d_ff, policy, rngs, norm=norm,
                            activation=decoder.gelu_tanh)
    if adaptive:  # nnx.data: the placeholders above were not modules
        stream.input_layernorm = nnx.data(AdaRMSNorm(width, s.norm_eps, policy, rngs))
        stream.post_attention_layernorm = nnx.data(AdaRMSNorm(width, s.norm_eps, policy, rngs))
    return stream


class JointLayer(nnx.Module):
    """Both experts' weights for one depth: the unit a ZeRO-3 schedule gathers at a time (module
    docstring). With `adaptive`, the expert's norms read the carried "cond"."""

    def __init__(self, shape: Shape, policy: Policy, rngs: nnx.Rngs, spec: attention.Spec = attention.Spec(),
                 adaptive: bool = False):
        s = shape
        self.spec, self.theta, self.adaptive = spec, s.rope_theta, adaptive
        self.vlm = gemma_stream(s.d_model, s.d_ff, s, policy, rngs, adaptive=False)
        self.expert = gemma_stream(s.expert_d_model, s.expert_d_ff, s, policy, rngs, adaptive)

    def expert_qkv(self, x: dict):
        """The expert's queries, keys and values of the carried suffix, and the attention
        residual's gate (None without adaptive norms)."""
        if not self.adaptive:
            return self.expert.qkv(x["suffix"]), None
        normed, gate = self.expert.input_layernorm(x["suffix"], x["cond"])
        return self.expert.project(normed), gate

    def expert_finish(self, x: dict, attended_BSQK: jax.Array, gate) -> jax.Array:
        """The suffix after its attention output and MLP (gated residuals with adaptive norms)."""
        if not self.adaptive:
            return self.expert.finish(x["suffix"], attended_BSQK)
        suffix = x["suffix"]
        B, S = suffix.shape[:2]
        suffix = suffix + self.expert.o_proj(attended_BSQK.reshape(B, S, -1).astype(suffix.dtype)) * gate
        y, gate = self.expert.post_attention_layernorm(suffix, x["cond"])
        return suffix + self.expert.mlp(y) * gate

    def __call__(self, x: dict) -> dict:
        prefix = x["prefix"]
        expert_qkv, gate = self.expert_qkv(x)
        out = layers.joint_attention(self.vlm.qkv(prefix), expert_qkv, x["pad"], x["ar"], self.theta, self.spec)
        P = prefix.shape[1]
        return {**x, "prefix": self.vlm.finish(prefix, out[:, :P]), "suffix": self.expert_finish(x, out[:, P:], gate)}

    def prefix_kv(self, prefix: jax.Array, positions_BP: jax.Array, mask: attention.Mask):
        """The prefix alone through the VLM's half (sampling): its output and its keys and values."""
        out, kv = layers.prefix_attention(self.vlm.qkv(prefix), positions_BP, mask, self.theta, self.spec)
        return self.vlm.finish(prefix, out), kv

    def suffix_step(self, x: dict, kv, positions_BS: jax.Array, mask: attention.Mask) -> dict:
        """The suffix through the expert's half, attending to the cached prefix and to itself."""
        qkv, gate = self.expert_qkv(x)
        out = layers.cached_attention(qkv, kv, positions_BS, mask, self.theta, self.spec)
        return {**x, "suffix": self.expert_finish(x, out, gate)}


class PaliGemmaWithExpert(FlowMatchingPolicy):
    """The shared body (module docstring): the tower, the projector, the prompt's embedding, the
    joint layers and the VLM's final norm; then the family's expert norm and heads (`init_heads`)."""

    ADAPTIVE = False  # the expert's norms adaptive (π0.5), or Gemma's (π0)

    def __init__(self, *, shape: Shape, vision: siglip.Shape, policy: Policy = Policy(), rngs: nnx.Rngs,
                 spec: attention.Spec = attention.Spec()):
        s, self.shape, adaptive = shape, shape, self.ADAPTIVE
        self.init_tower(vision, policy, rngs, spec)
        self.multi_modal_projector = nnx.Linear(vision.d_model, s.d_model, dtype=policy.compute,
                                                param_dtype=policy.param, rngs=rngs,
                                                kernel_init=nnx.initializers.normal(gemma.STD))
        self.embed_tokens = nnx.Embed(s.vocab_size, s.d_model, dtype=policy.compute, param_dtype=policy.param,
                                      embedding_init=nnx.initializers.normal(gemma.STD), rngs=rngs)

        @nnx.split_rngs(splits=s.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(rngs: nnx.Rngs) -> JointLayer:
            return JointLayer(s, policy, rngs, spec, adaptive)

        self.layers = make_layers(rngs)
        self.norm = decoder.GemmaRMSNorm(s.d_model, s.norm_eps, policy)  # the VLM's final norm (output unused)
        self.init_heads(s, policy, rngs)

    def init_heads(self, s: Shape, policy: Policy, rngs: nnx.Rngs) -> None:
        """The family's hook: the expert's final norm and the action heads."""
        raise NotImplementedError

    @classmethod
    def build(cls, *, cfg, policy: Policy, rngs: nnx.Rngs):
        """The family's factory (`Family.build`): its model of a ModelConfig."""
        return cls(shape=shape_of(cfg), vision=siglip.shape_of(cfg.vision), policy=policy, rngs=rngs,
                   spec=attention.spec_of(cfg))

    def image_features(self, x_ENE: jax.Array, cameras: int) -> jax.Array:
        """The tower's output post-layernormed and projected, [B, cameras·N, D] (transformers 5's
        get_image_features)."""
        features = self.multi_modal_projector(self.vision_post_layernorm(x_ENE))
        return features.reshape(-1, cameras * features.shape[1], features.shape[-1])

    @property
    def prefix_len(self) -> int:
        return self.shape.cameras * self.vision_shape.n_patches + self.shape.prompt_len

    def flops_per_row(self) -> float:
        """Training FLOPs of one row (PaLM appendix B: 6 per parameter per token it is applied to,
        plus attention): the tower on every camera's N patches, the projector and the VLM's half
        of each joint layer on the P prefix tokens, the expert's half and the heads on the S
        suffix tokens, and the joint attention of P + S queries over P + S keys (12·L·(P+S)·Q·K
        per token)."""
        s, P, S = self.shape, self.prefix_len, len(self.suffix_ar())
        tower = self.param_size(*TOWER)
        vlm = self.param_size("layers/vlm", "multi_modal_projector")
        expert = self.param_size("layers/expert", "expert_norm", *self.COMPONENTS["action"])
        return (s.cameras * siglip.flops_per_image(tower, self.vision_shape) + 6 * vlm * P + 6 * expert * S
                + 12 * s.n_layers * (P + S) ** 2 * s.n_heads * s.head_dim)


def check_config(cfg) -> None:
    """The rules of both families: the experts' heads are Gemma's (an even head dim, no untied
    head: the VLM's embedding is its lm_head), and the expert's width holds its time embedding."""
    gemma.check_config(cfg)
    layers.check_time_width(cfg)
