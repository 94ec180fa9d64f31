"""Paged MLA attention: the absorbed-form attention of `mla.py`, reading each row's latent cache through its block
table from a shared pool instead of from a dense per-row buffer.

The pool is the serving executor's target cache, `[L, blocks, block, Y]` (Y = C + R: latent and RoPE key; or the
packed fp8 entries, Y + 4 uint8), and `tables` `[B, per row]` names the pool block holding each row's positions
[j * block, (j + 1) * block). A row's query positions `q_pos_BT` fix what it sees (cache positions <= its query's)
and how many of its table's blocks are live: max position // block + 1. The kernel folds the live blocks into an
online softmax one block at a time, exactly as `mla.attend_live_prefix` and `mla.online_softmax` do over a dense
cache with `kv_block = block` (same roundings in the compute dtype, same fp32 state), and never reads a block past
a row's live ones, so table entries there (the null block 0) contribute nothing. The step's new entries must be in
the pool before the call (as `MLA.__call__` writes before it reads).

Lowerings, chosen by `backend`: "tpu" (Mosaic): grid (rows, table entries), the table and live-block counts
scalar-prefetched so each step's index map DMAs the block the table names; steps past a row's live blocks repeat
its last live block (no new DMA) and are skipped. "triton" (GPU): one program per row looping over its live blocks,
loading each at the table's offset. `interpret=True` runs either on CPU. Heads and query tokens are flattened to
one axis of query rows (T x N, token-major) so each block is two matmuls.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from jaxspec.models.cache import FP8, PACKED, SCALE_BYTES, Paged
from jaxspec.models.layers import NEG_INF

Backend = Literal["tpu", "triton"]
LANES = 128  # TPU vector lane width: the latent/RoPE split of a block must fall on a lane-tile edge
MIN_DOT = 16  # Triton's smallest dot operand dimension


def _entries(ref, at: tuple, C: int, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """(latent [block, C], RoPE key [block, R]) of the block of cache entries `ref[*at]` in the compute dtype, loaded
    as column ranges (powers of two for Triton); packed fp8 entries are dequantised as `cache.dequantize_entries` does
    (value x its token's float32 scale, then rounded to the compute dtype)."""
    width = ref.shape[-1]
    Y = width - SCALE_BYTES if ref.dtype == PACKED else width
    latent, k_rope = ref[(*at, slice(None), pl.ds(0, C))], ref[(*at, slice(None), pl.ds(C, Y - C))]
    if ref.dtype != PACKED:
        return latent.astype(dtype), k_rope.astype(dtype)
    # The scale's little-endian bytes, one column each (no reshaping bitcast, no value slicing: Triton has neither).
    byte = lambda i: ref[(*at, slice(None), pl.ds(Y + i, 1))].astype(jnp.uint32) << (8 * i)
    bits = byte(0) | byte(1) | byte(2) | byte(3)
    scale = jax.lax.bitcast_convert_type(bits, jnp.float32)
    deq = lambda v: (jax.lax.bitcast_convert_type(v, FP8).astype(jnp.float32) * scale).astype(dtype)
    return deq(latent), deq(k_rope)


def _fold(state, q_abs, q_rope, latent, k_rope, q_pos, start, scale: float):
    """One block into the online softmax over query rows: state (max [rows, 1], denominator [rows, 1], output
    [rows, C], fp32); q_pos [rows, 1] the rows' positions, `start` the block's first position. Mirrors
    `mla.online_softmax` over `MLA.absorbed_block`, roundings included."""
    m, denom, acc = state
    dt = q_abs.dtype
    nt = functools.partial(jax.lax.dot_general, dimension_numbers=(((1,), (1,)), ((), ())))
    s = nt(q_abs, latent, preferred_element_type=jnp.float32).astype(dt)
    s = s + nt(q_rope, k_rope, preferred_element_type=jnp.float32).astype(dt)
    mask = start + jax.lax.broadcasted_iota(jnp.int32, (1, latent.shape[0]), 1) <= q_pos
    s = jnp.where(mask, s.astype(jnp.float32) * scale, NEG_INF)
    m_new = jnp.maximum(m, s.max(axis=-1, keepdims=True))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
    mixed = jnp.dot(p.astype(dt), latent, preferred_element_type=jnp.float32).astype(dt).astype(jnp.float32)
    return m_new, denom * alpha + p.sum(axis=-1, keepdims=True), acc * alpha + mixed


def _init(rows: int, C: int):
    return jnp.full((rows, 1), NEG_INF, jnp.float32), jnp.zeros((rows, 1), jnp.float32), jnp.zeros((rows, C))


def _tpu_kernel(
    tab_ref, live_ref, layer_ref, qpos_ref, qa_ref, qr_ref, kv_ref, o_ref, m_ref, l_ref, acc_ref, *, C, scale
):
    b, j = pl.program_id(0), pl.program_id(1)

    @pl.when(j == 0)
    def _():
        m_ref[...], l_ref[...], acc_ref[...] = _init(*acc_ref.shape)

    @pl.when(j < live_ref[b])
    def _():
        latent, k_rope = _entries(kv_ref, (), C, qa_ref.dtype)
        state = (m_ref[...], l_ref[...], acc_ref[...])
        state = _fold(state, qa_ref[...], qr_ref[...], latent, k_rope, qpos_ref[...], j * kv_ref.shape[0], scale)
        m_ref[...], l_ref[...], acc_ref[...] = state

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
        o_ref[...] = (acc_ref[...] / l_ref[...]).astype(o_ref.dtype)


def _triton_kernel(tab_ref, live_ref, layer_ref, qpos_ref, qa_ref, qr_ref, pool_ref, o_ref, *, C, scale, per_row):
    b = pl.program_id(0)
    q_abs, q_rope, q_pos = qa_ref[b], qr_ref[b], qpos_ref[b]
    block = pool_ref.shape[2]

    def body(j, state):
        latent, k_rope = _entries(pool_ref, (layer_ref[0], tab_ref[b * per_row + j]), C, q_abs.dtype)
        return _fold(state, q_abs, q_rope, latent, k_rope, q_pos, j * block, scale)

    _, denom, acc = jax.lax.fori_loop(0, live_ref[b], body, _init(q_abs.shape[0], C))
    o_ref[b] = (acc / denom).astype(o_ref.dtype)


def supports(backend: Backend, C: int, R: int, block: int) -> bool:
    """Whether the `backend` lowering takes a latent of C, a RoPE key of R and pool blocks of `block` positions."""
    pow2 = lambda n: n >= MIN_DOT and n & (n - 1) == 0  # noqa: E731
    if backend == "tpu":
        return C % LANES == 0 and block % 8 == 0
    return pow2(C) and pow2(R) and pow2(block)


def attend_in_place(
    q_abs_BTNC: jax.Array,
    q_rope_BTNR: jax.Array,
    cache: Paged,
    layer: jax.Array | int,
    q_pos_BT: jax.Array,
    *,
    scale: float,
    xla: Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array],
) -> jax.Array:
    """The absorbed attention output [B, T, N, C] over a paged target cache, read in place: this kernel when the
    program is lowered for a TPU or a CUDA GPU and its shape rules hold there (`supports`), else `xla(q_abs, q_rope,
    pool, tables, q_pos)`, the model's XLA path (chosen per lowering platform, as the grouped INT4 kernel is)."""
    (C, R), block = (q_abs_BTNC.shape[-1], q_rope_BTNR.shape[-1]), cache.block
    dtype = jax.eval_shape(xla, q_abs_BTNC, q_rope_BTNR, cache.pool, cache.tables, q_pos_BT).dtype

    def kernel(backend: Backend):  # the fallback's dtype, so every branch returns the same type
        return lambda *a: paged_mla_attention(*a, scale=scale, backend=backend, layer=layer).astype(dtype)

    branches = {p: kernel(b) for p, b in (("tpu", "tpu"), ("cuda", "triton")) if supports(b, C, R, block)}
    args = (q_abs_BTNC, q_rope_BTNR, cache.pool, cache.tables, q_pos_BT)
    if not branches:
        return xla(*args)
    return jax.lax.platform_dependent(*args, **branches, default=xla)


