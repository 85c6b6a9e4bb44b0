"""π0.5 in Flax NNX (`model.family=pi05`): π0 (`pi0`) with the state read as text and the flow's
time conditioning the action expert through adaptive RMSNorms, as LeRobot 0.6.1's `PI05Pytorch`
(`pi05/modeling_pi05.py`, `pi_gemma.py`) and openpi's `pi0.py` with `pi05=True` compute it.

What differs from π0 (the rest is π0's, imported: the SigLIP tower, the projector, the VLM's half
of each joint layer, the joint attention, the unit protocol):

    the prompt    "Task: {task}, State: {256 bins of the normalized state};\\nAction: " (made by
                  `pi05_batch`), so the batch has no `state` and the model no `state_proj`
    the suffix    only the H action tokens, action_in_proj(x_t): no state token, no action-time MLP
    the time      cond = swish(time_mlp_out(swish(time_mlp_in(sincos(t))))), [B, W]
    the expert    every norm adaptive (`AdaRMSNorm`, no scale of its own): a dense W -> 3W
                  (zero-initialised) of cond gives scale, shift and gate; the norm's output is
                  rmsnorm(x)·(1 + scale) + shift in fp32 and each residual adds y·gate; the
                  final norm is adaptive too, its gate dropped

The adaptive norms' dense layers are parameters of the joint layer (`layers/expert/...`), so a
ZeRO-3 schedule gathers them with the rest of their layer. The carried dict gains "cond" [B, W].

Shapes: B batch, P prefix, H action horizon, A max_action_dim, W expert width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zerojax.models import attention, pi0, pi05_batch, pi05_lerobot, pi05_openpi, siglip
from zerojax.models.family import POLICY, Family
from zerojax.models.pi0 import Shape, Stream
from zerojax.models.vla import linear, time_embedding
from zerojax.precision import Policy

BATCH = ("images", "image_masks", "tokens", "token_mask", "actions", "action_is_pad", "noise", "time")
ACTION = ("action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out")
COMPONENTS = {**pi0.COMPONENTS, "action": ACTION}  # as π0's (`pi0.COMPONENTS`), its own action heads
# LoRA on the expert adapts its attention and MLP projections only, as openpi's gemma_300m_lora
# (`lora.Einsum` for attn, `lora.FeedForward` for ffn): not the adaptive norms' dense layers
# (`*_layernorm/dense`, `expert_norm/dense`), which stay in `expert`, so frozen with its base as
# openpi's freeze filter `.*llm.*_1.*` freezes them.
LORA_KERNELS = {"expert": ("layers/expert/*_proj/kernel",)}


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


class AdaStream(Stream):
    """The action expert's half of a joint layer: π0's `Stream` with adaptive norms and gated residuals."""

    def __init__(self, width: int, n_heads: int, n_kv_heads: int, head_dim: int, d_ff: int, eps: float,
                 policy: Policy, rngs: nnx.Rngs):
        super().__init__(width, n_heads, n_kv_heads, head_dim, d_ff, eps, policy, rngs)
        self.input_layernorm = AdaRMSNorm(width, eps, policy, rngs)
        self.post_attention_layernorm = AdaRMSNorm(width, eps, policy, rngs)

    def qkv(self, h_BLW: jax.Array, cond_BW: jax.Array):
        """The queries, keys and values, and the attention residual's gate."""
        B, L, _ = h_BLW.shape
        x, gate = self.input_layernorm(h_BLW, cond_BW)
        split = lambda proj: proj(x).reshape(B, L, -1, self.head_dim)  # noqa: E731
        return (split(self.q_proj), split(self.k_proj), split(self.v_proj)), gate

    def finish(self, h_BLW: jax.Array, attended_BLQK: jax.Array, cond_BW: jax.Array, gate: jax.Array) -> jax.Array:
        B, L = h_BLW.shape[:2]
        h_BLW = h_BLW + self.o_proj(attended_BLQK.reshape(B, L, -1).astype(h_BLW.dtype)) * gate
        y, gate = self.post_attention_layernorm(h_BLW, cond_BW)
        return h_BLW + self.mlp(y) * gate


