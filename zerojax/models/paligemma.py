"""PaliGemma in Flax NNX, with Hugging Face `PaliGemmaForConditionalGeneration`'s conventions (as
transformers 5 computes it) so that checkpoints map one to one: a SigLIP vision tower
(`models/siglip.py`), a linear projector, and a Gemma decoder (`models/gemma.py`'s layers).

Two stacks, run in order (the unit protocol):

    enter(batch)             the patch embeddings of batch["pixel_values"] [B, 3, S, S] plus positions
    vision                   SigLIP's encoder layers
    between("layers", ...)   the post-layernorm and the projector (vision width -> d_model), then the
                             image features put in place of the token embeddings at the image tokens
    layers                   Gemma's decoder layers, prefix-LM: the batch's `prefix` (True on the
                             image, BOS, the prompt and its newline: token_type_ids == 0) attends
                             both ways, the answer causally (`protocol.attention_mask`)
    exit(x, batch)           the final norm, the tied head and `protocol.text_loss` (the batch's
                             loss_mask: the answer's tokens and EOS)

The merge is transformers': text embeddings are scaled by sqrt(d_model) (the factor rounded to
the hidden dtype, Gemma's), the projected image features are not (transformers 5 applies no
factor to them; 4.x divided them by sqrt(d_model) and then multiplied every embedding by it, the
same in exact arithmetic); the k-th image token of a row receives the row's k-th patch feature
(`masked_scatter`, rows of image_tokens image tokens each), and the image token's own id is
never embedded. Positions count from 1 (PaliGemma's), unless the batch gives them.

The batch is the language-model contract of `models/protocol.py` plus `pixel_values`:
`tokens` [B, T+1] hold the image tokens first (T = model.seq_len counts them).

Below the model: the family's config rule (`check_config`), its FLOPs, and its Hugging Face
layout (`HF`: the nested text_config / vision_config both ways, the tensor table).

Shapes: B batch, T sequence, N patches (image tokens), E vision width, D d_model, V vocab.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from zerojax.errors import ConfigError
from zerojax.models import attention, gemma, protocol, siglip
from zerojax.models.family import VISION_LANGUAGE, Family, HfLayout, Tensor, require
from zerojax.models.flops import palm_flops_per_token
from zerojax.precision import Policy

TOWER = ("vision", "vision_embeddings", "vision_post_layernorm")  # optim.freeze=vision (or vision*) freezes these
DECODER = ("embed_tokens", "layers", "norm")  # Gemma: optim.lora.targets=decoder adapts its kernels only


class PaliGemma(nnx.Module):
    STACKED = ("vision", "layers")
    # Named components (`optim.components`): optim.freeze=vision, optim.lora.targets=decoder.
    # The projector belongs to neither: it is the glue, trained unless named.
    COMPONENTS = {"vision": TOWER, "decoder": DECODER}

    def __init__(self, *, vocab_size: int, d_model: int, n_layers: int, n_heads: int, n_kv_heads: int,
                 head_dim: int, d_ff: int, vision: siglip.Shape, image_token_id: int, rope_theta: float = 10000.0,
                 norm_eps: float = 1e-6, policy: Policy = Policy(), rngs: nnx.Rngs,
                 spec: attention.Spec = attention.Spec(), loss_chunk: int = 1024):
        self.image_token_id, self.vision_shape, self.loss_chunk = image_token_id, vision, loss_chunk
        self.vision_embeddings = siglip.Embeddings(vision, policy, rngs)
        self.vision = siglip.make_stack(vision, policy, rngs, spec)
        self.vision_post_layernorm = siglip.layer_norm(vision.d_model, vision.norm_eps, policy, rngs)
        self.multi_modal_projector = nnx.Linear(vision.d_model, d_model, dtype=policy.compute,
                                                param_dtype=policy.param, rngs=rngs,
                                                kernel_init=nnx.initializers.normal(gemma.STD))
        self.embed_tokens = nnx.Embed(vocab_size, d_model, dtype=policy.compute, param_dtype=policy.param,
                                      embedding_init=nnx.initializers.normal(gemma.STD), rngs=rngs)

        @nnx.split_rngs(splits=n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(rngs: nnx.Rngs) -> gemma.DecoderLayer:
            return gemma.DecoderLayer(d_model, n_heads, n_kv_heads, head_dim, d_ff, rope_theta, norm_eps, policy, rngs,
                                      spec)

        self.layers = make_layers(rngs)
        self.norm = gemma.RMSNorm(d_model, norm_eps, policy)

    # -- the unit protocol --------------------------------------------------------------------

    def enter(self, batch):
        if not isinstance(batch, dict) or "pixel_values" not in batch:
            fields = sorted(batch) if isinstance(batch, dict) else "a bare token array"
            raise ConfigError(f"model.family=paligemma reads images: its batch needs pixel_values [B, 3, H, W] next "
                              f"to tokens, and this data source yields {fields}; use an image source")
        return self.vision_embeddings(batch["pixel_values"])

    def between(self, name: str, x_BNE: jax.Array, batch):
        fields = protocol.text(batch)
        h_BTD = self.merge(fields.inputs, self.image_features(x_BNE))
        return protocol.stream(h_BTD, self.structure(fields.structure(), fields.inputs.shape))

    def exit(self, x, batch):
        return protocol.chunked_text_loss(self.head, protocol.unstream(x)[0], protocol.text(batch), self.loss_chunk)

    # -- the pieces ---------------------------------------------------------------------------

    def image_features(self, x_BNE: jax.Array) -> jax.Array:
        """The tower's output, post-layernormed and projected to the decoder's width: [B, N, D]."""
        return self.multi_modal_projector(self.vision_post_layernorm(x_BNE))

    def embed(self, tokens_BT: jax.Array, is_image_BT: jax.Array) -> jax.Array:
        """Gemma's scaled token embeddings; an image token is embedded as id 0 (transformers, when
        the image id lies outside the vocabulary; its embedding is replaced anyway)."""
        x_BTD = self.embed_tokens(jnp.where(is_image_BT, 0, tokens_BT))
        return x_BTD * jnp.asarray(math.sqrt(x_BTD.shape[-1]), x_BTD.dtype)

    def merge(self, tokens_BT: jax.Array, features_BND: jax.Array | None) -> jax.Array:
        """Token embeddings with the k-th image token of each row replaced by its k-th image feature."""
        is_image_BT = tokens_BT == self.image_token_id
        x_BTD = self.embed(tokens_BT, is_image_BT)
        if features_BND is None:
            return x_BTD
        k_BT = jnp.clip(jnp.cumsum(is_image_BT, axis=1) - 1, 0, features_BND.shape[1] - 1)
        picked_BTD = jnp.take_along_axis(features_BND, k_BT[..., None], axis=1).astype(x_BTD.dtype)
        return jnp.where(is_image_BT[..., None], picked_BTD, x_BTD)

    @staticmethod
    def structure(structure: dict, shape) -> dict:
        """The batch's structure fields, with PaliGemma's positions 1..T where it gives none."""
        if "positions" in structure:
            return structure
        return {**structure, "positions": jnp.broadcast_to(jnp.arange(1, shape[1] + 1, dtype=jnp.int32), shape)}

    def head(self, x_BTD: jax.Array) -> jax.Array:
        return self.embed_tokens.attend(self.norm(x_BTD)).astype(jnp.float32)  # tied, as Gemma's

    def logits(self, tokens_BT: jax.Array, pixel_values: jax.Array | None = None,
               token_type_ids: jax.Array | None = None) -> jax.Array:
        """[B, T, V] fp32 logits on one device, as transformers' forward(input_ids, pixel_values,
        token_type_ids): `tokens_BT` include the image tokens; without pixel_values the text alone
        (the image tokens embedded as tokens); without token_type_ids every token attends causally."""
        features = None
        if pixel_values is not None:
            features = self.image_features(protocol.apply_stack(self.vision, self.vision_embeddings(pixel_values)))
        structure = {} if token_type_ids is None else {"prefix": jnp.asarray(token_type_ids) == 0}
        x = protocol.stream(self.merge(tokens_BT, features), self.structure(structure, tokens_BT.shape))
        return self.head(protocol.unstream(protocol.apply_stack(self.layers, x))[0])

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per text token (PaLM appendix B): the decoder's 6 per parameter plus
        attention's 12·L·T·(H·K) per token, and each row's image through the tower and the
        projector (`siglip.flops_per_image`: its parameters applied to N patches, not T tokens)
        spread over the row's seq_len tokens."""
        params = nnx.to_pure_dict(nnx.state(self, nnx.Param))
        count = lambda names: sum(x.size for name in names for x in jax.tree.leaves(params[name]))
        image_side = (*TOWER, "multi_modal_projector")
        text = count([name for name in params if name not in image_side])
        n_layers, _, d_attn = self.layers.self_attn.q_proj.kernel.shape
        return (palm_flops_per_token(text, n_layers, seq_len, d_attn)
                + siglip.flops_per_image(count(image_side), self.vision_shape) / seq_len)


