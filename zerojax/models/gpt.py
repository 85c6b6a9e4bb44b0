"""A decoder-only GPT in Flax NNX (GPT-2's layout), following the unit protocol
(`zerojax.models.protocol`): `enter` embeds, the stacked `blocks` are the units, `exit` is the
final norm, the LM head (or the tied token embedding) and the next-token loss.

The blocks are created under `nnx.vmap`, so every block parameter carries a leading layer axis
[L, ...], and they are applied with `lax.scan` (compile time does not grow with depth). The
model knows nothing about meshes or devices.

Shapes: B batch, T sequence, D d_model, H heads, K head dim (D/H), F d_ff, V vocab, L layers.
Parameters are stored in `policy.param` (fp32) and used in `policy.compute`; attention softmax,
norms' statistics and the logits are computed in fp32. Below the model: the family's config rule
(`check_config`) and its Hugging Face layout (`HF`: GPT2LMHeadModel's config.json keys both ways
and its tensor table).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from zerojax.errors import ConfigError
from zerojax.models import attention, protocol
from zerojax.models.family import LANGUAGE_MODEL, Family, HfLayout, Tensor, require
from zerojax.models.flops import palm_flops_per_token
from zerojax.precision import Policy

TIED_BY_DEFAULT = True  # model.tie_embeddings=null: GPT-2 (and transformers' GPT2Config) ties


def _dense(d_in: int, d_out: int, policy: Policy, rngs: nnx.Rngs, std: float = 0.02, bias: bool = True):
    return nnx.Linear(
        d_in, d_out, use_bias=bias, dtype=policy.compute, param_dtype=policy.param,
        kernel_init=nnx.initializers.normal(std), rngs=rngs,
    )


def _norm(d: int, policy: Policy, rngs: nnx.Rngs, eps: float = 1e-5):
    return nnx.LayerNorm(d, epsilon=eps, dtype=policy.compute, param_dtype=policy.param, rngs=rngs)


class Embedding(nnx.Module):
    """Unit 0: token + learned position embeddings."""

    def __init__(self, vocab_size: int, d_model: int, seq_len: int, policy: Policy, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.wte = nnx.Embed(vocab_size, d_model, dtype=policy.compute, param_dtype=policy.param,
                             embedding_init=init, rngs=rngs)
        self.wpe = nnx.Param(init(rngs.params(), (seq_len, d_model), policy.param))
        self.compute = policy.compute

    def __call__(self, tokens_BT: jax.Array, positions_BT: jax.Array | None = None) -> jax.Array:
        """Positions 0..T-1 unless given (packed rows restart them per example)."""
        wpe = self.wpe[...]
        pos_BTD = wpe[: tokens_BT.shape[1]][None] if positions_BT is None else jnp.take(wpe, positions_BT, axis=0)
        return self.wte(tokens_BT) + pos_BTD.astype(self.compute)


class Attention(nnx.Module):
    """Multi-head attention with biases, scaled by head_dim ** -0.5, softmax in fp32
    (`attention.attend`, computed as `spec` says: model.attention)."""

    def __init__(self, d_model: int, n_heads: int, n_layers: int, policy: Policy, rngs: nnx.Rngs,
                 spec: attention.Spec = attention.Spec()):
        self.n_heads, self.spec = n_heads, spec
        self.qkv = _dense(d_model, 3 * d_model, policy, rngs)
        self.out = _dense(d_model, d_model, policy, rngs, std=0.02 / math.sqrt(2 * n_layers))

    def __call__(self, x_BTD: jax.Array, structure: dict | None = None) -> jax.Array:
        """`structure`: the batch's segment ids or prefix (protocol.stream), if any."""
        B, T, D = x_BTD.shape
        q_BTHK, k_BTHK, v_BTHK = jnp.split(self.qkv(x_BTD).reshape(B, T, 3 * self.n_heads, -1), 3, axis=2)
        structure = structure or {}
        if "kv" in structure:  # decoding (protocol.decode_stack): the cache's keys, the updated cache passed on
            structure["kv"], mask = protocol.cached_kv(structure["kv"], k_BTHK, v_BTHK, structure["positions"])
            k_BTHK, v_BTHK = structure["kv"]["k"], structure["kv"]["v"]
        else:
            mask = attention.of_structure(structure, T)
        return self.out(attention.attend(q_BTHK, k_BTHK, v_BTHK, mask, self.spec).reshape(B, T, D))


