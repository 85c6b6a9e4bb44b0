"""The next-token loss of a linear LM head, in blocks of tokens and of the vocabulary.

`linear_nll_sum(h_ND, w, targets_N, keep_N, ...)` is Σ keep · (logsumexp(h·W) - (h·W)[target])
without ever holding more than one [C, Vb] block of logits, and, unlike differentiating a scan
over token chunks (`protocol.chunked_text_loss`), without a whole-vocabulary temporary either:
its custom VJP walks the vocabulary in blocks, each block's weight gradient made whole from every
token chunk and handed out, the hidden states' gradient accumulated over the blocks (as
levanter's blockwise cross-entropy and Liger's fused linear cross-entropy do).

Why the blocks of the vocabulary: at Llama-3-8B's 128,256 x 4,096 head a whole-vocabulary
temporary is 2.1 GB in fp32; XLA's CPU backend computes bf16 matmuls in fp32, so differentiating
the token scan held two fp32 copies of the head, its fp32 gradient and a bf16 accumulator beside
the gathered head. Here the head enters the loops as its bits (uint16, as
`schedules.storage.as_bits` does for stacks) and is converted one [D, Vb] block at a time.

Shapes: N tokens (padded to a multiple of C, the token chunk), D hidden, V vocabulary, Vb a
vocabulary block; `w` is [D, V] (an untied head's kernel) or [V, D] (a tied embedding,
`vocab_dim=0`).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp


def _bits(x):
    narrow = x.dtype.itemsize == 2 and jnp.issubdtype(x.dtype, jnp.floating)
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if narrow else x


def _unbits(x, dtype):
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x


def vocab_blocks(V: int, block: int) -> int:
    """The fewest blocks of at most `block` entries that split V evenly (V itself if none does)."""
    return next((n for n in range(-(-V // block), V + 1) if V % n == 0), 1)


def _block(w_bits, b, n_blocks: int, vocab_dim: int, dtype):
    """Block b of the vocabulary as [D, Vb] in `dtype`, from the head's bits."""
    V = w_bits.shape[vocab_dim]
    Vb = V // n_blocks
    w_b = jax.lax.dynamic_slice_in_dim(w_bits, b * Vb, Vb, axis=vocab_dim)
    w_b = _unbits(w_b, dtype)
    return w_b.T if vocab_dim == 0 else w_b


def _logits(h_CD, w_DV):
    return jnp.dot(h_CD, w_DV, preferred_element_type=jnp.float32)


