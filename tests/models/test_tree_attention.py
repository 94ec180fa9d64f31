"""Tree attention (models/tree_attention.py): a prefix pass over the latent cache plus a masked pass over the fresh
latents, merged by log-sum-exp.

References:
- a dense float64 softmax over [cached prefix | fresh entries] with the full mask, in the EXPANDED form (per-head keys
  and values from kv_b), written here in numpy one (row, query) at a time; the fresh entries are a random tree's
  nodes plus extra entries seen at random (a drafter's scratch entries);
- mla.py's verify attention (MLA.__call__, HF-checked in test_kimi_parity.py): with a chain mask the tree path must
  equal it on the same inputs, and for a real tree node t's output must equal a chain verify of its own root-to-t path.
Stale cache slots (at or past a row's prefix) hold huge garbage and everything past the last live block is NaN: a
leaked stale slot makes the output wrong, a read past the live blocks makes it NaN.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec import KimiConfig
from jaxspec.decoding import tree as tr
from jaxspec.models import rope
from jaxspec.models.mla import MLA, live_blocks, softmax_finish, softmax_init
from jaxspec.models.tree_attention import tree_attention, tree_verify_mla

CFG = KimiConfig.preset("tiny")
C, R = CFG.kv_lora_rank, CFG.qk_rope_head_dim
L, LAYER, BLK = 2, 1, 8  # two layers in the stacked cache; the layer under test is index 1


@pytest.fixture(scope="module")
def layer():
    graphdef, params = nnx.split(nnx.jit(lambda: MLA(CFG, jnp.float32, nnx.Rngs(11)))())  # one compile, not one per op
    params = jax.tree.map(lambda w: w * 4.0, params)  # a peaked softmax: attending to a wrong slot shows
    freqs, factor = rope.inv_freq(R, CFG.rope_theta, CFG.rope_scaling)
    return graphdef, params, jnp.asarray(freqs), factor


def random_parents(rng, T: int) -> np.ndarray:
    """A random tree of T nodes with parents before children (node 0 the root)."""
    return np.asarray([-1] + [int(rng.integers(0, t)) for t in range(1, T)], np.int32)


def tree_arrays(parents_BT: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ancestor-or-self mask [B,T,T], depth [B,T]) by walking parent pointers in python."""
    B, T = parents_BT.shape
    mask = np.zeros((B, T, T), bool)
    depth = np.zeros((B, T), np.int32)
    for b in range(B):
        for t in range(T):
            s = t
            while s >= 0:
                mask[b, t, s] = True
                depth[b, t] += s != t
                s = parents_BT[b, s]
    return mask, depth


def poisoned_cache(rng, prefix_B, S, extra_live=0):
    """Latent cache [L,B,S,K]: random below each row's prefix, garbage from there, NaN past the blocks the prefix
    pass may read of that row (its own prefix + `extra_live`, rounded up to a block: the read is ragged)."""
    cache = rng.standard_normal((L, len(prefix_B), S, CFG.latent_dim)).astype(np.float32)
    n_blocks_B, blk = live_blocks(jnp.asarray(prefix_B)[:, None] + extra_live - 1, S, BLK)
    for b, n in enumerate(prefix_B):
        cache[:, b, n:] = 1e4 * rng.standard_normal(cache[:, b, n:].shape)
        cache[:, b, int(n_blocks_B[b]) * blk :] = np.nan
    return cache


