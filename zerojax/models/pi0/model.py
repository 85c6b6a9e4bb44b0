"""π0 in Flax NNX (`model.family=pi0`): a vision-language-action model trained by flow matching, as
LeRobot's `PI0FlowMatching` (and openpi's π0) computes it, so that checkpoints map one to one.

PaliGemma with an action expert (`paligemma_expert.model`: the tower, the prompt, the joint
layers) and the flow-matching policy (`vla.flow`: the loss, the sampler); π0's own are its
suffix and heads:

    the suffix    the state token state_proj(state), then the H action tokens
                  action_time_mlp(action_in_proj(x_t) ++ sin/cos time embedding); attention as
                  LeRobot's make_att_2d_masks builds it: the prefix attends within itself both
                  ways, the state token to the prefix and itself, the action tokens to
                  everything (padding never attended)
    the images    the projector's output divided by sqrt(D) and multiplied back, as LeRobot with
                  transformers 4.5x computes it
    the velocity  the expert's final norm, action_out_proj
    sampling      openpi's (and LeRobot 0.3.3's) Euler grid, t accumulated in fp32

The batch (`BATCH`) is made by the shared adapter (`vla.batch`).

Shapes: B batch, H action horizon, A max_action_dim, W expert width, E vision width, N patches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from zerojax.models import decoder
from zerojax.models.family import POLICY, Family
from zerojax.models.paligemma_expert.model import PaliGemmaWithExpert, Shape, check_config, components
from zerojax.models.pi0 import lerobot, openpi
from zerojax.models.vla import batch as vla_batch
from zerojax.models.vla.layers import linear
from zerojax.precision import Policy

BATCH = ("images", "image_masks", "tokens", "token_mask", "state", "actions", "action_is_pad", "noise", "time")
ACTION = ("state_proj", "action_in_proj", "action_out_proj", "action_time_mlp_in", "action_time_mlp_out")
COMPONENTS = components(ACTION)  # optim.freeze=vision|vlm, optim.lora.targets=language,expert, ...
EXPERT = COMPONENTS["expert"]


class Pi0(PaliGemmaWithExpert):
    """π0 (module docstring)."""

    COMPONENTS = COMPONENTS
    ACCUMULATED_TIME = True

    def init_heads(self, s: Shape, policy: Policy, rngs: nnx.Rngs) -> None:
        W = s.expert_d_model
        self.expert_norm = decoder.GemmaRMSNorm(W, s.norm_eps, policy)
        self.state_proj = linear(s.max_state_dim, W, policy, rngs)
        self.init_action_time_heads(s.max_action_dim, W, policy, rngs)

    def image_features(self, x_ENE: jax.Array, cameras: int) -> jax.Array:
        """The tower's output post-layernormed and projected, [B, cameras·N, D], scaled as LeRobot
        with transformers 4.5x does: divided by sqrt(D) in get_image_features, then multiplied by it."""
        features = self.multi_modal_projector(self.vision_post_layernorm(x_ENE))
        D = features.shape[-1]
        features = (features / D ** 0.5) * jnp.asarray(D ** 0.5, features.dtype)
        return features.reshape(-1, cameras * features.shape[1], D)

    def suffix_of(self, batch: dict, x_t_BHA: jax.Array, time_B: jax.Array) -> dict:
        """The state token and the action tokens, [B, 1 + H, W]."""
        state = self.state_proj(batch["state"])[:, None]
        actions = self.action_time_tokens(x_t_BHA, time_B)
        return {"suffix": jnp.concatenate([state, actions.astype(state.dtype)], axis=1)}

    def suffix_ar(self) -> list[int]:
        """The state token starts a block (the prefix does not see it), the first action token
        starts another (state and prefix do not see actions)."""
        return [1, 1] + [0] * (self.shape.horizon - 1)


FAMILY = Family(kind=POLICY, build=Pi0.build, check_config=check_config, lerobot=lerobot.LEROBOT,
                openpi=openpi.OPENPI, adapter=vla_batch.ADAPTER, recipe=lerobot.RECIPE)