class JointLayer(pi0.JointLayer):
    """π0's joint layer (`pi0.JointLayer`) with the adaptive expert; carries "cond" [B, W] too."""

    def __init__(self, shape: Shape, policy: Policy, rngs: nnx.Rngs, spec: attention.Spec = attention.Spec()):
        s = shape
        self.spec, self.theta = spec, s.rope_theta
        self.vlm = Stream(s.d_model, s.n_heads, s.n_kv_heads, s.head_dim, s.d_ff, s.norm_eps, policy, rngs)
        self.expert = AdaStream(s.expert_d_model, s.n_heads, s.n_kv_heads, s.head_dim, s.expert_d_ff, s.norm_eps,
                                policy, rngs)

    def __call__(self, x: dict) -> dict:
        prefix, suffix, cond = x["prefix"], x["suffix"], x["cond"]
        expert_qkv, gate = self.expert.qkv(suffix, cond)
        out = self.joint(x, self.vlm.qkv(prefix), expert_qkv)
        P = prefix.shape[1]
        return {**x, "prefix": self.vlm.finish(prefix, out[:, :P]),
                "suffix": self.expert.finish(suffix, out[:, P:], cond, gate)}

    def suffix_step(self, x: dict, kv, positions_BS: jax.Array, mask: attention.Mask) -> dict:
        suffix, cond = x["suffix"], x["cond"]
        qkv, gate = self.expert.qkv(suffix, cond)
        return {**x, "suffix": self.expert.finish(suffix, self.cached(qkv, kv, positions_BS, mask), cond, gate)}


class Pi05(pi0.Pi0):
    """π0.5 (module docstring): π0's model with π0.5's joint layer, heads, suffix and time."""

    COMPONENTS = COMPONENTS
    LORA_KERNELS = LORA_KERNELS
    LAYER = JointLayer

    def init_heads(self, s: Shape, policy: Policy, rngs: nnx.Rngs) -> None:
        W = s.expert_d_model
        self.expert_norm = AdaRMSNorm(W, s.norm_eps, policy, rngs)
        self.action_in_proj = linear(s.max_action_dim, W, policy, rngs)
        self.action_out_proj = linear(W, s.max_action_dim, policy, rngs)
        self.time_mlp_in = linear(W, W, policy, rngs)
        self.time_mlp_out = linear(W, W, policy, rngs)

    def between(self, name: str, x_ENE: jax.Array, batch: dict) -> dict:
        prefix, prefix_pad = self.embed_prefix(x_ENE, batch)
        suffix = self.suffix_of(batch, self.noisy_actions(batch), batch["time"])
        B, P, S = prefix.shape[0], prefix.shape[1], suffix["suffix"].shape[1]
        pad = jnp.concatenate([prefix_pad, jnp.ones((B, S), bool)], axis=1)
        ar = jnp.broadcast_to(jnp.asarray([0] * P + self.suffix_ar(), jnp.int32), (B, P + S))
        return {"prefix": prefix, "suffix": suffix["suffix"], "cond": suffix["cond"], "pad": pad, "ar": ar}

    def image_features(self, x_ENE: jax.Array, cameras: int) -> jax.Array:
        """The tower's output post-layernormed and projected, [B, cameras·N, D] (transformers 5's
        get_image_features: no sqrt(D) round trip)."""
        features = self.multi_modal_projector(self.vision_post_layernorm(x_ENE))
        return features.reshape(-1, cameras * features.shape[1], features.shape[-1])

    def suffix_of(self, batch: dict, x_t_BHA: jax.Array, time_B: jax.Array) -> dict:
        """The action tokens action_in_proj(x_t) [B, H, W] and the time's condition [B, W]."""
        actions = self.action_in_proj(x_t_BHA)
        times = time_embedding(time_B, actions.shape[-1]).astype(actions.dtype)
        cond = jax.nn.silu(self.time_mlp_out(jax.nn.silu(self.time_mlp_in(times))))
        return {"suffix": actions, "cond": cond}

    def suffix_ar(self) -> list[int]:
        """The first action token starts a block: the prefix does not see the actions."""
        return [1] + [0] * (self.shape.horizon - 1)

    def velocity(self, x: dict) -> jax.Array:
        out, _ = self.expert_norm(x["suffix"], x["cond"])  # the final norm's gate is dropped
        return self.action_out_proj(out[:, -self.shape.horizon:].astype(jnp.float32)).astype(jnp.float32)

    @staticmethod
    def euler_times(num_steps: int) -> np.ndarray:
        """LeRobot 0.6.1's `euler_integrate`: t = 1 + k·dt in float64, then fp32."""
        return np.asarray([1.0 + k * (-1.0 / num_steps) for k in range(num_steps)], np.float32)


def build(*, cfg, policy: Policy, rngs: nnx.Rngs) -> Pi05:
    """The `model.family=pi05` factory."""
    return Pi05(shape=pi0.shape_of(cfg), vision=siglip.shape_of(cfg.vision), policy=policy, rngs=rngs,
                spec=attention.spec_of(cfg))


FAMILY = Family(kind=POLICY, build=build, check_config=pi0.check_config, lerobot=pi05_lerobot.LEROBOT,
                openpi=pi05_openpi.OPENPI, adapter=pi05_batch.ADAPTER)
