"""EAGLE-3 training-time test (TTT): the drafter unrolled `depth` steps over whole sequences, and its loss.

Alignment (derived from the inference loop, `jaxspec/decoding/spec_loop.py`, which training must match):
- Drafter row t pairs the target state of position t with token t+1. Its first-step output (draft-extend / prefill)
  is the draft of token t+2, checked against the target's distribution at position t+1.
- Draft step j >= 1 from the same start t runs at position t+j with token t+1+j (teacher-forced here; the drafter's
  own draft at inference) and hidden input = step j-1's output at row t (h2, or norm(h2) with `norm_output`); it
  drafts token t+2+j, checked against the target's distribution at position t+1+j.
- Attention at step j sees what the drafter KV cache holds at inference: the first-step keys of rows 0..t (positions
  0..t, causal) and the keys the chain itself wrote at steps 1..j (positions t+1..t+j, row t only).
So with rows indexed by the chain start t, step j uses tokens shifted left by 1+j, RoPE positions t+j, and its
attention keys are [step-0 keys (causal)] + [row t's keys of steps 1..j]. The loss at (j, t) compares the draft with
the target's softmax at position t+1+j restricted to the draft vocabulary (renormalised), where token t+2+j is a
response token (loss mask) and the target's argmax at t+1+j is in the draft vocabulary; step j weighs 0.8^j.

`ttt_forward` runs the drafter's own layer math (`Eagle3Model.layer_input` ... `head`, the code inference runs) on its
parameters (through `nnx.merge`; no copies) in float32. An MLA drafter's attention is the target's MLA module
(`MLA.project`, `expanded_block`, `online_softmax`) with the same key set: its latent cache entries stand in for
the keys. It runs per device inside a shard_map with the mesh's model
axis (`ShardingRules.model_axis`) bound: the embedding may be vocab-split (its lookup sums over that axis); every
other drafter weight must be whole (the trainer replicates them: data-parallel training)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxspec.models import rope
from jaxspec.models.eagle3 import Eagle3Model, attention, float32, gqa_scores, group_queries
from jaxspec.models.layers import NEG_INF
from jaxspec.models.mla import online_softmax, softmax_finish, softmax_init
from sharding.collectives import sharded_argmax
from sharding.rules import DEFAULT_RULES

STEP_WEIGHT = 0.8  # loss weight of step j is STEP_WEIGHT ** j


def shift_left(x: jax.Array, n: int, fill=0) -> jax.Array:
    """x[:, t + n] at row t along axis 1, `fill` past the end."""
    if n == 0:
        return x
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, n)
    return jnp.pad(x[:, n:], pad, constant_values=fill)


def ttt_forward(model: Eagle3Model, tokens_BT: jax.Array, aux_BTI: jax.Array, depth: int) -> jax.Array:
    """Per-device TTT unroll: fp32 draft logits [J=depth, B, T, U]; [j, b, t] drafts token t+2+j of sequence b.

    `tokens_BT` are the sequence's own token ids (not shifted); `aux_BTI` the captured target states of every
    position (ascending layers, `concat_captured`).
    """
    if depth < 1:
        raise ValueError(f"depth: expected >= 1 TTT steps, got {depth}")
    B, T = tokens_BT.shape
    h_BTD = model.fuse_captured(aux_BTI, jnp.float32, float32)
    attend = _GQASteps(model) if model.config.mla is None else _MLASteps(model)
    logits = []
    for j in range(depth):
        with jax.named_scope(f"ttt_step_{j}"):
            e_BTD = model.embed_tokens(shift_left(tokens_BT, 1 + j), jnp.float32)
            a_BTW, residual_BTD = model.layer_input(e_BTD, h_BTD, float32)
            pos_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) + j, (B, T))
            # The trainer replicates every weight but the embedding: nothing to reduce over the model axis.
            h1_BTD = model.add_attention(residual_BTD, attend(a_BTW, pos_BT), jnp.float32, reduce=False)
            logits_BTU, h_BTD = model.head(model.mlp(h1_BTD, jnp.float32, float32, reduce=False), float32)
            logits.append(logits_BTU)
    return jnp.stack(logits)


def _causal_1TS(T: int) -> jax.Array:
    return (jnp.arange(T)[None, :] <= jnp.arange(T)[:, None])[None]


class _GQASteps:
    """The Llama drafter's attention of successive TTT steps (fp32 o_proj output [B,T,D]); keeps every step's keys."""

    def __init__(self, model: Eagle3Model):
        self.model, self.keys, self.values = model, [], []

    def __call__(self, a_BTW: jax.Array, pos_BT: jax.Array) -> jax.Array:
        q_BTNZ, k_BTOZ, v_BTOZ = self.model.project_qkv(a_BTW, pos_BT, float32)
        self.keys.append(k_BTOZ)
        self.values.append(v_BTOZ)
        return self.model.project_out(_ttt_attention(q_BTNZ, self.keys, self.values), float32)


def _ttt_attention(q_BTNZ: jax.Array, keys: list[jax.Array], values: list[jax.Array]) -> jax.Array:
    """Step j = len(keys) - 1: attend to step-0 keys causally and to row t's own keys of steps 1..j."""
    B, T, N, Z = q_BTNZ.shape
    causal_1TS = _causal_1TS(T)
    if len(keys) == 1:
        return attention(q_BTNZ, keys[0], values[0], causal_1TS)
    q_BTOPZ = group_queries(q_BTNZ, keys[0].shape[2])
    s_BOPTS = jnp.where(causal_1TS[:, None, None], gqa_scores(q_BTOPZ, keys[0]), NEG_INF)
    k_JBTOZ, v_JBTOZ = jnp.stack(keys[1:]), jnp.stack(values[1:])
    s_BOPTJ = jnp.einsum("BTOPZ,JBTOZ->BOPTJ", q_BTOPZ, k_JBTOZ) * Z**-0.5
    p = jax.nn.softmax(jnp.concatenate([s_BOPTS, s_BOPTJ], axis=-1), axis=-1)
    out_BTOPZ = jnp.einsum("BOPTS,BSOZ->BTOPZ", p[..., :T], values[0]) + jnp.einsum(
        "BOPTJ,JBTOZ->BTOPZ", p[..., T:], v_JBTOZ
    )
    return out_BTOPZ.reshape(B, T, N, Z)


