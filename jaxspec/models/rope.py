"""Rotary position embeddings: default and YaRN inverse frequencies (HF `modeling_rope_utils` semantics).

DeepSeek lays rope dims out in interleaved pairs (x0, x1), (x2, x3), ...; like HF we rotate each pair and return the
de-interleaved order [evens | odds]. Queries and cached keys go through the same function, so scores match HF.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import RopeScaling, yarn_mscale


def inv_freq(dim: int, theta: float, scaling: RopeScaling | None) -> tuple[np.ndarray, float]:
    """Inverse frequencies [dim/2] (float32) and the cos/sin attention factor."""
    pos_freqs = theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    extrapolation = (1.0 / pos_freqs).astype(np.float32)
    if scaling is None:
        return extrapolation, 1.0
    factor, base_len = scaling.factor, scaling.original_max_position_embeddings
    interpolation = (1.0 / (factor * pos_freqs)).astype(np.float32)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(base_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1 keeps the original (extrapolated) frequency
    freqs = interpolation * (1 - keep) + extrapolation * keep

    attention_factor = scaling.attention_factor
    if attention_factor is None:
        if scaling.mscale and scaling.mscale_all_dim:
            attention_factor = yarn_mscale(factor, scaling.mscale) / yarn_mscale(factor, scaling.mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    return freqs.astype(np.float32), float(attention_factor)


def cos_sin(positions: jax.Array, freqs: np.ndarray, attention_factor: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape positions.shape + [dim/2], in float32."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(freqs)
    return jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor


def apply_interleaved(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate interleaved pairs of the last dim; `cos`/`sin` broadcast against x[..., ::2]."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def apply_half(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Llama-style rotate-half RoPE (first half / second half pairs), used by EAGLE-3 drafters."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
