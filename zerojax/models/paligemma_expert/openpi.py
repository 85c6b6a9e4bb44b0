"""PaliGemma with an action expert in openpi's checkpoints: the `params/` tree of openpi's `Pi0`,
as openpi's training (`training/checkpoints.py: save_state`) and its released checkpoints write
it, read from openpi's source (`models/pi0.py`, `gemma.py`, `siglip.py`, `lora.py`): the rules
π0's and π0.5's layouts (`pi0.openpi`, `pi05.openpi`) share. `zerojax.interop.openpi` reads and
writes the tree for any family that declares an `OpenpiLayout`.

openpi's tree (layer axis L first: the Gemma and SigLIP blocks are `nn.scan`ned):
    PaliGemma/llm/embedder/input_embedding        [V, D]
    PaliGemma/llm/layers/attn/q_einsum/w          [L, N, D, H]     (the expert's: q_einsum_1, ...)
    PaliGemma/llm/layers/attn/kv_einsum/w         [L, 2, K, D, H]  (qkv_einsum [L, 3, N, D, H] if K == N)
    PaliGemma/llm/layers/attn/attn_vec_einsum/w   [L, N, H, D]
    PaliGemma/llm/layers/mlp/gating_einsum        [L, 2, D, F]     (gate, up)
    PaliGemma/llm/layers/mlp/linear               [L, F, D]
    PaliGemma/llm/layers/pre_attention_norm/scale, pre_ffw_norm/scale [L, D]; final_norm/scale [D]
    PaliGemma/img/embedding/{kernel [P (y), P (x), 3, E]: flax's Conv, HWIO; zerojax's is [x, y, ...], bias},
        pos_embedding [1, N_patches, E]
    PaliGemma/img/Transformer/encoderblock/{LayerNorm_0, LayerNorm_1, MlpBlock_0/Dense_{0,1},
        MultiHeadDotProductAttention_0/{query, key, value} (kernel [L, E, heads, hd]), out ([L, heads, hd, E])}
    PaliGemma/img/Transformer/encoder_norm, PaliGemma/img/head (the projector [E, D])
    the family's heads at the top level: {kernel, bias} each
Norm scales are stored as zerojax keeps them (`x·(1 + scale)`), kernels [in, out].
"""

from __future__ import annotations

from zerojax.errors import ConfigError
from zerojax.models.family import Rule

LLM, IMG = "PaliGemma/llm/", "PaliGemma/img/"
LAYERS, BLOCK = LLM + "layers/", IMG + "Transformer/encoderblock/"


# openpi's fine-tuning recipe, the same for π0 and π0.5 (openpi/training: `TrainConfig`'s defaults, its
# `optimizer.AdamW` with scripts/train.py's weight_decay_mask=None, `CosineDecaySchedule`, and `ema_decay`);
# the normalization is the model type's
RECIPE = {"optim.lr": 2.5e-5, "optim.b1": 0.9, "optim.b2": 0.95, "optim.eps": 1e-8, "optim.weight_decay": 1e-10,
          "optim.decay_mask": "all", "optim.clip_norm": 1.0, "optim.schedule": "cosine", "optim.warmup_steps": 1_000, "optim.decay_steps": 30_000,
          "optim.final_lr": 2.5e-6, "optim.ema": 0.99}


def same(zerojax: str, openpi: str) -> Rule:
    """A leaf stored as it is."""
    return Rule((zerojax,), (openpi,), lambda xp, a: (a,), lambda xp, a: (a,))


def reshaped(zerojax: str, openpi: str, to_shape, from_shape) -> Rule:
    """A leaf openpi keeps in another shape, the same elements in the same order: `to_shape` of
    zerojax's shape gives openpi's, `from_shape` back."""
    return Rule((zerojax,), (openpi,), lambda xp, a: (a.reshape(to_shape(a.shape)),),
                lambda xp, w: (w.reshape(from_shape(w.shape)),))


def linear(path: str, openpi: str | None = None) -> list[Rule]:
    """A dense layer's kernel and bias under the same names."""
    return [same(f"{path}/{leaf}", f"{openpi or path}/{leaf}") for leaf in ("kernel", "bias")]