class _MLASteps:
    """The MLA drafter's attention of successive TTT steps (fp32 o_proj output [B,T,D]), with the keys of the GQA
    path: step-0 latents causally, then row t's own latents of steps 1..j. The target's MLA math in its expanded form
    (what the drafter's uncached first step runs), on a float32 copy of the attention weights; keeps every step's
    latent cache entries."""

    def __init__(self, model: Eagle3Model):
        graphdef, state = nnx.split(model.attn)
        self.attn = nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(jnp.float32), state))
        self.freqs, self.factor = jnp.asarray(model.rope_freqs, jnp.float32), model.rope_factor
        self.latents: list[jax.Array] = []

    def __call__(self, a_BTW: jax.Array, pos_BT: jax.Array) -> jax.Array:
        attn, C, T = self.attn, self.attn.kv_a_norm.shape[0], a_BTW.shape[1]
        q_nope_BTNH, q_rope_BTNR, new_BTY = attn.project(a_BTW, rope.cos_sin(pos_BT, self.freqs, self.factor))
        self.latents.append(new_BTY)
        with jax.named_scope("ttt_mla_attention"):
            state = softmax_init(q_nope_BTNH, attn.kv_b_v.shape[-1])
            block = attn.expanded_block(q_nope_BTNH, q_rope_BTNR, C)
            state = online_softmax(state, *block(self.latents[0]), _causal_1TS(T), attn.softmax_scale)
            if len(self.latents) > 1:
                same_row = _same_row_block(attn, q_nope_BTNH, q_rope_BTNR, jnp.stack(self.latents[1:]))
                visible_1TJ = jnp.ones((1, T, len(self.latents) - 1), bool)
                state = online_softmax(state, *same_row, visible_1TJ, attn.softmax_scale)
            out_BTNA = softmax_finish(state, jnp.float32)
        return jnp.einsum("BTNA,NAD->BTD", out_BTNA, attn.o[...])


