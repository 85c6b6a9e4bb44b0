"""π0.5 in Flax NNX (`model.family=pi05`), as LeRobot 0.6.1's `PI05Pytorch`
(`pi05/modeling_pi05.py`, `pi_gemma.py`) and openpi's `pi0.py` with `pi05=True` compute it.

PaliGemma with an action expert (`paligemma_expert.model`, with adaptive expert norms) and the
flow-matching policy (`vla.flow`); π0.5's own are:

    the prompt    "Task: {task}, State: {256 bins of the normalized state};\\nAction: " (made by
                  `pi05.batch`), so the batch has no `state` and the model no `state_proj`
    the suffix    only the H action tokens, action_in_proj(x_t): no state token, no action-time MLP
    the time      cond = swish(time_mlp_out(swish(time_mlp_in(sincos(t))))), [B, W], carried as
                  "cond" to the expert's adaptive norms; the final norm is adaptive too, its gate
                  dropped. With a time per action token (model.action.train_delay), [B, H, W]
    sampling      LeRobot 0.6.1's Euler grid (t = 1 + k·dt in float64)

The adaptive norms' dense layers are parameters of the joint layer (`layers/expert/...`), so a
ZeRO-3 schedule gathers them with the rest of their layer.

Shapes: B batch, H action horizon, A max_action_dim, W expert width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from zerojax.models.family import POLICY, Family
from zerojax.models.paligemma_expert.model import (AdaRMSNorm, PaliGemmaWithExpert, Shape, check_config, components,
                                                   )
from zerojax.models.pi05 import batch, lerobot, openpi
from zerojax.models.vla.layers import linear, token_time_embedding
from zerojax.precision import Policy

BATCH = ("images", "image_masks", "tokens", "token_mask", "actions", "action_is_pad", "noise", "time")
ACTION = ("action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out")
COMPONENTS = components(ACTION)
# LoRA on the expert adapts its attention and MLP projections only, as openpi's gemma_300m_lora
# (`lora.Einsum` for attn, `lora.FeedForward` for ffn): not the adaptive norms' dense layers
# (`*_layernorm/dense`, `expert_norm/dense`), which stay in `expert`, so frozen with its base as
# openpi's freeze filter `.*llm.*_1.*` freezes them.
LORA_KERNELS = {"expert": ("layers/expert/*_proj/kernel",)}


class Pi05(PaliGemmaWithExpert):
    """π0.5 (module docstring)."""

    COMPONENTS = COMPONENTS
    LORA_KERNELS = LORA_KERNELS
    ADAPTIVE = True

    def init_heads(self, s: Shape, policy: Policy, rngs: nnx.Rngs) -> None:
        W = s.expert_d_model
        self.expert_norm = AdaRMSNorm(W, s.norm_eps, policy, rngs)
        self.action_in_proj = linear(s.max_action_dim, W, policy, rngs)
        self.action_out_proj = linear(W, s.max_action_dim, policy, rngs)
        self.time_mlp_in = linear(W, W, policy, rngs)
        self.time_mlp_out = linear(W, W, policy, rngs)

    def suffix_of(self, batch: dict, x_t_BHA: jax.Array, time: jax.Array) -> dict:
        """The action tokens action_in_proj(x_t) [B, H, W] and the time's condition: [B, W] of the
        row's time, or [B, H, W] of each token's (training-time RTC, LeRobot's per-token adarms_cond)."""
        actions = self.action_in_proj(x_t_BHA)
        times = token_time_embedding(time, actions.shape[-1]).astype(actions.dtype)
        cond = jax.nn.silu(self.time_mlp_out(jax.nn.silu(self.time_mlp_in(times))))
        return {"suffix": actions, "cond": cond}

    def suffix_ar(self) -> list[int]:
        """The first action token starts a block: the prefix does not see the actions."""
        return [1] + [0] * (self.shape.horizon - 1)

    def velocity(self, x: dict) -> jax.Array:
        out, _ = self.expert_norm(x["suffix"], x["cond"])  # the final norm's gate is dropped
        return self.action_out_proj(out[:, -self.shape.horizon:].astype(jnp.float32)).astype(jnp.float32)


FAMILY = Family(kind=POLICY, build=Pi05.build, check_config=check_config, lerobot=lerobot.LEROBOT,
                openpi=openpi.OPENPI, adapter=batch.ADAPTER, recipe=lerobot.RECIPE)
