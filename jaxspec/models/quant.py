"""INT4 weights that stay INT4 in device memory, and the one einsum that consumes them.

`Int4Array` holds jnp.int4 values and per-group scales along the weight's *input* axis (axis -2 of our
[..., in, out] layout; compressed-tensors groups along `in` of PyTorch's [out, in]). Dequantisation happens inside
`einsum`, per call, on whatever slice the caller passes (one layer, a few experts), never for the whole stack.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

# compressed-tensors stores Kimi's group scales in bf16; a weight means bf16(q * scale) whatever the compute dtype.
SCALE_DTYPE = jnp.bfloat16


@struct.dataclass
class Int4Array:
    """q: int4 [..., I, O]; scale: [..., I / group_size, O]. w[..., i, o] = q[..., i, o] * scale[..., i // g, o]."""

    q: jax.Array
    scale: jax.Array
    group_size: int = struct.field(pytree_node=False, default=32)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    @property
    def ndim(self) -> int:
        return len(self.q.shape)

    def dequantize(self, dtype: jnp.dtype = jnp.bfloat16) -> jax.Array:
        """q * scale, exact in fp32, rounded once to the scale dtype (the checkpoint's meaning), then to `dtype`."""
        *lead, i, o = self.q.shape
        g = self.group_size
        w = self.q.astype(jnp.float32).reshape(*lead, i // g, g, o) * self.scale.astype(jnp.float32)[..., None, :]
        return w.reshape(*lead, i, o).astype(self.scale.dtype).astype(dtype)

    def __getitem__(self, idx) -> Int4Array:
        """Index leading (non-matrix) axes, e.g. a layer or a gather of experts."""
        return Int4Array(self.q[idx], self.scale[idx], self.group_size)

    def take(self, indices: jax.Array, axis: int = 0) -> Int4Array:
        if axis < 0 or axis >= self.ndim - 2:
            raise ValueError(f"Int4Array.take: axis {axis} must be a leading axis of shape {self.shape}")
        return Int4Array(jnp.take(self.q, indices, axis), jnp.take(self.scale, indices, axis), self.group_size)


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


def quantize(w: jax.Array | np.ndarray, group_size: int, scale_dtype: jnp.dtype = SCALE_DTYPE) -> Int4Array:
    """Symmetric group quantisation of a [..., I, O] weight (scale = group max|w| / 7), as compressed-tensors does."""
    w = jnp.asarray(w, jnp.float32)
    *lead, i, o = w.shape
    if i % group_size:
        raise ValueError(f"quantize: input dim {i} is not divisible by group_size {group_size}")
    grouped = w.reshape(*lead, i // group_size, group_size, o)
    scale = (jnp.max(jnp.abs(grouped), axis=-2) / 7.0).astype(scale_dtype)
    safe = jnp.where(scale == 0, 1, scale).astype(jnp.float32)
    q = jnp.clip(jnp.round(grouped / safe[..., None, :]), -8, 7).reshape(w.shape)
    return Int4Array(q.astype(jnp.int4), scale, group_size)