def dense_reference(q_nope, q_rope, cache, fresh, prefix_B, mask_BTS, w_uk, w_uv, scale):
    """float64 expanded-form attention of every query over its visible keys only: [B,T,N,A]."""
    f64 = lambda x: np.asarray(x, np.float64)
    q_nope, q_rope, cache, fresh, w_uk, w_uv = map(f64, (q_nope, q_rope, cache, fresh, w_uk, w_uv))
    B, T, N, _ = q_nope.shape
    out = np.zeros((B, T, N, w_uv.shape[-1]))
    for b in range(B):
        for t in range(T):
            keys = np.concatenate([cache[LAYER, b, : prefix_B[b]], fresh[b, mask_BTS[b, t]]])  # [S', K]
            k_nope = np.einsum("sc,cnh->snh", keys[:, :C], w_uk)
            v = np.einsum("sc,cna->sna", keys[:, :C], w_uv)
            s = (
                np.einsum("nh,snh->ns", q_nope[b, t], k_nope) + np.einsum("nr,sr->ns", q_rope[b, t], keys[:, C:])
            ) * scale
            p = np.exp(s - s.max(-1, keepdims=True))
            out[b, t] = np.einsum("ns,sna->na", p / p.sum(-1, keepdims=True), v)
    return out


@partial(jax.jit, static_argnames=("graphdef",))
def _tree_core(graphdef, params, q_nope, q_rope, fresh, cache, prefix_B, mask_BTS):
    mla = nnx.merge(graphdef, params)
    q_abs = jnp.einsum("BTNH,CNH->BTNC", q_nope, mla.kv_b_k[...])
    block_fn = mla.absorbed_block(q_abs, q_rope, C)
    state = tree_attention(
        block_fn, softmax_init(q_nope, C), fresh, cache, LAYER, prefix_B, mask_BTS, mla.softmax_scale, BLK, jnp.float32
    )
    return jnp.einsum("BTNC,CNA->BTNA", softmax_finish(state, jnp.float32), mla.kv_b_v[...])


# (each row's prefix length, tree nodes T, buffer S): prefixes ragged, one empty, block boundaries crossed. The
# default cases share their shapes (one compile); the slow ones add a larger tree and a root-only "tree" (T = 1).
CORE_CASES = [([5, 16, 0], 6, 40), ([31, 8, 2], 6, 40)]
SLOW_CORE_CASES = [([30, 9], 9, 44), ([3], 1, 12)]


@pytest.mark.parametrize(
    ("prefix", "T", "S"), CORE_CASES + [pytest.param(*c, marks=pytest.mark.slow) for c in SLOW_CORE_CASES]
)
def test_tree_attention_equals_dense_masked_softmax(layer, prefix, T, S):
    graphdef, params, _, _ = layer
    rng = np.random.default_rng(sum(prefix) + T)
    B, N, H = len(prefix), CFG.num_attention_heads, CFG.qk_nope_head_dim
    parents = np.stack([random_parents(rng, T) for _ in range(B)])
    # The tree's own nodes, plus 3 more fresh entries each query sees at random (as a drafter's scratch entries).
    mask = np.concatenate([tree_arrays(parents)[0], rng.random((B, T, 3)) < 0.5], axis=2)
    q_nope = rng.standard_normal((B, T, N, H)).astype(np.float32)
    q_rope = rng.standard_normal((B, T, N, R)).astype(np.float32)
    fresh = rng.standard_normal((B, T + 3, CFG.latent_dim)).astype(np.float32)
    cache = poisoned_cache(rng, prefix, S)
    prefix_B = np.asarray(prefix, np.int32)
    out = np.asarray(_tree_core(graphdef, params, q_nope, q_rope, fresh, cache, prefix_B, mask))
    assert np.isfinite(out).all(), "read past the live blocks"
    mla = nnx.merge(graphdef, params)
    want = dense_reference(
        q_nope, q_rope, cache, fresh, prefix_B, mask, mla.kv_b_k[...], mla.kv_b_v[...], mla.softmax_scale
    )
    np.testing.assert_allclose(out, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())
    with pytest.raises(ValueError, match=r"fresh_BSY / mask_BTS: expected \[B, S, Y\] / \[B, T, S\]"):
        jax.eval_shape(partial(_tree_core, graphdef), params, q_nope, q_rope, fresh, cache, prefix_B, mask[:, :, 1:])


