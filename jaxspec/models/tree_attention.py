"""Tree attention for MLA: the verify step of a draft tree (jaxspec/decoding/tree.py) over the latent cache.

A verify step scores the T nodes of a tree (node 0 the pending token) in one forward. Node t sits at RoPE position
prefix + depth(t) but at cache slot prefix + t (slots must be distinct; `compact_path` below later moves the accepted
path to prefix + depth). Node t must see the cached prefix (slots < prefix, its row's own length) and its own
ancestors-or-self among the fresh tokens, nothing else: not its siblings, cousins, or the stale slots past the prefix.

Two passes with the same online-softmax state as mla.py, merged by log-sum-exp:
- prefix pass: mla.py's live-prefix blocked loop over the latent cache, every query of a row masked to slots below
  the row's prefix length (so it reads O(live) cache bytes and never the tree's own freshly written slots);
- fresh pass: one block over the T fresh latents with the tree's ancestor mask [B, T, T].
Each pass yields (running max, denominator, unnormalised output); `merge_softmax` rescales both to the larger max and
adds them, which equals one softmax over the concatenated keys. Keeping the passes separate lets the prefix pass be a
decode kernel that returns (output, log-sum-exp) while the small masked pass stays in XLA. With a chain mask (lower
triangular, depth = index) this is exactly mla.py's verify attention.

Runs per device inside shard_map, like mla.py (N is the local head count; the output is a partial sum over heads).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.models.cache import Cache, Paged, through_cache, write_cache
from jaxspec.models.dcp import Stripes
from jaxspec.models.mla import (
    KV_BLOCK,
    MLA,
    BlockFn,
    Softmax,
    attend_live_prefix,
    online_softmax,
    softmax_finish,
    softmax_init,
)
from jaxspec.models.quant import einsum as ein


def merge_softmax(a: Softmax, b: Softmax) -> Softmax:
    """Two online-softmax states over disjoint key sets -> the state over their union (log-sum-exp merge)."""
    m_a_BNT, l_a_BNT, acc_a = a
    m_b_BNT, l_b_BNT, acc_b = b
    m_BNT = jnp.maximum(m_a_BNT, m_b_BNT)
    w_a_BNT, w_b_BNT = jnp.exp(m_a_BNT - m_BNT), jnp.exp(m_b_BNT - m_BNT)
    to_out = lambda w_BNT: w_BNT.transpose(0, 2, 1)[..., None]  # [B,N,T] -> [B,T,N,1]
    return m_BNT, l_a_BNT * w_a_BNT + l_b_BNT * w_b_BNT, acc_a * to_out(w_a_BNT) + acc_b * to_out(w_b_BNT)


def tree_attention(
    block_fn: BlockFn,
    init: Softmax,
    fresh_BSY: jax.Array,
    cache_LBSY: Cache,
    layer: jax.Array | int,
    prefix_len_B: jax.Array,
    mask_BTS: jax.Array,
    scale: float,
    kv_block: int,
    dtype: jnp.dtype,
) -> Softmax:
    """Softmax state of T tree queries over the cached prefix of `layer` and the fresh tokens they may see.

    `block_fn` is an mla.py block function built from the queries (absorbed or expanded form), `fresh_BSY` the S
    fresh entries (latent | rotated RoPE key) that are not in the cache and `mask_BTS` which of them each query sees:
    for a verify step the T tree nodes themselves (S = T) and the tree's ancestor-or-self mask; for an MLA drafter's
    tree steps its scratch entries and `TreeDraft.lineage`. Cache slots at or past a row's `prefix_len_B` are never
    read into the result.
    """
    B, T = mask_BTS.shape[:2]
    if fresh_BSY.ndim != 3 or fresh_BSY.shape[0] != B or mask_BTS.shape != (B, T, fresh_BSY.shape[1]):
        raise ValueError(
            f"fresh_BSY / mask_BTS: expected [B, S, Y] / [B, T, S], got {fresh_BSY.shape}, {mask_BTS.shape}"
        )
    with jax.named_scope("prefix"):
        # Query position prefix - 1 makes mla.py's causal mask (slot <= position) exactly "slot < prefix".
        last_prefix_BT = jnp.broadcast_to((prefix_len_B - 1)[:, None], (B, T)).astype(jnp.int32)
        prefix = attend_live_prefix(cache_LBSY, layer, last_prefix_BT, block_fn, init, scale, kv_block, dtype)
    with jax.named_scope("fresh"):
        fresh = online_softmax(init, *block_fn(fresh_BSY.astype(dtype)), mask_BTS, scale)
    return merge_softmax(prefix, fresh)


def tree_verify_mla(
    mla: MLA,
    x_BTD: jax.Array,
    cos_sin: tuple[jax.Array, jax.Array],
    prefix_len_B: jax.Array,
    mask_BTS: jax.Array,
    cache_LBSY: Cache,
    layer: jax.Array | int,
    *,
    kv_block: int = KV_BLOCK,
    stripes: Stripes | None = None,
) -> tuple[jax.Array, jax.Array]:
    """One MLA layer's verify step over a tree (absorbed form): (partial output [B,T,D] fp32, updated cache).

    `cos_sin` is RoPE at the tree positions (prefix + depth); the T fresh entries are written at slots prefix + t.
    Mirrors `MLA.__call__`'s absorbed path with the causal mask replaced by the tree's. `stripes`: the cache is
    striped by position over a DCP group (models/dcp.py).
    """
    q_nope_BTNH, q_rope_BTNR, fresh_BTY = mla.project(x_BTD, cos_sin)
    with jax.named_scope("attend_tree"):
        slots_BT = prefix_len_B[:, None] + jnp.arange(x_BTD.shape[1], dtype=jnp.int32)
        cache_LBSY = write_cache(cache_LBSY, layer, fresh_BTY, slots_BT if stripes is None else stripes.slots(slots_BT))
        # The fresh keys go through the cache dtype, as a chain verify reads them back from the cache.
        fresh_BTY = through_cache(fresh_BTY, cache_LBSY)
        out_BTD = mla_tree_attention(
            mla,
            q_nope_BTNH,
            q_rope_BTNR,
            fresh_BTY,
            cache_LBSY,
            layer,
            prefix_len_B,
            mask_BTS,
            kv_block=kv_block,
            stripes=stripes,
        )
    return out_BTD, cache_LBSY


def mla_tree_attention(
    mla: MLA,
    q_nope_BTNH: jax.Array,
    q_rope_BTNR: jax.Array,
    fresh_BSY: jax.Array,
    cache_LBSY: Cache,
    layer: jax.Array | int,
    prefix_len_B: jax.Array,
    mask_BTS: jax.Array,
    *,
    kv_block: int = KV_BLOCK,
    stripes: Stripes | None = None,
) -> jax.Array:
    """Absorbed MLA attention of T queries (`MLA.project`'s, rotated) over the cached prefix and the fresh entries
    `mask_BTS` marks: the partial output [B,T,D] fp32 (a verify step's tree nodes, or an MLA drafter's tree step over
    its scratch entries). With `stripes` the prefix pass is the DCP group's (`MLA.attend_striped`) and the fresh pass,
    which every device holds whole, runs for this device's heads only."""
    C = mla.kv_a_norm.shape[0]
    dtype = q_nope_BTNH.dtype
    q_abs_BTNC = ein("BTNH,CNH->BTNC", q_nope_BTNH, mla.kv_b_k[...])
    block, init = mla.absorbed_block(q_abs_BTNC, q_rope_BTNR, C), softmax_init(q_nope_BTNH, C)
    scale = mla.softmax_scale
    if stripes is None:
        args = (fresh_BSY, cache_LBSY, layer, prefix_len_B, mask_BTS, scale, kv_block, dtype)
        state = tree_attention(block, init, *args)
    else:
        B, T = mask_BTS.shape[:2]
        last_prefix_BT = jnp.broadcast_to((prefix_len_B - 1)[:, None], (B, T)).astype(jnp.int32)
        prefix = mla.attend_striped(q_abs_BTNC, q_rope_BTNR, cache_LBSY, layer, last_prefix_BT, kv_block, stripes)
        state = merge_softmax(prefix, online_softmax(init, *block(fresh_BSY.astype(dtype)), mask_BTS, scale))
    out_BTNA = ein("BTNC,CNA->BTNA", softmax_finish(state, dtype), mla.kv_b_v[...])
    return ein("BTNA,NAD->BTD", out_BTNA, mla.o[...], dtype=jnp.float32)


def compact_path(
    cache: Cache, prefix_len_B: jax.Array, path: jax.Array, num_accepted_B: jax.Array, *, batch_axis: int
) -> jax.Array:
    """Move the accepted path's cache entries to consecutive slots: slot prefix + path[j] -> prefix + j, j <= a.

    `cache` has its batch axis at `batch_axis` and its positions right after it: the target's latent cache
    [L, B, S, K] (batch_axis=1), the drafter's [B, S, ...] (batch_axis=0). The verify step wrote node t at slot
    prefix + t; after the move slots up to prefix + num_accepted hold the path, each node at prefix + its depth (its
    RoPE position). Everything else is untouched (slots past the path are dead and get overwritten later). One
    gather and one scatter of (max_depth + 1) entries per row; with a donated cache the scatter is in place.
    """
    B = prefix_len_B.shape[0]
    if isinstance(cache, Paged):
        return _compact_paged(cache, prefix_len_B, path, num_accepted_B)
    if cache.shape[batch_axis] != B:
        raise ValueError(f"cache: expected batch {B} at axis {batch_axis}, got shape {cache.shape}")
    if path.shape[0] != B or num_accepted_B.shape != (B,):
        raise ValueError(
            f"path / num_accepted_B: expected [B, max_depth + 1] / [B], got {path.shape}, {num_accepted_B.shape}"
        )
    S = cache.shape[batch_axis + 1]
    j = jnp.arange(path.shape[1], dtype=jnp.int32)  # [path]
    rows = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], path.shape)
    src = prefix_len_B[:, None] + path
    dst = jnp.where(j <= num_accepted_B[:, None], prefix_len_B[:, None] + j, S)  # S: dropped
    lead = (slice(None),) * batch_axis
    return cache.at[(*lead, rows, dst)].set(cache[(*lead, rows, src)], mode="drop")


def _compact_paged(cache: Paged, prefix_len_B: jax.Array, path: jax.Array, num_accepted_B: jax.Array) -> Paged:
    """`compact_path` on a paged target cache ([L, N, block, Y] through its rows' tables): the same moves, each
    position found in the row's own blocks."""
    j = jnp.arange(path.shape[1], dtype=jnp.int32)
    src_blocks, src_offsets = cache.slots(prefix_len_B[:, None] + path)
    dst = jnp.where(j <= num_accepted_B[:, None], prefix_len_B[:, None] + j, -1)  # -1: past the pool, dropped
    dst_blocks, dst_offsets = cache.slots(dst)
    moved = cache.pool[:, src_blocks, src_offsets]
    return cache._replace(pool=cache.pool.at[:, dst_blocks, dst_offsets].set(moved, mode="drop"))
