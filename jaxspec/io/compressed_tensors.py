"""NumPy codec for compressed-tensors "pack-quantized" INT4 weights (symmetric, group-wise, no zero point).

Layout (as in the Kimi-K2 / K2.5 checkpoints): int32 word g of a row holds input columns 8g..8g+7,
column 8g+i in bits 4i..4i+3, each nibble storing q + 8 for q in [-8, 7]. Dequant is w = q * scale[group]
(`jaxspec.models.quant`: quantize / Int4Array.dequantize). Deliberately numpy-only: the loader uses it on host, and
the tests check it against the compressed-tensors library itself.
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