@partial(jax.jit, static_argnames=("graphdef", "factor", "tree"))
def _layer(graphdef, params, freqs, x_BTD, pos_BT, cache, prefix_B, mask_BTS, *, factor, tree):
    mla = nnx.merge(graphdef, params)
    cos_sin = rope.cos_sin(pos_BT, freqs, factor)
    if tree:
        return tree_verify_mla(mla, x_BTD, cos_sin, prefix_B, mask_BTS, cache, LAYER, kv_block=BLK)
    return mla(x_BTD, cos_sin, pos_BT, cache, LAYER, "absorbed", kv_block=BLK)


def run_layer(layer, x, pos, cache, prefix=None, mask=None):
    graphdef, params, freqs, factor = layer
    out, cache = _layer(
        graphdef,
        params,
        freqs,
        x,
        jnp.asarray(pos, jnp.int32),
        cache,
        prefix,
        mask,
        factor=factor,
        tree=mask is not None,
    )
    return np.asarray(out), np.asarray(cache)


def test_chain_mask_equals_mla_verify(layer):
    rng = np.random.default_rng(1)
    # The shapes of the chain verifies in the next test (B = 16 rows, T = 4, S = 40): their program is reused.
    B, T, S = 16, 4, 40
    prefix = [7, 20, 0, 31] + rng.integers(0, 30, B - 4).tolist()
    prefix_B = np.asarray(prefix, np.int32)
    x = rng.standard_normal((B, T, CFG.hidden_size)).astype(np.float32)
    pos = prefix_B[:, None] + np.arange(T)
    cache = poisoned_cache(rng, prefix, S, extra_live=T)
    chain = np.broadcast_to(np.tril(np.ones((T, T), bool)), (B, T, T))
    want, want_cache = run_layer(layer, x, pos, cache)
    out, out_cache = run_layer(layer, x, pos, cache, prefix_B, chain)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    np.testing.assert_array_equal(out_cache, want_cache)


@jax.jit
def build_tree(logits_JBKV, prefix_B):
    """A 3-step topk-3 tree of 8 nodes from random drafter logits (step 1 uses the first slot only)."""
    draft = tr.first_expansion(logits_JBKV[0, :, 0], 3)
    for logits_BKV in logits_JBKV[1:]:
        draft = tr.expand(draft, logits_BKV)
    return tr.finish(draft, jnp.zeros_like(prefix_B), prefix_B, 8)


def test_tree_node_equals_chain_verify_of_its_path(layer):
    """Node t of a tree sees exactly what the last token of a chain verify over its root-to-t path sees."""
    rng = np.random.default_rng(2)
    prefix, S = [6, 13], 40
    B, D = len(prefix), CFG.hidden_size
    prefix_B = np.asarray(prefix, np.int32)
    tree = build_tree(rng.standard_normal((3, B, 3, 9)).astype(np.float32), prefix_B)
    T, J = 8, tree.max_depth + 1
    x = rng.standard_normal((B, T, D)).astype(np.float32)
    cache = poisoned_cache(rng, prefix, S, extra_live=T)
    out, out_cache = run_layer(layer, x, tree.positions_BT, cache, prefix_B, tree.mask_BTS)
    assert np.isfinite(out).all()
    # The tree's fresh entries sit at slots prefix + t.
    for b, n in enumerate(prefix):
        assert np.isfinite(out_cache[LAYER, b, n : n + T]).all() and np.abs(out_cache[LAYER, b, n : n + T]).max() < 1e3

    # Chain rows: one per (row, node), its path's inputs at positions prefix..prefix+depth, padded to J tokens.
    mask, depth_BT = tree_arrays(np.asarray(tree.parent_BT))  # the path to t: its ancestors, in node order
    chains, rows = [], []
    for b in range(B):
        for t in range(T):
            on_path = x[b, mask[b, t]]
            chains.append(np.concatenate([on_path, np.zeros((J - len(on_path), D), np.float32)]))
            rows.append(b)
    chain_x = np.stack(chains)
    chain_pos = prefix_B[rows][:, None] + np.arange(J)
    chain_out, _ = run_layer(layer, chain_x, chain_pos, cache[:, rows])
    want = np.stack([chain_out[i, depth_BT[b, i % T]] for i, b in enumerate(rows)]).reshape(B, T, D)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
