"""Feed-forward blocks: the dense SwiGLU MLP and the DeepSeek-V3 MoE (sigmoid/noaux_tc router, routed experts,
shared expert).

Runs per device inside shard_map. The MLP hidden dim of dense and shared MLPs is split over the model axis, and the
routed experts are split over it too (expert parallel): each device computes its own experts' weighted outputs for
every token routed to them. Both give partial sums; the caller adds them and reduces once.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jaxspec.config import KimiConfig
from jaxspec.models import quant
from jaxspec.models.kernels import grouped_int4
from jaxspec.models.layers import fp8_linear_blocks, linear, param, swiglu, zeros
from sharding.rules import DEFAULT_RULES

ExpertImpl = Literal["auto", "xla", "pallas"]


class MLP(nnx.Module):
    """SwiGLU MLP with its hidden dim split over the model axis; returns a partial sum in fp32."""

    def __init__(self, hidden: int, inner: int, dtype: jnp.dtype, rngs: nnx.Rngs, blocks: tuple[int, int] | None):
        """`blocks`: the weights' FP8 blocks in our [in, out] layout (`fp8_linear_blocks`), None if unquantised."""
        self.gate = linear(rngs, (hidden, inner), ("embed", "mlp"), dtype, blocks)
        self.up = linear(rngs, (hidden, inner), ("embed", "mlp"), dtype, blocks)
        self.down = linear(rngs, (inner, hidden), ("mlp", "embed"), dtype, blocks)

    def __call__(self, x_MD: jax.Array) -> jax.Array:
        h_MF = swiglu(quant.einsum("MD,DF->MF", x_MD, self.gate[...]), quant.einsum("MD,DF->MF", x_MD, self.up[...]))
        return quant.einsum("MF,FD->MD", h_MF, self.down[...], dtype=jnp.float32)


def _expert_weight(
    rngs: nnx.Rngs, shape: tuple[int, int, int], axes, dtype, group_size: int | None, blocks: tuple[int, int] | None
) -> nnx.Param:
    """INT4 with a `group_size`, else FP8 with `blocks`, else `dtype`."""
    if group_size is None:
        return linear(rngs, shape, axes, dtype, blocks)
    p = param(rngs, shape, axes, jnp.float32)
    p.set_value(quant.quantize(p.get_value(), group_size))
    return p


@struct.dataclass
class LayerSlice:
    """Layer `layer` of a stacked routed-expert weight [L, E, I, O], left unsliced: experts are read straight from
    the stack. (Sliced per layer by the layer scan, XLA copies the layer's WHOLE expert stack every step.)"""

    stack: quant.Weight
    layer: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.stack.shape[1:]


# The routed experts' projections, and their paths within a MoE decoder layer (`MoE`'s gate/up/down under "mlp").
EXPERT_PROJS = ("gate", "up", "down")
ROUTED_PATHS = tuple(("mlp", proj) for proj in EXPERT_PROJS)


def is_routed_weight(path: tuple, _value=None) -> bool:
    """nnx filter: the routed-expert weights of a MoE stack (kept whole by the layer scan, see LayerSlice)."""
    return tuple(path[-2:]) in ROUTED_PATHS


class MoE(nnx.Module):
    def __init__(
        self,
        cfg: KimiConfig,
        dtype: jnp.dtype,
        int4_experts: bool,
        rngs: nnx.Rngs,
        *,
        axis: str = DEFAULT_RULES.model_axis,
    ):
        D, E, F = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
        g = cfg.quant.group_size if int4_experts else None
        if int4_experts and cfg.quant is None:
            raise ValueError("int4 experts need cfg.quant (a quantization_config)")
        self.router = param(rngs, (D, E), ("embed", None), dtype)
        self.router_bias = param(rngs, (E,), (None,), jnp.float32, zeros)  # e_score_correction_bias
        blocks = fp8_linear_blocks(cfg)
        self.gate = _expert_weight(rngs, (E, D, F), ("experts", "embed", None), dtype, g, blocks)
        self.up = _expert_weight(rngs, (E, D, F), ("experts", "embed", None), dtype, g, blocks)
        self.down = _expert_weight(rngs, (E, F, D), ("experts", None, "embed"), dtype, g, blocks)
        self.shared = MLP(D, F * cfg.n_shared_experts, dtype, rngs, blocks)
        self.top_k, self.n_group, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.axis = axis  # the expert-parallel mesh axis (ShardingRules.model_axis)
        self.impl: ExpertImpl = "auto"  # static (in the graphdef); see `Target.with_expert_impl`

    def __call__(self, x_MD: jax.Array) -> jax.Array:
        with jax.named_scope("router"):
            idx_MK, w_MK = route(
                x_MD,
                self.router[...],
                self.router_bias[...],
                top_k=self.top_k,
                n_group=self.n_group,
                topk_group=self.topk_group,
                norm_topk_prob=self.norm_topk_prob,
                scaling=self.scaling,
            )
        with jax.named_scope("routed_experts"):
            routed = routed_experts(
                x_MD,
                idx_MK,
                w_MK,
                self.gate.get_value(),
                self.up.get_value(),
                self.down.get_value(),
                impl=self.impl,
                axis=self.axis,
            )
        with jax.named_scope("shared_expert"):
            return routed + self.shared(x_MD)