class MLP(nnx.Module):
    def __init__(self, d_model: int, d_ff: int, n_layers: int, policy: Policy, rngs: nnx.Rngs):
        self.up = _dense(d_model, d_ff, policy, rngs)
        self.down = _dense(d_ff, d_model, policy, rngs, std=0.02 / math.sqrt(2 * n_layers))

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        return self.down(jax.nn.gelu(self.up(x_BTD)))


class Block(nnx.Module):
    """One pre-norm transformer block: the unit a ZeRO-3 schedule gathers at a time."""

    def __init__(self, d_model, n_heads, d_ff, n_layers, policy: Policy, rngs: nnx.Rngs, eps: float = 1e-5,
                 spec: attention.Spec = attention.Spec()):
        self.ln1 = _norm(d_model, policy, rngs, eps)
        self.attn = Attention(d_model, n_heads, n_layers, policy, rngs, spec)
        self.ln2 = _norm(d_model, policy, rngs, eps)
        self.mlp = MLP(d_model, d_ff, n_layers, policy, rngs)

    def __call__(self, x):
        x_BTD, structure = protocol.unstream(x)
        x_BTD = x_BTD + self.attn(self.ln1(x_BTD), structure)
        return protocol.stream(x_BTD + self.mlp(self.ln2(x_BTD)), structure)


class Head(nnx.Module):
    """Last unit: final norm and the LM head (or the tied token embedding)."""

    def __init__(self, d_model: int, vocab_size: int, tie: bool, policy: Policy, rngs: nnx.Rngs, eps: float = 1e-5):
        self.ln_f = _norm(d_model, policy, rngs, eps)
        self.lm_head = None if tie else _dense(d_model, vocab_size, policy, rngs, bias=False)

    def __call__(self, x_BTD: jax.Array, embed: Embedding) -> jax.Array:
        x_BTD = self.ln_f(x_BTD)
        logits_BTV = embed.wte.attend(x_BTD) if self.lm_head is None else self.lm_head(x_BTD)
        return logits_BTV.astype(jnp.float32)


class GPT(nnx.Module):
    STACKED = ("blocks",)  # units whose parameters carry a leading layer axis

    def __init__(self, *, vocab_size: int, d_model: int, n_layers: int, n_heads: int, d_ff: int,
                 seq_len: int, tie_embeddings: bool = True, norm_eps: float = 1e-5, policy: Policy = Policy(),
                 rngs: nnx.Rngs, spec: attention.Spec = attention.Spec(), loss_chunk: int = 1024):
        self.loss_chunk = loss_chunk  # tokens whose logits the loss holds at once (model.loss_chunk)
        self.embed = Embedding(vocab_size, d_model, seq_len, policy, rngs)

        @nnx.split_rngs(splits=n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs: nnx.Rngs) -> Block:
            return Block(d_model, n_heads, d_ff, n_layers, policy, rngs, norm_eps, spec)

        self.blocks = make_blocks(rngs)  # every leaf has a leading layer axis [L, ...]
        self.head = Head(d_model, vocab_size, tie_embeddings, policy, rngs, norm_eps)

    def enter(self, batch):
        fields = protocol.text(batch)
        return protocol.stream(self.embed(fields.inputs, fields.positions), fields.structure())

    def exit(self, x, batch):
        head = lambda h_BTD: self.head(h_BTD, self.embed)
        return protocol.chunked_text_loss(head, protocol.unstream(x)[0], protocol.text(batch), self.loss_chunk)

    def logits(self, tokens_BT: jax.Array) -> jax.Array:
        """[B, T, V] fp32 logits on one device (sampling, checks)."""
        x_BTD = self.embed(tokens_BT)
        return self.head(protocol.apply_stack(self.blocks, x_BTD), self.embed)

    def decode(self, tokens_BT: jax.Array, positions_BT: jax.Array, cache):
        """Generation on one device: (logits of new tokens at `positions_BT` (< model.seq_len,
        the learned positions), the updated key/value cache), as Llama's `decode`."""
        x = protocol.stream(self.embed(tokens_BT, positions_BT), {"positions": positions_BT})
        x, cache = protocol.decode_stack(self.blocks, x, cache)
        return self.head(protocol.unstream(x)[0], self.embed), cache

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (PaLM appendix B): 6 per parameter plus attention's 12·L·T·D."""
        n_params = sum(x.size for x in jax.tree.leaves(nnx.state(self, nnx.Param)))
        n_layers, d_model = self.blocks.ln1.scale.shape
        return palm_flops_per_token(n_params, n_layers, seq_len, d_model)


