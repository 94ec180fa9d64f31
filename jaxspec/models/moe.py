"""Feed-forward blocks: the dense SwiGLU MLP and the DeepSeek-V3 MoE (sigmoid/noaux_tc router, routed experts,
shared expert).

Runs per device inside shard_map. The MLP hidden dim of dense and shared MLPs is split over the model axis, and the
routed experts are split over it too (expert parallel): each device computes its own experts' weighted outputs for
every token routed to them. Both give partial sums; the caller adds them and reduces once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.config import KimiConfig
from jaxspec.models import quant
from jaxspec.models.layers import param, swiglu, zeros
from sharding.mesh import MODEL


class MLP(nnx.Module):
    """SwiGLU MLP with its hidden dim split over the model axis; returns a partial sum in fp32."""

    def __init__(self, hidden: int, inner: int, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.gate = param(rngs, (hidden, inner), ("embed", "mlp"), dtype)
        self.up = param(rngs, (hidden, inner), ("embed", "mlp"), dtype)
        self.down = param(rngs, (inner, hidden), ("mlp", "embed"), dtype)

    def __call__(self, x_MD: jax.Array) -> jax.Array:
        h_MF = swiglu(quant.einsum("MD,DF->MF", x_MD, self.gate[...]), quant.einsum("MD,DF->MF", x_MD, self.up[...]))
        return quant.einsum("MF,FD->MD", h_MF, self.down[...], dtype=jnp.float32)


def _expert_weight(rngs: nnx.Rngs, shape: tuple[int, int, int], axes, dtype, group_size: int | None) -> nnx.Param:
    p = param(rngs, shape, axes, dtype if group_size is None else jnp.float32)
    if group_size is not None:
        p.set_value(quant.quantize(p.get_value(), group_size))
    return p


class MoE(nnx.Module):
    def __init__(self, cfg: KimiConfig, dtype: jnp.dtype, int4_experts: bool, rngs: nnx.Rngs):
        D, E, F = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
        g = cfg.quant.group_size if int4_experts else None
        if int4_experts and cfg.quant is None:
            raise ValueError("int4 experts need cfg.quant (a quantization_config)")
        self.router = param(rngs, (D, E), ("embed", None), dtype)
        self.router_bias = param(rngs, (E,), (None,), jnp.float32, zeros)  # e_score_correction_bias
        self.gate = _expert_weight(rngs, (E, D, F), ("experts", "embed", None), dtype, g)
        self.up = _expert_weight(rngs, (E, D, F), ("experts", "embed", None), dtype, g)
        self.down = _expert_weight(rngs, (E, F, D), ("experts", None, "embed"), dtype, g)
        self.shared = MLP(D, F * cfg.n_shared_experts, dtype, rngs)
        self.top_k, self.n_group, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor

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
                x_MD, idx_MK, w_MK, self.gate.get_value(), self.up.get_value(), self.down.get_value()
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


# Active experts are computed this many at a time, so the dequantised weights alive at once stay bounded
# (8 Kimi experts: 3 x 8 x 2048 x 7168 bf16 = 0.7 GB) however many tokens a step carries.
EXPERT_CHUNK = 8


def routed_experts(
    x_MD: jax.Array, idx_MK: jax.Array, w_MK: jax.Array, gate: quant.Weight, up: quant.Weight, down: quant.Weight
) -> jax.Array:
    """This device's experts' weighted outputs (partial sum over experts, fp32 [M, D]).

    Only experts that some token picked are computed: with M tokens at most M*K local experts are active, so a
    static capacity of min(E_local, M*K) (rounded up to whole chunks) is exact. Decode and verify (small M) touch and
    dequantise a handful of experts, not all of them; chunks of EXPERT_CHUNK bound the temporaries for large M.
    """
    M, K = idx_MK.shape
    E_local = gate.shape[0]
    first = jax.lax.axis_index(MODEL) * E_local
    # combine_ME[m, e]: routing weight of token m for local expert e (0 when not routed here).
    combine_ME = jnp.einsum("MK,MKE->ME", w_MK, jax.nn.one_hot(idx_MK - first, E_local, dtype=jnp.float32))
    chunk = min(EXPERT_CHUNK, E_local)
    n_chunks = -(-min(E_local, M * K) // chunk)
    # Local experts ordered by how many tokens picked them: every active expert lands in the first chunks.
    order_E = jax.lax.top_k(jnp.sum(combine_ME != 0, axis=0), E_local)[1]
    active_NC = order_E[: n_chunks * chunk].reshape(n_chunks, chunk)

    def one_chunk(acc_MD, ids_C):
        g, u, d = (_take(w, ids_C) for w in (gate, up, down))
        h_CMF = swiglu(quant.einsum("MD,CDF->CMF", x_MD, g), quant.einsum("MD,CDF->CMF", x_MD, u))
        y_CMD = quant.einsum("CMF,CFD->CMD", h_CMF, d, dtype=jnp.float32)
        return acc_MD + jnp.einsum("CMD,MC->MD", y_CMD, jnp.take(combine_ME, ids_C, axis=1)), None

    # The sum differs per device (each owns different experts): the scan carry must be typed as varying over MODEL.
    acc_MD = jax.lax.pcast(jnp.zeros_like(x_MD, dtype=jnp.float32), (MODEL,), to="varying")
    return jax.lax.scan(one_chunk, acc_MD, active_NC)[0]


def _take(w: quant.Weight, idx: jax.Array) -> quant.Weight:
    return w.take(idx, 0) if isinstance(w, quant.Int4Array) else jnp.take(w, idx, axis=0)
