"""The pre-norm decoder layer the families share, and its one Hugging Face key table.

Llama's layer (RMSNorm, SwiGLU), Gemma's ((1 + w) RMSNorm in fp32, GeGLU) and the streams of the
vision-language-action models (π0's and π0.5's Gemma experts, SmolVLA's Llama ones) are one
layer: a norm, rotary grouped-query attention without biases (q/k/v/o projections), a second
norm and a gated MLP. They differ in the norm, the activation and, in a VLA, in where the
attention happens (`Stream`: the projections and the MLP, the attention left to the caller,
which concatenates two streams' queries and keys). Module names are Hugging Face's
(`input_layernorm`, `self_attn/q_proj`, `mlp/gate_proj`, ...), so one table (`hf_tensors`) maps
every family's layer to its checkpoint names, composed per submodule as levanter's key maps are.

Kernels are stored [in, out] (HF stores [out, in]). Shapes: B batch, T sequence, D width, H
heads, G key/value heads, K head dim.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from zerojax.models import attention, protocol
from zerojax.models.family import Tensor
from zerojax.precision import Policy

STD = 0.02  # HF's initializer_range


def dense(d_in: int, d_out: int, policy: Policy, rngs: nnx.Rngs) -> nnx.Linear:
    """A projection without bias, initialised as HF's (normal, std 0.02)."""
    return nnx.Linear(d_in, d_out, use_bias=False, dtype=policy.compute, param_dtype=policy.param,
                      kernel_init=nnx.initializers.normal(STD), rngs=rngs)


def rms_norm(d: int, eps: float, policy: Policy, rngs: nnx.Rngs) -> nnx.RMSNorm:
    """Llama's RMSNorm: x / rms(x) · w, w initialised to 1."""
    return nnx.RMSNorm(d, epsilon=eps, dtype=policy.compute, param_dtype=policy.param, rngs=rngs)


class GemmaRMSNorm(nnx.Module):
    """transformers' GemmaRMSNorm: x / rms(x) · (1 + scale) in fp32, cast back to x's dtype."""

    def __init__(self, d: int, eps: float, policy: Policy):
        self.eps = eps
        self.scale = nnx.Param(jnp.zeros((d,), policy.param))

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        x = x_BTD.astype(jnp.float32)
        y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return (y * (1.0 + self.scale[...].astype(jnp.float32))).astype(x_BTD.dtype)


def gelu_tanh(x: jax.Array) -> jax.Array:
    """HF's gelu_pytorch_tanh: torch's gelu(approximate="tanh") (Gemma's GeGLU)."""
    return jax.nn.gelu(x, approximate=True)


def rope(x_BTHK: jax.Array, theta: float, positions_BT: jax.Array | None = None) -> jax.Array:
    """Rotary embedding, HF's rotate-half layout: the first and second halves of each head dim
    are the pair rotated together by angle position x theta^(-2i/K). Positions 0..T-1 unless
    given (packed rows restart them per example)."""
    T, K = x_BTHK.shape[1], x_BTHK.shape[3]
    inv_freq_K2 = 1.0 / (theta ** (jnp.arange(0, K, 2, dtype=jnp.float32) / K))
    pos_BT = jnp.arange(T, dtype=jnp.float32)[None] if positions_BT is None else positions_BT.astype(jnp.float32)
    angles_BTK = jnp.concatenate([pos_BT[..., None] * inv_freq_K2] * 2, axis=-1)
    cos, sin = jnp.cos(angles_BTK)[:, :, None], jnp.sin(angles_BTK)[:, :, None]
    x1, x2 = jnp.split(x_BTHK.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x_BTHK * cos + rotated * sin).astype(x_BTHK.dtype)


class MLP(nnx.Module):
    """A gated MLP: down(act(gate(x)) * up(x)); SwiGLU with `activation=jax.nn.silu` (Llama's)."""

    def __init__(self, d_model: int, d_ff: int, policy: Policy, rngs: nnx.Rngs, activation=jax.nn.silu):
        self.activation = activation
        self.gate_proj = dense(d_model, d_ff, policy, rngs)
        self.up_proj = dense(d_model, d_ff, policy, rngs)
        self.down_proj = dense(d_ff, d_model, policy, rngs)

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        return self.down_proj(self.activation(self.gate_proj(x_BTD)) * self.up_proj(x_BTD))


class Attention(nnx.Module):
    """Rotary grouped-query attention without biases (Llama's; Gemma's with its own head_dim),
    scaled by head_dim ** -0.5, softmax in fp32; head h reads key/value head h // (H / G), as HF's
    repeat_kv (`attention.attend`, computed as `spec` says: model.attention)."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, theta: float, policy: Policy,
                 rngs: nnx.Rngs, spec: attention.Spec = attention.Spec()):
        self.n_heads, self.n_kv_heads, self.theta, self.spec = n_heads, n_kv_heads, theta, spec
        self.q_proj = dense(d_model, n_heads * head_dim, policy, rngs)
        self.k_proj = dense(d_model, n_kv_heads * head_dim, policy, rngs)
        self.v_proj = dense(d_model, n_kv_heads * head_dim, policy, rngs)
        self.o_proj = dense(n_heads * head_dim, d_model, policy, rngs)

    def __call__(self, x_BTD: jax.Array, structure: dict | None = None) -> jax.Array:
        """`structure`: the batch's positions, segment ids or prefix (protocol.stream), if any."""
        B, T, _ = x_BTD.shape
        structure = structure or {}
        pos_BT = structure.get("positions")
        q_BTHK = rope(self.q_proj(x_BTD).reshape(B, T, self.n_heads, -1), self.theta, pos_BT)
        k_BTGK = rope(self.k_proj(x_BTD).reshape(B, T, self.n_kv_heads, -1), self.theta, pos_BT)
        v_BTGK = self.v_proj(x_BTD).reshape(B, T, self.n_kv_heads, -1)
        if "kv" in structure:  # decoding (protocol.decode_stack): the cache's keys, the updated cache passed on
            structure["kv"], mask = protocol.cached_kv(structure["kv"], k_BTGK, v_BTGK, pos_BT)
            k_BTGK, v_BTGK = structure["kv"]["k"], structure["kv"]["v"]
        else:
            mask = attention.of_structure(structure, T)
        return self.o_proj(attention.attend(q_BTHK, k_BTGK, v_BTGK, mask, self.spec).reshape(B, T, -1))


