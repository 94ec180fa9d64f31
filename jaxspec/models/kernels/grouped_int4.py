"""Grouped INT4 matmul: rows sorted by expert, each tile of rows times ONE expert's packed INT4 weight.

`plan_tiles` turns the rows' expert ids into tiles (expert, window of `rows` sorted rows) over the hit experts
only, as megablox's `make_group_metadata` does; a window holding rows of two experts is computed by both tiles, each
writing only its own expert's rows. `grouped_matmul` runs them as a Pallas kernel: the tile table is read before
the weights, so only hit experts' packed weights and scales are loaded (TPU: scalar-prefetched index maps, whose DMA
is skipped while a block index repeats, so consecutive tiles of one expert load it once; GPU/Triton: loads at
tile-dependent offsets); INT4 is dequantised in registers and accumulated in fp32. Packed rows 2r / 2r+1 sit in the
low / high nibble, so the kernel contracts the even and the odd input columns against the two nibbles separately
and never interleaves them.

Lowerings: "tpu" (Mosaic) and "triton" (GPU), chosen by `backend`; `interpret=True` runs either on CPU.
"""

from __future__ import annotations

import functools
import math
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from jaxspec.models.quant import Int4Array

Backend = Literal["tpu", "triton"]
# Packed input rows dequantised per step inside a tile (x 2 values x `cols` outputs), and output columns per tile:
# bound the kernel's temporaries. Triton's dot operands live in shared memory (228 KB on an H200), TPU's in VMEM.
CHUNK = {"tpu": 512, "triton": 128}
COLS = {"tpu": 256, "triton": 128}


class Tiles(NamedTuple):
    """Tile t computes sorted rows [start[t], start[t] + rows) against expert[t] and writes those in [lo[t], hi[t]).
    Only the first `num` tiles are live; the rest repeat the last live tile (no new loads) and are skipped."""

    expert: jax.Array  # int32 [max tiles]
    start: jax.Array  # int32 [max tiles]
    lo: jax.Array  # int32 [max tiles]
    hi: jax.Array  # int32 [max tiles]
    num: jax.Array  # int32 [1]