def _same_row_block(attn, q_nope_BTNH, q_rope_BTNR, latents_JBTY) -> tuple[jax.Array, Callable]:
    """(scores [B,N,T,J], mixing) of query row t against row t's own latent entries of steps 1..J: per-head keys and
    values expanded from each entry, as `MLA.expanded_block` expands a block (only the diagonal is computed)."""
    C = attn.kv_a_norm.shape[0]
    latent_JBTC, k_rope_JBTR = latents_JBTY[..., :C], latents_JBTY[..., C:]
    k_nope_JBTNH = jnp.einsum("JBTC,CNH->JBTNH", latent_JBTC, attn.kv_b_k[...])
    v_JBTNA = jnp.einsum("JBTC,CNA->JBTNA", latent_JBTC, attn.kv_b_v[...])
    s_BNTJ = jnp.einsum("BTNH,JBTNH->BNTJ", q_nope_BTNH, k_nope_JBTNH)
    s_BNTJ += jnp.einsum("BTNR,JBTR->BNTJ", q_rope_BTNR, k_rope_JBTR)
    return s_BNTJ, lambda p_BNTJ: jnp.einsum("BNTJ,JBTNA->BTNA", p_BNTJ, v_JBTNA)


# ----------------------------------------------------------------------------------------------- the target side
def restrict_to_draft_vocab(
    logits_BTV: jax.Array, draft_ids_U: jax.Array, t2d_V: jax.Array, *, axis: str = DEFAULT_RULES.model_axis
) -> tuple[jax.Array, jax.Array]:
    """Per device (vocab split over mesh axis `axis`, the rules' `model_axis`): the target's fp32 logits at the draft
    vocabulary's target ids [B,T,U] (every device gets all U) and whether the target's argmax is in the draft
    vocabulary [B,T]."""
    V_local = logits_BTV.shape[-1]
    local_U = draft_ids_U - jax.lax.axis_index(axis) * V_local
    mine_U = (local_U >= 0) & (local_U < V_local)
    rows_BTU = jnp.take(logits_BTV, jnp.clip(local_U, 0, V_local - 1), axis=-1).astype(jnp.float32)
    restricted_BTU = jax.lax.psum(jnp.where(mine_U, rows_BTU, 0.0), axis)
    argmax_BT = sharded_argmax(logits_BTV, axis)
    return restricted_BTU, jnp.take(t2d_V, argmax_BT)


def ttt_loss_terms(
    logits_JBTU: jax.Array, target_BTU: jax.Array, in_vocab_BT: jax.Array, loss_mask_BT: jax.Array
) -> dict[str, jax.Array]:
    """Per-step sums over this device's rows, each [J] (sum them over the data axis, then `combine_terms`).

    `target_BTU`/`in_vocab_BT` are indexed by target position (from `restrict_to_draft_vocab`); `loss_mask_BT`
    marks the tokens to learn (response tokens). ce: cross-entropy against the renormalised restricted target
    softmax over the valid positions; valid: their count; correct: draft argmax == target argmax there; counted:
    every loss-masked position (positions whose target argmax is outside the draft vocabulary count as misses).
    """
    out: dict[str, list[jax.Array]] = {"ce": [], "valid": [], "correct": [], "counted": []}
    for j in range(logits_JBTU.shape[0]):
        tgt_BTU = shift_left(target_BTU, 1 + j)
        counted_BT = shift_left(loss_mask_BT, 2 + j, False)
        valid_BT = counted_BT & shift_left(in_vocab_BT, 1 + j, False)
        logp_BTU = jax.nn.log_softmax(logits_JBTU[j], axis=-1)
        ce_BT = -jnp.sum(jax.nn.softmax(tgt_BTU, axis=-1) * logp_BTU, axis=-1)
        hit_BT = jnp.argmax(logits_JBTU[j], axis=-1) == jnp.argmax(tgt_BTU, axis=-1)
        out["ce"].append(jnp.sum(jnp.where(valid_BT, ce_BT, 0.0)))
        out["valid"].append(jnp.sum(valid_BT, dtype=jnp.float32))
        out["correct"].append(jnp.sum(hit_BT & valid_BT, dtype=jnp.float32))
        out["counted"].append(jnp.sum(counted_BT, dtype=jnp.float32))
    return {k: jnp.stack(v) for k, v in out.items()}