def _check(q_abs_BTNC, q_rope_BTNR, pool, tables, q_pos_BT, backend) -> None:
    """Refuse what the kernel cannot run, naming the argument and what was expected."""
    if backend not in ("tpu", "triton"):
        raise ValueError(f"paged_mla_attention: backend must be 'tpu' or 'triton', got {backend!r}")
    if q_abs_BTNC.ndim != 4 or q_rope_BTNR.shape[:3] != q_abs_BTNC.shape[:3] or q_rope_BTNR.ndim != 4:
        raise ValueError(f"q_rope_BTNR: expected [B, T, N, R] beside q_abs {q_abs_BTNC.shape}, got {q_rope_BTNR.shape}")
    (B, T, _, C), R = q_abs_BTNC.shape, q_rope_BTNR.shape[-1]
    Y = C + R + (SCALE_BYTES if pool.dtype == PACKED else 0)
    if pool.ndim != 4 or pool.shape[-1] != Y:
        raise ValueError(
            f"pool: expected [L, blocks, block, {Y}] (C + R{' + scale bytes' * (Y > C + R)}), got {pool.shape}"
        )
    if tables.ndim != 2 or tables.shape[0] != B or tables.dtype != jnp.int32:
        raise ValueError(f"tables: expected int32 [{B}, blocks per row], got {tables.dtype} {tables.shape}")
    if q_pos_BT.shape != (B, T):
        raise ValueError(f"q_pos_BT: expected [{B}, {T}], got {q_pos_BT.shape}")
    block = pool.shape[2]
    if backend == "tpu" and not supports("tpu", C, R, block):
        raise ValueError(
            f"q_abs_BTNC / pool: the TPU lowering needs C % {LANES} == 0 and block % 8 == 0, got C {C}, block {block}"
        )
    if backend == "triton" and not supports("triton", C, R, block):
        raise ValueError(
            f"q_abs_BTNC / q_rope_BTNR / pool: Triton needs C, R and block powers of two >= {MIN_DOT}, "
            f"got {C}, {R}, {block}"
        )


