"""Multi-head latent attention (MLA) with a latent KV cache.

Per token and layer the cache holds `kv_lora_rank + qk_rope_head_dim` values: the normalised KV latent and the
rotated RoPE key shared by all heads. Two mathematically equal ways to attend over it:
- "expanded" (prefill): expand the latent to per-head keys/values with kv_b, then ordinary attention;
- "absorbed" (decode/verify): fold kv_b's key half into the query and its value half into the output, so attention
  runs directly over the 576-wide latent and nothing per-head is materialised for the cached positions.
Runs per device inside shard_map: N below is the local head count and the output is a partial sum over the local
heads; the caller reduces it.

Attention over each row's own live prefix (ragged): with a cache, both forms read, row by row, only the positions up
to that row's own last query position, in fixed blocks of `kv_block` positions under `fori_loop`s whose trip counts
are data-dependent (per row: ceil(live / kv_block)), with an online (flash-style) softmax. One compiled program
serves every length; each block is sliced out of the stacked cache and cast on its own, so a step reads the sum of
its rows' live cache bytes: one long row beside short ones does not make them read its length.

Two cache layouts, one attention (`write_cache`, `attend_live_prefix`): a dense cache [L, B, S, Y] (row b's
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

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.config import LATENT_NORM_EPS, KimiConfig
from jaxspec.models import rope
from jaxspec.models.layers import NEG_INF, linear, ones, param, rms_norm
from jaxspec.models.quant import einsum as ein
from jaxspec.models.quant import head_block

AttnImpl = Literal["expanded", "absorbed"]
# Cache positions per block of the live-prefix loop. Larger blocks mean fewer loop iterations (each costs a little
# fixed overhead, notably on GPU) but up to kv_block - 1 dead positions read per step; 512 x 576 bf16 values per
# sequence is 590 KB, one small DMA on an accelerator.
KV_BLOCK = 512

FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)  # 448
SCALE_BYTES = 4  # one float32 scale per cached token and layer
PACKED = jnp.uint8  # the cache dtype of the fp8 format

# Online-softmax state (fp32): running max [B,N,T], running denominator [B,N,T], unnormalised output [B,T,N,C]
# (absorbed: over the latent) or [B,T,N,A] (expanded: over per-head values).
Softmax = tuple[jax.Array, jax.Array, jax.Array]


class Block(NamedTuple):
    """Scores and mixing of queries over one block of cache entries. `fn(queries, kv_BSY)` takes the queries (arrays
    with the row axis first) and a block [B,S,Y] (compute dtype) and returns its scores [B,N,T,S] and a function
    mixing probabilities into the softmax output. Called with a block alone it uses every row's queries; `row(b)` is
    the same block function for row b's queries only (the ragged loop's)."""

    queries: Any
    fn: Callable[[Any, jax.Array], tuple[jax.Array, Callable[[jax.Array], jax.Array]]]

    def __call__(self, kv_BSY: jax.Array) -> tuple[jax.Array, Callable[[jax.Array], jax.Array]]:
        return self.fn(self.queries, kv_BSY)

    def row(self, b: jax.Array) -> Block:
        return Block(jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, b, 1), self.queries), self.fn)


BlockFn = Block  # the name the callers knew


class Paged(NamedTuple):
    """A cache kept as a pool of blocks and read and written in place: `pool` [L, N, block, Y] (N blocks of `block`
    positions, either cache format) and `tables` int32 [B, K]: row b's positions [k * block, (k + 1) * block) are
    in pool block `tables[b, k]` (block 0, the null block, where a row owns none: what is written there is never
    read as a live position of any row)."""

    pool: jax.Array
    tables: jax.Array

    @property
    def block(self) -> int:
        return self.pool.shape[2]

    @property
    def positions(self) -> int:
        """Positions a row can address (its table's blocks)."""
        return self.tables.shape[1] * self.block

    def slots(self, pos_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(pool block [B, T], offset in it [B, T]) of each row's positions; a position outside [0, positions) gets
        block N (past the pool: a write there is dropped)."""
        K, blk = self.tables.shape[1], self.block
        k_BT = pos_BT // blk
        inside_BT = (pos_BT >= 0) & (k_BT < K)
        blocks_BT = jnp.take_along_axis(self.tables, jnp.clip(k_BT, 0, K - 1), axis=1)
        return jnp.where(inside_BT, blocks_BT, self.pool.shape[1]), pos_BT % blk


Cache = jax.Array | Paged  # a dense [L, B, S, Y] cache or a paged one


def fp8_blocks(cfg: KimiConfig) -> dict[str, tuple[int, ...]] | None:
    """Each projection's FP8 blocks in our layout (None for an unquantised model). The checkpoint blocks PyTorch's
    [out, in] weights: q_b / q_proj rows are N x (H + R) per head, kv_a_proj rows C + R, kv_b rows N x (H + A), o_proj
    columns N x A, so a per-head axis gets the largest block that never crosses one of the checkpoint's."""
    if cfg.fp8 is None:
        return None
    (br, bc), H, R, A, C = cfg.fp8.block, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    return {
        "q_a": (bc, br),
        "q_nope": (bc, 1, head_block(br, H + R, 0)),
        "q_rope": (bc, 1, head_block(br, H + R, H)),
        "kv_a_latent": (bc, br),
        "kv_a_rope": (bc, head_block(br, 0, C)),
        "kv_b_k": (bc, 1, head_block(br, H + A, 0)),
        "kv_b_v": (bc, 1, head_block(br, H + A, H)),
        "o": (1, head_block(bc, A, 0), br),
    }


class MLA(nnx.Module):
    def __init__(self, cfg: KimiConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        D, Q, C = cfg.hidden_size, cfg.q_lora_rank, cfg.kv_lora_rank
        N, H, R, A = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        b = fp8_blocks(cfg)
        w = lambda name, shape, axes: linear(rngs, shape, axes, dtype, b and b[name])
        if cfg.q_lora:
            self.q_a = w("q_a", (D, Q), ("embed", "q_lora"))
            self.q_a_norm = param(rngs, (Q,), ("q_lora",), dtype, ones)
            self.q_b_nope = w("q_nope", (Q, N, H), ("q_lora", "heads", None))
            self.q_b_rope = w("q_rope", (Q, N, R), ("q_lora", "heads", None))
        else:  # q_lora_rank null: one q_proj straight from the hidden state (DeepSeek-V2-Lite, Moonlight)
            self.q_nope = w("q_nope", (D, N, H), ("embed", "heads", None))
            self.q_rope = w("q_rope", (D, N, R), ("embed", "heads", None))
        self.kv_a_latent = w("kv_a_latent", (D, C), ("embed", "kv_lora"))
        self.kv_a_rope = w("kv_a_rope", (D, R), ("embed", None))
        self.kv_a_norm = param(rngs, (C,), ("kv_lora",), dtype, ones)
        self.kv_b_k = w("kv_b_k", (C, N, H), ("kv_lora", "heads", None))  # W_uk
        self.kv_b_v = w("kv_b_v", (C, N, A), ("kv_lora", "heads", None))  # W_uv
        self.o = w("o", (N, A, D), ("heads", None, "embed"))
        self.softmax_scale = cfg.softmax_scale

    def __call__(
        self,
        x_BTD: jax.Array,
        cos_sin: tuple[jax.Array, jax.Array],
        q_pos_BT: jax.Array,
        cache_LBSY: Cache | None,
        layer: jax.Array | int,
        impl: AttnImpl,
        *,
        kv_block: int = KV_BLOCK,
    ) -> tuple[jax.Array, Cache | None]:
        """Returns (partial attention output [B,T,D] in fp32, updated cache or None).

        `cache_LBSY` is the whole stacked cache (all layers; dense or `Paged`) and `layer` the index of this layer in
        it: the step writes its T entries there and reads back only each row's live blocks, so no per-layer copy of
        the buffer is made.
        """
        C = self.kv_a_norm.shape[0]
        q_nope_BTNH, q_rope_BTNR, new_BTY = self.project(x_BTD, cos_sin)

        with jax.named_scope(f"attend_{impl}"):
            if impl == "absorbed":
                q_abs_BTNC = ein("BTNH,CNH->BTNC", q_nope_BTNH, self.kv_b_k[...])
                block_fn, width = self.absorbed_block(q_abs_BTNC, q_rope_BTNR, C), C
            elif impl == "expanded":
                block_fn, width = self.expanded_block(q_nope_BTNH, q_rope_BTNR, C), self.kv_b_v.shape[-1]
            else:
                raise ValueError(f"attention impl must be 'expanded' or 'absorbed', got {impl!r}")
            init = softmax_init(q_nope_BTNH, width)
            if cache_LBSY is None:  # full forward: the new tokens are the keys, one block
                mask_BTS = q_pos_BT[:, None, :] <= q_pos_BT[:, :, None]
                state = online_softmax(init, *block_fn(new_BTY), mask_BTS, self.softmax_scale)
            else:
                cache_LBSY = write_cache(cache_LBSY, layer, new_BTY, q_pos_BT)
                state = attend_live_prefix(
                    cache_LBSY, layer, q_pos_BT, block_fn, init, self.softmax_scale, kv_block, x_BTD.dtype
                )
            out_BTNA = softmax_finish(state, x_BTD.dtype)  # [B,T,N,C] when absorbed
            if impl == "absorbed":
                out_BTNA = ein("BTNC,CNA->BTNA", out_BTNA, self.kv_b_v[...])
        out_BTD = ein("BTNA,NAD->BTD", out_BTNA, self.o[...], dtype=jnp.float32)
        return out_BTD, cache_LBSY

    def absorbed_block(self, q_abs_BTNC: jax.Array, q_rope_BTNR: jax.Array, C: int) -> BlockFn:
        """Scores and mixing over the 576-wide latent directly (W_uk folded into the query, W_uv applied after)."""

        def block(queries, kv_BSY):
            q_abs_BTNC, q_rope_BTNR = queries
            latent_BSC, k_rope_BSR = kv_BSY[..., :C], kv_BSY[..., C:]
            scores_BNTS = ein("BTNC,BSC->BNTS", q_abs_BTNC, latent_BSC) + ein("BTNR,BSR->BNTS", q_rope_BTNR, k_rope_BSR)
            return scores_BNTS, lambda p_BNTS: ein("BNTS,BSC->BTNC", p_BNTS, latent_BSC)

        return Block((q_abs_BTNC, q_rope_BTNR), block)

    def expanded_block(self, q_nope_BTNH: jax.Array, q_rope_BTNR: jax.Array, C: int) -> BlockFn:
        """Per-head keys/values expanded from this block's latent only."""
        kv_b_k, kv_b_v = self.kv_b_k[...], self.kv_b_v[...]

        def block(queries, kv_BSY):
            q_nope_BTNH, q_rope_BTNR = queries
            latent_BSC, k_rope_BSR = kv_BSY[..., :C], kv_BSY[..., C:]
            k_nope_BSNH = ein("BSC,CNH->BSNH", latent_BSC, kv_b_k)
            v_BSNA = ein("BSC,CNA->BSNA", latent_BSC, kv_b_v)
            scores_BNTS = ein("BTNH,BSNH->BNTS", q_nope_BTNH, k_nope_BSNH) + ein(
                "BTNR,BSR->BNTS", q_rope_BTNR, k_rope_BSR
            )
            return scores_BNTS, lambda p_BNTS: ein("BNTS,BSNA->BTNA", p_BNTS, v_BSNA)

        return Block((q_nope_BTNH, q_rope_BTNR), block)

    def project(self, x_BTD: jax.Array, cos_sin: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(q_nope [B,T,N,H], rotated q_rope [B,T,N,R], the tokens' cache entries [B,T,Y]: normalised KV latent and
        rotated shared RoPE key)."""
        cos, sin = cos_sin
        with jax.named_scope("q"):
            q_nope_BTNH, q_rope_BTNR = self.queries(x_BTD)
            q_rope_BTNR = rope.apply_interleaved(q_rope_BTNR, cos[:, :, None], sin[:, :, None])
        with jax.named_scope("kv_latent"):
            latent_BTC = rms_norm(
                ein("BTD,DC->BTC", x_BTD, self.kv_a_latent[...]), self.kv_a_norm[...], LATENT_NORM_EPS
            )
            k_rope_BTR = rope.apply_interleaved(ein("BTD,DR->BTR", x_BTD, self.kv_a_rope[...]), cos, sin)
        return q_nope_BTNH, q_rope_BTNR, jnp.concatenate([latent_BTC, k_rope_BTR], axis=-1)

    def queries(self, x_BTD: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(q_nope [B,T,N,H], q_rope before rotation [B,T,N,R]) through the query latent, or q_proj without one."""
        if not hasattr(self, "q_a"):
            return ein("BTD,DNH->BTNH", x_BTD, self.q_nope[...]), ein("BTD,DNR->BTNR", x_BTD, self.q_rope[...])
        q_lat_BTQ = rms_norm(ein("BTD,DQ->BTQ", x_BTD, self.q_a[...]), self.q_a_norm[...], LATENT_NORM_EPS)
        return ein("BTQ,QNH->BTNH", q_lat_BTQ, self.q_b_nope[...]), ein("BTQ,QNR->BTNR", q_lat_BTQ, self.q_b_rope[...])


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


def read_entries(cache_entries: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Entries read from a cache (either format) in the compute dtype."""
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
        pool = cache_LBSY.pool.at[layer, blocks_BT, offsets_BT].set(stored, mode="drop")
        return cache_LBSY._replace(pool=pool)
    rows_BT = jnp.broadcast_to(jnp.arange(pos_BT.shape[0], dtype=pos_BT.dtype)[:, None], pos_BT.shape)
    return cache_LBSY.at[layer, rows_BT, pos_BT].set(stored, mode="drop")


def _array(cache: Cache) -> jax.Array:
    return cache.pool if isinstance(cache, Paged) else cache


def cache_positions(cache: Cache) -> int:
    """Positions each row of a cache can hold."""
    return cache.positions if isinstance(cache, Paged) else cache.shape[2]


def read_block(cache: Cache, layer: jax.Array | int, row: jax.Array, start: jax.Array, size: int) -> jax.Array:
    """Row `row`'s raw entries at positions [start, start + size) of `layer`, [1, size, Y] (start a multiple of a
    paged cache's block, size too; the caller keeps the range inside the row's positions)."""
    if not isinstance(cache, Paged):
        return jax.lax.dynamic_slice(cache, (layer, row, start, 0), (1, 1, size, cache.shape[-1]))[0]
    blk = cache.block
    ids = jax.lax.dynamic_slice(cache.tables, (row, start // blk), (1, size // blk))[0]
    return cache.pool[layer, ids].reshape(1, size, cache.pool.shape[-1])


def read_size(cache: Cache, kv_block: int) -> int:
    """Positions per block of the live-prefix loop: `kv_block` (at least one of a paged cache's blocks, and a whole
    number of them), capped at the row's positions."""
    if kv_block < 1:
        raise ValueError(f"kv_block: cache positions per attention block must be >= 1, got {kv_block}")
    if isinstance(cache, Paged):
        return cache.block * max(1, min(kv_block // cache.block, cache.tables.shape[1]))
    return min(kv_block, cache.shape[2])


def live_blocks(q_pos_BT: jax.Array, cache_len: int, kv_block: int) -> tuple[jax.Array, int]:
    """(blocks to read per row [B], block size): blocks of min(kv_block, cache_len) positions covering each row's
    positions up to its last query position, capped at the buffer."""
    if kv_block < 1:
        raise ValueError(f"kv_block: cache positions per attention block must be >= 1, got {kv_block}")
    blk = min(kv_block, cache_len)
    live_B = jnp.max(q_pos_BT, axis=1) + 1
    return jnp.clip((live_B + blk - 1) // blk, 0, -(-cache_len // blk)), blk


def attend_live_prefix(
    cache_LBSY: Cache,
    layer: jax.Array | int,
    q_pos_BT: jax.Array,
    block_fn: Block,
    init: Softmax,
    scale: float,
    kv_block: int,
    dtype: jnp.dtype,
) -> Softmax:
    """Online softmax over each row's own live blocks of `layer` (ragged: row by row, each as far as its own last
    query position); exact per-row causality by position."""
    S, blk = cache_positions(cache_LBSY), read_size(cache_LBSY, kv_block)
    n_blocks_B, _ = live_blocks(q_pos_BT, S, blk)

    def row(b, state):
        q_pos_1T, block = jax.lax.dynamic_slice_in_dim(q_pos_BT, b, 1), block_fn.row(b)

        def body(j, state):
            # When S is not a multiple of blk the last block is shifted back to end at S; its positions before
            # j * blk were seen by the previous block and are masked here.
            start = jnp.minimum(j * blk, S - blk)
            kv_1SY = read_entries(read_block(cache_LBSY, layer, b, start, blk), dtype)
            kv_pos_S = start + jnp.arange(blk, dtype=q_pos_BT.dtype)
            mask_1TS = (kv_pos_S >= j * blk) & (kv_pos_S <= q_pos_1T[:, :, None])
            return online_softmax(state, *block(kv_1SY), mask_1TS, scale)

        mine = jax.lax.fori_loop(0, n_blocks_B[b], body, jax.tree.map(lambda x: x[b][None], state))
        return jax.tree.map(lambda x, m: jax.lax.dynamic_update_slice_in_dim(x, m, b, 0), state, mine)

    return jax.lax.fori_loop(0, q_pos_BT.shape[0], row, init)


def softmax_init(q_BTNH: jax.Array, width: int) -> Softmax:
    # Built from the queries so the state varies over the same manual mesh axes as the loop's outputs.
    zero_BNT = jnp.zeros_like(q_BTNH[..., 0], jnp.float32).transpose(0, 2, 1)
    return zero_BNT + NEG_INF, zero_BNT, jnp.zeros_like(q_BTNH[..., :1], jnp.float32) + jnp.zeros(width, jnp.float32)


def online_softmax(
    state: Softmax, scores_BNTS: jax.Array, mix: Callable[[jax.Array], jax.Array], mask_BTS: jax.Array, scale: float
) -> Softmax:
    """Fold one block into the running softmax. Masked entries get probability exactly 0 (even in a block where a
    row has no visible position yet), so stale or padded cache entries never contribute."""
    m_BNT, l_BNT, acc = state
    mask_BNTS = mask_BTS[:, None]
    s_BNTS = jnp.where(mask_BNTS, scores_BNTS.astype(jnp.float32) * scale, NEG_INF)
    m_new_BNT = jnp.maximum(m_BNT, s_BNTS.max(axis=-1))
    alpha_BNT = jnp.exp(m_BNT - m_new_BNT)
    p_BNTS = jnp.where(mask_BNTS, jnp.exp(s_BNTS - m_new_BNT[..., None]), 0.0)
    l_BNT = l_BNT * alpha_BNT + p_BNTS.sum(axis=-1)
    mixed = mix(p_BNTS.astype(scores_BNTS.dtype)).astype(jnp.float32)
    acc = acc * alpha_BNT.transpose(0, 2, 1)[..., None] + mixed
    return m_new_BNT, l_BNT, acc


def softmax_finish(state: Softmax, dtype: jnp.dtype) -> jax.Array:
    _, l_BNT, acc = state
    return (acc / l_BNT.transpose(0, 2, 1)[..., None]).astype(dtype)
