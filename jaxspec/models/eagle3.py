"""The EAGLE-3 drafter (Flax NNX): its config and its forward (`jaxspec.io.drafter_config` reads the config from the
published checkpoint formats).

One Llama-style decoder layer:
    first step:  h = fc(concat(captured target states, low -> high))    later steps: h = previous step's output
    a  = concat(input_layernorm(embed(token)), hidden_norm(h))            # 2D wide, embedding first
    h1 = residual + attn(a)     residual = h, or hidden_norm(h) with `norm_before_residual`
    h2 = h1 + swiglu_mlp(post_attention_layernorm(h1))
    logits = lm_head(norm(h2))  over the draft vocabulary; draft id u is target id u + d2t[u]
    output = h2, or norm(h2) with `norm_output` (EAGLE 3.1): what the next draft step reads as its h

EAGLE 3.1 also normalises the captured states before fc: `fc_norm` (vLLM, speculators; `use_aux_norm` is its older
name) one RMSNorm per captured state, concat(norm_0(s_0), norm_1(s_1), ...); `norm_before_fc` (speculators) one
RMSNorm over the whole concatenation. The two are exclusive.

Like the target, `Eagle3Model.__call__` runs per device inside ONE `jax.shard_map` over the target's mesh. Query and
KV heads, the MLP hidden dim and the draft vocabulary are split over "model" when their sizes divide it (heads: both
query and KV heads must divide); a dimension that does not divide is replicated and computed redundantly on every
device instead (no psum for it). The embedding table is vocab-split like the target's (usually it IS the target's).

Capture-layer ids: the internal convention is the target's (`jaxspec/models/kimi.py`): id k = the residual stream at
the OUTPUT of target layer k, 0-indexed (`jaxspec.io.drafter_config` converts the checkpoints' conventions to it).
Captured states are concatenated in ascending layer order, as SGLang and vLLM capture them.

Shape letters (glossary.md): O = the drafter's KV heads, P = query heads per KV head (N = O * P), Z = the drafter's
head dim (RoPE on all of it), W = the 2D-wide attention input, I = the fc input (X * target hidden).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.config import KimiConfig, RopeScaling
from jaxspec.models import rope
from jaxspec.models.cache import Paged
from jaxspec.models.kimi import embed_lookup
from jaxspec.models.layers import NEG_INF, ones, param, rms_norm, swiglu
from jaxspec.models.mla import KV_BLOCK, MLA, Block, attend_live_prefix, online_softmax, softmax_finish, softmax_init
from jaxspec.models.quant import einsum as ein
from jaxspec.models.tree_attention import merge_softmax, mla_tree_attention
from sharding.rules import DEFAULT_RULES, ShardingRules


@dataclasses.dataclass(frozen=True)
class DraftRope:
    """The drafter's own RoPE (HF Llama semantics, rotate-half): default, linear, llama3 or yarn."""

    theta: float
    kind: Literal["default", "linear", "llama3", "yarn"] = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    yarn: RopeScaling | None = None

    def inv_freq(self, dim: int) -> tuple[np.ndarray, float]:
        """Inverse frequencies [dim/2] (float32) and the cos/sin attention factor."""
        freqs, attn_factor = rope.inv_freq(dim, self.theta, self.yarn)
        if self.kind == "linear":
            freqs = freqs / np.float32(self.factor)
        elif self.kind == "llama3":  # transformers `_compute_llama3_parameters`
            old_len = self.original_max_position_embeddings
            wavelen = 2 * math.pi / freqs
            scaled = np.where(wavelen > old_len / self.low_freq_factor, freqs / self.factor, freqs)
            smooth = (old_len / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = (wavelen >= old_len / self.high_freq_factor) & (wavelen <= old_len / self.low_freq_factor)
            freqs = np.where(medium, smoothed, scaled)
        return freqs.astype(np.float32), attn_factor


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """A one-layer Llama EAGLE-3 drafter for a given target. Built by `jaxspec.io.drafter_config`:
    `read_drafter_config` (a checkpoint's config.json) or `draft_config_for` (sized for a target)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int  # the target vocabulary (embedding rows, t2d length)
    draft_vocab_size: int  # lm_head rows; == vocab_size when the checkpoint has no draft vocabulary
    target_hidden_size: int
    rope: DraftRope
    max_position_embeddings: int
    capture_layers: tuple[int, ...]  # internal convention: outputs of these target layers, ascending
    capture_convention: Literal["output", "input", "default"]  # how the checkpoint's ids were read
    norm_before_residual: bool = False
    # EAGLE 3.1 (see the module docstring): per-state RMSNorm before fc, one RMSNorm over the concatenation before fc,
    # and the post-norm h2 fed to the next step.
    fc_norm: bool = False
    norm_before_fc: bool = False
    norm_output: bool = False
    format: Literal["sglang", "speculators", "mla"] = "sglang"
    # An MLA drafter's attention geometry and RoPE (DeepSeek YaRN, interleaved) as a KimiConfig whose hidden_size is
    # the drafter's; None for the Llama (GQA, rotate-half RoPE) drafter. head_dim/num_key_value_heads/rope are unused.
    mla: KimiConfig | None = None

    @property
    def full_vocab(self) -> bool:
        """The drafter predicts over the target's whole vocabulary (no draft-to-target id map)."""
        return self.draft_vocab_size == self.vocab_size


@dataclasses.dataclass(frozen=True)
class Split:
    """Which dims are split over the mesh's tensor-parallel axis `axis` (the rest are replicated)."""

    heads: bool
    mlp: bool
    vocab: bool
    axis: str  # ShardingRules.model_axis: the axis split dims live on and the forward reduces over

    @classmethod
    def plan(cls, cfg: Eagle3Config, model_shards: int, rules: ShardingRules = DEFAULT_RULES) -> Split:
        """Split a dim when the rules map it to the model axis (the axis the forward reduces over) and it divides."""
        axis = rules.model_axis
        split = lambda logical, *sizes: logical == axis and all(s % model_shards == 0 for s in sizes)
        return cls(
            heads=split(rules.heads, cfg.num_attention_heads, cfg.num_key_value_heads),
            mlp=split(rules.mlp, cfg.intermediate_size),
            vocab=split(rules.vocab, cfg.draft_vocab_size),
            axis=axis,
        )

    def rules_for(self, rules: ShardingRules) -> ShardingRules:
        """The rules for this drafter's parameters: "heads" replicated when heads are not split (the MLA module
        declares its per-head weights with the "heads" axis unconditionally)."""
        return rules if self.heads else dataclasses.replace(rules, heads=None)


KVCache = tuple[jax.Array, ...]  # Llama: (k, v), each [B,S,O,Z]; MLA: (latent [B,S,Y],) (Y = C + R)
# How the layer math reads a weight: as stored (inference) or in float32 (the training-time test, `ttt.py`).
WeightFn = Callable[[nnx.Param], jax.Array]


def stored(var: nnx.Param) -> jax.Array:
    return var[...]


def float32(var: nnx.Param) -> jax.Array:
    return var[...].astype(jnp.float32)


class Eagle3Model(nnx.Module):
    """The drafter's one decoder layer. Its pieces (`embed_tokens` ... `head`) are the ONE implementation of the layer
    math: `__call__` (inference) composes them around the cached attention, and the training-time test
    (`jaxspec/training/ttt.py`) around its unrolled attention, reading weights in float32 and reducing nothing."""

    def __init__(
        self, cfg: Eagle3Config, *, dtype: jnp.dtype = jnp.bfloat16, split: Split | None = None, rngs: nnx.Rngs
    ):
        D, F, V, U = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.draft_vocab_size
        N, O, Z = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim  # noqa: E741
        X = len(cfg.capture_layers)
        XD = X * cfg.target_hidden_size
        self.split = split = split or Split.plan(cfg, 1)
        heads, mlp, vocab = ("heads" if split.heads else None), ("mlp" if split.mlp else None), split.vocab
        self.config, self.dtype = cfg, dtype
        # embed (and lm_head for a full-vocabulary drafter without one) may be the target's own arrays, so they are
        # declared exactly like the target's: vocab-split [V, D] and [D, V].
        self.embed = param(rngs, (V, D), ("vocab", "embed"), dtype)
        self.fc = param(rngs, (XD, D), (None, "embed"), dtype)
        if cfg.fc_norm:  # one weight row per captured state
            self.fc_norm = param(rngs, (X, cfg.target_hidden_size), (None, None), dtype, ones)
        if cfg.norm_before_fc:
            self.fc_input_norm = param(rngs, (XD,), (None,), dtype, ones)
        self.input_norm = param(rngs, (D,), ("embed",), dtype, ones)
        self.hidden_norm = param(rngs, (D,), ("embed",), dtype, ones)
        if cfg.mla is None:
            self.q = param(rngs, (2 * D, N, Z), (None, heads, None), dtype)
            self.k = param(rngs, (2 * D, O, Z), (None, heads, None), dtype)
            self.v = param(rngs, (2 * D, O, Z), (None, heads, None), dtype)
            self.o = param(rngs, (N, Z, D), (heads, None, "embed"), dtype)
        else:  # its "heads" axis is replicated through the drafter's rules when heads are not split
            self.attn = DraftMLA(cfg.mla, dtype, rngs)
        self.post_attn_norm = param(rngs, (D,), ("embed",), dtype, ones)
        self.gate = param(rngs, (D, F), ("embed", mlp), dtype)
        self.up = param(rngs, (D, F), ("embed", mlp), dtype)
        self.down = param(rngs, (F, D), (mlp, "embed"), dtype)
        self.final_norm = param(rngs, (D,), ("embed",), dtype, ones)
        self.lm_head = param(rngs, (D, U), ("embed", "vocab" if vocab else None), dtype)
        if cfg.mla is None:
            freqs, self.rope_factor = cfg.rope.inv_freq(Z)
        else:
            m = cfg.mla
            freqs, self.rope_factor = rope.inv_freq(m.qk_rope_head_dim, m.rope_theta, m.rope_scaling)
        self.rope_freqs = tuple(float(f) for f in freqs)  # static: keep numpy out of the graph state

    def __call__(
        self,
        tokens_BT: jax.Array,
        hidden: jax.Array,
        pos_BT: jax.Array,
        cache: KVCache | None = None,
        *,
        first_step: bool,
        kv_block: int = KV_BLOCK,
        at_B: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array, KVCache | None]:
        """Per-device step. `hidden` is the captured aux [B,T,X*Dt] if `first_step`, else the previous h2 [B,T,D].
        Attention over a cache reads each row's live prefix in blocks of `kv_block` positions (mla.py).

        Returns (fp32 logits [B,T,U] (local vocab shard when split), the next step's h [B,T,D] (`output`: h2, or
        norm(h2) with `norm_output`), updated cache or None). With `at_B` [B] (an index into T per row) every
        position still writes its cache entry, but the layer's output, MLP and head run at position `at_B` only: the
        logits and output are [B,1,...] (a draft-extend needs the next draft at each row's last accepted position,
        nothing after its attention at the others).
        """
        attend = lambda a_BTW: self._attend(a_BTW, pos_BT, cache, kv_block)  # noqa: E731
        return self._step(tokens_BT, hidden, first_step, attend, at_B)

    def tree_step(
        self,
        tokens_BK: jax.Array,
        hidden_BKD: jax.Array,
        pos_BK: jax.Array,
        cache: KVCache,
        scratch: KVCache,
        write_at: int,
        mask_BKM: jax.Array,
        prefix_len_B: jax.Array,
        *,
        kv_block: int = KV_BLOCK,
    ) -> tuple[jax.Array, jax.Array, KVCache]:
        """Per-device draft step over K tree nodes per row (jaxspec/decoding/tree.py), from their parents' h2
        `hidden_BKD`. The cache is only read: each node sees its row's cached entries below `prefix_len_B` and the
        `scratch` entries `mask_BKM` marks (its ancestors and itself); its own entry goes to scratch slots
        `write_at`..`write_at`+K (static). Returns (fp32 logits [B,K,U], the nodes' outputs [B,K,D] (their
        children's h), the updated scratch)."""

        def attend(a_BKW):
            args = (a_BKW, pos_BK, cache, scratch, write_at, mask_BKM, prefix_len_B, kv_block)
            return self._attend_tree_mla(*args) if self.config.mla is not None else self._attend_tree(*args)

        return self._step(tokens_BK, hidden_BKD, False, attend)

    def _step(
        self, tokens_BT, hidden, first_step: bool, attend: Callable[[jax.Array], tuple[jax.Array, Any]], at_B=None
    ):
        """The layer around its attention: (logits, output, what `attend` returns besides its output); with `at_B`
        (see `__call__`) from the attention output on at each row's position `at_B` only."""
        dt = self.dtype
        e_BTD = self.embed_tokens(tokens_BT, dt)
        h_BTD = self.fuse_captured(hidden, dt) if first_step else hidden.astype(dt)
        a_BTW, residual_BTD = self.layer_input(e_BTD, h_BTD)
        with jax.named_scope("attention"):
            attn_BTD, cache = attend(a_BTW)
            if at_B is not None:
                at = lambda x_BTD: jnp.take_along_axis(x_BTD, at_B[:, None, None], axis=1)  # noqa: E731
                attn_BTD, residual_BTD = at(attn_BTD), at(residual_BTD)
            h1_BTD = self.add_attention(residual_BTD, attn_BTD, dt)
        logits_BTU, out_BTD = self.head(self.mlp(h1_BTD, dt))
        return logits_BTU, out_BTD, cache

    # ---------------------------------------------------------------- the layer math, shared with training
    def embed_tokens(self, tokens_BT: jax.Array, dtype: jnp.dtype) -> jax.Array:
        """The (vocab-split) embedding rows of `tokens_BT` [B,T,D] as `dtype`."""
        with jax.named_scope("embed"):
            return embed_lookup(self.embed[...], tokens_BT, self.split.axis).astype(dtype)

    def fuse_captured(self, aux_BTI: jax.Array, dtype: jnp.dtype, weight: WeightFn = stored) -> jax.Array:
        """The first step's h [B,T,D]: `fc` over the concatenated captured target states (each normalised first with
        `fc_norm`, the concatenation with `norm_before_fc`)."""
        cfg = self.config
        with jax.named_scope("fc"):
            aux_BTI = aux_BTI.astype(dtype)
            if cfg.fc_norm:
                B, T, _ = aux_BTI.shape
                aux_BTXD = aux_BTI.reshape(B, T, -1, cfg.target_hidden_size)
                aux_BTI = rms_norm(aux_BTXD, weight(self.fc_norm), cfg.rms_norm_eps).reshape(B, T, -1)
            if cfg.norm_before_fc:
                aux_BTI = rms_norm(aux_BTI, weight(self.fc_input_norm), cfg.rms_norm_eps)
            return ein("BTI,ID->BTD", aux_BTI, weight(self.fc))

    def layer_input(self, e_BTD, h_BTD, weight: WeightFn = stored) -> tuple[jax.Array, jax.Array]:
        """(attention input [B,T,W] = [input_norm(embedding) | hidden_norm(h)], the residual stream [B,T,D])."""
        eps = self.config.rms_norm_eps
        hn_BTD = rms_norm(h_BTD, weight(self.hidden_norm), eps)
        residual_BTD = hn_BTD if self.config.norm_before_residual else h_BTD
        return jnp.concatenate([rms_norm(e_BTD, weight(self.input_norm), eps), hn_BTD], axis=-1), residual_BTD

    def project_qkv(self, a_BTW, pos_BT, weight: WeightFn = stored) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Llama attention's (q [B,T,N,Z], k [B,T,O,Z], v [B,T,O,Z]) with rotate-half RoPE on q and k."""
        cos, sin = rope.cos_sin(pos_BT, jnp.asarray(self.rope_freqs, jnp.float32), self.rope_factor)
        cos, sin = cos[:, :, None], sin[:, :, None]
        q_BTNZ = rope.apply_half(ein("BTW,WNZ->BTNZ", a_BTW, weight(self.q)), cos, sin)
        k_BTOZ = rope.apply_half(ein("BTW,WOZ->BTOZ", a_BTW, weight(self.k)), cos, sin)
        return q_BTNZ, k_BTOZ, ein("BTW,WOZ->BTOZ", a_BTW, weight(self.v))

    def project_out(self, out_BTNZ: jax.Array, weight: WeightFn = stored) -> jax.Array:
        """o_proj: fp32 [B,T,D], a partial sum over the local heads when heads are split."""
        return ein("BTNZ,NZD->BTD", out_BTNZ, weight(self.o), dtype=jnp.float32)

    def add_attention(self, residual_BTD, attn_BTD, dtype: jnp.dtype, *, reduce: bool = True) -> jax.Array:
        """h1 = residual + attention output (summed over the model axis first when heads are split and `reduce`)."""
        if reduce and self.split.heads:
            attn_BTD = jax.lax.psum(attn_BTD, self.split.axis)
        return residual_BTD + attn_BTD.astype(dtype)

    def mlp(self, h1_BTD, dtype: jnp.dtype, weight: WeightFn = stored, *, reduce: bool = True) -> jax.Array:
        """h2 = h1 + SwiGLU(post_attention_layernorm(h1)) (its down projection summed over the model axis when the
        MLP is split and `reduce`)."""
        with jax.named_scope("mlp"):
            x_BTD = rms_norm(h1_BTD, weight(self.post_attn_norm), self.config.rms_norm_eps)
            y_BTF = swiglu(ein("BTD,DF->BTF", x_BTD, weight(self.gate)), ein("BTD,DF->BTF", x_BTD, weight(self.up)))
            y_BTD = ein("BTF,FD->BTD", y_BTF, weight(self.down), dtype=jnp.float32)
            if reduce and self.split.mlp:
                y_BTD = jax.lax.psum(y_BTD, self.split.axis)
            return h1_BTD + y_BTD.astype(dtype)

    def head(self, h2_BTD: jax.Array, weight: WeightFn = stored) -> tuple[jax.Array, jax.Array]:
        """(fp32 draft logits [B,T,U] (the local vocabulary shard when it is split), the layer's output [B,T,D]: h2,
        or with `norm_output` the normalised h2 the logits are read from)."""
        with jax.named_scope("head"):
            x_BTD = rms_norm(h2_BTD, weight(self.final_norm), self.config.rms_norm_eps)
            logits_BTU = ein("BTD,DU->BTU", x_BTD, weight(self.lm_head), dtype=jnp.float32)
            return logits_BTU, x_BTD if self.config.norm_output else h2_BTD

    # ---------------------------------------------------------------- inference attention over the KV cache
    def _attend(self, a_BTW, pos_BT, cache, kv_block: int):
        if self.config.mla is not None:
            return self._attend_mla(a_BTW, pos_BT, cache, kv_block)
        q_BTNZ, k_BTOZ, v_BTOZ = self.project_qkv(a_BTW, pos_BT)
        if isinstance(cache, Paged):
            return self._attend_pool(q_BTNZ, (k_BTOZ, v_BTOZ), pos_BT, cache, kv_block)
        if cache is None:
            k_BSOZ, v_BSOZ, kv_pos_BS = k_BTOZ, v_BTOZ, pos_BT
        else:
            # Each sequence writes its T new entries contiguously from its first query position (as in mla.py).
            write = lambda c, n, p: jax.lax.dynamic_update_slice(c, n.astype(c.dtype), (p, 0, 0))
            cache = tuple(jax.vmap(write)(c, n, pos_BT[:, 0]) for c, n in zip(cache, (k_BTOZ, v_BTOZ), strict=True))
            k_BSOZ, v_BSOZ = (c.astype(a_BTW.dtype) for c in cache)
            kv_pos_BS = jnp.broadcast_to(jnp.arange(k_BSOZ.shape[1]), k_BSOZ.shape[:2])
        # Causal by position: entries past a sequence's own position are stale or padding and never seen.
        mask_BTS = kv_pos_BS[:, None, :] <= pos_BT[:, :, None]
        return self.project_out(attention(q_BTNZ, k_BSOZ, v_BSOZ, mask_BTS)), cache

    def _attend_pool(self, q_BTNZ, new: tuple[jax.Array, jax.Array], pos_BT, cache: Paged, kv_block: int):
        """Llama attention over the drafter's pool in place: the step's keys and values written into the rows'
        blocks, then each row reads its own blocks as far as its own position (mla.attend_live_prefix's ragged loop,
        online softmax), as the target reads its pool."""
        cache = cache.write(new, pos_BT)
        O, Z = new[0].shape[2:]  # noqa: E741
        block = Block(group_queries(q_BTNZ, O), _gqa_block)
        init = softmax_init(q_BTNZ, Z)
        state = attend_live_prefix(cache, 0, pos_BT, block, init, Z**-0.5, kv_block, q_BTNZ.dtype)
        return self.project_out(softmax_finish(state, q_BTNZ.dtype)), cache

    def _attend_mla(self, a_BTW, pos_BT, cache, kv_block: int):
        """The target's MLA over the drafter's latent cache (a 1-tuple: [B, S, kv_lora_rank + qk_rope_head_dim], or
        a pool of one array [N, block, Y], read and written in place as the target's is)."""
        cos_sin = rope.cos_sin(pos_BT, jnp.asarray(self.rope_freqs, jnp.float32), self.rope_factor)
        impl = "expanded" if cache is None else "absorbed"  # as the target: prefill expanded, cached steps absorbed
        if cache is None:
            return self.attn(a_BTW, cos_sin, pos_BT, None, 0, impl)[0], None
        if isinstance(cache, Paged):  # the target's layout: a layer stack of one
            stacked = Paged(cache.pool[0][None], cache.tables)
            out_BTD, stacked = self.attn(a_BTW, cos_sin, pos_BT, stacked, 0, impl, kv_block=kv_block)
            return out_BTD, Paged((stacked.pool[0],), cache.tables)
        # MLA takes a layer-stacked cache and a layer index; the drafter's one layer is a stack of one.
        out_BTD, latent_LBSY = self.attn(a_BTW, cos_sin, pos_BT, cache[0][None], 0, impl, kv_block=kv_block)
        return out_BTD, (latent_LBSY[0],)

    def _attend_tree(self, a_BKW, pos_BK, cache, scratch, write_at, mask_BKM, prefix_len_B, kv_block: int):
        """Llama attention of tree nodes over [cache | scratch] (see `tree_step`)."""
        q_BKNZ, k_BKOZ, v_BKOZ = self.project_qkv(a_BKW, pos_BK)
        put = lambda c, n: jax.lax.dynamic_update_slice_in_dim(c, n.astype(c.dtype), write_at, axis=1)
        scratch = tuple(put(c, n) for c, n in zip(scratch, (k_BKOZ, v_BKOZ), strict=True))
        if isinstance(cache, Paged):
            return self._attend_tree_pool(q_BKNZ, cache, scratch, mask_BKM, prefix_len_B, kv_block), scratch
        k_BSOZ, v_BSOZ = (
            jnp.concatenate([c, s], axis=1).astype(a_BKW.dtype) for c, s in zip(cache, scratch, strict=True)
        )
        S = cache[0].shape[1]
        prefix_BKS = jnp.broadcast_to((jnp.arange(S) < prefix_len_B[:, None])[:, None], (*pos_BK.shape, S))
        mask_BKS = jnp.concatenate([prefix_BKS, mask_BKM], axis=-1)
        return self.project_out(attention(q_BKNZ, k_BSOZ, v_BSOZ, mask_BKS)), scratch

    def _attend_tree_pool(self, q_BKNZ, cache: Paged, scratch, mask_BKM, prefix_len_B, kv_block: int) -> jax.Array:
        """Tree nodes' Llama attention over the drafter's pool in place (each row's own blocks below its prefix,
        ragged) and over the scratch entries `mask_BKM` marks, the two softmax states merged."""
        O, Z = scratch[0].shape[2:]  # noqa: E741
        dtype = q_BKNZ.dtype
        block, init = Block(group_queries(q_BKNZ, O), _gqa_block), softmax_init(q_BKNZ, Z)
        last_prefix_BK = jnp.broadcast_to((prefix_len_B - 1)[:, None], q_BKNZ.shape[:2]).astype(jnp.int32)
        prefix = attend_live_prefix(cache, 0, last_prefix_BK, block, init, Z**-0.5, kv_block, dtype)
        fresh = online_softmax(init, *block(tuple(c.astype(dtype) for c in scratch)), mask_BKM, Z**-0.5)
        return self.project_out(softmax_finish(merge_softmax(prefix, fresh), dtype))

    def _attend_tree_mla(self, a_BKW, pos_BK, cache, scratch, write_at, mask_BKM, prefix_len_B, kv_block: int):
        """The target's tree attention (absorbed MLA) over the drafter's latent cache and scratch latents."""
        cos_sin = rope.cos_sin(pos_BK, jnp.asarray(self.rope_freqs, jnp.float32), self.rope_factor)
        q_nope_BKNH, q_rope_BKNR, fresh_BKY = self.attn.project(a_BKW, cos_sin)
        (latent_BMY,) = scratch
        latent_BMY = jax.lax.dynamic_update_slice_in_dim(latent_BMY, fresh_BKY.astype(latent_BMY.dtype), write_at, 1)
        stacked = Paged(cache.pool[0][None], cache.tables) if isinstance(cache, Paged) else cache[0][None]
        out_BKD = mla_tree_attention(
            self.attn, q_nope_BKNH, q_rope_BKNR, latent_BMY, stacked, 0, prefix_len_B, mask_BKM, kv_block=kv_block
        )
        return out_BKD, (latent_BMY,)


class DraftMLA(MLA):
    """The target's MLA module reading the drafter's 2D-wide attention input [embedding | hidden] (q_a_proj and
    kv_a_proj_with_mqa take 2D inputs, as in vLLM's `deepseek_eagle3`) and writing its D-wide output (o_proj)."""

    def __init__(self, cfg: KimiConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        super().__init__(cfg.replace(hidden_size=2 * cfg.hidden_size), dtype, rngs)
        self.o = param(
            rngs, (cfg.num_attention_heads, cfg.v_head_dim, cfg.hidden_size), ("heads", None, "embed"), dtype
        )


def _gqa_block(q_BTOPZ: jax.Array, kv: tuple[jax.Array, jax.Array]):
    """`mla.Block`'s function for grouped-query attention: a block of keys and values ([B,S,O,Z] each) gives the
    scores [B,N,T,S] (unscaled, fp32) and the mixing of probabilities into the output [B,T,N,Z]."""
    k_BSOZ, v_BSOZ = kv
    B, T, O, P, Z = q_BTOPZ.shape  # noqa: E741
    s_BNTS = ein("BTOPZ,BSOZ->BOPTS", q_BTOPZ, k_BSOZ, dtype=jnp.float32).reshape(B, O * P, T, -1)

    def mix(p_BNTS: jax.Array) -> jax.Array:
        return ein("BOPTS,BSOZ->BTOPZ", p_BNTS.reshape(B, O, P, T, -1), v_BSOZ).reshape(B, T, O * P, Z)

    return s_BNTS, mix


def group_queries(q_BTNZ: jax.Array, kv_heads: int) -> jax.Array:
    """[B,T,N,Z] -> [B,T,O,P,Z]: query heads grouped by the KV head they share (N = O * P)."""
    B, T, N, Z = q_BTNZ.shape
    return q_BTNZ.reshape(B, T, kv_heads, N // kv_heads, Z)


def gqa_scores(q_BTOPZ: jax.Array, k_BSOZ: jax.Array) -> jax.Array:
    """Scaled fp32 attention scores [B,O,P,T,S]."""
    return ein("BTOPZ,BSOZ->BOPTS", q_BTOPZ, k_BSOZ, dtype=jnp.float32) * q_BTOPZ.shape[-1] ** -0.5


def attention(q_BTNZ: jax.Array, k_BSOZ: jax.Array, v_BSOZ: jax.Array, mask_BTS: jax.Array) -> jax.Array:
    """Grouped-query softmax attention [B,T,N,Z]; keys where `mask_BTS` (broadcast over B) is False get weight 0."""
    B, T, N, Z = q_BTNZ.shape
    s_BOPTS = jnp.where(mask_BTS[:, None, None], gqa_scores(group_queries(q_BTNZ, k_BSOZ.shape[2]), k_BSOZ), NEG_INF)
    p_BOPTS = jax.nn.softmax(s_BOPTS, axis=-1).astype(q_BTNZ.dtype)
    return ein("BOPTS,BSOZ->BTOPZ", p_BOPTS, v_BSOZ).reshape(B, T, N, Z)


def concat_captured(captured_XBTD: jax.Array) -> jax.Array:
    """[X, B, T, D] captured target states (ascending layers) -> the drafter's aux input [B, T, X*D]."""
    X, B, T, D = captured_XBTD.shape
    return jnp.moveaxis(captured_XBTD, 0, 2).reshape(B, T, X * D)
