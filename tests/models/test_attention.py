"""Attention over the live prefix (mla.py): the blocked, data-dependent loop equals full attention, with exact
per-row causality, and never reads past the live blocks.

Reference: the no-cache forward of the same layer over each row's whole sequence (causal by position, so position p
sees exactly tokens 0..p), which tests/models/test_kimi_parity.py checks against HF transformers. Stale cache entries
(past a row's own position) are filled with huge garbage and everything past the last live block with NaN: a read
past the live blocks makes the output NaN, a missing block or a leaked stale entry makes it wrong.
"""

import contextlib
import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from jaxspec import KimiConfig, Target
from jaxspec.models import rope
from jaxspec.models.kernels import lowering_for_gpu
from jaxspec.models.mla import CPU_KV_BLOCK, KV_BLOCK, MLA, kv_block_for, live_blocks
from sharding.mesh import make_mesh

CFG = KimiConfig.preset("tiny")
TRITON_CALL = "__gpu$xla.gpu.triton"


@pytest.fixture(scope="module")
def layer():
    graphdef, params = nnx.split(MLA(CFG, jnp.float32, nnx.Rngs(7)))
    # Larger than init scale so that the softmax is peaked: attending to a wrong position then shows.
    params = jax.tree.map(lambda w: w * 4.0, params)
    freqs, factor = rope.inv_freq(CFG.qk_rope_head_dim, CFG.rope_theta, CFG.rope_scaling)
    return graphdef, params, jnp.asarray(freqs), factor


@partial(jax.jit, static_argnames=("graphdef", "factor", "impl", "kv_block"))
def _run(graphdef, params, freqs, x_BTD, pos_BT, cache_LBSY, *, factor, impl, kv_block):
    cos_sin = rope.cos_sin(pos_BT, freqs, factor)
    return nnx.merge(graphdef, params)(x_BTD, cos_sin, pos_BT, cache_LBSY, 1, impl, kv_block=kv_block)


def run(layer, x, pos, cache, impl, kv_block=8):
    graphdef, params, freqs, factor = layer
    out, cache = _run(
        graphdef, params, freqs, x, jnp.asarray(pos, jnp.int32), cache, factor=factor, impl=impl, kv_block=kv_block
    )
    return np.asarray(out), None if cache is None else np.asarray(cache)


# (buffer S, block, each row's first query position, query tokens T). Live = max(row position) + T.
CASES = [
    (40, 8, [5, 15], 1),  # live 16: exactly two blocks (a block boundary); NaN from 16 on
    (37, 8, [30, 9], 4),  # S not a multiple of the block: the last block is shifted back and overlaps
    (37, 8, [14, 2], 3),  # live 17: one position into the third block; NaN from 24 on
    (6, 8, [4, 1], 2),  # buffer shorter than a block
]


