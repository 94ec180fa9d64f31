"""NumPy codec for compressed-tensors "pack-quantized" INT4 weights (symmetric, group-wise, no zero point).

Layout (as in the Kimi-K2 / K2.5 checkpoints): int32 word g of a row holds input columns 8g..8g+7,
column 8g+i in bits 4i..4i+3, each nibble storing q + 8 for q in [-8, 7]. Dequant is w = q * scale[group].
Deliberately numpy-only: the loader uses it on host, and the tests check it against the compressed-tensors
library itself.
"""

from __future__ import annotations

import numpy as np

INT4_MIN, INT4_MAX = -8, 7
_OFFSET = 8  # nibble = q + 8, so every stored nibble is unsigned 0..15
_PER_WORD = 8  # 32 bits / 4 bits
_SHIFTS = np.arange(_PER_WORD, dtype=np.uint32) * 4  # column 8g+i sits in bits 4i..4i+3


def pack_int4(q: np.ndarray) -> np.ndarray:
    """Pack int4 values [..., in] (integers in [-8, 7], in % 8 == 0) into int32 words [..., in / 8]."""
    q = np.asarray(q)
    if not np.issubdtype(q.dtype, np.integer):
        raise ValueError(f"pack_int4: q must be an integer array, got dtype {q.dtype}")
    if q.ndim < 1 or q.shape[-1] % _PER_WORD:
        raise ValueError(f"pack_int4: last dim of q must be a multiple of {_PER_WORD}, got shape {q.shape}")
    if q.size and (q.min() < INT4_MIN or q.max() > INT4_MAX):
        raise ValueError(f"pack_int4: q values out of range [{INT4_MIN}, {INT4_MAX}]: min {q.min()}, max {q.max()}")
    nibbles = (q.astype(np.int64) + _OFFSET).astype(np.uint32)
    nibbles = nibbles.reshape(*q.shape[:-1], q.shape[-1] // _PER_WORD, _PER_WORD)
    # The nibbles occupy disjoint bits, so a sum is an OR; uint32 keeps the top nibble from overflowing.
    words = (nibbles << _SHIFTS).sum(axis=-1, dtype=np.uint32)
    return words.view(np.int32)


def unpack_int4(packed: np.ndarray, in_features: int) -> np.ndarray:
    """Unpack int32 words [..., in_features / 8] into int8 values [..., in_features] in [-8, 7]."""
    packed = np.asarray(packed)
    if packed.dtype != np.int32:
        raise ValueError(f"unpack_int4: packed must be int32, got dtype {packed.dtype}")
    if packed.ndim < 1 or packed.shape[-1] * _PER_WORD != in_features:
        raise ValueError(
            f"unpack_int4: packed shape {packed.shape} does not hold in_features={in_features} "
            f"({_PER_WORD} values per int32 word)"
        )
    # Via uint32 so negative words (top nibble >= 8) shift logically; the mask makes it safe either way.
    nibbles = (packed.view(np.uint32)[..., None] >> _SHIFTS) & 0xF
    return (nibbles.astype(np.int8) - _OFFSET).reshape(*packed.shape[:-1], in_features)


def _check_groups(name: str, in_features: int, group_size: int) -> int:
    if group_size <= 0 or in_features % group_size:
        raise ValueError(f"{name}: group_size {group_size} must be positive and divide in_features {in_features}")
    return in_features // group_size


def quantize_int4(w: np.ndarray, group_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric group-wise INT4: returns q int8 [..., in] and scale float32 [..., in / group_size].

    scale = max|w| over the group / 7, q = clip(round_half_even(w / scale), -8, 7), all in float32.
    """
    w = np.asarray(w)
    if w.ndim < 1:
        raise ValueError(f"quantize_int4: w must have an input dimension, got shape {w.shape}")
    n_groups = _check_groups("quantize_int4", w.shape[-1], group_size)
    wg = w.astype(np.float32).reshape(*w.shape[:-1], n_groups, group_size)
    scale = np.abs(wg).max(axis=-1) / np.float32(INT4_MAX)
    # All-zero groups (or an underflowing max/7) would divide by zero; scale 1 gives q = 0, dequantizing to 0.
    scale = np.where(scale == 0, np.float32(1), scale).astype(np.float32)
    q = np.clip(np.rint(wg / scale[..., None]), INT4_MIN, INT4_MAX).astype(np.int8)
    return q.reshape(w.shape), scale


def dequantize_int4(q: np.ndarray, scale: np.ndarray, group_size: int) -> np.ndarray:
    """w[..., g * group_size + j] = q[..., g * group_size + j] * scale[..., g], in float32."""
    q, scale = np.asarray(q), np.asarray(scale)
    if q.ndim < 1:
        raise ValueError(f"dequantize_int4: q must have an input dimension, got shape {q.shape}")
    n_groups = _check_groups("dequantize_int4", q.shape[-1], group_size)
    if scale.shape != (*q.shape[:-1], n_groups):
        raise ValueError(
            f"dequantize_int4: scale shape {scale.shape} does not match q shape {q.shape} with group_size {group_size}"
        )
    qg = q.astype(np.float32).reshape(*q.shape[:-1], n_groups, group_size)
    return (qg * scale.astype(np.float32)[..., None]).reshape(q.shape)