class DecoderLayer(nnx.Module):
    """One pre-norm decoder layer of a language model: the unit a ZeRO-3 schedule gathers at a
    time. `norm(width)` makes each of its two norms; `activation` is the MLP's gate."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, d_ff: int, theta: float,
                 policy: Policy, rngs: nnx.Rngs, *, norm: Callable[[int], nnx.Module], activation=jax.nn.silu,
                 spec: attention.Spec = attention.Spec()):
        self.input_layernorm = norm(d_model)
        self.self_attn = Attention(d_model, n_heads, n_kv_heads, head_dim, theta, policy, rngs, spec)
        self.post_attention_layernorm = norm(d_model)
        self.mlp = MLP(d_model, d_ff, policy, rngs, activation=activation)

    def __call__(self, x):
        x_BTD, structure = protocol.unstream(x)
        x_BTD = x_BTD + self.self_attn(self.input_layernorm(x_BTD), structure)
        return protocol.stream(x_BTD + self.mlp(self.post_attention_layernorm(x_BTD)), structure)


class Stream(nnx.Module):
    """One decoder layer's weights with the attention left to the caller: a stream of a
    vision-language-action model, whose queries, keys and values meet another stream's in one
    attention. `kv_in` is the k/v projections' input width where it is not the stream's own
    (SmolVLA's cross-attention layers project the VLM's keys and values)."""

    def __init__(self, width: int, n_heads: int, n_kv_heads: int, head_dim: int, d_ff: int, policy: Policy,
                 rngs: nnx.Rngs, *, norm: Callable[[int], nnx.Module], activation=jax.nn.silu, kv_in: int = 0):
        self.input_layernorm = norm(width)
        self.q_proj = dense(width, n_heads * head_dim, policy, rngs)
        self.k_proj = dense(kv_in or width, n_kv_heads * head_dim, policy, rngs)
        self.v_proj = dense(kv_in or width, n_kv_heads * head_dim, policy, rngs)
        self.o_proj = dense(n_heads * head_dim, width, policy, rngs)
        self.post_attention_layernorm = norm(width)
        self.mlp = MLP(width, d_ff, policy, rngs, activation=activation)
        self.head_dim = head_dim

    def heads(self, y_BLX: jax.Array) -> jax.Array:
        """[B, L, n·K] -> [B, L, n, K]."""
        return y_BLX.reshape(*y_BLX.shape[:2], -1, self.head_dim)

    def project(self, x_BLW: jax.Array):
        """The queries, keys and values of an already normalized input, [B, L, heads, K] each."""
        return self.heads(self.q_proj(x_BLW)), self.heads(self.k_proj(x_BLW)), self.heads(self.v_proj(x_BLW))

    def qkv(self, h_BLW: jax.Array):
        return self.project(self.input_layernorm(h_BLW))

    def attended(self, h_BLW: jax.Array, attended_BLQK: jax.Array) -> jax.Array:
        """The residual stream after the attention's output projection."""
        B, L = h_BLW.shape[:2]
        return h_BLW + self.o_proj(attended_BLQK.reshape(B, L, -1).astype(h_BLW.dtype))

    def finish(self, h_BLW: jax.Array, attended_BLQK: jax.Array) -> jax.Array:
        h_BLW = self.attended(h_BLW, attended_BLQK)
        return h_BLW + self.mlp(self.post_attention_layernorm(h_BLW))


PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}
NORMS = ("input_layernorm", "post_attention_layernorm")


def hf_tensors(path: str, layer: str, *, nested: bool = True, norms: bool = True, every: int = 1,
               offset: int = 0) -> dict[str, Tensor]:
    """A decoder layer's leaves -> their Hugging Face tensors: zerojax's `path` (a stacked leaf's
    prefix, "layers" or "layers/expert") and the checkpoint's `layer` ("model.layers.{i}.").
    `nested`: the attention projections live under `self_attn/` (a `DecoderLayer`), not beside
    the MLP (a `Stream`); `norms`: the two norms' scales (an adaptive norm has none of its own);
    `every`, `offset`: a unit holding `every` of the checkpoint's layers (`Tensor.every`)."""
    at = dict(every=every, offset=offset)
    out = {f"{path}/{norm}/scale": Tensor(f"{layer}{norm}.weight", **at) for norm in NORMS} if norms else {}
    for module, projections in PROJECTIONS.items():
        here = f"{path}/{module}" if nested or module == "mlp" else path
        out.update({f"{here}/{p}/kernel": Tensor(f"{layer}{module}.{p}.weight", True, **at) for p in projections})
    return out