def paged_mla_attention(
    q_abs_BTNC: jax.Array,
    q_rope_BTNR: jax.Array,
    pool: jax.Array,
    tables: jax.Array,
    q_pos_BT: jax.Array,
    *,
    scale: float,
    backend: Backend,
    layer: jax.Array | int = 0,
    interpret: bool = False,
) -> jax.Array:
    """Absorbed-form attention output [B, T, N, C] (q_abs's dtype, normalised: `mla.softmax_finish` of the state) of
    queries q_abs (W_uk folded in) and rotated q_rope over the cache positions <= each query's position, read from
    `pool[layer]` ([L, blocks, block, Y], either cache format; the stack is never sliced outside the kernel) through
    `tables` (int32 [B, blocks per row]). `scale` is the model's softmax scale."""
    _check(q_abs_BTNC, q_rope_BTNR, pool, tables, q_pos_BT, backend)
    (B, T, N, C), R, per_row, block = q_abs_BTNC.shape, q_rope_BTNR.shape[-1], tables.shape[1], pool.shape[2]
    rows = T * N if backend == "tpu" else max(MIN_DOT, pl.next_power_of_2(T * N))
    pad = lambda x: jnp.pad(x.reshape(B, T * N, -1), ((0, 0), (0, rows - T * N), (0, 0)))
    q_abs, q_rope, q_pos = pad(q_abs_BTNC), pad(q_rope_BTNR), pad(jnp.repeat(q_pos_BT.astype(jnp.int32), N, axis=1))
    live_B = jnp.clip(jnp.max(q_pos_BT, axis=1).astype(jnp.int32) // block + 1, 0, per_row)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    # Inside shard_map the result varies over every mesh axis some operand varies over (typed via a probe op).
    probe = q_abs[0, 0, 0].astype(jnp.float32) + q_rope[0, 0, 0] + pool[0, 0, 0, 0] + tables[0, 0] + q_pos[0, 0, 0]
    out = jax.ShapeDtypeStruct((B, rows, C), q_abs.dtype, manual_axis_type=jax.typeof(probe + layer[0]).mat)
    scalars = (tables.reshape(-1), live_B, layer)
    if backend == "tpu":
        call = _tpu_call(out, rows, C, R, per_row, pool.shape[1:], scale, interpret)
    else:
        kernel = functools.partial(_triton_kernel, C=C, scale=scale, per_row=per_row)
        params = pltriton.CompilerParams(num_warps=4, num_stages=2)
        call = pl.pallas_call(kernel, out, grid=(B,), compiler_params=params, interpret=interpret)
    return call(*scalars, q_pos, q_abs, q_rope, pool)[:, : T * N].reshape(B, T, N, C)


def _tpu_call(out, rows: int, C: int, R: int, per_row: int, entry_shape, scale: float, interpret: bool):
    """The Mosaic pallas_call: grid (row, table entry), the block table and live counts scalar-prefetched."""

    def kv_index(b, j, tab, live, layer):  # past a row's live blocks: its last live one again (no new DMA)
        return layer[0], tab[b * per_row + jnp.maximum(jnp.minimum(j, live[b] - 1), 0)], 0, 0

    per_b = lambda width: pl.BlockSpec((None, rows, width), lambda b, j, *_: (b, 0, 0))
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(out.shape[0], per_row),
        in_specs=[per_b(1), per_b(C), per_b(R), pl.BlockSpec((None, None, *entry_shape[1:]), kv_index)],
        out_specs=per_b(C),
        scratch_shapes=[pltpu.VMEM((rows, 1), jnp.float32), pltpu.VMEM((rows, 1), jnp.float32)]
        + [pltpu.VMEM((rows, C), jnp.float32)],
    )
    params = pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"))
    kernel = functools.partial(_tpu_kernel, C=C, scale=scale)
    return pl.pallas_call(kernel, out, grid_spec=spec, compiler_params=params, interpret=interpret)
