"""A Llama-family decoder in Flax NNX, with Hugging Face `LlamaForCausalLM`'s conventions so that
checkpoints map one to one: RMSNorm (`model.norm_eps`), rotary position embeddings in the
rotate-half layout (`model.rope_theta`), a SwiGLU MLP (`model.d_ff` the intermediate size),
grouped-query attention (`model.n_kv_heads`), no biases, and an untied LM head by default.

Module names follow HF's (`embed_tokens`, `layers/self_attn/q_proj`, `mlp/gate_proj`, `norm`,
`lm_head`); kernels are stored [in, out] (HF stores [out, in]). The decoder layers are the
unit protocol's one stack. Softmax, norms' statistics and the logits are computed in fp32.
Below the model: the family's config rule (`check_config`) and its Hugging Face layout (`HF`:
LlamaForCausalLM and MistralForCausalLM, config.json keys both ways, the tensor table).

Shapes: B batch, T sequence, D d_model, H heads, G key/value heads, K head dim, F d_ff, V vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from zerojax.errors import ConfigError
from zerojax.models import attention, decoder, protocol, vocab_loss
from zerojax.models.family import LANGUAGE_MODEL, Family, HfLayout, Tensor, require
from zerojax.models.flops import palm_flops_per_token
from zerojax.precision import Policy

STD = decoder.STD
TIED_BY_DEFAULT = False  # model.tie_embeddings=null: transformers' LlamaConfig does not tie


class Llama(nnx.Module):
    STACKED = ("layers",)

    def __init__(self, *, vocab_size: int, d_model: int, n_layers: int, n_heads: int, n_kv_heads: int, d_ff: int,
                 rope_theta: float = 10000.0, norm_eps: float = 1e-5, tie_embeddings: bool = False,
                 policy: Policy = Policy(), rngs: nnx.Rngs, spec: attention.Spec = attention.Spec(),
                 loss_chunk: int = 1024):
        self.loss_chunk = loss_chunk  # tokens whose logits the loss holds at once (model.loss_chunk)
        self.embed_tokens = nnx.Embed(vocab_size, d_model, dtype=policy.compute, param_dtype=policy.param,
                                      embedding_init=nnx.initializers.normal(STD), rngs=rngs)

        @nnx.split_rngs(splits=n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(rngs: nnx.Rngs) -> decoder.DecoderLayer:
            return decoder.DecoderLayer(d_model, n_heads, n_kv_heads, d_model // n_heads, d_ff, rope_theta, policy,
                                        rngs, norm=lambda d: decoder.rms_norm(d, norm_eps, policy, rngs), spec=spec)

        self.layers = make_layers(rngs)  # every leaf has a leading layer axis [L, ...]
        self.norm = decoder.rms_norm(d_model, norm_eps, policy, rngs)
        self.lm_head = None if tie_embeddings else decoder.dense(d_model, vocab_size, policy, rngs)

    def enter(self, batch):
        fields = protocol.text(batch)
        return protocol.stream(protocol.embed(self.embed_tokens, fields.inputs), fields.structure())

    def head(self, x_BTD: jax.Array) -> jax.Array:
        x_BTD = self.norm(x_BTD)
        logits_BTV = self.embed_tokens.attend(x_BTD) if self.lm_head is None else self.lm_head(x_BTD)
        return logits_BTV.astype(jnp.float32)

    def exit(self, x, batch):
        """The loss without whole logits: a plain (tied or untied) head in blocks of tokens and of
        the vocabulary (`vocab_loss`); any other head (LoRA on it) in chunks of tokens."""
        h_BTD, fields = protocol.unstream(x)[0], protocol.text(batch)
        if self.lm_head is None:  # tied: logits = h · embedding^T
            w, vocab_dim, dtype = self.embed_tokens.embedding[...], 0, self.embed_tokens.dtype
        elif type(self.lm_head) is nnx.Linear and self.lm_head.bias is None:
            w, vocab_dim, dtype = self.lm_head.kernel[...], 1, self.lm_head.dtype
        else:
            return protocol.chunked_text_loss(self.head, h_BTD, fields, self.loss_chunk)
        dtype = dtype or w.dtype
        return vocab_loss.linear_text_loss(self.norm(h_BTD).astype(dtype), w.astype(dtype), fields, self.loss_chunk,
                                           vocab_dim)

    def logits(self, tokens_BT: jax.Array) -> jax.Array:
        """[B, T, V] fp32 logits on one device (sampling, checks against transformers)."""
        return self.head(protocol.apply_stack(self.layers, self.embed_tokens(tokens_BT)))

    def decode(self, tokens_BT: jax.Array, positions_BT: jax.Array, cache):
        """Generation on one device: (logits [B, T, V] fp32 of new tokens at `positions_BT`, the
        key/value cache with them): `cache` the number of slots to start with (the prefill), or
        the last call's cache (protocol.decode_stack)."""
        x = protocol.stream(self.embed_tokens(tokens_BT), {"positions": positions_BT})
        x, cache = protocol.decode_stack(self.layers, x, cache)
        return self.head(protocol.unstream(x)[0]), cache

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (PaLM appendix B): 6 per parameter plus attention's 12·L·T·D
        (D here the query width H·K, which is d_model)."""
        n_params = sum(x.size for x in jax.tree.leaves(nnx.state(self, nnx.Param)))
        n_layers, d_model = self.layers.input_layernorm.scale.shape
        return palm_flops_per_token(n_params, n_layers, seq_len, d_model)


def build(*, cfg, policy: Policy, rngs: nnx.Rngs) -> Llama:
    """The `model.family=llama` factory."""
    return Llama(vocab_size=cfg.vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                 n_kv_heads=cfg.n_kv_heads or cfg.n_heads, d_ff=cfg.d_ff, rope_theta=cfg.rope_theta,
                 norm_eps=cfg.norm_eps, policy=policy, rngs=rngs, spec=attention.spec_of(cfg),
                 loss_chunk=cfg.loss_chunk,
                 tie_embeddings=TIED_BY_DEFAULT if cfg.tie_embeddings is None else cfg.tie_embeddings)


def check_config(cfg) -> None:
    """Llama's rules on a ModelConfig: heads of width d_model / n_heads (HF's LlamaForCausalLM
    derives head_dim so), and the rotary embedding rotates pairs, so the head dim is even."""
    if cfg.head_dim not in (0, cfg.d_model // cfg.n_heads):
        raise ConfigError(f"model.head_dim={cfg.head_dim}: llama's heads are model.d_model / model.n_heads = "
                          f"{cfg.d_model // cfg.n_heads} wide (leave model.head_dim=0, or use model.family=gemma)")
    if (cfg.d_model // cfg.n_heads) % 2:
        even = [h for h in range(cfg.n_heads, 0, -1) if cfg.d_model % h == 0 and cfg.d_model // h % 2 == 0]
        fix = f"try model.n_heads={even[0]}" if even else "use an even model.d_model"
        raise ConfigError(f"model.d_model={cfg.d_model} / model.n_heads={cfg.n_heads} = "
                          f"{cfg.d_model // cfg.n_heads}: llama's rotary embedding needs an even head "
                          f"dimension; {fix}")


# ---------------------------------------------------------------------------------------------
# Hugging Face: LlamaForCausalLM, and MistralForCausalLM, the same layout (a sliding window, the
# one difference, is refused by config.hf_config).

HF_KEYS = {"vocab_size": "vocab_size", "d_model": "hidden_size", "n_layers": "num_hidden_layers",
           "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "d_ff": "intermediate_size",
           "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps", "tie_embeddings": "tie_word_embeddings"}
HF_OPTIONAL = {"n_kv_heads": 0, "rope_theta": 10000.0, "tie_embeddings": TIED_BY_DEFAULT}  # transformers' defaults


def from_hf_config(hf: dict, where: str) -> dict:
    """The model.* keys of a LlamaForCausalLM config.json (`where`: its path, for errors)."""
    require(hf, where, "llama", [hf_key for key, hf_key in HF_KEYS.items() if key not in HF_OPTIONAL])
    return {key: hf.get(hf_key, HF_OPTIONAL.get(key)) for key, hf_key in HF_KEYS.items()}


def to_hf_config(model: dict) -> dict:
    """config.json's keys for a run's model section; rope_theta for transformers 4, rope_parameters for 5."""
    out = {HF_KEYS[k]: model[k] for k in HF_KEYS if k not in ("tie_embeddings", "n_kv_heads")}
    tie = TIED_BY_DEFAULT if model["tie_embeddings"] is None else model["tie_embeddings"]
    return {**out, "tie_word_embeddings": tie, "model_type": "llama",
            "num_key_value_heads": model["n_kv_heads"] or model["n_heads"],
            "rope_parameters": {"rope_type": "default", "rope_theta": model["rope_theta"]}, "hidden_act": "silu",
            "max_position_embeddings": model["seq_len"], "attention_bias": False, "mlp_bias": False,
            "bos_token_id": None, "eos_token_id": None}


HF_TENSORS = {
    "embed_tokens/embedding": Tensor("model.embed_tokens.weight"),
    "norm/scale": Tensor("model.norm.weight"),
    "lm_head/kernel": Tensor("lm_head.weight", True),
    **decoder.hf_tensors("layers", "model.layers.{i}."),
}
HF = HfLayout(architectures=("LlamaForCausalLM", "MistralForCausalLM"), from_hf_config=from_hf_config,
              to_hf_config=to_hf_config, tensors=HF_TENSORS,
              derived={"head_dim": (lambda m: m.d_model // m.n_heads, "hidden_size / num_attention_heads")})

FAMILY = Family(kind=LANGUAGE_MODEL, build=build, check_config=check_config, hf=HF)
