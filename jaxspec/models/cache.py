"""The target's latent KV cache: its two layouts and two formats, and how a step writes and reads it.

Two cache layouts, one attention (`write_cache` here, `mla.attend_live_prefix`): a dense cache [L, B, S, Y] (row b's
positions in order: what `generate` keeps), or `Paged`: a pool of blocks [L, N, block, Y] read and written in place
through each row's block table (what the serving executor keeps: rows share the pool, and a row's cache is never
copied out of it and back). A dense cache is a paged one whose tables are contiguous; both read the same blocks of
`kv_block` positions, so they compute the same values.

FP8 cache (`kv_cache_dtype="fp8"`): each token's cache entry (latent and RoPE key together) is stored as
float8_e4m3fn values with one float32 scale per token and layer, packed into a uint8 cache
[L, B, S, Y + 4]: Y bytes of e4m3 values, then the scale's 4 bytes. The scale is the entry's max |value| / 448
(e4m3's largest finite value), so no value clips and no calibration is needed; it costs 4 bytes of 580 at full
size (1.99x the positions of a bf16 cache). A uint8 cache is the fp8 format: `write_cache` quantises into it and
`read_entries` dequantises each block just before attention, so every path over the cache (chain and tree verify,
decode, prefill) handles both formats. Why this design: vLLM/SGLang/tpu-inference store MLA caches as float8 with a
per-tensor scale (1.0 unless calibrated: an outlier token clips); DeepSeek-V3.2's FlashMLA layout packs values and
float32 scales in one byte buffer per token (656 B: 512 e4m3 + 4 scales + 64 bf16 RoPE values). One scale per token
is that layout's idea at the least cost; e4m3 is floating point, so values far below the token's max keep their
3-bit relative precision down to 2^-15 of it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from sharding.mesh import DATA

FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)  # 448
SCALE_BYTES = 4  # one float32 scale per cached token and layer
PACKED = jnp.uint8  # the cache dtype of the fp8 format


class Paged(NamedTuple):
    """A cache kept as a pool of blocks and read and written in place through block tables. `pool`: the target's
    latent pool [L, N, block, Y] (N blocks of `block` positions, either cache format), or a drafter's tuple of
    arrays [N, block, ...] (its one layer); `tables` int32 [B, K]: row b's positions [k * block, (k + 1) * block)
    are in pool block `tables[b, k]` (block 0, the null block, where a row owns none: what is written there is never
    read as a live position of any row)."""

    pool: Any
    tables: jax.Array

    @property
    def stacked(self) -> bool:
        """Whether the pool is the target's layer-stacked array (else a drafter's tuple)."""
        return not isinstance(self.pool, tuple)

    @property
    def block(self) -> int:
        return self.pool.shape[2] if self.stacked else self.pool[0].shape[1]

    @property
    def positions(self) -> int:
        """Positions a row can address (its table's blocks)."""
        return self.tables.shape[1] * self.block

    def slots(self, pos_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(pool block [B, T], offset in it [B, T]) of each row's positions; a position outside [0, positions) gets
        block N (past the pool: a write there is dropped)."""
        K, blk = self.tables.shape[1], self.block
        n_blocks = self.pool.shape[1] if self.stacked else self.pool[0].shape[0]
        k_BT = pos_BT // blk
        inside_BT = (pos_BT >= 0) & (k_BT < K)
        blocks_BT = jnp.take_along_axis(self.tables, jnp.clip(k_BT, 0, K - 1), axis=1)
        return jnp.where(inside_BT, blocks_BT, n_blocks), pos_BT % blk

    def window(self, rows: int, positions: int | None = None, start=0) -> Paged:
        """The same pool seen by rows [start, start + rows) and their positions [0, positions) (all: None; a whole
        number of blocks): a window of the tables, never of the pool (`LoopState.window`)."""
        tables = jax.lax.dynamic_slice_in_dim(self.tables, start, rows)
        if positions is not None:
            if positions % self.block:
                raise ValueError(f"Paged.window: positions {positions} is not a multiple of the block {self.block}")
            tables = tables[:, : positions // self.block]
        return Paged(self.pool, tables)

    def write(self, new: tuple[jax.Array, ...], pos_BT: jax.Array) -> Paged:
        """This drafter pool with each row's T new entries (one array [B, T, ...] per pool array) put at its
        positions `pos_BT`, in the rows' blocks (in place; positions outside the rows' tables dropped)."""
        blocks_BT, offsets_BT = self.slots(pos_BT)
        put = lambda pool, n: _set(pool, (blocks_BT, offsets_BT), n.astype(pool.dtype))  # noqa: E731
        return Paged(tuple(put(p, n) for p, n in zip(self.pool, new, strict=True)), self.tables)


def paged_specs(mesh, pool_specs: Any, batch_axis: Any) -> Paged:
    """The PartitionSpecs of a `Paged` cache on `mesh`: its pool's `pool_specs` (its blocks placed as a dense cache's
    rows) and its tables' (rows as the batch). A pool is one for all rows: it needs the data axis to be 1."""
    if mesh.shape.get(DATA, 1) != 1:
        raise ValueError(f"a paged cache needs the mesh's data axis to be 1, got a {dict(mesh.shape)} mesh")
    return Paged(pool_specs, jax.sharding.PartitionSpec(batch_axis, None))


Cache = jax.Array | Paged  # a dense [L, B, S, Y] cache or a paged one


def is_fp8(cache: jax.Array) -> bool:
    """Whether a cache is in the packed fp8 format (module docstring)."""
    return cache.dtype == PACKED


