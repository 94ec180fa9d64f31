"""Multi-head latent attention (MLA) with a latent KV cache.

Per token and layer the cache holds `kv_lora_rank + qk_rope_head_dim` values: the normalised KV latent and the
rotated RoPE key shared by all heads. Two mathematically equal ways to attend over it:
- "expanded" (prefill): expand the latent to per-head keys/values with kv_b, then ordinary attention;
- "absorbed" (decode/verify): fold kv_b's key half into the query and its value half into the output, so attention
  runs directly over the 576-wide latent and nothing per-head is materialised for the cached positions.
Runs per device inside shard_map: N below is the local head count and the output is a partial sum over the local
heads; the caller reduces it.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.config import LATENT_NORM_EPS, KimiConfig
from jaxspec.models import rope
from jaxspec.models.layers import ones, param, rms_norm
from jaxspec.models.quant import einsum as ein

AttnImpl = Literal["expanded", "absorbed"]
_NEG_INF = -1e30


class MLA(nnx.Module):
    def __init__(self, cfg: KimiConfig, dtype: jnp.dtype, rngs: nnx.Rngs):
        D, Q, C = cfg.hidden_size, cfg.q_lora_rank, cfg.kv_lora_rank
        N, H, R, A = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        if cfg.q_lora:
            self.q_a = param(rngs, (D, Q), ("embed", "q_lora"), dtype)
            self.q_a_norm = param(rngs, (Q,), ("q_lora",), dtype, ones)
            self.q_b_nope = param(rngs, (Q, N, H), ("q_lora", "heads", None), dtype)
            self.q_b_rope = param(rngs, (Q, N, R), ("q_lora", "heads", None), dtype)
        else:  # q_lora_rank null: one q_proj straight from the hidden state (DeepSeek-V2-Lite, Moonlight)
            self.q_nope = param(rngs, (D, N, H), ("embed", "heads", None), dtype)
            self.q_rope = param(rngs, (D, N, R), ("embed", "heads", None), dtype)
        self.kv_a_latent = param(rngs, (D, C), ("embed", "kv_lora"), dtype)
        self.kv_a_rope = param(rngs, (D, R), ("embed", None), dtype)
        self.kv_a_norm = param(rngs, (C,), ("kv_lora",), dtype, ones)
        self.kv_b_k = param(rngs, (C, N, H), ("kv_lora", "heads", None), dtype)  # W_uk
        self.kv_b_v = param(rngs, (C, N, A), ("kv_lora", "heads", None), dtype)  # W_uv
        self.o = param(rngs, (N, A, D), ("heads", None, "embed"), dtype)
        self.softmax_scale = cfg.softmax_scale

    def __call__(
        self,
        x_BTD: jax.Array,
        cos_sin: tuple[jax.Array, jax.Array],
        q_pos_BT: jax.Array,
        cache_BSK: jax.Array | None,
        impl: AttnImpl,
    ) -> tuple[jax.Array, jax.Array | None]:
        """Returns (partial attention output [B,T,D] in fp32, updated layer cache or None)."""
        cos, sin = cos_sin
        C = self.kv_a_norm.shape[0]

        with jax.named_scope("q"):
            q_nope_BTNH, q_rope_BTNR = self._queries(x_BTD)
            q_rope_BTNR = rope.apply_interleaved(q_rope_BTNR, cos[:, :, None], sin[:, :, None])
        with jax.named_scope("kv_latent"):
            latent_BTC = rms_norm(
                ein("BTD,DC->BTC", x_BTD, self.kv_a_latent[...]), self.kv_a_norm[...], LATENT_NORM_EPS
            )
            k_rope_BTR = rope.apply_interleaved(ein("BTD,DR->BTR", x_BTD, self.kv_a_rope[...]), cos, sin)
            new_BTK = jnp.concatenate([latent_BTC, k_rope_BTR], axis=-1)

        if cache_BSK is None:
            kv_BSK, kv_pos_BS = new_BTK, q_pos_BT
        else:
            # Each sequence writes its T new entries contiguously from its first query position.
            write = lambda c, n, p: jax.lax.dynamic_update_slice(c, n.astype(c.dtype), (p, 0))  # noqa: E731
            cache_BSK = jax.vmap(write)(cache_BSK, new_BTK, q_pos_BT[:, 0])
            kv_BSK = cache_BSK.astype(x_BTD.dtype)
            kv_pos_BS = jnp.broadcast_to(jnp.arange(kv_BSK.shape[1]), kv_BSK.shape[:2])
        latent_BSC, k_rope_BSR = kv_BSK[..., :C], kv_BSK[..., C:]
        # Causal by position: entries past a sequence's own position are stale or padding and never seen.
        mask_BTS = kv_pos_BS[:, None, :] <= q_pos_BT[:, :, None]

        with jax.named_scope(f"attend_{impl}"):
            rope_BNTS = ein("BTNR,BSR->BNTS", q_rope_BTNR, k_rope_BSR)
            if impl == "absorbed":
                q_abs_BTNC = ein("BTNH,CNH->BTNC", q_nope_BTNH, self.kv_b_k[...])
                scores_BNTS = ein("BTNC,BSC->BNTS", q_abs_BTNC, latent_BSC) + rope_BNTS
                probs_BNTS = _softmax(scores_BNTS, mask_BTS, self.softmax_scale)
                ctx_BTNC = ein("BNTS,BSC->BTNC", probs_BNTS, latent_BSC)
                out_BTNA = ein("BTNC,CNA->BTNA", ctx_BTNC, self.kv_b_v[...])
            elif impl == "expanded":
                k_nope_BSNH = ein("BSC,CNH->BSNH", latent_BSC, self.kv_b_k[...])
                v_BSNA = ein("BSC,CNA->BSNA", latent_BSC, self.kv_b_v[...])
                scores_BNTS = ein("BTNH,BSNH->BNTS", q_nope_BTNH, k_nope_BSNH) + rope_BNTS
                probs_BNTS = _softmax(scores_BNTS, mask_BTS, self.softmax_scale)
                out_BTNA = ein("BNTS,BSNA->BTNA", probs_BNTS, v_BSNA)
            else:
                raise ValueError(f"attention impl must be 'expanded' or 'absorbed', got {impl!r}")
        out_BTD = ein("BTNA,NAD->BTD", out_BTNA, self.o[...], dtype=jnp.float32)
        return out_BTD, cache_BSK

    def _queries(self, x_BTD: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(q_nope [B,T,N,H], q_rope before rotation [B,T,N,R]) through the query latent, or q_proj without one."""
        if not hasattr(self, "q_a"):
            return ein("BTD,DNH->BTNH", x_BTD, self.q_nope[...]), ein("BTD,DNR->BTNR", x_BTD, self.q_rope[...])
        q_lat_BTQ = rms_norm(ein("BTD,DQ->BTQ", x_BTD, self.q_a[...]), self.q_a_norm[...], LATENT_NORM_EPS)
        return ein("BTQ,QNH->BTNH", q_lat_BTQ, self.q_b_nope[...]), ein("BTQ,QNR->BTNR", q_lat_BTQ, self.q_b_rope[...])


def _softmax(scores_BNTS: jax.Array, mask_BTS: jax.Array, scale: float) -> jax.Array:
    s = scores_BNTS.astype(jnp.float32) * scale
    s = jnp.where(mask_BTS[:, None], s, _NEG_INF)
    return jax.nn.softmax(s, axis=-1).astype(scores_BNTS.dtype)
