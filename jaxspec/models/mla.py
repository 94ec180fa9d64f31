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

Cache layouts and formats (dense or paged; the model dtype or packed fp8): cache.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.config import LATENT_NORM_EPS, KimiConfig
from jaxspec.models import rope
from jaxspec.models.cache import (
    Cache,
    Paged,
    cache_positions,
    read_block,
    read_entries,
    read_size,
    write_cache,
)
from jaxspec.models.dcp import Stripes
from jaxspec.models.kernels import paged_mla
from jaxspec.models.layers import NEG_INF, linear, ones, param, rms_norm
from jaxspec.models.quant import einsum as ein
from jaxspec.models.quant import head_block

AttnImpl = Literal["expanded", "absorbed"]
# Cache positions per block of the live-prefix loop. Larger blocks mean fewer loop iterations (each costs a little
# fixed overhead, notably on GPU) but up to kv_block - 1 dead positions read per step; 512 x 576 bf16 values per
# sequence is 590 KB, one small DMA on an accelerator.
KV_BLOCK = 512
# On XLA:CPU: one block of the default cache pool per iteration (a paged cache reads at least one of its blocks: a
# slice, where a read of several is a gather), as the Pallas kernels read the pool on accelerators. The bundled pair
# at the serving defaults (8 slots x 1,024 positions, prompts up to 256 tokens) served 1.14-1.43x the tokens/s of
# KV_BLOCK (benchmarks/results/kv_block.md; ad hoc, at 1,700 positions chain segments as fast over 1 row, 10% faster
# over 8).
CPU_KV_BLOCK = 64


def kv_block_for(platform: str | None) -> int:
    """Cache positions per block of the live-prefix attention loop for programs lowered for `platform` (a JAX
    platform name: "cpu", "tpu", "gpu", ...; None: not known, as for an abstract mesh naming no device): CPU_KV_BLOCK
    on the CPU, else KV_BLOCK."""
    return CPU_KV_BLOCK if platform == "cpu" else KV_BLOCK


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
        stripes: Stripes | None = None,
    ) -> tuple[jax.Array, Cache | None]:
        """Returns (partial attention output [B,T,D] in fp32, updated cache or None).

        `cache_LBSY` is the whole stacked cache (all layers; dense or `Paged`) and `layer` the index of this layer in
        it: the step writes its T entries there and reads back only each row's live blocks, so no per-layer copy of
        the buffer is made. `stripes`: the cache is striped by position over a DCP group (models/dcp.py); attention
        over it is then always absorbed.
        """
        C, dt = self.kv_a_norm.shape[0], x_BTD.dtype
        q_nope_BTNH, q_rope_BTNR, new_BTY = self.project(x_BTD, cos_sin)
        if stripes is not None and cache_LBSY is not None:
            impl = "absorbed"

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
                out_BTNA = softmax_finish(online_softmax(init, *block_fn(new_BTY), mask_BTS, self.softmax_scale), dt)
            else:
                slots_BT = q_pos_BT if stripes is None else stripes.slots(q_pos_BT)
                cache_LBSY = write_cache(cache_LBSY, layer, new_BTY, slots_BT)
                if stripes is None:
                    out_BTNA = self._attend_cache(impl, block_fn, init, cache_LBSY, layer, q_pos_BT, kv_block, dt)
                else:
                    state = self.attend_striped(*block_fn.queries, cache_LBSY, layer, q_pos_BT, kv_block, stripes)
                    out_BTNA = softmax_finish(state, dt)
            if impl == "absorbed":
                out_BTNA = ein("BTNC,CNA->BTNA", out_BTNA, self.kv_b_v[...])
        out_BTD = ein("BTNA,NAD->BTD", out_BTNA, self.o[...], dtype=jnp.float32)
        return out_BTD, cache_LBSY

    def _attend_cache(
        self, impl: AttnImpl, block_fn: Block, init: Softmax, cache: Cache, layer, q_pos_BT, kv_block, dt
    ):
        """The normalised attention output ([B,T,N,C] absorbed, [B,T,N,A] expanded) over each row's live cache: the
        XLA loop over each row's own blocks, or on a paged cache in the absorbed form the Pallas kernel where the
        program is lowered for a TPU or a GPU that takes its shapes (models/kernels/paged_mla.py)."""
        scale = self.softmax_scale

        def xla(q_abs, q_rope, pool, tables, q_pos):  # the paged absorbed form, as the kernel's fallback
            block = self.absorbed_block(q_abs, q_rope, q_abs.shape[-1])
            state = attend_live_prefix(Paged(pool, tables), layer, q_pos, block, init, scale, kv_block, dt)
            return softmax_finish(state, dt)

        if impl == "absorbed" and isinstance(cache, Paged):
            return paged_mla.attend_in_place(*block_fn.queries, cache, layer, q_pos_BT, scale=scale, xla=xla)
        return softmax_finish(attend_live_prefix(cache, layer, q_pos_BT, block_fn, init, scale, kv_block, dt), dt)

    def attend_striped(
        self, q_abs_BTNC, q_rope_BTNR, cache: Cache, layer, q_pos_BT, kv_block: int, stripes: Stripes
    ) -> Softmax:
        """Softmax state of this device's heads over a position-striped cache (models/dcp.py): the group's queries
        gathered, each device's stripe attended for all of them, the partial states merged by log-sum-exp."""
        C, dt = q_abs_BTNC.shape[-1], q_abs_BTNC.dtype
        q_BTGY = stripes.gather(jnp.concatenate([q_abs_BTNC, q_rope_BTNR.astype(dt)], axis=-1), axis=2)
        block = self.absorbed_block(q_BTGY[..., :C], q_BTGY[..., C:], C)
        init = softmax_init(q_BTGY, C)
        visible_BT, scale = stripes.visible(q_pos_BT), self.softmax_scale
        return stripes.merge(attend_live_prefix(cache, layer, visible_BT, block, init, scale, kv_block, dt))

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
