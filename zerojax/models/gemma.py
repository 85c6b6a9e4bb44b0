"""A Gemma-family decoder in Flax NNX, with Hugging Face `GemmaForCausalLM`'s conventions so that
checkpoints map one to one. Where it differs from `models/llama.py`:

- RMSNorm scales by `(1 + w)`, `w` initialised to 0, and computes in fp32 before casting back
  (transformers' GemmaRMSNorm);
- the MLP is GeGLU with tanh-approximated GELU (`gelu_pytorch_tanh`): down(gelu(gate(x)) * up(x));
- token embeddings are multiplied by sqrt(d_model), the factor rounded to the hidden dtype first
  as transformers does;
- the head dim (`model.head_dim`) is its own key, not d_model / n_heads;
- the LM head is always the token embedding (tied).

Attention is multi-query or grouped-query (`model.n_kv_heads`) with Llama's rotary embedding
(`decoder.rope`, HF's rotate-half layout), scaled by 1/sqrt(head_dim); no biases. Softmax, norms
and the logits are computed in fp32.

Left out (Gemma-2 and later): logit soft-capping (`final_logit_softcapping`,
`attn_logit_softcapping`), sliding-window attention, the extra pre/post-feedforward norms and
`query_pre_attn_scalar`; a config.json that sets them is refused.

Module names follow HF's (`embed_tokens`, `layers/self_attn/q_proj`, `mlp/gate_proj`, `norm`);
kernels are stored [in, out] (HF stores [out, in]). The decoder layers are the unit protocol's
one stack. Below the model: the family's config rules (`check_config`) and its Hugging Face
layout (`HF`: config.json keys both ways, the tensor table).

Shapes: B batch, T sequence, D d_model, H heads, G key/value heads, K head dim, F d_ff, V vocab.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from zerojax.errors import ConfigError
from zerojax.models import attention, decoder, protocol
from zerojax.models.family import LANGUAGE_MODEL, Family, HfLayout, Tensor, require
from zerojax.models.flops import palm_flops_per_token
from zerojax.precision import Policy

STD = decoder.STD
ACTIVATION = "gelu_pytorch_tanh"  # HF's name for the one activation this family has
RMSNorm, gelu_tanh = decoder.GemmaRMSNorm, decoder.gelu_tanh  # Gemma's norm and GeGLU's gate


def DecoderLayer(d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, d_ff: int, theta: float, eps: float,
                 policy: Policy, rngs: nnx.Rngs, spec: attention.Spec = attention.Spec()) -> decoder.DecoderLayer:
    """Gemma's decoder layer (`decoder.DecoderLayer` with its norm and GeGLU): the unit a ZeRO-3
    schedule gathers at a time."""
    return decoder.DecoderLayer(d_model, n_heads, n_kv_heads, head_dim, d_ff, theta, policy, rngs,
                                norm=lambda d: RMSNorm(d, eps, policy), activation=gelu_tanh, spec=spec)


class Gemma(nnx.Module):
    STACKED = ("layers",)

    def __init__(self, *, vocab_size: int, d_model: int, n_layers: int, n_heads: int, n_kv_heads: int,
                 head_dim: int, d_ff: int, rope_theta: float = 10000.0, norm_eps: float = 1e-6,
                 policy: Policy = Policy(), rngs: nnx.Rngs, spec: attention.Spec = attention.Spec(),
                 loss_chunk: int = 1024):
        self.loss_chunk = loss_chunk  # tokens whose logits the loss holds at once (model.loss_chunk)
        self.embed_tokens = nnx.Embed(vocab_size, d_model, dtype=policy.compute, param_dtype=policy.param,
                                      embedding_init=nnx.initializers.normal(STD), rngs=rngs)

        @nnx.split_rngs(splits=n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(rngs: nnx.Rngs) -> decoder.DecoderLayer:
            return DecoderLayer(d_model, n_heads, n_kv_heads, head_dim, d_ff, rope_theta, norm_eps, policy, rngs, spec)

        self.layers = make_layers(rngs)  # every leaf has a leading layer axis [L, ...]
        self.norm = RMSNorm(d_model, norm_eps, policy)

    def embed(self, tokens_BT: jax.Array) -> jax.Array:
        x_BTD = self.embed_tokens(tokens_BT)
        # HF: inputs_embeds * torch.tensor(hidden_size ** 0.5, dtype=hidden dtype), rounded first.
        return x_BTD * jnp.asarray(math.sqrt(x_BTD.shape[-1]), x_BTD.dtype)

    def enter(self, batch):
        fields = protocol.text(batch)
        return protocol.stream(self.embed(fields.inputs), fields.structure())

    def head(self, x_BTD: jax.Array) -> jax.Array:
        return self.embed_tokens.attend(self.norm(x_BTD)).astype(jnp.float32)  # tied: no normalizer here

    def exit(self, x, batch):
        return protocol.chunked_text_loss(self.head, protocol.unstream(x)[0], protocol.text(batch), self.loss_chunk)

    def logits(self, tokens_BT: jax.Array) -> jax.Array:
        """[B, T, V] fp32 logits on one device (sampling, checks against transformers)."""
        return self.head(protocol.apply_stack(self.layers, self.embed(tokens_BT)))

    def decode(self, tokens_BT: jax.Array, positions_BT: jax.Array, cache):
        """Generation on one device: (logits of new tokens, the updated cache), as Llama's `decode`."""
        x = protocol.stream(self.embed(tokens_BT), {"positions": positions_BT})
        x, cache = protocol.decode_stack(self.layers, x, cache)
        return self.head(protocol.unstream(x)[0]), cache

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (PaLM appendix B): 6 per parameter plus attention's 12·L·T·D,
        D here the query width H·K (not d_model: the head dim is free)."""
        n_params = sum(x.size for x in jax.tree.leaves(nnx.state(self, nnx.Param)))
        n_layers, _, d_attn = self.layers.self_attn.q_proj.kernel.shape
        return palm_flops_per_token(n_params, n_layers, seq_len, d_attn)


def head_dim_of(cfg) -> int:
    return cfg.head_dim or cfg.d_model // cfg.n_heads


def build(*, cfg, policy: Policy, rngs: nnx.Rngs) -> Gemma:
    """The `model.family=gemma` factory."""
    return Gemma(vocab_size=cfg.vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                 n_kv_heads=cfg.n_kv_heads or cfg.n_heads, head_dim=head_dim_of(cfg), d_ff=cfg.d_ff,
                 rope_theta=cfg.rope_theta, norm_eps=cfg.norm_eps, policy=policy, rngs=rngs,
                 spec=attention.spec_of(cfg), loss_chunk=cfg.loss_chunk)


def check_config(cfg) -> None:
    """Gemma's rules on a ModelConfig: the head is tied, and the rotary embedding rotates pairs,
    so the head dim is even."""
    if cfg.tie_embeddings is False:
        raise ConfigError("model.tie_embeddings=false: gemma's LM head is its token embedding "
                          "(leave model.tie_embeddings=null or true, or use model.family=llama)")
    if head_dim_of(cfg) % 2:
        where = (f"model.head_dim={cfg.head_dim}" if cfg.head_dim else
                 f"model.d_model={cfg.d_model} / model.n_heads={cfg.n_heads} = {head_dim_of(cfg)}")
        raise ConfigError(f"{where}: gemma's rotary embedding needs an even head dimension; "
                          "set an even model.head_dim")


# ---------------------------------------------------------------------------------------------
# Hugging Face: GemmaForCausalLM.

HF_KEYS = {"vocab_size": "vocab_size", "d_model": "hidden_size", "n_layers": "num_hidden_layers",
           "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
           "d_ff": "intermediate_size", "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps",
           "tie_embeddings": "tie_word_embeddings"}
HF_OPTIONAL = {"rope_theta": 10000.0, "norm_eps": 1e-6, "tie_embeddings": True}  # transformers' GemmaConfig defaults
# Left out (the module docstring): config.json keys that must be unset, null or false.
LEFT_OUT = ("final_logit_softcapping", "attn_logit_softcapping", "sliding_window", "use_bidirectional_attention")


def _activation(hf: dict, where: str) -> None:
    """Only the tanh-approximated GELU is this family's. transformers 5 reads `hidden_act`, and
    takes the legacy "gelu" of the official releases as the tanh approximation (GemmaConfig's
    __post_init__); transformers 4 let `hidden_activation`, when set, override it."""
    for key, allowed in (("hidden_activation", (None, ACTIVATION)), ("hidden_act", (None, ACTIVATION, "gelu"))):
        if hf.get(key) not in allowed:
            raise ConfigError(f"{where}: {key}={hf[key]!r} is not supported by zerojax's gemma; "
                              f"its MLP is GeGLU with {ACTIVATION}")


def from_hf_config(hf: dict, where: str) -> dict:
    """The model.* keys of a GemmaForCausalLM config.json (`where`: its path, for errors)."""
    for key in LEFT_OUT:
        if hf.get(key) not in (None, False):
            raise ConfigError(f"{where}: {key}={hf[key]!r} is not supported by zerojax's gemma (Gemma-1: no "
                              "soft-capping, sliding windows nor bidirectional attention); remove it or set it to null")
    if hf.get("query_pre_attn_scalar") not in (None, hf.get("head_dim")):
        raise ConfigError(f"{where}: query_pre_attn_scalar={hf['query_pre_attn_scalar']!r} is not head_dim="
                          f"{hf.get('head_dim')!r}; zerojax's gemma scales attention by head_dim ** -0.5")
    _activation(hf, where)
    require(hf, where, "gemma", [hf_key for key, hf_key in HF_KEYS.items() if key not in HF_OPTIONAL])
    return {key: hf.get(hf_key, HF_OPTIONAL.get(key)) for key, hf_key in HF_KEYS.items()}


def to_hf_config(model: dict) -> dict:
    """config.json's keys for a run's model section; rope_theta for transformers 4, rope_parameters for 5."""
    out = {HF_KEYS[k]: model[k] for k in HF_KEYS if k not in ("tie_embeddings", "n_kv_heads", "head_dim")}
    return {**out, "tie_word_embeddings": True, "model_type": "gemma",
            "num_key_value_heads": model["n_kv_heads"] or model["n_heads"],
            "head_dim": model["head_dim"] or model["d_model"] // model["n_heads"],
            "rope_parameters": {"rope_type": "default", "rope_theta": model["rope_theta"]},
            "hidden_act": ACTIVATION, "hidden_activation": ACTIVATION,
            "max_position_embeddings": model["seq_len"], "attention_bias": False,
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


HF_TENSORS = {
    "embed_tokens/embedding": Tensor("model.embed_tokens.weight"),
    "norm/scale": Tensor("model.norm.weight"),
    **decoder.hf_tensors("layers", "model.layers.{i}."),
}
HF = HfLayout(architectures=("GemmaForCausalLM",), from_hf_config=from_hf_config, to_hf_config=to_hf_config,
              tensors=HF_TENSORS)

FAMILY = Family(kind=LANGUAGE_MODEL, build=build, check_config=check_config, hf=HF)
