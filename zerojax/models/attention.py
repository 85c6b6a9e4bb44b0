"""One attention for every family, the mask given as data (`Mask`: per-token descriptors), and
three ways to compute it (`model.attention`):

    naive      the dense reference: [B, H, T, S] fp32 scores and their softmax (zerojax's first code)
    blockwise  flash-style, in pure JAX: an online softmax over key blocks of `model.attention_block`
               keys, and a custom VJP whose backward recomputes each block's probabilities from the
               saved row maxima and sums (Dao et al. 2022, FlashAttention, Algorithms 1 and 2).
               Temporaries are O(T · block) per head, not O(T · S); blocks need not divide S
    cudnn      jax.nn.dot_product_attention(implementation="cudnn") for the masks it takes (causal,
               or none) in bf16/fp16; any other mask or dtype as `auto`. GPU only
    auto       cudnn on a GPU where it applies, else blockwise; up to DENSE_KEYS keys, the dense
               code (naive's): on the CPU it is the fastest there, and its [T, S] scores are a few
               blocks' worth

Pure JAX matters for blockwise: the CPU-compiled peaks that `zerojax analyze` and `plan` read are
the ones a GPU would see.

The mask. Query i attends key j iff both are real (`valid`), they share a segment (`segment`:
packing), and group[j] <= group[i] (`group`: the cumulative autoregressive flag of big_vision's
and LeRobot's make_att_2d_masks). Every family's mask is one of these:

    causal      group = position                                   (gpt, llama, gemma)
    prefix-LM   group = start of its prefix run on the prefix, else its position (PaliGemma)
    blocks      group = cumsum(ar), valid = padding               (π0's prefix, state, actions)
    decoding    query group = its position, key group = the slot  (a key/value cache)
    none        mask=None: everyone sees everyone                 (SigLIP)

Shapes: B batch, T queries, S keys, H query heads, G key/value heads (head h reads h // (H/G)),
R = H/G, K head dim, C keys per block, N blocks.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from zerojax.errors import ConfigError

IMPLS = ("auto", "blockwise", "cudnn", "naive")  # model.attention
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)  # cuDNN's fused attention takes half precision only
DENSE_KEYS = 512  # model.attention=auto computes up to this many keys densely
NEG = jnp.finfo(jnp.float32).min  # a masked score (a row with no key left averages every key, as naive's softmax)


@dataclasses.dataclass(frozen=True)
class Spec:
    """How a model computes attention: `impl` one of IMPLS, `block` keys per block (blockwise)."""

    impl: str = "auto"
    block: int = 128


def spec_of(cfg) -> Spec:
    """The Spec of a ModelConfig (model.attention, model.attention_block); cudnn is refused on a
    backend without it."""
    if cfg.attention == "cudnn" and jax.default_backend() != "gpu":
        raise ConfigError(f"model.attention=cudnn needs a GPU (cuDNN), and this backend is {jax.default_backend()}; "
                          "use model.attention=auto or blockwise")
    return Spec(cfg.attention, cfg.attention_block)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["q_group", "k_group", "q_segment", "k_segment",
                                                                   "q_valid", "k_valid"], meta_fields=["kind"])
@dataclasses.dataclass(frozen=True)
class Mask:
    """Per-token descriptors, each [B or 1, T] (queries) or [B or 1, S] (keys); None: all real,
    one segment. `kind` is "causal" when the mask is exactly group = position (cuDNN's is_causal)."""

    q_group: jax.Array
    k_group: jax.Array
    q_segment: jax.Array | None = None
    k_segment: jax.Array | None = None
    q_valid: jax.Array | None = None
    k_valid: jax.Array | None = None
    kind: str = "general"


def causal(T: int) -> Mask:
    t = jnp.arange(T, dtype=jnp.int32)[None]
    return Mask(t, t, kind="causal")


def of_structure(structure: dict, T: int) -> Mask:
    """A language batch's mask (protocol.STRUCTURE): causal, never across segments, and both ways
    inside a prefix. A prefix is a run of tokens (PaliGemma's, one per segment when packed); two
    prefix runs of one segment do not see each other's later tokens."""
    if "prefix" not in structure and "segment_ids" not in structure:
        return causal(T)
    t = jnp.arange(T, dtype=jnp.int32)[None]
    group = t
    if "prefix" in structure:
        p_BT = structure["prefix"].astype(bool)
        starts = p_BT & ~jnp.pad(p_BT, ((0, 0), (1, 0)))[:, :-1]
        run_start = jax.lax.cummax(jnp.where(starts, t, 0), axis=1)
        group = jnp.where(p_BT, run_start, t)
    seg = structure.get("segment_ids")
    return Mask(group, group, seg, seg)


def cached(positions_BT: jax.Array, S: int) -> Mask:
    """Decoding: a new token at position p sees the cache's slots 0..p."""
    return Mask(positions_BT.astype(jnp.int32), jnp.arange(S, dtype=jnp.int32)[None])


def blocks(pad_BL: jax.Array, ar_BL: jax.Array) -> Mask:
    """big_vision's and LeRobot's make_att_2d_masks as descriptors."""
    cum_BL = jnp.cumsum(ar_BL.astype(jnp.int32), axis=1)
    pad_BL = pad_BL.astype(bool)
    return Mask(cum_BL, cum_BL, q_valid=pad_BL, k_valid=pad_BL)


def _allowed(qg, kg, qs, ks, qv, kv):
    """bool [B or 1, T, C] from descriptors [., T] and [., C]."""
    ok = kg[:, None, :] <= qg[:, :, None]
    if qs is not None:
        ok = ok & (qs[:, :, None] == ks[:, None, :])
    if qv is not None:
        ok = ok & qv[:, :, None]
    if kv is not None:
        ok = ok & kv[:, None, :]
    return ok


def dense(mask: Mask) -> jax.Array:
    """The whole mask, bool [B or 1, T, S] (the naive path, tests)."""
    return _allowed(mask.q_group, mask.k_group, mask.q_segment, mask.k_segment, mask.q_valid, mask.k_valid)


def attend(q_BTHK: jax.Array, k_BSGK: jax.Array, v_BSGK: jax.Array, mask: Mask | None, spec: Spec = Spec()):
    """softmax(q·k / sqrt(K) where the mask allows) · v, softmax in fp32: [B, T, H, K] in v's dtype."""
    impl, S = spec.impl, k_BSGK.shape[1]
    if impl in ("auto", "cudnn") and _cudnn_applies(q_BTHK, mask) and (impl == "cudnn" or S > DENSE_KEYS):
        return jax.nn.dot_product_attention(q_BTHK, k_BSGK, v_BSGK, is_causal=mask is not None,
                                            implementation="cudnn").astype(v_BSGK.dtype)
    if impl == "naive" or (impl != "blockwise" and S <= DENSE_KEYS):
        return naive(q_BTHK, k_BSGK, v_BSGK, mask)
    if mask is None:
        zeros = jnp.zeros((1, q_BTHK.shape[1]), jnp.int32)
        mask = Mask(zeros, jnp.zeros((1, S), jnp.int32))
    return _flash(q_BTHK, k_BSGK, v_BSGK, mask, spec.block)


def _cudnn_applies(q, mask) -> bool:
    return (jax.default_backend() == "gpu" and q.dtype in CUDNN_DTYPES
            and (mask is None or mask.kind == "causal"))


def naive(q_BTHK, k_BSGK, v_BSGK, mask: Mask | None):
    """The dense reference: [B, G, R, T, S] scores in fp32, as the families computed them first."""
    B, T, H, K = q_BTHK.shape
    G = k_BSGK.shape[2]
    q_BTGRK = q_BTHK.reshape(B, T, G, H // G, K)
    scores = jnp.einsum("btgrk,bsgk->bgrts", q_BTGRK, k_BSGK).astype(jnp.float32) / jnp.sqrt(jnp.float32(K))
    if mask is not None:
        scores = jnp.where(dense(mask)[:, None, None], scores, NEG)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BSGK.dtype)
    return jnp.einsum("bgrts,bsgk->btgrk", probs, v_BSGK).reshape(B, T, H, K)


# ---------------------------------------------------------------------------------------------
# blockwise: keys in N blocks of C (the last padded), a scan over them.


def _key_blocks(x_BS, C: int, fill=0):
    """[B, S, ...] -> [N, B, C, ...], S padded up to N·C with `fill`."""
    B, S = x_BS.shape[:2]
    N = -(-S // C)
    pad = [(0, 0), (0, N * C - S)] + [(0, 0)] * (x_BS.ndim - 2)
    x = jnp.pad(x_BS, pad, constant_values=fill).reshape(B, N, C, *x_BS.shape[2:])
    return jnp.moveaxis(x, 1, 0)


def _blocked(k, v, mask: Mask, C: int):
    """The scan's inputs: keys, values, key descriptors and which keys are real, per block."""
    S = k.shape[1]
    B = max(k.shape[0], *(d.shape[0] for d in (mask.k_group, mask.k_segment, mask.k_valid) if d is not None))
    desc = lambda d: None if d is None else _key_blocks(jnp.broadcast_to(d, (B, S)), C)
    real = _key_blocks(jnp.ones((1, S), bool), C, fill=False)
    return (_key_blocks(k, C), _key_blocks(v, C), desc(mask.k_group), desc(mask.k_segment), desc(mask.k_valid), real)


def _block_scores(q5, block, mask: Mask, K: int):
    """Scores of every query against one key block (`_blocked`'s), masked: fp32 [B, G, R, T, C],
    and where the mask allows, bool [B or 1, 1, 1, T, C]."""
    k_c, _, kg, ks, kv, real = block
    s = jnp.einsum("btgrk,bcgk->bgrtc", q5, k_c, preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(K))
    ok = _allowed(mask.q_group, kg, mask.q_segment, ks, mask.q_valid, kv)
    ok = ok[:, None, None]
    s = jnp.where(ok, s, NEG)
    return jnp.where(real[:, None, None], s, -jnp.inf), ok  # block padding: no weight, even in a row with no key left


def _whole(step):
    """A scan body that differentiation does not split: when an outer scan (a stack's layers) is
    linearized, JAX would move the mask's integer work (known early) into a scan of its own and
    keep its [N, B, G, R, T, C] results for the rest, quadratic in T again; under
    jax.checkpoint the body is recomputed whole."""
    return jax.checkpoint(step, policy=jax.checkpoint_policies.nothing_saveable)


def _forward(q, k, v, mask: Mask, C: int):
    """(out [B, T, H, K], row maxima m and sums l [B, G, R, T])."""
    B, T, H, K = q.shape
    G = k.shape[2]
    q5 = q.reshape(B, T, G, H // G, K)

    def step(carry, xs):
        m, l, acc = carry
        s, _ = _block_scores(q5, xs, mask, K)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        corr = jnp.exp(m - m_new)
        pv = jnp.einsum("bgrtc,bcgk->bgrtk", p.astype(v.dtype), xs[1], preferred_element_type=jnp.float32)
        return (m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv), None

    init = (jnp.full((B, G, H // G, T), -jnp.inf, jnp.float32), jnp.zeros((B, G, H // G, T), jnp.float32),
            jnp.zeros((B, G, H // G, T, K), jnp.float32))
    (m, l, acc), _ = jax.lax.scan(_whole(step), init, _blocked(k, v, mask, C))
    out = jnp.einsum("bgrtk->btgrk", acc / l[..., None]).reshape(B, T, H, K).astype(v.dtype)
    return out, m, l


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, mask: Mask, C: int):
    return _forward(q, k, v, mask, C)[0]


def _flash_fwd(q, k, v, mask, C):
    out, m, l = _forward(q, k, v, mask, C)
    return out, (q, k, v, mask, out, m, l)


def _flash_bwd(C, res, d_out):
    """FlashAttention's backward: per key block, p recomputed from the saved m and l; dS = p·(dP - D)
    with D the rows' sum of dO·O (zero where masked: naive's `where` passes no gradient there, which
    matters in a row with no key left); dQ accumulated over blocks, dK and dV one block each."""
    q, k, v, mask, out, m, l = res
    B, T, H, K = q.shape
    S, G = k.shape[1], k.shape[2]
    R = H // G
    q5 = q.reshape(B, T, G, R, K)
    do5 = jnp.einsum("btgrk->bgrtk", d_out.reshape(B, T, G, R, K).astype(jnp.float32))
    D = jnp.einsum("bgrtk,btgrk->bgrt", do5, out.reshape(B, T, G, R, K).astype(jnp.float32))

    def step(dq, xs):
        s, ok = _block_scores(q5, xs, mask, K)
        p = jnp.exp(s - m[..., None]) / l[..., None]
        dv_c = jnp.einsum("bgrtc,bgrtk->bcgk", p, do5)
        dp = jnp.einsum("bgrtk,bcgk->bgrtc", do5, xs[1], preferred_element_type=jnp.float32)
        ds = jnp.where(ok, p * (dp - D[..., None]), 0.0) / jnp.sqrt(jnp.float32(K))  # masked scores are constants
        dq = dq + jnp.einsum("bgrtc,bcgk->btgrk", ds, xs[0], preferred_element_type=jnp.float32)
        dk_c = jnp.einsum("bgrtc,btgrk->bcgk", ds, q5, preferred_element_type=jnp.float32)
        return dq, (dk_c, dv_c)

    dq, (dk, dv) = jax.lax.scan(_whole(step), jnp.zeros((B, T, G, R, K), jnp.float32), _blocked(k, v, mask, C))
    unblock = lambda x: jnp.moveaxis(x, 0, 1).reshape(B, -1, G, K)[:, :S]
    return dq.reshape(B, T, H, K).astype(q.dtype), unblock(dk).astype(k.dtype), unblock(dv).astype(v.dtype), None


_flash.defvjp(_flash_fwd, _flash_bwd)