def build(*, cfg, policy: Policy, rngs: nnx.Rngs) -> PaliGemma:
    """The `model.family=paligemma` factory."""
    return PaliGemma(vocab_size=cfg.vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                     n_kv_heads=cfg.n_kv_heads or cfg.n_heads, head_dim=gemma.head_dim_of(cfg), d_ff=cfg.d_ff,
                     vision=siglip.shape_of(cfg.vision), image_token_id=cfg.image_token_id,
                     rope_theta=cfg.rope_theta, norm_eps=cfg.norm_eps, policy=policy, rngs=rngs,
                     spec=attention.spec_of(cfg), loss_chunk=cfg.loss_chunk)


def check_config(cfg) -> None:
    """PaliGemma's rules: Gemma's (a tied head, an even head dim), and room in model.seq_len for
    the image tokens and at least one text token."""
    gemma.check_config(cfg)
    n_image = cfg.vision.image_tokens
    if cfg.seq_len <= n_image:
        raise ConfigError(f"model.seq_len={cfg.seq_len} leaves no room for text after the {n_image} image tokens "
                          f"((model.vision.image_size={cfg.vision.image_size} / model.vision.patch_size="
                          f"{cfg.vision.patch_size}) ** 2); raise model.seq_len above {n_image}")


# ---------------------------------------------------------------------------------------------
# Hugging Face: PaliGemmaForConditionalGeneration (a gemma text_config, a siglip_vision_model
# vision_config).