def plan_tiles(expert_sorted: jax.Array, n_experts: int, rows: int, *, aligned: bool) -> Tiles:
    """Tiles over the hit experts for rows sorted by expert id (`expert_sorted`; ids >= n_experts: rows nobody
    computes). aligned: windows on multiples of `rows` (TPU block indexing; an expert straddling a boundary gets
    two consecutive tiles, which reuse its loaded weights); else each hit expert's windows start at its first row,
    so an expert with at most `rows` rows is exactly one tile. The caller pads `rows` spare rows at the end."""
    n_rows = expert_sorted.shape[0]
    count_E = jnp.zeros(n_experts + 1, jnp.int32).at[jnp.minimum(expert_sorted, n_experts)].add(1)[:n_experts]
    end_E = jnp.cumsum(count_E)
    start_E = end_E - count_E
    first_E = start_E // rows * rows if aligned else start_E
    n_E = jnp.where(count_E > 0, (end_E - first_E + rows - 1) // rows, 0)
    cum_E = jnp.cumsum(n_E)
    num = cum_E[-1]
    # Each hit expert needs ceil(rows it has / rows) tiles, plus one where a window boundary cuts it.
    max_tiles = n_rows // rows + min(n_experts, n_rows)
    t = jnp.minimum(jnp.arange(max_tiles, dtype=jnp.int32), jnp.maximum(num - 1, 0))
    e = jnp.minimum(jnp.searchsorted(cum_E, t, side="right", method="compare_all"), n_experts - 1).astype(jnp.int32)
    start = jnp.clip(first_E[e] + (t - (cum_E[e] - n_E[e])) * rows, 0, n_rows - rows)
    return Tiles(e, start.astype(jnp.int32), start_E[e], end_E[e], num.reshape(1))


def _dequant_dot(x_even, x_odd, packed, scale, group_size: int) -> jax.Array:
    """x_even @ lo + x_odd @ hi in fp32, where lo/hi are bf16(q * scale) of the two nibbles of `packed` [in/2, out]."""
    half, o = packed.shape
    p = packed.astype(jnp.int32)
    s = scale.astype(jnp.float32)[:, None, :]  # one scale per group_size/2 packed rows

    def deq(q):
        w = (q.astype(jnp.float32).reshape(half * 2 // group_size, group_size // 2, o) * s).reshape(half, o)
        return w.astype(scale.dtype).astype(x_even.dtype)  # rounded once to the scale dtype, as Int4Array does

    dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32)
    return dot(x_even, deq((p & 0xF) - 8)) + dot(x_odd, deq((p >> 4) - 8))


def _tile_dot(load, half: int, group_size: int, backend: Backend) -> jax.Array:
    """Sum over chunks of packed input rows (bounded temporaries; power-of-two blocks for Triton) of
    _dequant_dot(*load(packed rows, scale rows))."""
    chunk = math.gcd(half, CHUNK[backend])
    if chunk % (group_size // 2):
        raise ValueError(f"grouped_matmul: input dim {2 * half} does not split into whole groups of {group_size}")
    acc = None
    for k in range(0, half, chunk):
        part = _dequant_dot(*load(pl.ds(k, chunk), pl.ds(2 * k // group_size, 2 * chunk // group_size)), group_size)
        acc = part if acc is None else acc + part
    return acc


def row_mask(start, lo, hi, rows: int) -> jax.Array:
    r = start + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    return (r >= lo) & (r < hi)


def _tpu_kernel(
    e_ref, s_ref_start, lo_ref, hi_ref, num_ref, layer_ref, xe_ref, xo_ref, p_ref, s_ref, o_ref, *, rows, group_size
):
    t = pl.program_id(1)

    @pl.when(t < num_ref[0])
    def _():
        load = lambda k, ks: (xe_ref[:, k], xo_ref[:, k], p_ref[k, :], s_ref[ks, :])
        acc = _tile_dot(load, p_ref.shape[0], group_size, "tpu")
        keep = row_mask(s_ref_start[t], lo_ref[t], hi_ref[t], rows)
        o_ref[...] = jnp.where(keep, acc.astype(o_ref.dtype), o_ref[...])


def _triton_kernel(
    e_ref, start_ref, lo_ref, hi_ref, num_ref, layer_ref, xe_ref, xo_ref, p_ref, s_ref, o_ref, *, rows, cols, g
):
    j, t = pl.program_id(0), pl.program_id(1)

    @pl.when(t < num_ref[0])
    def _():
        e, start = e_ref[t], start_ref[t]
        r, c = pl.ds(start, rows), pl.ds(j * cols, cols)
        i = layer_ref[0]
        load = lambda k, ks: (xe_ref[r, k], xo_ref[r, k], p_ref[i, e, k, c], s_ref[i, e, ks, c])
        acc = _tile_dot(load, p_ref.shape[2], g, "triton")
        keep = row_mask(start, lo_ref[t], hi_ref[t], rows)
        pltriton.store(o_ref.at[r, c], acc.astype(o_ref.dtype), mask=jnp.broadcast_to(keep, acc.shape))


def grouped_matmul(
    x: jax.Array,
    w: Int4Array,
    tiles: Tiles,
    *,
    rows: int,
    out_dtype: jnp.dtype,
    backend: Backend,
    layer: jax.Array | None = None,
    cols: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """out[r] = x[r] @ dequant(w[expert of r]) for the rows r the tiles cover ([rows of x, out] of out_dtype; other
    rows are undefined). x: [sorted rows (a multiple of `rows`), in]; w: INT4 [experts, in, out], or a stack
    [layers, experts, in, out] read at `layer` (the stack is never sliced outside the kernel, so no layer copy);
    the tiles must be aligned for the TPU lowering."""
    if layer is None:
        w, layer = w[None], jnp.zeros((), jnp.int32)
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    n_rows, n_in = x.shape
    n_out = w.shape[3]
    if backend not in ("tpu", "triton"):
        raise ValueError(f"grouped_matmul: backend must be 'tpu' or 'triton', got {backend!r}")
    cols = min(cols or COLS[backend], n_out)
    if n_rows % rows or n_out % cols or w.shape[2] != n_in:
        raise ValueError(f"grouped_matmul: x {x.shape}, w {w.shape}, rows {rows}, cols {cols} do not tile")
    x_even, x_odd = x[:, 0::2], x[:, 1::2]
    grid = (n_out // cols, tiles.expert.shape[0])
    # Inside shard_map the result varies over every mesh axis some operand varies over (typed via a probe op).
    probe = x[0, 0].astype(jnp.float32) + w.packed[0, 0, 0, 0] + w.scale[0, 0, 0, 0] + tiles.expert[0] + layer[0]
    out = jax.ShapeDtypeStruct((n_rows, n_out), out_dtype, manual_axis_type=jax.typeof(probe).mat)
    if backend == "tpu":
        kernel = functools.partial(_tpu_kernel, rows=rows, group_size=w.group_size)
        x_spec = pl.BlockSpec(
            (rows, n_in // 2), lambda j, t, e, s, *_: (jax.lax.div(s[t], rows), 0)
        )  # starts >= 0: truncating div (no sign op)
        w_spec = lambda n: pl.BlockSpec((None, None, n, cols), lambda j, t, e, *a: (a[-1][0], e[t], 0, j))
        spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=grid,
            in_specs=[x_spec, x_spec, w_spec(n_in // 2), w_spec(n_in // w.group_size)],
            out_specs=pl.BlockSpec((rows, cols), lambda j, t, e, s, *_: (jax.lax.div(s[t], rows), j)),
        )
        params = pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"))
        call = pl.pallas_call(kernel, out, grid_spec=spec, compiler_params=params, interpret=interpret)
    else:
        kernel = functools.partial(_triton_kernel, rows=rows, cols=cols, g=w.group_size)
        params = pltriton.CompilerParams(num_warps=4, num_stages=2)
        call = pl.pallas_call(kernel, out, grid=grid, compiler_params=params, interpret=interpret)
    return call(*tiles, layer, x_even, x_odd, w.packed, w.scale)