def build(*, cfg, policy: Policy, rngs: nnx.Rngs) -> GPT:
    """The `model.family=gpt` factory."""
    tie = TIED_BY_DEFAULT if cfg.tie_embeddings is None else cfg.tie_embeddings
    return GPT(vocab_size=cfg.vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
               d_ff=cfg.d_ff, seq_len=cfg.seq_len, tie_embeddings=tie, norm_eps=cfg.norm_eps, policy=policy,
               rngs=rngs, spec=attention.spec_of(cfg), loss_chunk=cfg.loss_chunk)


def check_config(cfg) -> None:
    """GPT's rules on a ModelConfig: one key/value head per query head, of width d_model / n_heads."""
    if cfg.head_dim not in (0, cfg.d_model // cfg.n_heads):
        raise ConfigError(f"model.head_dim={cfg.head_dim}: gpt's heads are model.d_model / model.n_heads = "
                          f"{cfg.d_model // cfg.n_heads} wide (leave model.head_dim=0, or use model.family=gemma)")
    if cfg.n_kv_heads not in (0, cfg.n_heads):
        raise ConfigError(f"model.n_kv_heads={cfg.n_kv_heads}: grouped-query attention is llama's; gpt has one "
                          "key/value head per query head (leave model.n_kv_heads=0, or use model.family=llama)")


# ---------------------------------------------------------------------------------------------
# Hugging Face: GPT2LMHeadModel.

HF_KEYS = {"vocab_size": "vocab_size", "d_model": "n_embd", "n_layers": "n_layer", "n_heads": "n_head",
           "d_ff": "n_inner", "norm_eps": "layer_norm_epsilon", "tie_embeddings": "tie_word_embeddings"}


def from_hf_config(hf: dict, where: str) -> dict:
    """The model.* keys of a GPT2LMHeadModel config.json (`where`: its path, for errors); the
    context is the position table's length, n_positions."""
    if (hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh")
            or hf.get("scale_attn_by_inverse_layer_idx") or hf.get("reorder_and_upcast_attn")):
        raise ConfigError(f"{where}: only GPT-2's own attention and gelu_new (tanh) MLP are supported")
    optional = ("d_ff", "tie_embeddings")  # n_inner=null is 4 * n_embd, as in transformers
    require(hf, where, "gpt", [hf_key for key, hf_key in HF_KEYS.items() if key not in optional] + ["n_positions"])
    out = {key: hf.get(hf_key, TIED_BY_DEFAULT if key == "tie_embeddings" else None) for key, hf_key in HF_KEYS.items()}
    if out["d_ff"] is None:
        out["d_ff"] = 4 * hf["n_embd"]
    return {**out, "seq_len": hf["n_positions"]}


def to_hf_config(model: dict) -> dict:
    """config.json's keys for a run's model section."""
    tie = TIED_BY_DEFAULT if model["tie_embeddings"] is None else model["tie_embeddings"]
    return {**{HF_KEYS[k]: model[k] for k in HF_KEYS if k != "tie_embeddings"}, "tie_word_embeddings": tie,
            "model_type": "gpt2", "n_positions": model["seq_len"], "activation_function": "gelu_new",
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": None, "eos_token_id": None}


LAYER = "transformer.h.{i}."
HF_TENSORS = {  # GPT-2's Conv1D weights are stored [in, out], as zerojax's kernels
    "embed/wte/embedding": Tensor("transformer.wte.weight"),
    "embed/wpe": Tensor("transformer.wpe.weight", may_be_longer=True),  # n_positions may exceed model.seq_len
    "head/ln_f/scale": Tensor("transformer.ln_f.weight"),
    "head/ln_f/bias": Tensor("transformer.ln_f.bias"),
    "head/lm_head/kernel": Tensor("lm_head.weight", True),
    **{f"blocks/{ours}/{k}": Tensor(LAYER + f"{theirs}.{'weight' if k in ('scale', 'kernel') else 'bias'}")
       for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2"), ("attn/qkv", "attn.c_attn"),
                            ("attn/out", "attn.c_proj"), ("mlp/up", "mlp.c_fc"), ("mlp/down", "mlp.c_proj"))
       for k in (("scale", "bias") if ours.startswith("ln") else ("kernel", "bias"))},
}
# fan_in_fan_out: PEFT adapts Conv1D, whose weight is [in, out]; the hub's original GPT-2 files
# name their tensors without `transformer.`.
HF = HfLayout(architectures=("GPT2LMHeadModel",), from_hf_config=from_hf_config, to_hf_config=to_hf_config,
              tensors=HF_TENSORS, fan_in_fan_out=True, optional_prefix="transformer.")

FAMILY = Family(kind=LANGUAGE_MODEL, build=build, check_config=check_config, hf=HF)