VISION_KEYS = {"image_size": "image_size", "patch_size": "patch_size", "d_model": "hidden_size",
               "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads", "d_ff": "intermediate_size",
               "norm_eps": "layer_norm_eps"}
VISION_OPTIONAL = {"norm_eps": 1e-6}  # SiglipVisionConfig's default


def _square(value, key: str, where: str):
    """HF allows image_size / patch_size as [height, width]; zerojax's tower is square."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise ConfigError(f"{where}: vision_config.{key}={value!r} is not square; zerojax's SigLIP takes square "
                              "images and patches")
        return value[0]
    return value


def _vision_keys(vision: dict, where: str) -> dict:
    where = f"{where}: vision_config"
    if vision.get("num_channels", siglip.CHANNELS) != siglip.CHANNELS:
        raise ConfigError(f"{where}.num_channels={vision['num_channels']!r}: zerojax's SigLIP reads RGB images "
                          f"({siglip.CHANNELS} channels)")
    if vision.get("hidden_act", siglip.ACTIVATION) != siglip.ACTIVATION:
        raise ConfigError(f"{where}.hidden_act={vision['hidden_act']!r} is not supported; zerojax's SigLIP MLP "
                          f"uses {siglip.ACTIVATION}")
    require(vision, where, "paligemma", [v for k, v in VISION_KEYS.items() if k not in VISION_OPTIONAL])
    out = {k: vision.get(v, VISION_OPTIONAL.get(k)) for k, v in VISION_KEYS.items()}
    return {**out, **{k: _square(out[k], VISION_KEYS[k], where) for k in ("image_size", "patch_size")}}


def _text_keys(text: dict, where: str) -> dict:
    """Gemma's keys of the text_config. PaliGemma's config sets use_bidirectional_attention on it;
    the mask is PaliGemma's own (the prefix both ways, then causal), so it is not Gemma's to refuse."""
    where = f"{where}: text_config"
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if not isinstance(rope, dict) or rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ConfigError(f"{where}: rope scaling {rope!r} is not supported by zerojax's paligemma")
    if text.get("attention_bias"):
        raise ConfigError(f"{where}: attention_bias={text['attention_bias']!r} is not supported by zerojax's paligemma")
    text = {k: v for k, v in text.items() if k != "use_bidirectional_attention"}
    if "rope_theta" in rope:
        text.setdefault("rope_theta", rope["rope_theta"])
    return gemma.from_hf_config(text, where)


def from_hf_config(hf: dict, where: str) -> dict:
    """The model.* keys of a PaliGemmaForConditionalGeneration config.json."""
    for key in ("text_config", "vision_config"):
        if not isinstance(hf.get(key), dict):
            raise ConfigError(f"{where}: {key}={hf.get(key)!r} is not a mapping; a PaliGemma config.json nests its "
                              "text_config (Gemma) and vision_config (SigLIP)")
    out = {**_text_keys(hf["text_config"], where), "vision": _vision_keys(hf["vision_config"], where)}
    image_token = hf.get("image_token_index", hf.get("image_token_id"))
    require({"image_token_index": image_token}, where, "paligemma", ["image_token_index"])
    projection = hf.get("projection_dim", hf["vision_config"].get("projection_dim"))
    if projection not in (None, out["d_model"]):
        raise ConfigError(f"{where}: projection_dim={projection} is not text_config.hidden_size={out['d_model']}; "
                          "the projector feeds the image features to the decoder, so they must agree")
    return {**out, "image_token_id": image_token}


def to_hf_config(model: dict) -> dict:
    """config.json's keys for a run's model section."""
    vision = model["vision"]
    text = gemma.to_hf_config(model)
    vision_config = {**{VISION_KEYS[k]: vision[k] for k in VISION_KEYS}, "model_type": "siglip_vision_model",
                     "num_channels": siglip.CHANNELS, "hidden_act": siglip.ACTIVATION, "vision_use_head": False,
                     "projection_dim": model["d_model"]}
    return {"model_type": "paligemma", "text_config": text, "vision_config": vision_config,
            "image_token_index": model["image_token_id"], "projection_dim": model["d_model"],
            "hidden_size": model["d_model"], "vocab_size": model["vocab_size"], "tie_word_embeddings": True}


VISION_PREFIX = "vision_tower.vision_model."  # the published checkpoints' names (transformers 4 and 5 read them)
HF_TENSORS = {
    **{path: Tensor("language_model." + t.name, t.transposed) for path, t in gemma.HF_TENSORS.items()},
    **siglip.hf_tensors(*TOWER, VISION_PREFIX),
    "multi_modal_projector/kernel": Tensor("multi_modal_projector.linear.weight", True),
    "multi_modal_projector/bias": Tensor("multi_modal_projector.linear.bias"),
}
HF = HfLayout(architectures=("PaliGemmaForConditionalGeneration",), from_hf_config=from_hf_config,
              to_hf_config=to_hf_config, tensors=HF_TENSORS, aliases={VISION_PREFIX: "vision_tower."})

FAMILY = Family(kind=VISION_LANGUAGE, build=build, check_config=check_config, hf=HF)
