"""The SigLIP vision tower in Flax NNX, with Hugging Face `SiglipVisionModel`'s conventions so that
checkpoints map one to one (PaliGemma's tower, `models/paligemma.py`; no pooling head, as
PaliGemma's `vision_use_head=False`):

- the patch embedding: HF's Conv2d(3, D, kernel=stride=P, padding="valid") written as a linear
  map over non-overlapping patches: kernel [P (x), P (y), C, D] is HF's weight [D, C, P (y), P (x)]
  with every dim reversed (the converter's `transposed`), so the two compute the same sums;
- learned positions, one per patch (an nnx.Embed, HF's `position_embedding`);
- pre-LN encoder layers: x + attn(ln1(x)), then x + mlp(ln2(x)); bidirectional multi-head
  attention with biased q, k, v and out projections scaled by head_dim ** -0.5, softmax in
  fp32; MLP fc2(gelu_tanh(fc1(x))) with biases;
- a post-layernorm after the last layer (`post_layernorm`).

The encoder layers are one stack of units (`make_stack`, under nnx.vmap); the embeddings and the
post-layernorm belong to the model that holds the stack (the outer unit). `hf_tensors` is the
tower's Hugging Face tensor table under a prefix, `flops_per_image` its training FLOPs.

Shapes: B batch, C channels, H, W image, P patch side, N patches, D width, F d_ff, K head dim.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from zerojax.models import attention
from zerojax.models.family import Tensor
from zerojax.models.flops import palm_flops_per_token
from zerojax.precision import Policy

CHANNELS = 3  # RGB: HF's num_channels
ACTIVATION = "gelu_pytorch_tanh"  # HF's hidden_act of every SigLIP checkpoint


class Shape(NamedTuple):
    """The tower's shapes (`model.vision.*`)."""

    image_size: int
    patch_size: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    norm_eps: float = 1e-6

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


def shape_of(vision) -> Shape:
    """The Shape of a `model.vision` section."""
    return Shape(*(getattr(vision, k) for k in Shape._fields))


def _linear(d_in: int, d_out: int, policy: Policy, rngs: nnx.Rngs):
    # SiglipPreTrainedModel._init_weights: xavier-uniform kernels, zero biases.
    return nnx.Linear(d_in, d_out, use_bias=True, dtype=policy.compute, param_dtype=policy.param,
                      kernel_init=nnx.initializers.xavier_uniform(), rngs=rngs)


def layer_norm(d: int, eps: float, policy: Policy, rngs: nnx.Rngs):
    return nnx.LayerNorm(d, epsilon=eps, dtype=policy.compute, param_dtype=policy.param, rngs=rngs)