def quantize_entries(new_BTY: jax.Array) -> jax.Array:
    """Cache entries [..., Y] -> packed fp8 [..., Y + 4] uint8: e4m3 values, then the float32 scale's bytes."""
    x = new_BTY.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    values = jax.lax.bitcast_convert_type(jnp.clip(x / scale, -FP8_MAX, FP8_MAX).astype(FP8), PACKED)
    return jnp.concatenate([values, jax.lax.bitcast_convert_type(scale[..., 0], PACKED)], axis=-1)


def dequantize_entries(packed: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Packed fp8 entries [..., Y + 4] -> [..., Y] in `dtype` (value x its token's scale, in float32)."""
    Y = packed.shape[-1] - SCALE_BYTES
    values = jax.lax.bitcast_convert_type(packed[..., :Y], FP8).astype(jnp.float32)
    scale = jax.lax.bitcast_convert_type(packed[..., Y:], jnp.float32)
    return (values * scale[..., None]).astype(dtype)


def read_entries(cache_entries: jax.Array | tuple[jax.Array, ...], dtype: jnp.dtype) -> jax.Array | tuple:
    """Entries read from a cache (either format; a drafter pool's tuple of arrays) in the compute dtype."""
    if isinstance(cache_entries, tuple):
        return tuple(read_entries(c, dtype) for c in cache_entries)
    return dequantize_entries(cache_entries, dtype) if is_fp8(cache_entries) else cache_entries.astype(dtype)


def through_cache(new_BTY: jax.Array, cache: Cache) -> jax.Array:
    """New entries as attention will read them back from `cache` (rounded through its format), in their dtype."""
    if is_fp8(_array(cache)):
        return dequantize_entries(quantize_entries(new_BTY), new_BTY.dtype)
    return new_BTY.astype(_array(cache).dtype)


def write_cache(cache_LBSY: Cache, layer: jax.Array | int, new_BTY: jax.Array, pos_BT: jax.Array) -> Cache:
    """Store each row's T new entries at their positions in `layer` (an in-place scatter; out-of-range dropped),
    quantised when the cache is fp8; a `Paged` cache's through its rows' block tables."""
    stored = quantize_entries(new_BTY) if is_fp8(_array(cache_LBSY)) else new_BTY.astype(_array(cache_LBSY).dtype)
    if isinstance(cache_LBSY, Paged):
        blocks_BT, offsets_BT = cache_LBSY.slots(pos_BT)
        return cache_LBSY._replace(pool=_set(cache_LBSY.pool, (layer, blocks_BT, offsets_BT), stored))
    rows_BT = jnp.broadcast_to(jnp.arange(pos_BT.shape[0], dtype=pos_BT.dtype)[:, None], pos_BT.shape)
    return _set(cache_LBSY, (layer, rows_BT, pos_BT), stored)


def _set(array: jax.Array, index: tuple, values: jax.Array) -> jax.Array:
    """`array.at[index].set(values, mode="drop")`; on CPU a bfloat16 array's through a uint16 view: XLA:CPU widens a
    bfloat16 scatter to float32 across the whole operand (the whole pool, each layer of each step), and a bit copy is
    the same either way."""
    plain = lambda a, v: a.at[index].set(v, mode="drop")  # noqa: E731
    if array.dtype != jnp.bfloat16:
        return plain(array, values)

    def bits(a, v):
        u16 = lambda x, t: jax.lax.bitcast_convert_type(x, t)  # noqa: E731
        return u16(u16(a, jnp.uint16).at[index].set(u16(v, jnp.uint16), mode="drop"), jnp.bfloat16)

    return jax.lax.platform_dependent(array, values, cpu=bits, default=plain)


def _array(cache: Cache) -> jax.Array:
    return cache.pool if isinstance(cache, Paged) else cache


def cache_positions(cache: Cache) -> int:
    """Positions each row of a cache can hold."""
    return cache.positions if isinstance(cache, Paged) else cache.shape[2]


def read_block(cache: Cache, layer: jax.Array | int, row: jax.Array, start: jax.Array, size: int) -> jax.Array:
    """Row `row`'s raw entries at positions [start, start + size) of `layer`, [1, size, Y] (start a multiple of a
    paged cache's block, size too; the caller keeps the range inside the row's positions); of a drafter's pool (one
    layer, `layer` unused), a tuple of [1, size, ...] per pool array."""
    if not isinstance(cache, Paged):
        return jax.lax.dynamic_slice(cache, (layer, row, start, 0), (1, 1, size, cache.shape[-1]))[0]
    blk = cache.block
    ids = jax.lax.dynamic_slice(cache.tables, (row, start // blk), (1, size // blk))[0]
    if not cache.stacked:
        return tuple(p[ids].reshape(1, size, *p.shape[2:]) for p in cache.pool)
    return cache.pool[layer, ids].reshape(1, size, cache.pool.shape[-1])


def read_size(cache: Cache, kv_block: int) -> int:
    """Positions per block of the live-prefix loop: `kv_block` (at least one of a paged cache's blocks, and a whole
    number of them), capped at the row's positions."""
    if kv_block < 1:
        raise ValueError(f"kv_block: cache positions per attention block must be >= 1, got {kv_block}")
    if isinstance(cache, Paged):
        return cache.block * max(1, min(kv_block // cache.block, cache.tables.shape[1]))
    return min(kv_block, cache.shape[2])


__all__ = [
    "FP8",
    "FP8_MAX",
    "PACKED",
    "SCALE_BYTES",
    "Cache",
    "Paged",
    "paged_specs",
    "cache_positions",
    "dequantize_entries",
    "is_fp8",
    "quantize_entries",
    "read_block",
    "read_entries",
    "read_size",
    "through_cache",
    "write_cache",
]