def split_last(n: int) -> tuple:
    """[..., n·h] <-> [..., n, h] (SigLIP's query/key/value kernels and biases)."""
    return lambda s: (*s[:-1], n, s[-1] // n), lambda s: (*s[:-2], s[-2] * s[-1])


def split_middle(n: int) -> tuple:
    """[L, n·h, D] <-> [L, n, h, D] (SigLIP's out kernel, Gemma's attn_vec_einsum)."""
    return lambda s: (s[0], n, s[1] // n, s[2]), lambda s: (s[0], s[1] * s[2], s[3])


def siglip_rules(heads: int) -> list[Rule]:
    """The tower: So400m's scanned encoder blocks, its stem and its norm, the projector."""
    attn = BLOCK + "MultiHeadDotProductAttention_0/"
    swap = lambda xp, k: (xp.transpose(k, (1, 0, 2, 3)),)  # noqa: E731 - zerojax's [P (x), P (y), C, E], flax's HWIO
    out = [Rule(("vision_embeddings/patch_embedding/kernel",), (IMG + "embedding/kernel",), swap, swap),
           same("vision_embeddings/patch_embedding/bias", IMG + "embedding/bias"),
           reshaped("vision_embeddings/position_embedding/embedding", IMG + "pos_embedding",
                    lambda s: (1, *s), lambda s: s[1:]),
           same("vision_post_layernorm/scale", IMG + "Transformer/encoder_norm/scale"),
           same("vision_post_layernorm/bias", IMG + "Transformer/encoder_norm/bias"),
           *linear("multi_modal_projector", IMG + "head"),
           *linear("vision/mlp/fc1", BLOCK + "MlpBlock_0/Dense_0"), *linear("vision/mlp/fc2", BLOCK + "MlpBlock_0/Dense_1")]
    for norm, flax in (("layer_norm1", "LayerNorm_0"), ("layer_norm2", "LayerNorm_1")):
        out += [same(f"vision/{norm}/{leaf}", f"{BLOCK}{flax}/{leaf}") for leaf in ("scale", "bias")]
    for proj, flax in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value")):
        out += [reshaped(f"vision/self_attn/{proj}/{leaf}", f"{attn}{flax}/{leaf}", *split_last(heads))
                for leaf in ("kernel", "bias")]
    out += [reshaped("vision/self_attn/out_proj/kernel", attn + "out/kernel", *split_middle(heads)),
            same("vision/self_attn/out_proj/bias", attn + "out/bias")]
    return out


def _to_heads(n: int):
    """zerojax's [L, D, n·H] projection -> openpi's [L, n, D, H]."""
    return lambda xp, k: xp.transpose(k.reshape(k.shape[0], k.shape[1], n, -1), (0, 2, 1, 3))


def _from_heads(xp, w):
    """openpi's [L, n, D, H] -> zerojax's [L, D, n·H]."""
    return xp.transpose(w, (0, 2, 1, 3)).reshape(w.shape[0], w.shape[2], -1)


def attention_rules(stream: str, suffix: str, model: dict) -> list[Rule]:
    """One stream's attention (the VLM's, suffix "", or the expert's, "_1") in openpi's einsums."""
    n, k = model["n_heads"], model["n_kv_heads"]
    attn, zj = LAYERS + "attn/", f"layers/{stream}/"
    q, kk, v, o = (zj + f"{p}/kernel" for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
    if k == n:  # openpi's qkv_einsum [L, 3, N, D, H] where every head has its own key and value
        out = [Rule((q, kk, v), (f"{attn}qkv_einsum{suffix}/w",),
                    lambda xp, *qkv: (xp.stack([_to_heads(n)(xp, a) for a in qkv], axis=1),),
                    lambda xp, w: tuple(_from_heads(xp, w[:, i]) for i in range(3)))]
    else:
        out = [Rule((q,), (f"{attn}q_einsum{suffix}/w",), lambda xp, a: (_to_heads(n)(xp, a),),
                    lambda xp, w: (_from_heads(xp, w),)),
               Rule((kk, v), (f"{attn}kv_einsum{suffix}/w",),
                    lambda xp, a, b: (xp.stack([_to_heads(k)(xp, a), _to_heads(k)(xp, b)], axis=1),),
                    lambda xp, w: (_from_heads(xp, w[:, 0]), _from_heads(xp, w[:, 1])))]
    out.append(reshaped(o, f"{attn}attn_vec_einsum{suffix}/w", *split_middle(n)))
    return out


def stream_rules(stream: str, suffix: str, model: dict, norms: bool = True) -> list[Rule]:
    """One stream's joint-layer leaves: attention, the gated MLP, and (`norms`) its RMSNorm scales."""
    mlp, zj = f"{LAYERS}mlp{suffix}/", f"layers/{stream}/"
    out = attention_rules(stream, suffix, model) + [
        Rule((zj + "mlp/gate_proj/kernel", zj + "mlp/up_proj/kernel"), (mlp + "gating_einsum",),
             lambda xp, gate, up: (xp.stack([gate, up], axis=1),), lambda xp, w: (w[:, 0], w[:, 1])),
        same(zj + "mlp/down_proj/kernel", mlp + "linear")]
    if norms:
        out += [same(zj + "input_layernorm/scale", f"{LAYERS}pre_attention_norm{suffix}/scale"),
                same(zj + "post_attention_layernorm/scale", f"{LAYERS}pre_ffw_norm{suffix}/scale")]
    return out


def paligemma_rules(model: dict) -> list[Rule]:
    """The tower, the projector, the embedding, the VLM's layers and final norm: π0's and π0.5's alike."""
    return [*siglip_rules(model["vision"]["n_heads"]), *stream_rules("vlm", "", model),
            same("embed_tokens/embedding", LLM + "embedder/input_embedding"), same("norm/scale", LLM + "final_norm/scale")]


def paligemma_keys(shapes: dict, where: str) -> dict:
    """The model.* keys openpi's PaliGemma half implies (ConfigError naming a missing leaf): the
    sizes of both streams (the expert's from its `_1` copies) and of the tower."""
    def shape(name):
        if name not in shapes:
            raise ConfigError(f"{where}: no leaf {name!r}, which an openpi π0 / π0.5 tree has "
                              f"(it has {len(shapes)} leaves, e.g. {sorted(shapes)[:2]})")
        return tuple(shapes[name])

    vocab, width = shape(LLM + "embedder/input_embedding")
    layers, heads, _, head_dim = shape(LAYERS + "attn/q_einsum/w") if LAYERS + "attn/q_einsum/w" in shapes else \
        (lambda s: (s[0], s[2], s[3], s[4]))(shape(LAYERS + "attn/qkv_einsum/w"))
    kv_heads = shape(LAYERS + "attn/kv_einsum/w")[2] if LAYERS + "attn/kv_einsum/w" in shapes else heads
    expert = LAYERS + ("attn/q_einsum_1/w" if kv_heads != heads else "attn/qkv_einsum_1/w")
    expert_width = shape(expert)[-2]
    patch, _, _, e = shape(IMG + "embedding/kernel")
    n_patches = shape(IMG + "pos_embedding")[1]
    attn = BLOCK + "MultiHeadDotProductAttention_0/"
    return {
        "vocab_size": vocab, "d_model": width, "n_layers": layers, "n_heads": heads, "n_kv_heads": kv_heads,
        "head_dim": head_dim, "d_ff": shape(LAYERS + "mlp/gating_einsum")[-1], "norm_eps": 1e-6,
        "expert": {"d_model": expert_width, "d_ff": shape(LAYERS + "mlp_1/gating_einsum")[-1]},
        "vision": {"image_size": int(round(n_patches ** 0.5)) * patch, "patch_size": patch, "d_model": e,
                   "n_layers": shape(BLOCK + "LayerNorm_0/scale")[0], "n_heads": shape(attn + "query/kernel")[2],
                   "d_ff": shape(BLOCK + "MlpBlock_0/Dense_0/kernel")[-1]},
        "action": {"max_action_dim": shape("action_in_proj/kernel")[0]},
    }