class PatchEmbedding(nnx.Module):
    """HF's Conv2d patch embedding as one einsum over the patches: [B, C, H, W] -> [B, N, D]."""

    def __init__(self, patch_size: int, d_model: int, policy: Policy, rngs: nnx.Rngs):
        self.patch_size, self.dtype = patch_size, policy.compute
        init = nnx.initializers.lecun_normal(in_axis=(0, 1, 2), out_axis=3)
        self.kernel = nnx.Param(init(rngs.params(), (patch_size, patch_size, CHANNELS, d_model), policy.param))
        self.bias = nnx.Param(jnp.zeros((d_model,), policy.param))

    def __call__(self, pixels_BCHW: jax.Array) -> jax.Array:
        B, C, H, W = pixels_BCHW.shape
        P = self.patch_size
        # [b, c, i (patch row), y (row in the patch), j (patch column), x (column in the patch)]
        x = pixels_BCHW.astype(self.dtype).reshape(B, C, H // P, P, W // P, P)
        out_BIJD = jnp.einsum("bciyjx,xycd->bijd", x, self.kernel[...].astype(self.dtype))
        out_BND = out_BIJD.reshape(B, (H // P) * (W // P), -1)  # patches row by row, as HF's flatten(2)
        return out_BND + self.bias[...].astype(self.dtype)


class Embeddings(nnx.Module):
    """SiglipVisionEmbeddings: patch embeddings plus one learned position per patch."""

    def __init__(self, shape: Shape, policy: Policy, rngs: nnx.Rngs):
        self.image_size, self.n_patches = shape.image_size, shape.n_patches
        self.patch_embedding = PatchEmbedding(shape.patch_size, shape.d_model, policy, rngs)
        self.position_embedding = nnx.Embed(shape.n_patches, shape.d_model, dtype=policy.compute,
                                            param_dtype=policy.param, rngs=rngs,
                                            embedding_init=nnx.initializers.normal(shape.d_model ** -0.5))

    def __call__(self, pixels_BCHW: jax.Array) -> jax.Array:
        want = (CHANNELS, self.image_size, self.image_size)
        if tuple(pixels_BCHW.shape[1:]) != want:
            raise ValueError(f"pixel_values has shape {list(pixels_BCHW.shape)}; the vision tower takes "
                             f"[B, {', '.join(map(str, want))}] (model.vision.image_size={self.image_size})")
        x_BND = self.patch_embedding(pixels_BCHW)
        return x_BND + self.position_embedding.embedding[...].astype(x_BND.dtype)[None]


def gelu_tanh(x: jax.Array) -> jax.Array:
    """HF's gelu_pytorch_tanh: torch's gelu(approximate="tanh")."""
    return jax.nn.gelu(x, approximate=True)


class Attention(nnx.Module):
    """Bidirectional multi-head attention with biased projections (SiglipAttention): no mask."""

    def __init__(self, d_model: int, n_heads: int, policy: Policy, rngs: nnx.Rngs,
                 spec: attention.Spec = attention.Spec()):
        self.n_heads, self.spec = n_heads, spec
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (_linear(d_model, d_model, policy, rngs)
                                                                for _ in range(4))

    def __call__(self, x_BND: jax.Array) -> jax.Array:
        B, N, D = x_BND.shape
        q, k, v = (p(x_BND).reshape(B, N, self.n_heads, -1) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(attention.attend(q, k, v, None, self.spec).reshape(B, N, D))


class MLP(nnx.Module):
    def __init__(self, d_model: int, d_ff: int, policy: Policy, rngs: nnx.Rngs):
        self.fc1 = _linear(d_model, d_ff, policy, rngs)
        self.fc2 = _linear(d_ff, d_model, policy, rngs)

    def __call__(self, x_BND: jax.Array) -> jax.Array:
        return self.fc2(gelu_tanh(self.fc1(x_BND)))


class EncoderLayer(nnx.Module):
    """One pre-LN encoder layer (SiglipEncoderLayer): a unit of the tower's stack."""

    def __init__(self, shape: Shape, policy: Policy, rngs: nnx.Rngs, spec: attention.Spec = attention.Spec()):
        self.layer_norm1 = layer_norm(shape.d_model, shape.norm_eps, policy, rngs)
        self.self_attn = Attention(shape.d_model, shape.n_heads, policy, rngs, spec)
        self.layer_norm2 = layer_norm(shape.d_model, shape.norm_eps, policy, rngs)
        self.mlp = MLP(shape.d_model, shape.d_ff, policy, rngs)

    def __call__(self, x_BND: jax.Array) -> jax.Array:
        x_BND = x_BND + self.self_attn(self.layer_norm1(x_BND))
        return x_BND + self.mlp(self.layer_norm2(x_BND))


def make_stack(shape: Shape, policy: Policy, rngs: nnx.Rngs, spec: attention.Spec = attention.Spec()):
    """The tower's encoder layers as one stack (every leaf with a leading layer axis [L, ...])."""

    @nnx.split_rngs(splits=shape.n_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make_layers(rngs: nnx.Rngs) -> EncoderLayer:
        return EncoderLayer(shape, policy, rngs, spec)

    return make_layers(rngs)


def flops_per_image(params: float, shape: Shape) -> float:
    """Training FLOPs of one image through the tower (PaLM appendix B per patch: 6 per parameter
    plus attention's 12·L·N·D, every patch attending to all N), times its N patches."""
    return shape.n_patches * palm_flops_per_token(params, shape.n_layers, shape.n_patches, shape.d_model)


# ---------------------------------------------------------------------------------------------
# Hugging Face: SiglipVisionModel's tensors, under the prefix of the model that holds it.


def hf_tensors(stack: str, embeddings: str, post_layernorm: str, prefix: str) -> dict[str, Tensor]:
    """zerojax path -> HF tensor for the tower: `stack`, `embeddings` and `post_layernorm` are the
    holding model's attribute names, `prefix` the HF names' (PaliGemma's `vision_tower.vision_model.`)."""
    layer = prefix + "encoder.layers.{i}."
    out = {
        f"{embeddings}/patch_embedding/kernel": Tensor(prefix + "embeddings.patch_embedding.weight", True),
        f"{embeddings}/patch_embedding/bias": Tensor(prefix + "embeddings.patch_embedding.bias"),
        f"{embeddings}/position_embedding/embedding": Tensor(prefix + "embeddings.position_embedding.weight"),
        f"{post_layernorm}/scale": Tensor(prefix + "post_layernorm.weight"),
        f"{post_layernorm}/bias": Tensor(prefix + "post_layernorm.bias"),
    }
    for norm in ("layer_norm1", "layer_norm2"):
        out[f"{stack}/{norm}/scale"] = Tensor(layer + f"{norm}.weight")
        out[f"{stack}/{norm}/bias"] = Tensor(layer + f"{norm}.bias")
    for module in ("self_attn/q_proj", "self_attn/k_proj", "self_attn/v_proj", "self_attn/out_proj",
                   "mlp/fc1", "mlp/fc2"):
        name = layer + module.replace("/", ".")
        out[f"{stack}/{module}/kernel"] = Tensor(name + ".weight", True)
        out[f"{stack}/{module}/bias"] = Tensor(name + ".bias")
    return out