def route(
    x_MD: jax.Array,
    router_DE: jax.Array,
    bias_E: jax.Array,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[jax.Array, jax.Array]:
    """Sigmoid scores, bias-corrected group-limited top-k selection, unbiased normalised weights (all fp32)."""
    scores_ME = jax.nn.sigmoid(jnp.einsum("MD,DE->ME", x_MD.astype(jnp.float32), router_DE.astype(jnp.float32)))
    choice_ME = scores_ME + bias_E
    if n_group > 1:
        M, E = choice_ME.shape
        grouped = choice_ME.reshape(M, n_group, E // n_group)
        group_score_MG = jax.lax.top_k(grouped, 2)[0].sum(-1)
        keep_MG = jax.nn.one_hot(jax.lax.top_k(group_score_MG, topk_group)[1], n_group).sum(-2) > 0
        choice_ME = jnp.where(jnp.repeat(keep_MG, E // n_group, axis=-1), choice_ME, -jnp.inf)
    idx_MK = jax.lax.top_k(choice_ME, top_k)[1]
    w_MK = jnp.take_along_axis(scores_ME, idx_MK, axis=-1)
    if norm_topk_prob:
        w_MK = w_MK / (w_MK.sum(-1, keepdims=True) + 1e-20)
    return idx_MK, w_MK * scaling


def _tile_rows(pairs: int, experts: int) -> int:
    """Sorted rows per tile: about the rows an expert gets under uniform routing (a power of two in [8, 128]);
    decode and verify get 8, a long prefill up to 128 (fewer, fuller tiles)."""
    return min(128, max(8, 1 << max(0, -(-pairs // experts) - 1).bit_length()))


def routed_experts(
    x_MD: jax.Array,
    idx_MK: jax.Array,
    w_MK: jax.Array,
    gate: quant.Weight,
    up: quant.Weight,
    down: quant.Weight,
    *,
    impl: ExpertImpl = "auto",
    interpret: grouped_int4.Backend | None = None,
    axis: str = DEFAULT_RULES.model_axis,
) -> jax.Array:
    """This device's experts' weighted outputs (partial sum over experts, fp32 [M, D]).

    The (token, expert) pairs routed to this device are sorted by expert and cut into tiles (expert, window of
    sorted rows) over the hit experts only; each tile reads one expert's weights. Work and weight reads scale with
    the distinct local experts hit (decode: one tile per hit expert), not with E_local.

    impl: "xla" (a loop over the tiles); "pallas" (the grouped INT4 kernel: Mosaic on TPU, Triton on GPU; an error
    elsewhere, or with `interpret` that lowering in the Pallas interpreter); "auto": for INT4 experts the kernel when
    lowering for TPU/CUDA and xla otherwise (chosen per lowering platform), xla for float experts.
    """
    args = (x_MD, idx_MK, w_MK, gate, up, down)
    run = functools.partial(_routed, axis=axis)
    int4 = isinstance(gate.stack if isinstance(gate, LayerSlice) else gate, quant.Int4Array)
    if impl not in ("auto", "xla", "pallas"):
        raise ValueError(f"routed_experts: impl must be 'auto', 'xla' or 'pallas', got {impl!r}")
    if impl == "pallas" and not int4:
        raise ValueError("routed_experts: impl='pallas' needs INT4 experts (the kernel reads packed INT4 weights)")
    if interpret is not None:
        if impl != "pallas":
            raise ValueError(f"routed_experts: interpret={interpret!r} needs impl='pallas', got {impl!r}")
        return run(*args, backend=interpret, interpret=True)
    if impl == "xla" or not int4:
        return run(*args, backend=None)
    if impl == "pallas" and jax.default_backend() not in ("tpu", "gpu"):
        raise ValueError(
            f"routed_experts: impl='pallas' has no lowering for backend {jax.default_backend()!r} (TPU or GPU); "
            "use impl='xla', or interpret='tpu'/'triton' to run a lowering in the Pallas interpreter"
        )
    kernels = dict(tpu=functools.partial(run, backend="tpu"), cuda=functools.partial(run, backend="triton"))
    default = dict(default=functools.partial(run, backend=None)) if impl == "auto" else {}
    return jax.lax.platform_dependent(*args, **kernels, **default)


def _routed(
    x_MD, idx_MK, w_MK, gate, up, down, *, axis: str, backend: grouped_int4.Backend | None, interpret: bool = False
):
    M, K = idx_MK.shape
    E_local = gate.shape[0]
    rows = _tile_rows(M * K, E_local * jax.lax.axis_size(axis))
    rows = max(rows, 16) if backend else rows  # TPU bf16 sublane tile / Triton dot minimum
    local_MK = idx_MK - jax.lax.axis_index(axis) * E_local
    mine_MK = (local_MK >= 0) & (local_MK < E_local)
    # Pairs (flattened M*K, padded to whole tiles), sorted by local expert; other devices' pairs sort last.
    expert_pairs = jnp.where(mine_MK, local_MK, E_local).reshape(-1)
    # Whole windows plus `rows` spare rows, so no window of a hit expert runs past the end (see plan_tiles).
    expert_pairs = jnp.pad(expert_pairs, (0, rows + -(M * K) % rows), constant_values=E_local)
    order_pairs = jnp.argsort(expert_pairs, stable=True).astype(jnp.int32)
    tiles = grouped_int4.plan_tiles(expert_pairs[order_pairs], E_local, rows, aligned=backend == "tpu")
    x_sorted = jnp.take(x_MD, jnp.minimum(order_pairs // K, M - 1), axis=0)
    if backend is None:
        y_sorted = _experts_xla(x_sorted, tiles, gate, up, down, rows, axis)[0]
    else:

        def mm(x, w, out_dtype):
            stack, layer = (w.stack, w.layer) if isinstance(w, LayerSlice) else (w, None)
            kw = dict(rows=rows, backend=backend, layer=layer, interpret=interpret, out_dtype=out_dtype)
            return grouped_int4.grouped_matmul(x, stack, tiles, **kw)

        h_sorted = swiglu(mm(x_sorted, gate, x_MD.dtype), mm(x_sorted, up, x_MD.dtype))
        y_sorted = mm(h_sorted, down, jnp.float32)
    # Back to (token, k) order. Rows of other devices' pairs were never computed and may hold anything: select.
    inv_pairs = jnp.zeros_like(order_pairs).at[order_pairs].set(jnp.arange(order_pairs.shape[0], dtype=jnp.int32))
    y_MKD = jnp.take(y_sorted, inv_pairs[: M * K], axis=0).reshape(M, K, -1)
    return jnp.einsum("MKD,MK->MD", jnp.where(mine_MK[..., None], y_MKD, 0), jnp.where(mine_MK, w_MK, 0))


def _experts_xla(
    x_sorted: jax.Array,
    tiles: grouped_int4.Tiles,
    gate: quant.Weight,
    up: quant.Weight,
    down: quant.Weight,
    rows: int,
    axis: str,
) -> tuple[jax.Array, jax.Array]:
    """A data-dependent loop over the live tiles: each slices ONE expert's (packed) weights, dequantises that slice
    and computes its block of rows. Returns (y [sorted rows, D] fp32 for the rows the tiles own, iterations run)."""

    def tile(carry):
        t, y_sorted = carry
        # Tie the stacks to the loop counter: XLA:CPU has no bf16 dynamic-slice, so it converts a bf16 scale stack
        # to f32 WHOLE, then hoists that loop-invariant convert out of the loops (measured: 0.8 s of a 1.3 s
        # step). Behind the barrier the convert fuses with the slice and touches only this expert.
        (gate_, up_, down_), t = jax.lax.optimization_barrier(((gate, up, down), t))
        e, start = tiles.expert[t], tiles.start[t]
        g, u, d = (_expert(w, e) for w in (gate_, up_, down_))
        x_MD = jax.lax.dynamic_slice_in_dim(x_sorted, start, rows)
        h_MF = swiglu(quant.matmul(x_MD, g), quant.matmul(x_MD, u))
        y_MD = quant.matmul(h_MF, d, dtype=jnp.float32)
        keep_M = grouped_int4.row_mask(start, tiles.lo[t], tiles.hi[t], rows)
        y_MD = jax.lax.dynamic_slice_in_dim(y_sorted, start, rows) + jnp.where(keep_M, y_MD, 0)
        return t + 1, jax.lax.dynamic_update_slice_in_dim(y_sorted, y_MD, start, 0)

    # Each device owns different experts: the loop carry must be typed as varying over the expert axis.
    y_sorted = jax.lax.pcast(jnp.zeros_like(x_sorted, jnp.float32), (axis,), to="varying")
    t = jax.lax.pcast(jnp.int32(0), (axis,), to="varying")
    t, y_sorted = jax.lax.while_loop(lambda c: c[0] < tiles.num[0], tile, (t, y_sorted))
    return y_sorted, t


def _expert(w: quant.Weight | LayerSlice, e: jax.Array) -> quant.Weight:
    """One expert's weight [I, O] (still packed if INT4, still FP8 with its scales if FP8), by a dynamic index: reads
    only that expert."""
    lead = (w.layer, e) if isinstance(w, LayerSlice) else (e,)
    w = w.stack if isinstance(w, LayerSlice) else w

    def take(a):
        start = (*lead, *(jnp.zeros((), jnp.int32),) * 2)
        return jax.lax.dynamic_slice(a, start, (*(1,) * len(lead), *a.shape[-2:])).reshape(a.shape[-2:])

    if isinstance(w, quant.Fp8Array):
        return quant.Fp8Array(take(w.values), take(w.scale), w.blocks)
    if not isinstance(w, quant.Int4Array):
        return take(w)
    return quant.Int4Array(take(w.packed), take(w.scale), w.group_size)
