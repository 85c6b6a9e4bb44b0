"""SmolVLA's unit (`smolvla.model`): a run of VLM layers and the expert layers that read them, as LeRobot
0.6.1's `SmolVLMWithExpertModel` (`smolvla/smolvlm_with_expert.py`) computes them.

Both streams are Llama decoder layers (RMSNorm, grouped-query attention with LeRobot's own
rotary embedding, base 10000, SwiGLU MLP). The expert's layers alternate (`every` =
self_attn_every_n_layers):

    layer i, i % every == 0   self-attention: the prefix's and the suffix's queries, keys and
                              values concatenated, one attention under big_vision's mask
                              (`vla.layers.joint_attention`); the expert's k/v projections read its width W
    the others                cross-attention: the prefix attends to itself; the expert's queries
                              (rotary positions 0..S-1) attend to its k/v projections of the VLM's
                              keys (after their rotary embedding) and values, of width G·K

So the expert's k/v projections have two shapes, [W, G·K] and [G·K, G·K], and layers of both
kinds cannot be one stack made under nnx.vmap: the unit (`Block`) is one period, `every` VLM
layers (`vlm_0`, ...) and their expert layers (`expert_0` self-attention, `expert_1`, ...
cross-attention), so that a ZeRO-3 schedule gathers the VLM layers with the expert layers that
read them, once per pass. The carried dict is the flow-matching policy's: {"prefix": [B, P, D], "suffix": [B, S, W],
"pad": bool [B, P+S], "ar": int32 [B, P+S]}.

Shapes: B batch, P prefix, S suffix, D VLM width, W expert width, G kv heads, Q query heads, K
head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from zerojax.models import attention, decoder
from zerojax.models.decoder import rope
from zerojax.models.vla import layers
from zerojax.models.vla.flow import Shape
from zerojax.precision import Policy

THETA = 10_000.0  # LeRobot's apply_rope: max_wavelength=10_000, whatever the VLM's rope_theta


def llama_stream(width: int, s: Shape, d_ff: int, policy: Policy, rngs: nnx.Rngs, kv_in: int = 0) -> decoder.Stream:
    """One Llama decoder layer's weights (`decoder.Stream`); `kv_in` the k/v projections' input width."""
    return decoder.Stream(width, s.n_heads, s.n_kv_heads, s.head_dim, d_ff, policy, rngs,
                          norm=lambda d: decoder.rms_norm(d, s.norm_eps, policy, rngs), kv_in=kv_in)


def cross(expert: decoder.Stream, h_BSW: jax.Array, k_BPGK: jax.Array, v_BPGK: jax.Array, prefix_pad_BP: jax.Array,
          spec: attention.Spec) -> jax.Array:
    """An expert cross-attention layer: queries from the suffix (rotary positions 0..S-1), keys
    and values this layer's projections of the VLM's (every suffix token sees the real prefix)."""
    B, S = h_BSW.shape[:2]
    q = rope(expert.heads(expert.q_proj(expert.input_layernorm(h_BSW))), THETA, jnp.arange(S)[None])
    k = expert.heads(expert.k_proj(k_BPGK.reshape(*k_BPGK.shape[:2], -1).astype(h_BSW.dtype)))
    v = expert.heads(expert.v_proj(v_BPGK.reshape(*v_BPGK.shape[:2], -1).astype(h_BSW.dtype)))
    P = k.shape[1]
    mask = attention.Mask(jnp.ones((1, S), jnp.int32), jnp.zeros((1, P), jnp.int32), k_valid=prefix_pad_BP.astype(bool))
    return expert.finish(h_BSW, layers.attend(q, k, v, mask, spec))


class Block(nnx.Module):
    """The unit: `every` VLM layers and their expert layers (module docstring)."""

    def __init__(self, s: Shape, policy: Policy, rngs: nnx.Rngs, spec: attention.Spec = attention.Spec()):
        self.spec, self.every = spec, s.every
        for j in range(s.every):
            setattr(self, f"vlm_{j}", llama_stream(s.d_model, s, s.d_ff, policy, rngs))
            kv_in = 0 if j == 0 else s.n_kv_heads * s.head_dim
            setattr(self, f"expert_{j}", llama_stream(s.expert_d_model, s, s.expert_d_ff, policy, rngs, kv_in))

    def vlm(self, j: int) -> decoder.Stream:
        return getattr(self, f"vlm_{j}")

    def expert(self, j: int) -> decoder.Stream:
        return getattr(self, f"expert_{j}")

    def __call__(self, x: dict) -> dict:
        prefix, suffix, pad, ar = x["prefix"], x["suffix"], x["pad"], x["ar"]
        P = prefix.shape[1]
        positions_BL = jnp.cumsum(pad.astype(jnp.int32), axis=1) - 1
        prefix_mask = attention.blocks(pad[:, :P], ar[:, :P])
        for j in range(self.every):
            vlm, expert = self.vlm(j), self.expert(j)
            qp, kp, vp = vlm.qkv(prefix)
            if j == 0:  # self-attention of both streams at once
                out = layers.joint_attention((qp, kp, vp), expert.qkv(suffix), pad, ar, THETA, self.spec)
                prefix, suffix = vlm.finish(prefix, out[:, :P]), expert.finish(suffix, out[:, P:])
                continue
            out, (kp, vp) = layers.prefix_attention((qp, kp, vp), positions_BL[:, :P], prefix_mask, THETA, self.spec)
            suffix = cross(expert, suffix, kp, vp, pad[:, :P], self.spec)
            prefix = vlm.finish(prefix, out)
        return {**x, "prefix": prefix, "suffix": suffix}

    def prefix_kv(self, prefix: jax.Array, positions_BP: jax.Array, mask: attention.Mask):
        """The prefix alone through the VLM layers (sampling): its output and each layer's keys and
        values after the rotary embedding, [every, B, P, G, K] each."""
        ks, vs = [], []
        for j in range(self.every):
            out, (k, v) = layers.prefix_attention(self.vlm(j).qkv(prefix), positions_BP, mask, THETA, self.spec)
            prefix = self.vlm(j).finish(prefix, out)
            ks.append(k)
            vs.append(v)
        return prefix, (jnp.stack(ks), jnp.stack(vs))

    def suffix_step(self, x: dict, kv, positions_BS: jax.Array, mask: attention.Mask) -> dict:
        """The suffix ({"suffix": [B, S, W], "prefix_pad": [B, P]}) through the expert layers,
        attending to the cached prefix (and, in a self-attention layer, to itself)."""
        suffix = x["suffix"]
        for j in range(self.every):
            expert, k_BPGK, v_BPGK = self.expert(j), kv[0][j], kv[1][j]
            if j:
                suffix = cross(expert, suffix, k_BPGK, v_BPGK, x["prefix_pad"], self.spec)
                continue
            out = layers.cached_attention(expert.qkv(suffix), (k_BPGK, v_BPGK), positions_BS, mask, THETA, self.spec)
            suffix = expert.finish(suffix, out)
        return {**x, "suffix": suffix}
