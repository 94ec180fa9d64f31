"""INT4 and block-FP8 weights that stay quantised in device memory, and the one einsum that consumes them.

`Int4Array` holds 4-bit values packed two per byte (uint8) and per-group scales along the weight's *input* axis
(axis -2 of our [..., in, out] layout; compressed-tensors groups along `in` of PyTorch's [out, in]). Dequantisation
happens inside `einsum`, per call, on whatever slice the caller passes (one layer, a few experts), never for the
whole stack.

Why uint8 pairs rather than `jnp.int4`: measured on XLA's CPU backend, a `lax.scan` over a stacked `jnp.int4`
weight widens the WHOLE stack to s8 before the loop (a full 1-byte-per-value copy: +142 GB per device for Kimi-K2.5's
experts). Packed uint8 costs exactly 4 bits per value on every backend and unpacks with two fused bit operations.

`Fp8Array` holds DeepSeek-V3's block-FP8 weights as the checkpoint stores them: float8_e4m3fn values (the same bytes,
in our layout) and one float32 scale per block. Blocks are declared per trailing axis, in our layout: a PyTorch
[out, in] weight in 128 x 128 blocks is [in, out] here with blocks (128, 128); a weight split per head (q_b, kv_b, o)
gets the largest block per axis that never straddles one of the checkpoint's blocks (`head_block`). Dequantisation
is DeepSeek's `weight_dequant`: float32(value) * scale, rounded once to the compute dtype, inside `einsum`, per call.
"""

from __future__ import annotations

import math

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


FP8 = jnp.float8_e4m3fn


@struct.dataclass
class Fp8Array:
    """values: float8_e4m3fn [..., *dims]; scale: float32 [..., *ceil(dims / blocks)] (`blocks` per trailing axis,
    leading axes unblocked); w = float32(values) * scale of its block."""

    values: jax.Array
    scale: jax.Array
    blocks: tuple[int, ...] = struct.field(pytree_node=False, default=())

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def ndim(self) -> int:
        return len(self.values.shape)

    @property
    def dtype(self) -> jnp.dtype:
        return self.values.dtype

    def dequantize(self, dtype: jnp.dtype = jnp.bfloat16) -> jax.Array:
        """float32(values) * block scale, rounded once to `dtype`."""
        scale = self.scale.astype(jnp.float32)
        for axis, b in enumerate(self.blocks, start=self.ndim - len(self.blocks)):
            if b > 1:
                scale = jax.lax.slice_in_dim(jnp.repeat(scale, b, axis=axis), 0, self.shape[axis], axis=axis)
        return (self.values.astype(jnp.float32) * scale).astype(dtype)

    def __getitem__(self, idx) -> Fp8Array:
        """`...` (the whole array, as `nnx.Param[...]` reads it) or an index into the leading (unblocked) axis."""
        if idx is Ellipsis:
            return self
        if self.ndim <= len(self.blocks):
            raise ValueError(f"Fp8Array: shape {self.shape} has no unblocked leading axis to index")
        return Fp8Array(self.values[idx], self.scale[idx], self.blocks)


def quantize_fp8(w: jax.Array | np.ndarray, blocks: tuple[int, ...]) -> Fp8Array:
    """Block-FP8 quantisation of `w` (blocks per trailing axis): scale = block max|w| / 448 (e4m3's largest finite
    value, so nothing clips), values = e4m3(w / scale). An all-zero block gets scale 1."""
    w = jnp.asarray(w, jnp.float32)
    lead = w.ndim - len(blocks)
    amax = jnp.abs(w)
    for axis, b in enumerate(blocks, start=lead):  # max over each block: pad the axis to whole blocks, fold it
        pad = [(0, 0)] * amax.ndim
        pad[axis] = (0, -amax.shape[axis] % b)
        amax = jnp.pad(amax, pad)
        amax = amax.reshape(*amax.shape[:axis], -1, b, *amax.shape[axis + 1 :]).max(axis=axis + 1)
    scale = jnp.where(amax == 0, 1.0, amax / float(jnp.finfo(FP8).max))
    expanded = Fp8Array(jnp.ones(w.shape, FP8), scale, tuple(blocks)).dequantize(jnp.float32)
    return Fp8Array((w / expanded).astype(FP8), scale, tuple(blocks))


def head_block(block: int, period: int, offset: int) -> int:
    """The block of a per-head axis of our layout whose elements sit at checkpoint rows `h * period + offset + i`:
    the largest size that divides `block` (so a run never crosses one of the checkpoint's blocks) and the rows'
    spacing."""
    return math.gcd(block, period, offset)


Weight = jax.Array | Int4Array | Fp8Array


def einsum(spec: str, x: jax.Array, w: Weight, *, dtype: jnp.dtype | None = None) -> jax.Array:
    """`jnp.einsum(spec, x, w)` in x's dtype, where w may be INT4 or FP8 (dequantised here, per call); cast to `dtype`.

    Every matmul of the models goes through here. Operands share x's dtype and the result keeps it: accelerators
    accumulate bf16 dots in fp32 internally, and XLA's CPU runtime rejects bf16 x bf16 -> f32 dots outright.
    """
    if isinstance(w, Int4Array | Fp8Array):
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
