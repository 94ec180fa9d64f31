"""INT4 weights that stay INT4 in device memory, and the one einsum that consumes them.

`Int4Array` holds 4-bit values packed two per byte (uint8) and per-group scales along the weight's *input* axis
(axis -2 of our [..., in, out] layout; compressed-tensors groups along `in` of PyTorch's [out, in]). Dequantisation
happens inside `einsum`, per call, on whatever slice the caller passes (one layer, a few experts), never for the
whole stack.

Why uint8 pairs rather than `jnp.int4`: measured on XLA's CPU backend, a `lax.scan` over a stacked `jnp.int4`
weight widens the WHOLE stack to s8 before the loop (a full 1-byte-per-value copy: +142 GB per device for Kimi-K2.5's
experts). Packed uint8 costs exactly 4 bits per value on every backend and unpacks with two fused bit operations.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

# compressed-tensors stores Kimi's group scales in bf16; a weight means bf16(q * scale) whatever the compute dtype.
SCALE_DTYPE = jnp.bfloat16


def pack_pairs(q):
    """int values in [-8, 7], [..., in, out] -> uint8 [..., in/2, out]: row 2r in the low nibble, 2r+1 in the high."""
    xp = jnp if isinstance(q, jax.Array) else np
    u = (q.astype(xp.int16) + 8).astype(xp.uint8)
    return u[..., 0::2, :] | (u[..., 1::2, :] << 4)


@struct.dataclass
class Int4Array:
    """packed: uint8 [..., in/2, out]; scale: [..., in/group_size, out];
    w[..., i, o] = q[..., i, o] * scale[..., i//g, o]."""

    packed: jax.Array
    scale: jax.Array
    group_size: int = struct.field(pytree_node=False, default=32)

    @classmethod
    def from_values(cls, q, scale, group_size: int) -> Int4Array:
        """From int values [..., in, out] in [-8, 7] (numpy or jax) and scales [..., in/group_size, out]."""
        if q.shape[-2] % group_size or q.shape[-2] // group_size != scale.shape[-2]:
            raise ValueError(f"Int4Array: values {q.shape} and scales {scale.shape} disagree for group {group_size}")
        return cls(pack_pairs(q), scale, group_size)

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (unpacked) shape."""
        *lead, half, o = self.packed.shape
        return (*lead, 2 * half, o)

    @property
    def ndim(self) -> int:
        return len(self.packed.shape)

    def values(self, dtype: jnp.dtype = jnp.int8) -> jax.Array:
        """The signed 4-bit values [..., in, out] as `dtype`."""
        lo = (self.packed & 0xF).astype(dtype) - 8
        hi = (self.packed >> 4).astype(dtype) - 8
        return jnp.stack([lo, hi], axis=-2).reshape(self.shape)

    def dequantize(self, dtype: jnp.dtype = jnp.bfloat16) -> jax.Array:
        """bf16(q * scale), then `dtype`. A 4-bit q times a bf16 scale is exact in fp32, so computing the product in
        the scale dtype rounds it exactly once, as compressed-tensors' decompression does."""
        *lead, i, o = self.shape
        g = self.group_size
        w = self.values(self.scale.dtype).reshape(*lead, i // g, g, o) * self.scale[..., None, :]
        return w.reshape(*lead, i, o).astype(dtype)

    def __getitem__(self, idx) -> Int4Array:
        """Index leading (non-matrix) axes, e.g. a layer or a gather of experts."""
        return Int4Array(self.packed[idx], self.scale[idx], self.group_size)

    def take(self, indices: jax.Array, axis: int = 0) -> Int4Array:
        if axis < 0 or axis >= self.ndim - 2:
            raise ValueError(f"Int4Array.take: axis {axis} must be a leading axis of shape {self.shape}")
        return Int4Array(jnp.take(self.packed, indices, axis), jnp.take(self.scale, indices, axis), self.group_size)


Weight = jax.Array | Int4Array


def einsum(spec: str, x: jax.Array, w: Weight, *, dtype: jnp.dtype | None = None) -> jax.Array:
    """`jnp.einsum(spec, x, w)` in x's dtype, where w may be INT4 (dequantised here, per call); cast to `dtype`.

    Every matmul of the models goes through here. Operands share x's dtype and the result keeps it: accelerators
    accumulate bf16 dots in fp32 internally, and XLA's CPU runtime rejects bf16 x bf16 -> f32 dots outright.
    """
    if isinstance(w, Int4Array):
        w = w.dequantize(x.dtype)
    out = jnp.einsum(spec, x, w.astype(x.dtype))
    return out if dtype is None else out.astype(dtype)


def matmul(x_MI: jax.Array, w: Weight, *, dtype: jnp.dtype | None = None) -> jax.Array:
    """`x [M, I] @ w [I, O]` in x's dtype (cast to `dtype`); for a 2-D INT4 `w`, without interleaving its nibbles.

    Packed row r holds rows 2r (low nibble) and 2r+1 (high nibble) of W, so x @ W = x[:, 0::2] @ W_lo +
    x[:, 1::2] @ W_hi. Each half is dequantised elementwise on the packed layout, exactly as `dequantize` rounds
    (bf16(q * scale): q * scale is exact in fp32), and the two products are summed in fp32. On XLA:CPU this is ~7x
    faster per expert than dequantize-then-matmul, whose nibble interleave fuses into costly index arithmetic.
    """
    if not isinstance(w, Int4Array) or w.ndim != 2 or w.group_size % 2:
        return einsum("MI,IO->MO", x_MI, w, dtype=dtype)
    scale_HO = jnp.repeat(w.scale.astype(jnp.float32), w.group_size // 2, axis=0)  # group of each packed row

    def half(nibble_HO: jax.Array, x_MH: jax.Array) -> jax.Array:
        w_HO = ((nibble_HO.astype(jnp.float32) - 8) * scale_HO).astype(w.scale.dtype).astype(x_MI.dtype)
        return jnp.matmul(x_MH, w_HO).astype(jnp.float32)

    out = half(w.packed & 0xF, x_MI[:, 0::2]) + half(w.packed >> 4, x_MI[:, 1::2])
    return out.astype(dtype or x_MI.dtype)


def quantize(w: jax.Array | np.ndarray, group_size: int, scale_dtype: jnp.dtype = SCALE_DTYPE) -> Int4Array:
    """Symmetric group quantisation of a [..., in, out] weight: scale = group max|w| / 7 (so +max never clips),
    q = clip(round_half_even(w / scale), -8, 7) against the scale as stored. An all-zero group gets scale 1 (q = 0).
    (compressed-tensors' min-max observer divides by 7.5 instead; both are valid pack-quantized weights.)"""
    w = jnp.asarray(w, jnp.float32)
    *lead, i, o = w.shape
    if i % group_size:
        raise ValueError(f"quantize: input dim {i} is not divisible by group_size {group_size}")
    grouped = w.reshape(*lead, i // group_size, group_size, o)
    scale = jnp.max(jnp.abs(grouped), axis=-2) / 7.0
    scale = jnp.where(scale == 0, 1.0, scale).astype(scale_dtype)
    q = jnp.clip(jnp.round(grouped / scale.astype(jnp.float32)[..., None, :]), -8, 7).reshape(w.shape)
    return Int4Array.from_values(q.astype(jnp.int8), scale, group_size)
