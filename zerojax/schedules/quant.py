"""Block-quantized weight gathers (ZeRO++'s qwZ): `precision.gather=int8 | float8_e4m3fn`.

A unit's flat local buffer x[n] (fp32, packed from its master shards) is cut into b =
ceil(n / zero.quant_block) blocks of one length L = ceil(n / b) <= quant_block (the last block
zero-padded: fewer than b padding elements per unit). Each block is scaled symmetrically by its
own absmax (Dettmers et al. 2022, "8-bit optimizers via block-wise quantization"; ZeRO++,
Wang et al. 2023, arXiv 2306.10209, section 4.1):

    scale = absmax(block) / Q          Q = 127 (int8), 448 (E4M3's largest finite value)
    q     = round(x / scale)           int8: to nearest, |q| <= 127; E4M3: the cast's rounding
    x'    = q · scale                  |x - x'| <= scale / 2 for int8 (half a step)

An all-zero block has scale 0 and comes back as zeros. Each device sends its payload and its
fp32 scales as one int8 buffer, block by block ([b, L + 4]: L payload bytes, then the scale's 4
bytes, bitcast): one `all_gather` per unit, as for an unquantized gather, which every backend
moves as s8, one byte per element. Bytes are bytes: the E4M3 payload travels as its bits, because
XLA's CPU backend would move an fp8-typed all-gather as f16 (two bytes; measured, and checked in
tests/test_quant.py), as NCCL moves fp8 as uint8 too. Right after the gather every device
dequantizes into the compute dtype. Per element gathered: b_g = 1 + 4 / L bytes, DESIGN §2's
formula with b_g = 1 + 4 / quant_block where the units divide into whole blocks.

Only what is gathered is rounded: the fp32 master, the Adam moments and the update stay exact.
The backward is the straight-through estimator ZeRO++ uses: the gradient is taken with respect
to the dequantized weights and reduce-scattered as it is (in `precision.reduce`), as if the
rounding were the identity. The explicit schedule (`fsdp.py`) does this by construction, since
it never differentiates through a gather: each unit's vjp is taken at the gathered weights and
its result reduce-scattered. `all_gather` below carries the same rule as a `custom_vjp` (its
backward is an unquantized gather's: a `psum_scatter` of the cotangent), so code that does
differentiate through a quantized gather gets the same gradient and not round's zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class Format:
    dtype: jnp.dtype  # what a block's values are rounded to
    largest: float  # Q: a block's absmax maps to this


QUANT_FORMATS = {"int8": Format(jnp.dtype(jnp.int8), 127.0),
                 "float8_e4m3fn": Format(jnp.dtype(jnp.float8_e4m3fn), 448.0)}


def is_quantized(dtype) -> bool:
    """Is `dtype` (a policy's gather dtype) one of the block-quantized formats?"""
    return jnp.dtype(dtype).name in QUANT_FORMATS


def blocks(n: int, quant_block: int) -> tuple[int, int]:
    """(count, length) of the blocks a buffer of n elements is cut into: equal lengths, at most
    `quant_block`, so a unit pads fewer elements than it has blocks."""
    count = max(1, math.ceil(n / quant_block))
    return count, max(1, math.ceil(n / count))


def bytes_per_element(quant_block: int, scale_dtype=jnp.float32) -> float:
    """b_g of DESIGN §2 for a quantized gather: one payload byte plus a block's scale bytes."""
    return 1 + jnp.dtype(scale_dtype).itemsize / quant_block


def quantize(x_n: jax.Array, quant_block: int, dtype, scale_dtype=jnp.float32):
    """x[n] -> (q[b, L] in `dtype`, scale[b] in `scale_dtype`), blocks as `blocks` cuts them."""
    fmt = QUANT_FORMATS[jnp.dtype(dtype).name]
    count, length = blocks(x_n.shape[0], quant_block)
    x_bL = jnp.pad(x_n.astype(jnp.float32), (0, count * length - x_n.shape[0])).reshape(count, length)
    scale_b = (jnp.max(jnp.abs(x_bL), axis=1) / fmt.largest).astype(scale_dtype)
    # An all-zero block (scale 0) is divided by 1; a scale rounded to bf16 may be a little
    # small, hence the clip: the block's absmax still maps into the format.
    safe = jnp.where(scale_b > 0, scale_b, 1).astype(jnp.float32)[:, None]
    v_bL = jnp.clip(x_bL / safe, -fmt.largest, fmt.largest)
    q_bL = jnp.round(v_bL) if fmt.dtype == jnp.int8 else v_bL
    return q_bL.astype(fmt.dtype), scale_b


def dequantize(q_bL: jax.Array, scale_b: jax.Array, n: int, dtype) -> jax.Array:
    """(q[..., b, L], scale[..., b]) -> x'[..., n] in `dtype` (leading dims: one per device)."""
    x = q_bL.astype(jnp.float32) * scale_b.astype(jnp.float32)[..., None]
    return x.reshape(*x.shape[:-2], -1)[..., :n].astype(dtype)


def encode(q_bL: jax.Array, scale_b: jax.Array) -> jax.Array:
    """One int8 buffer [b·(L + s)]: each block's payload bytes, then its scale's s bytes."""
    scale_bytes = jax.lax.bitcast_convert_type(scale_b, jnp.int8)  # [b, s] (s = 4 for fp32)
    return jnp.concatenate([jax.lax.bitcast_convert_type(q_bL, jnp.int8), scale_bytes], axis=1).ravel()


def decode(bytes_: jax.Array, count: int, length: int, dtype, scale_dtype=jnp.float32):
    """`encode`'s buffers gathered, [..., b·(L + s)] -> (q[..., b, L], scale[..., b])."""
    rows = bytes_.reshape(*bytes_.shape[:-1], count, -1)
    q = jax.lax.bitcast_convert_type(rows[..., :length], jnp.dtype(dtype))
    return q, jax.lax.bitcast_convert_type(rows[..., length:], jnp.dtype(scale_dtype))


def all_gather(x_n: jax.Array, axis: str, quant_block: int, dtype, out_dtype, scale_dtype=jnp.float32):
    """Inside `shard_map`: every device's x[n], quantized in blocks, gathered as one int8 buffer
    and dequantized: [N, n] in `out_dtype`. Differentiable, straight through (module docstring):
    the gradient with respect to x is fp32."""
    if x_n.shape[0] == 0:  # a unit with nothing sharded: nothing to scale
        return jax.lax.all_gather(x_n.astype(out_dtype), axis)
    dtypes = (jnp.dtype(dtype), jnp.dtype(out_dtype), jnp.dtype(scale_dtype))
    return _all_gather(x_n.astype(jnp.float32), axis, quant_block, *dtypes)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _all_gather(x_n, axis, quant_block, dtype, out_dtype, scale_dtype):
    count, length = blocks(x_n.shape[0], quant_block)
    gathered = jax.lax.all_gather(encode(*quantize(x_n, quant_block, dtype, scale_dtype)), axis)
    return dequantize(*decode(gathered, count, length, dtype, scale_dtype), x_n.shape[0], out_dtype)


def _all_gather_fwd(x_n, axis, quant_block, dtype, out_dtype, scale_dtype):
    return _all_gather(x_n, axis, quant_block, dtype, out_dtype, scale_dtype), None


def _all_gather_bwd(axis, quant_block, dtype, out_dtype, scale_dtype, _, ct_Nn):
    # The transpose of an unquantized all_gather: the rounding counts as the identity.
    return (jax.lax.psum_scatter(ct_Nn.astype(jnp.float32), axis, scatter_dimension=0, tiled=False),)


_all_gather.defvjp(_all_gather_fwd, _all_gather_bwd)