def combine_terms(terms: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(loss = sum_j 0.8^j * mean CE of step j, {"loss_j", "acc_j", "valid_j"}) from globally summed terms."""
    J = terms["ce"].shape[0]
    loss_J = terms["ce"] / jnp.maximum(terms["valid"], 1.0)
    weights_J = jnp.asarray(STEP_WEIGHT ** np.arange(J), jnp.float32)
    acc_J = terms["correct"] / jnp.maximum(terms["counted"], 1.0)
    return jnp.sum(weights_J * loss_J), {"loss_j": loss_J, "acc_j": acc_J, "valid_j": terms["valid"]}


# ----------------------------------------------------------------------------------------------- convenience
def ttt_logits(drafter, token_ids, aux_hidden, depth: int) -> jax.Array:
    """The TTT unroll of a `Drafter` on its mesh: fp32 logits [J, B, T, U] (see `ttt_forward`)."""
    tokens = drafter.device_tokens(token_ids)
    aux = jnp.asarray(aux_hidden)
    width = len(drafter.capture_layers) * drafter.config.target_hidden_size
    if aux.shape != (*tokens.shape, width):
        raise ValueError(f"aux_hidden: expected shape {(*tokens.shape, width)}, got {aux.shape}")
    return _jit_ttt_logits(drafter, drafter.params, tokens, aux, depth)


def drafter_param_specs(drafter, params) -> dict[str, Any]:
    """shard_map specs for TTT, nested like `nnx.to_pure_dict(params)` (an MLA drafter's attention weights under
    "attn"): the embedding keeps its (vocab-split) layout, every other weight is whole."""
    embed = drafter.rules.spec(params["embed"].get_metadata()["logical_axes"])
    whole = lambda tree: jax.tree.map(lambda _: PartitionSpec(), tree)
    return {k: embed if k == "embed" else whole(v) for k, v in nnx.to_pure_dict(params).items()}


@functools.partial(jax.jit, static_argnums=(0, 4))
def _jit_ttt_logits(drafter, params, tokens_BT, aux_BTI, depth):
    mesh, batch = drafter.mesh, drafter.rules.batch
    specs = drafter_param_specs(drafter, params)
    params = jax.tree.map(
        lambda v, spec: jax.sharding.reshard(v, NamedSharding(mesh, spec)), nnx.to_pure_dict(params), specs
    )

    def local(params, tokens, aux):
        model = nnx.merge(drafter.graphdef, nnx.State(jax.tree.map(nnx.Param, params)))
        return ttt_forward(model, tokens, aux, depth)

    tokens_BT = jax.sharding.reshard(tokens_BT, NamedSharding(mesh, PartitionSpec(batch, None)))
    aux_BTI = jax.sharding.reshard(aux_BTI, NamedSharding(mesh, PartitionSpec(batch, None, None)))
    fn = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(specs, PartitionSpec(batch, None), PartitionSpec(batch, None, None)),
        out_specs=PartitionSpec(None, batch, None, None),
    )
    return fn(params, tokens_BT, aux_BTI)
