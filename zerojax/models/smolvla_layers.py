"""SmolVLA's unit (`smolvla`): a run of VLM layers and the expert layers that read them, as LeRobot
0.6.1's `SmolVLMWithExpertModel` (`smolvla/smolvlm_with_expert.py`) computes them.

Both streams are Llama decoder layers (RMSNorm, grouped-query attention with LeRobot's own
rotary embedding, base 10000, SwiGLU MLP). The expert's layers alternate (`every` =
self_attn_every_n_layers):

    layer i, i % every == 0   self-attention: the prefix's and the suffix's queries, keys and
                              values concatenated, one attention under big_vision's mask (π0's
                              joint attention); the expert's k/v projections read its width W
    the others                cross-attention: the prefix attends to itself; the expert's queries
                              (rotary positions 0..S-1) attend to its k/v projections of the VLM's
                              keys (after their rotary embedding) and values, of width G·K

So the expert's k/v projections have two shapes, [W, G·K] and [G·K, G·K], and layers of both
kinds cannot be one stack made under nnx.vmap: the unit (`Block`) is one period, `every` VLM
layers (`vlm_0`, ...) and their expert layers (`expert_0` self-attention, `expert_1`, ...
cross-attention), so that a ZeRO-3 schedule gathers the VLM layers with the expert layers that
read them, once per pass. The carried dict is π0's: {"prefix": [B, P, D], "suffix": [B, S, W],
"pad": bool [B, P+S], "ar": int32 [B, P+S]}.

Shapes: B batch, P prefix, S suffix, D VLM width, W expert width, G kv heads, Q query heads, K
head dim.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from zerojax.models import attention
from zerojax.models.llama import MLP, _dense, _norm, rope
from zerojax.models.pi0 import attend
from zerojax.precision import Policy

THETA = 10_000.0  # LeRobot's apply_rope: max_wavelength=10_000, whatever the VLM's rope_theta


class Shape(NamedTuple):
    """The sizes of a SmolVLA (model.*, model.expert.*, model.action.*, model.smolvla.*)."""

    vocab_size: int
    d_model: int  # the VLM's width
    n_layers: int  # both streams' depth (LeRobot's num_vlm_layers)
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    expert_d_model: int
    expert_d_ff: int
    horizon: int
    max_state_dim: int = 32
    max_action_dim: int = 32
    action_dim: int = 32
    cameras: int = 1
    prompt_len: int = 48
    norm_eps: float = 1e-5
    every: int = 2  # self_attn_every_n_layers: the unit's length
    pixel_shuffle: int = 2


class Stream(nnx.Module):
    """One Llama decoder layer's weights; `kv_in` is the k/v projections' input width."""

    def __init__(self, width: int, s: Shape, d_ff: int, policy: Policy, rngs: nnx.Rngs, kv_in: int = 0):
        self.input_layernorm = _norm(width, s.norm_eps, policy, rngs)
        self.q_proj = _dense(width, s.n_heads * s.head_dim, policy, rngs)
        self.k_proj = _dense(kv_in or width, s.n_kv_heads * s.head_dim, policy, rngs)
        self.v_proj = _dense(kv_in or width, s.n_kv_heads * s.head_dim, policy, rngs)
        self.o_proj = _dense(s.n_heads * s.head_dim, width, policy, rngs)
        self.post_attention_layernorm = _norm(width, s.norm_eps, policy, rngs)
        self.mlp = MLP(width, d_ff, policy, rngs)
        self.head_dim = s.head_dim

    def heads(self, y_BLX: jax.Array) -> jax.Array:
        return y_BLX.reshape(*y_BLX.shape[:2], -1, self.head_dim)

    def qkv(self, h_BLW: jax.Array):
        x = self.input_layernorm(h_BLW)
        return self.heads(self.q_proj(x)), self.heads(self.k_proj(x)), self.heads(self.v_proj(x))

    def finish(self, h_BLW: jax.Array, attended_BLQK: jax.Array) -> jax.Array:
        B, L = h_BLW.shape[:2]
        h_BLW = h_BLW + self.o_proj(attended_BLQK.reshape(B, L, -1).astype(h_BLW.dtype))
        return h_BLW + self.mlp(self.post_attention_layernorm(h_BLW))

    def cross(self, h_BSW: jax.Array, k_BPGK: jax.Array, v_BPGK: jax.Array, prefix_pad_BP: jax.Array,
              spec: attention.Spec) -> jax.Array:
        """An expert cross-attention layer: queries from the suffix (rotary positions 0..S-1), keys
        and values this layer's projections of the VLM's (every suffix token sees the real prefix)."""
        B, S = h_BSW.shape[:2]
        q = rope(self.heads(self.q_proj(self.input_layernorm(h_BSW))), THETA, jnp.arange(S)[None])
        k = self.heads(self.k_proj(k_BPGK.reshape(*k_BPGK.shape[:2], -1).astype(h_BSW.dtype)))
        v = self.heads(self.v_proj(v_BPGK.reshape(*v_BPGK.shape[:2], -1).astype(h_BSW.dtype)))
        P = k.shape[1]
        mask = attention.Mask(jnp.ones((1, S), jnp.int32), jnp.zeros((1, P), jnp.int32),
                              k_valid=prefix_pad_BP.astype(bool))
        return self.finish(h_BSW, attend(q, k, v, mask, spec))


class Block(nnx.Module):
    """The unit: `every` VLM layers and their expert layers (module docstring)."""

    def __init__(self, s: Shape, policy: Policy, rngs: nnx.Rngs, spec: attention.Spec = attention.Spec()):
        self.spec, self.every = spec, s.every
        for j in range(s.every):
            setattr(self, f"vlm_{j}", Stream(s.d_model, s, s.d_ff, policy, rngs))
            kv_in = 0 if j == 0 else s.n_kv_heads * s.head_dim
            setattr(self, f"expert_{j}", Stream(s.expert_d_model, s, s.expert_d_ff, policy, rngs, kv_in))

    def vlm(self, j: int) -> Stream:
        return getattr(self, f"vlm_{j}")

    def expert(self, j: int) -> Stream:
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
                qs, ks, vs = expert.qkv(suffix)
                q = rope(jnp.concatenate([qp, qs.astype(qp.dtype)], axis=1), THETA, positions_BL)
                k = rope(jnp.concatenate([kp, ks.astype(kp.dtype)], axis=1), THETA, positions_BL)
                v = jnp.concatenate([vp, vs.astype(vp.dtype)], axis=1)
                out = attend(q, k, v, attention.blocks(pad, ar), self.spec)
                prefix, suffix = vlm.finish(prefix, out[:, :P]), expert.finish(suffix, out[:, P:])
                continue
            qp, kp = rope(qp, THETA, positions_BL[:, :P]), rope(kp, THETA, positions_BL[:, :P])
            suffix = expert.cross(suffix, kp, vp, pad[:, :P], self.spec)
            prefix = vlm.finish(prefix, attend(qp, kp, vp, prefix_mask, self.spec))
        return {**x, "prefix": prefix, "suffix": suffix}

    def prefix_kv(self, prefix: jax.Array, positions_BP: jax.Array, mask: attention.Mask):
        """The prefix alone through the VLM layers (sampling): its output and each layer's keys and
        values after the rotary embedding, [every, B, P, G, K] each."""
        ks, vs = [], []
        for j in range(self.every):
            q, k, v = self.vlm(j).qkv(prefix)
            q, k = rope(q, THETA, positions_BP), rope(k, THETA, positions_BP)
            prefix = self.vlm(j).finish(prefix, attend(q, k, v, mask, self.spec))
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
                suffix = expert.cross(suffix, k_BPGK, v_BPGK, x["prefix_pad"], self.spec)
                continue
            q, k, v = expert.qkv(suffix)
            q, k = rope(q, THETA, positions_BS), rope(k, THETA, positions_BS)
            k = jnp.concatenate([k_BPGK, k.astype(k_BPGK.dtype)], axis=1)
            v = jnp.concatenate([v_BPGK, v.astype(v_BPGK.dtype)], axis=1)
            suffix = expert.finish(suffix, attend(q, k, v, mask, self.spec))
        return {**x, "suffix": suffix}
