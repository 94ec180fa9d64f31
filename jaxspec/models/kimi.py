"""The Kimi-K2.5 / DeepSeek-V3 target model (Flax NNX), written for one device of a manual-SPMD mesh.

`KimiModel.__call__` runs inside `jax.shard_map` over the ("data", "model") mesh: it sees per-device shards of
every weight (heads, experts, MLP hidden and vocabulary split over "model") and states its collectives:
one psum for the vocab-split embedding, then per decoder layer exactly two (after attention; after the dense MLP or
the routed + shared experts), and none for the head (logits stay vocab-split). `jaxspec.runtime.Target` wraps it in
shard_map/jit for users; with a 1x1 mesh the same code is the single-device model.

Layers are stacked (leading "layers" axis) and run under `lax.scan`: the dense first layers in one stack, the MoE
layers in another.

Hidden-state capture convention (the project's ONE convention, used by the drafter and training too):
    layer id k means "the residual stream at the OUTPUT of decoder layer k", 0-indexed,
which is HF `output_hidden_states[k + 1]` for k < num_hidden_layers - 1 (HF's last entry has the final norm applied).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.config import KimiConfig
from jaxspec.models import quant, rope
from jaxspec.models.dcp import Stripes
from jaxspec.models.layers import fp8_linear_blocks, ones, param, rms_norm
from jaxspec.models.mla import KV_BLOCK, MLA, AttnImpl
from jaxspec.models.moe import MLP, LayerSlice, MoE, is_routed_weight
from jaxspec.models.tree_attention import tree_verify_mla
from sharding.rules import DEFAULT_RULES, ShardingRules


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: KimiConfig, dtype: jnp.dtype, moe: bool, int4_experts: bool, rngs: nnx.Rngs, *, axis: str):
        """`axis`: the mesh axis of tensor/expert parallelism (`ShardingRules.model_axis`) the layer reduces over."""
        D = cfg.hidden_size
        self.input_norm = param(rngs, (D,), ("embed",), dtype, ones)
        self.post_attn_norm = param(rngs, (D,), ("embed",), dtype, ones)
        self.attn = MLA(cfg, dtype, rngs)
        if moe:
            self.mlp = MoE(cfg, dtype, int4_experts, rngs, axis=axis)
        else:
            self.mlp = MLP(D, cfg.intermediate_size, dtype, rngs, fp8_linear_blocks(cfg))
        self.eps, self.axis = cfg.rms_norm_eps, axis

    def __call__(
        self,
        x_BTD,
        cos_sin,
        pos_BT,
        cache_LBSY,
        layer,
        impl: AttnImpl,
        kv_block: int = KV_BLOCK,
        tree_mask_BTS=None,
        stripes: Stripes | None = None,
    ):
        """`tree_mask_BTS`: verify a draft tree (see `KimiModel.__call__`) instead of T consecutive tokens;
        `stripes`: the cache is striped by position over DCP groups (models/dcp.py)."""
        B, T, D = x_BTD.shape
        with jax.named_scope("attention"):
            x_norm_BTD = rms_norm(x_BTD, self.input_norm[...], self.eps)
            if tree_mask_BTS is None:
                attn_BTD, cache_LBSY = self.attn(
                    x_norm_BTD, cos_sin, pos_BT, cache_LBSY, layer, impl, kv_block=kv_block, stripes=stripes
                )
            else:  # the root (node 0) sits at the prefix length: its position
                attn_BTD, cache_LBSY = tree_verify_mla(
                    self.attn,
                    x_norm_BTD,
                    cos_sin,
                    pos_BT[:, 0],
                    tree_mask_BTS,
                    cache_LBSY,
                    layer,
                    kv_block=kv_block,
                    stripes=stripes,
                )
            h_BTD = x_BTD + jax.lax.psum(attn_BTD, self.axis).astype(x_BTD.dtype)
        with jax.named_scope("mlp"):
            y_MD = self.mlp(rms_norm(h_BTD, self.post_attn_norm[...], self.eps).reshape(B * T, D))
            out_BTD = h_BTD + jax.lax.psum(y_MD, self.axis).astype(x_BTD.dtype).reshape(B, T, D)
        return out_BTD, cache_LBSY


def stacked(make: Callable[[nnx.Rngs], nnx.Module], n: int, rngs: nnx.Rngs) -> nnx.Module:
    """n copies of a module with every weight stacked on a leading "layers" axis (for lax.scan)."""
    keys = jax.random.split(rngs.params(), n)
    stack = nnx.vmap(lambda k: make(nnx.Rngs(params=k)), in_axes=0, out_axes=0)(keys)
    for _, var in nnx.to_flat_state(nnx.state(stack)):
        var.set_metadata(logical_axes=("layers", *var.get_metadata()["logical_axes"]))
    return stack


class KimiModel(nnx.Module):
    def __init__(
        self,
        cfg: KimiConfig,
        *,
        dtype: jnp.dtype = jnp.bfloat16,
        int4_experts: bool | None = None,
        rules: ShardingRules = DEFAULT_RULES,
        rngs: nnx.Rngs,
    ):
        """`rules` name the mesh axis the per-device forward reduces over (`ShardingRules.model_axis`)."""
        int4_experts = cfg.quant is not None if int4_experts is None else int4_experts
        D, V, k = cfg.hidden_size, cfg.vocab_size, cfg.first_k_dense_replace
        self.config = cfg
        self.dtype = dtype
        self.int4_experts = int4_experts
        self.axis = axis = rules.model_axis
        self.embed = param(rngs, (V, D), ("vocab", "embed"), dtype)
        self.dense_layers = (
            stacked(lambda r: DecoderLayer(cfg, dtype, False, False, r, axis=axis), k, rngs) if k else None
        )
        n_moe = cfg.num_moe_layers
        self.moe_layers = (
            stacked(lambda r: DecoderLayer(cfg, dtype, True, int4_experts, r, axis=axis), n_moe, rngs)
            if n_moe
            else None
        )
        self.final_norm = param(rngs, (D,), ("embed",), dtype, ones)
        self.lm_head = param(rngs, (D, V), ("embed", "vocab"), dtype)
        self.rope_freqs, self.rope_factor = rope.inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.rope_freqs = tuple(float(f) for f in self.rope_freqs)  # static: keep numpy out of the graph state

    def __call__(
        self,
        tokens_BT: jax.Array,
        pos_BT: jax.Array,
        cache_LBSY: jax.Array | None = None,
        *,
        capture: Sequence[int] = (),
        impl: AttnImpl = "expanded",
        kv_block: int = KV_BLOCK,
        tree_mask_BTS: jax.Array | None = None,
        stripes: Stripes | None = None,
    ) -> tuple[jax.Array, jax.Array | None, jax.Array]:
        """Per-device forward. Returns (local logits [B,T,V/model], updated cache, captured [X,B,T,D]).
        `kv_block`: cache positions per block of the live-prefix attention loop (see mla.py). `tree_mask_BTS` (with
        a cache): the T tokens are the nodes of a draft tree (jaxspec/decoding/tree.py), node 0 the root at each row's
        prefix length `pos_BT[:, 0]`; node t is written at cache slot prefix + t, sits at RoPE position `pos_BT`
        (prefix + depth) and sees the cached prefix and the nodes the mask marks (its ancestors and itself), through
        models/tree_attention.py. `stripes`: the cache striped over DCP groups (models/dcp.py)."""
        B, T = tokens_BT.shape
        if tree_mask_BTS is not None and (cache_LBSY is None or tree_mask_BTS.shape != (B, T, T)):
            raise ValueError(
                f"tree_mask_BTS: expected [B, T, T] = [{B}, {T}, {T}] with a cache, got "
                f"{tree_mask_BTS.shape} (cache {'missing' if cache_LBSY is None else 'given'})"
            )
        with jax.named_scope("embed"):
            x_BTD = embed_lookup(self.embed[...], tokens_BT, self.axis)
        cos_sin = rope.cos_sin(pos_BT, jnp.asarray(self.rope_freqs, jnp.float32), self.rope_factor)
        # zeros_like(x) keeps x's manual-axis variance (it varies over "data"), as the scan carry requires
        captured_XBTD = jnp.repeat(jnp.zeros_like(x_BTD)[None], len(capture) + 1, axis=0) if capture else None

        carry = (x_BTD, cache_LBSY, captured_XBTD)
        first = 0
        for stack in (self.dense_layers, self.moe_layers):
            if stack is None:
                continue
            # Routed experts stay whole (not scanned over): each layer reads only its hit experts from the stack.
            graphdef, experts, params = nnx.split(
                stack, is_routed_weight if stack is self.moe_layers else nnx.Not(...), ...
            )
            n = jax.tree.leaves(params)[0].shape[0]

            def body(carry, xs, graphdef=graphdef, experts=experts, first=first):
                x, cache, captured = carry
                layer_params, layer_id, slot = xs
                view = lambda v: v.replace(LayerSlice(v.get_value(), layer_id - first))
                layer = nnx.merge(graphdef, jax.tree.map(view, experts, is_leaf=_is_var), layer_params)
                # The whole stacked cache goes in (and comes out updated): slicing out one layer's [B,S,Y] here
                # would copy the full buffer every layer, however short the live prefix.
                x, cache = layer(x, cos_sin, pos_BT, cache, layer_id, impl, kv_block, tree_mask_BTS, stripes)
                captured = None if captured is None else jax.lax.dynamic_update_index_in_dim(captured, x, slot, 0)
                return (x, cache, captured), None

            carry, _ = jax.lax.scan(body, carry, (params, *_layer_ids_and_slots(capture, first, n)))
            first += n
        x_BTD, cache_LBSY, captured_XBTD = carry
        with jax.named_scope("head"):
            h_BTD = rms_norm(x_BTD, self.final_norm[...], self.config.rms_norm_eps)
            logits_BTV = quant.einsum("BTD,DV->BTV", h_BTD, self.lm_head[...])
        captured_XBTD = captured_XBTD[: len(capture)] if capture else jnp.zeros_like(x_BTD)[None][:0]
        return logits_BTV, cache_LBSY, captured_XBTD


def _layer_ids_and_slots(capture: Sequence[int], first: int, n: int) -> tuple[jax.Array, jax.Array]:
    """The ids of layers first..first+n-1 and where each writes its output in the capture carry [X+1, B, T, D]: a
    captured layer its slot (its index in `capture`), any other the last slot, which the forward drops. Constants the
    layer scan slices beside the layer's parameters, so a captured forward runs one in-place write of [B, T, D] per
    layer and nothing else: the slot worked out from the layer id in each layer (compare, any, argmax, select) made
    the capture 1-3% of a bundled-pair decode step over 8 rows on a CPU, 0.3-0.6% this way, and it was the K=0 tax of
    adaptive serving (docs/serving.md)."""
    layers = range(first, first + n)
    slots = [capture.index(layer) if layer in capture else len(capture) for layer in layers]
    return jnp.asarray(layers, jnp.int32), jnp.asarray(slots, jnp.int32)


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def embed_lookup(table_VD: jax.Array, tokens_BT: jax.Array, axis: str) -> jax.Array:
    """Vocab-split lookup: each device serves the ids in its row range, one psum over `axis` assembles the rows."""
    V_local = table_VD.shape[0]
    local_BT = tokens_BT - jax.lax.axis_index(axis) * V_local
    mine_BT = (local_BT >= 0) & (local_BT < V_local)
    rows_BTD = jnp.take(table_VD, jnp.clip(local_BT, 0, V_local - 1), axis=0)
    return jax.lax.psum(jnp.where(mine_BT[..., None], rows_BTD, 0), axis)