def _forward(h_ND, w, targets_N, n_blocks, chunk, vocab_dim):
    """(logsumexp [N], target logit [N]) over the vocabulary, block by block."""
    N, D = h_ND.shape
    Vb = w.shape[vocab_dim] // n_blocks
    h_bits, w_bits = _bits(h_ND).reshape(N // chunk, chunk, D), _bits(w)
    t_NC = targets_N.reshape(N // chunk, chunk)

    def per_block(carry, b):
        w_DV = _block(w_bits, b, n_blocks, vocab_dim, w.dtype)

        def per_chunk(_, xs):
            hb, t_C, m_C, s_C, tl_C = xs
            z_CV = _logits(_unbits(hb, h_ND.dtype), w_DV)
            m_new = jnp.maximum(m_C, z_CV.max(-1))
            s_new = s_C * jnp.exp(m_C - m_new) + jnp.exp(z_CV - m_new[:, None]).sum(-1)
            local = t_C - b * Vb
            inside = (local >= 0) & (local < Vb)
            picked = jnp.take_along_axis(z_CV, jnp.clip(local, 0, Vb - 1)[:, None], axis=-1)[:, 0]
            return None, (m_new, s_new, jnp.where(inside, picked, tl_C))

        _, carry = jax.lax.scan(per_chunk, None, (h_bits, t_NC, *carry))
        return carry, None

    start = jnp.full(t_NC.shape, -jnp.inf, jnp.float32), jnp.zeros(t_NC.shape, jnp.float32)
    (m, s, tl), _ = jax.lax.scan(per_block, (*start, jnp.zeros(t_NC.shape, jnp.float32)), jnp.arange(n_blocks))
    return (m + jnp.log(s)).reshape(N), tl.reshape(N)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def linear_nll_sum(h_ND, w, targets_N, keep_N, n_blocks: int, chunk: int, vocab_dim: int):
    """Σ_n keep_n · nll_n of the logits h·W (fp32), N a multiple of `chunk`, V of `n_blocks`."""
    lse_N, target_N = _forward(h_ND, w, targets_N, n_blocks, chunk, vocab_dim)
    return ((lse_N - target_N) * keep_N).sum()


def _fwd(h_ND, w, targets_N, keep_N, n_blocks, chunk, vocab_dim):
    lse_N, target_N = _forward(h_ND, w, targets_N, n_blocks, chunk, vocab_dim)
    return ((lse_N - target_N) * keep_N).sum(), (h_ND, w, targets_N, keep_N, lse_N)


def _bwd(n_blocks, chunk, vocab_dim, res, g):
    """d/dz = g·keep·(softmax(z) - onehot(target)), block by block: each block's weight gradient
    from every token chunk; the hidden states' gradient summed over the blocks (fp32)."""
    h_ND, w, targets_N, keep_N, lse_N = res
    N, D = h_ND.shape
    Vb = w.shape[vocab_dim] // n_blocks
    h_bits, w_bits = _bits(h_ND).reshape(N // chunk, chunk, D), _bits(w)
    rows = [x.reshape(N // chunk, chunk) for x in (targets_N, keep_N.astype(jnp.float32) * g, lse_N)]

    def per_block(carry, b):
        dh_NCD, dw_bits = carry
        w_DV = _block(w_bits, b, n_blocks, vocab_dim, w.dtype)

        def per_chunk(dw_DV, xs):
            hb, t_C, gk_C, lse_C, dh_CD = xs
            h_CD = _unbits(hb, h_ND.dtype)
            p_CV = jnp.exp(_logits(h_CD, w_DV) - lse_C[:, None])
            onehot_CV = (t_C - b * Vb)[:, None] == jnp.arange(Vb)[None, :]
            d_CV = gk_C[:, None] * (p_CV - onehot_CV)
            dh_CD = dh_CD + jnp.dot(d_CV.astype(w.dtype), w_DV.T, preferred_element_type=jnp.float32)
            return dw_DV + jnp.dot(h_CD.T, d_CV.astype(h_CD.dtype), preferred_element_type=jnp.float32), dh_CD

        dw_DV, dh_NCD = jax.lax.scan(per_chunk, jnp.zeros((D, Vb), jnp.float32), (h_bits, *rows, dh_NCD))
        block = _bits((dw_DV.T if vocab_dim == 0 else dw_DV).astype(w.dtype))
        return (dh_NCD, jax.lax.dynamic_update_slice_in_dim(dw_bits, block, b * Vb, axis=vocab_dim)), None

    # The gradients' buffers are made from g: a constant zeros buffer (a scan's stacked output,
    # too) is made by XLA's CPU scheduler at the start of the step and held through the forward.
    zero = g.astype(jnp.float32) * 0.0
    dw_bits = _bits(jnp.zeros(w.shape, w.dtype) + zero.astype(w.dtype))
    start = (jnp.zeros((N // chunk, chunk, D), jnp.float32) + zero, dw_bits)
    (dh_NCD, dw_bits), _ = jax.lax.scan(per_block, start, jnp.arange(n_blocks))
    dw = _unbits(dw_bits, w.dtype)
    return dh_NCD.reshape(N, D).astype(h_ND.dtype), dw, None, None


linear_nll_sum.defvjp(_fwd, _bwd)


VOCAB_BLOCK = 8192  # the most vocabulary entries whose logits (and weight block) a step holds


def linear_text_loss(h_BTD, w, fields, chunk: int, vocab_dim: int = 1):
    """`protocol.text_loss` of the logits h·W (fp32; W [D, V], or [V, D] with vocab_dim=0) in
    blocks: `chunk` tokens by at most VOCAB_BLOCK vocabulary entries. Returns the mean over every
    target, or (mean over the unmasked targets, their number) with a loss mask."""
    B, T, D = h_BTD.shape
    N = B * T
    chunk = min(chunk, N)
    pad = -(-N // chunk) * chunk - N
    keep_N = (jnp.ones((N,), jnp.float32) if fields.loss_mask is None
              else fields.loss_mask.reshape(N).astype(jnp.float32))
    h_ND = jnp.pad(h_BTD.reshape(N, D), ((0, pad), (0, 0)))
    t_N, k_N = jnp.pad(fields.targets.reshape(N), (0, pad)), jnp.pad(keep_N, (0, pad))
    n_blocks = vocab_blocks(w.shape[vocab_dim], VOCAB_BLOCK)
    total = linear_nll_sum(h_ND, w, t_N, k_N, n_blocks, chunk, vocab_dim)
    if fields.loss_mask is None:
        return total / N
    count = keep_N.sum()
    return total / jnp.maximum(count, 1.0), count
