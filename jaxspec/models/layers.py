"""Shared building blocks: parameter declaration, RMSNorm, SwiGLU."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.config import KimiConfig
from jaxspec.models import quant

# The additive mask of attention scores: exp() of it is exactly 0 in fp32, yet it stays finite (no inf - inf = NaN).
NEG_INF = -1e30

Init = Callable[[jax.Array, tuple[int, ...], jnp.dtype], jax.Array]


def normal(std: float = 0.02) -> Init:
    return lambda key, shape, dtype: (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def ones(key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
    del key
    return jnp.ones(shape, dtype)


def zeros(key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
    del key
    return jnp.zeros(shape, dtype)


def param(
    rngs: nnx.Rngs,
    shape: Sequence[int],
    axes: Sequence[str | None],
    dtype: jnp.dtype,
    init: Init | None = None,
) -> nnx.Param:
    """Declare a weight once: shape, dtype, logical axes (see glossary.md) and initializer.

    Shardings, checkpoint restore targets and converter layouts are all derived from this declaration.
    """
    shape, axes = tuple(int(s) for s in shape), tuple(axes)
    if len(shape) != len(axes):
        raise ValueError(f"param: shape {shape} and logical axes {axes} differ in rank")
    init = init or normal()
    return nnx.Param(init(rngs.params(), shape, dtype), logical_axes=axes)


def linear(
    rngs: nnx.Rngs, shape: Sequence[int], axes: Sequence[str | None], dtype: jnp.dtype, blocks: Sequence[int] | None
) -> nnx.Param:
    """A linear weight: `param`, or with `blocks` (per trailing axis) a block-FP8 `quant.Fp8Array`."""
    p = param(rngs, shape, axes, dtype if blocks is None else jnp.float32)
    if blocks is not None:
        p.set_value(quant.quantize_fp8(p.get_value(), tuple(blocks)))
    return p


def fp8_linear_blocks(cfg: KimiConfig) -> tuple[int, int] | None:
    """Our [in, out] blocks of a PyTorch [out, in] FP8 weight, or None for an unquantised model."""
    return None if cfg.fp8 is None else cfg.fp8.block[::-1]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF semantics: normalise in fp32, cast back to the input dtype, then scale by the weight."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate) * up