@pytest.mark.parametrize(("S", "blk", "starts", "T"), CASES)
def test_blocked_cache_attention_equals_full_attention(layer, S, blk, starts, T):
    B, L = len(starts), 2  # two layers in the stacked cache; the layer under test is index 1
    rng = np.random.default_rng(S * 131 + blk + T)
    x_BSD = rng.standard_normal((B, S, CFG.hidden_size)).astype(np.float32)
    full_pos = np.broadcast_to(np.arange(S), (B, S))
    ref_BSD, _ = run(layer, x_BSD, full_pos, None, "expanded")

    # Cached prefill of all S positions (blocked, expanded form) equals the full forward.
    cache = jnp.zeros((L, B, S, CFG.latent_dim), jnp.float32)
    out, cache = run(layer, x_BSD, full_pos, cache, "expanded", kv_block=blk)
    np.testing.assert_allclose(out, ref_BSD, atol=1e-5 * ref_BSD.std())

    # Row b restarts at starts[b]: its entries from there on are stale (huge garbage, and the other layer too);
    # nothing past the row's OWN last live block may be read at all (NaN): a short row beside a long one reads
    # only its own blocks (ragged).
    n_blocks, _ = live_blocks(jnp.asarray(starts)[:, None] + T - 1, S, blk)
    assert list(np.asarray(n_blocks)) == [min(-(-(s + T) // min(blk, S)), -(-S // min(blk, S))) for s in starts]
    poisoned = cache.copy()
    for b, s in enumerate(starts):
        poisoned[:, b, s:] = 1e4 * rng.standard_normal(poisoned[:, b, s:].shape)
        poisoned[:, b, int(n_blocks[b]) * min(blk, S) :] = np.nan

    pos = np.asarray(starts)[:, None] + np.arange(T)
    x_BTD = np.stack([x_BSD[b, s : s + T] for b, s in enumerate(starts)])
    want = np.stack([ref_BSD[b, s : s + T] for b, s in enumerate(starts)])
    for impl in ("absorbed", "expanded"):
        out, new_cache = run(layer, x_BTD, pos, poisoned, impl, kv_block=blk)
        assert np.isfinite(out).all(), f"{impl}: read past the live blocks"
        np.testing.assert_allclose(out, want, atol=1e-5 * ref_BSD.std(), err_msg=impl)
        # The step wrote exactly its T entries per row into layer 1 (as the prefill had) and nothing else.
        expect = poisoned.copy()
        for b, s in enumerate(starts):
            expect[1, b, s : s + T] = cache[1, b, s : s + T]
        np.testing.assert_allclose(new_cache, expect, rtol=1e-5, atol=1e-5, err_msg=impl)


def test_live_blocks_rejects_a_bad_block():
    with pytest.raises(ValueError, match="kv_block"):
        live_blocks(jnp.zeros((1, 1), jnp.int32), 16, 0)


def test_ragged_verify_on_2x4_mesh_reads_only_each_shard_live_blocks():
    """Tiny target on a 2x4 mesh: each data shard loops over its OWN rows' live blocks. Shard 0 (rows 0, 1) is
    short, so its cache past its two live blocks is NaN; shard 1 runs into the shifted last block of a 37-position
    buffer. Logits equal the no-cache forward (HF-checked in test_kimi_parity.py) at every row's positions."""
    cfg = CFG.replace(num_hidden_layers=2)
    target = Target.random(cfg, mesh=make_mesh("2x4"), dtype=jnp.float32, seed=4)
    S, blk, T, starts = 37, 8, 3, np.array([3, 6, 20, 33])
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (4, 36))
    full = np.asarray(target.logits(tokens))

    step = jax.jit(lambda p, t, q, c: target.apply(p, t, q, c, kv_block=blk)[:2])
    prefill_pos = np.broadcast_to(np.arange(36), (4, 36))
    logits, cache = step(target.params, tokens, prefill_pos, target.init_cache(4, S))
    np.testing.assert_allclose(np.asarray(logits), full, atol=1e-5 * full.std())

    cache = np.array(cache)
    for b, s in enumerate(starts):  # stale from each row's restart position
        cache[:, b, s:] = 1e4 * np.random.default_rng(b).standard_normal(cache[:, b, s:].shape)
    cache[:, :2, 2 * blk :] = np.nan  # shard 0's live length is 6 + 3 = 9: two blocks
    cache = jax.device_put(cache, NamedSharding(target.mesh, target.cache_spec()))
    pos = starts[:, None] + np.arange(T)
    verify = np.stack([tokens[b, s : s + T] for b, s in enumerate(starts)])
    logits, _ = step(target.params, verify, pos, cache)
    want = np.stack([full[b, s : s + T] for b, s in enumerate(starts)])
    assert np.isfinite(np.asarray(logits)).all(), "a data shard read past its own live blocks"
    np.testing.assert_allclose(np.asarray(logits), want, atol=1e-5 * full.std())


def test_a_target_reads_its_cache_in_blocks_of_its_platform():
    """`Target.apply` reads the live prefix in blocks of the target's `kv_block` unless told otherwise: on the CPU
    one block of the default pool (CPU_KV_BLOCK), elsewhere KV_BLOCK. Past the first CPU_KV_BLOCK positions the
    cache is NaN: a read by KV_BLOCK makes the logits NaN."""
    assert kv_block_for("tpu") == kv_block_for("gpu") == kv_block_for(None) == KV_BLOCK > CPU_KV_BLOCK
    target = Target.random(CFG.replace(num_hidden_layers=2), dtype=jnp.float32, seed=4)
    assert target.kv_block == CPU_KV_BLOCK == kv_block_for("cpu")
    with lowering_for_gpu(target.mesh) as gpu:  # an abstract mesh (jax.export for CUDA): its abstract device's
        on_gpu = dataclasses.replace(target, mesh=gpu)
        assert on_gpu.kv_block == KV_BLOCK
        assert on_gpu.abstract_pool(2, 128, 64).pool.shape[1] == 2 * 128 // 64 + 1  # (its layout asked mesh.devices)
    assert dataclasses.replace(target, mesh=target.mesh.abstract_mesh).kv_block == CPU_KV_BLOCK  # its devices'
    nameless = jax.sharding.AbstractMesh((1, 1), target.mesh.axis_names)
    assert nameless.abstract_device is None and dataclasses.replace(target, mesh=nameless).kv_block == KV_BLOCK
    tokens = np.random.default_rng(5).integers(0, CFG.vocab_size, (2, 40))
    full = np.asarray(target.logits(tokens))
    step = jax.jit(lambda p, t, q, c: target.apply(p, t, q, c)[:2])
    _, cache = step(target.params, tokens[:, :36], np.broadcast_to(np.arange(36), (2, 36)), target.init_cache(2, 128))
    cache = np.array(cache)
    cache[:, :, CPU_KV_BLOCK:] = np.nan
    pos = np.broadcast_to(np.arange(36, 40), (2, 4))
    logits, _ = step(target.params, tokens[:, 36:], pos, jnp.asarray(cache))
    np.testing.assert_allclose(np.asarray(logits), full[:, 36:], atol=1e-5 * full.std())


def paged_like(cache: np.ndarray, block: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """`cache` [L, B, S, Y] as a pool [L, 1 + B * S / block, block, Y] with shuffled tables [B, S / block] (block 0,
    the null block, is NaN: no row owns it)."""
    L, B, S, Y = cache.shape
    K = S // block
    tables = (1 + rng.permutation(B * K)).reshape(B, K).astype(np.int32)
    pool = np.full((L, 1 + B * K, block, Y), np.nan, np.float32)
    for b in range(B):
        pool[:, tables[b]] = cache[:, b].reshape(L, K, block, Y)
    return pool, tables


@pytest.mark.parametrize("impl", ["absorbed", "expanded"])
def test_a_paged_cache_is_read_and_written_in_place_as_the_dense_one(layer, impl):
    """The same entries in a pool of shuffled blocks: the step's outputs are the dense cache's, value for value, and
    its new entries land in each row's own blocks (nothing else of the pool changes)."""
    from jaxspec.models.cache import Paged

    rng = np.random.default_rng(5)
    B, S, T, block = 3, 32, 2, 8
    cache = rng.standard_normal((2, B, S, CFG.latent_dim)).astype(np.float32)
    pool, tables = paged_like(cache, block, rng)
    x = rng.standard_normal((B, T, CFG.hidden_size)).astype(np.float32)
    pos = np.asarray([[3], [17], [29]]) + np.arange(T)
    want, want_cache = run(layer, x, pos, jnp.asarray(cache), impl)
    graphdef, params, freqs, factor = layer
    out, paged = _run(
        graphdef,
        params,
        freqs,
        x,
        jnp.asarray(pos),
        Paged(jnp.asarray(pool), jnp.asarray(tables)),
        factor=factor,
        impl=impl,
        kv_block=8,
    )
    np.testing.assert_array_equal(np.asarray(out), want)
    got_pool = np.asarray(paged.pool)
    assert np.isnan(got_pool[:, 0]).all()  # the null block: never written
    for b in range(B):
        np.testing.assert_array_equal(got_pool[:, tables[b]].reshape(2, S, -1), want_cache[:, b])


@pytest.mark.parametrize("platform, call", [("tpu", "tpu_custom_call"), ("cuda", TRITON_CALL), ("cpu", None)])
def test_the_paged_absorbed_read_lowers_to_the_kernel_on_tpu_and_gpu(platform, call):
    """Lowered for a TPU or a CUDA GPU, decode over a paged cache is the Pallas kernel; lowered for the CPU it is the
    XLA loop over each row's blocks (no kernel). Kimi-K2.5's latent width: 512 + 64."""
    from jaxspec.models.cache import Paged
    from jaxspec.models.kernels import lowering_for_gpu

    cfg = CFG.replace(kv_lora_rank=512, qk_rope_head_dim=64)
    graphdef, params = nnx.split(MLA(cfg, jnp.float32, nnx.Rngs(0)))
    freqs, factor = rope.inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)

    def step(x, pos, pool, tables):
        cos_sin = rope.cos_sin(pos, jnp.asarray(freqs), factor)
        return nnx.merge(graphdef, params)(x, cos_sin, pos, Paged(pool, tables), 0, "absorbed")

    shapes = (
        jax.ShapeDtypeStruct((2, 1, cfg.hidden_size), jnp.float32),
        jax.ShapeDtypeStruct((2, 1), jnp.int32),
        jax.ShapeDtypeStruct((1, 9, 16, cfg.latent_dim), jnp.float32),
        jax.ShapeDtypeStruct((2, 4), jnp.int32),
    )
    allow = [jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)]  # never stored: no stability needed
    with lowering_for_gpu() if platform == "cuda" else contextlib.nullcontext():
        text = jax.export.export(jax.jit(step), platforms=[platform], disabled_checks=allow)(*shapes).mlir_module()
    if call is None:
        assert "tpu_custom_call" not in text and "while" in text  # the XLA loop over each row's blocks
    else:
        assert text.count(call) >= 1, f"no {call} in the {platform} lowering"


def test_a_bfloat16_pool_is_written_without_widening_it_on_cpu():
    """XLA:CPU widens a bfloat16 scatter to float32 across the whole operand: a step's write into the pool goes
    through a uint16 view instead (a bit copy), so no pool-sized float32 buffer appears; the values are the same."""
    import re

    from jaxspec.models.cache import Paged, write_cache

    pool = jnp.zeros((2, 33, 16, 40), jnp.bfloat16)
    tables = jnp.arange(32, dtype=jnp.int32).reshape(4, 8) + 1
    new = jax.random.normal(jax.random.key(0), (4, 2, 40)).astype(jnp.bfloat16)
    pos = jnp.asarray([[3, 4], [17, 18], [120, 121], [127, 128]], jnp.int32)  # 128: past the row, dropped
    write = jax.jit(lambda p, n: write_cache(Paged(p, tables), 1, n, pos).pool)
    assert not re.findall(r"f32\[2,33,16,40\]", write.lower(pool, new).compile().as_text())
    widened = jax.jit(lambda p, n: p.at[1, tables[:, :1], pos % 16].set(n, mode="drop"))
    assert re.findall(r"f32\[2,33,16,40\]", widened.lower(pool, new).compile().as_text())  # what it avoids
    got, want = np.asarray(write(pool, new).astype(jnp.float32)), np.zeros((2, 33, 16, 40), np.float32)
    for b, row in enumerate(np.asarray(pos)):
        for t, p in enumerate(row):
            if p < 128:  # the rest is dropped
                want[1, int(tables[b, p // 16]), p % 16] = np.asarray(new[b, t], np.float32)
    np.testing.assert_array_equal(got, want)
