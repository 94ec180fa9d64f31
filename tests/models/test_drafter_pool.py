"""The drafter over the serving pool: its step writes its new entries into each row's own blocks and reads each row's
blocks in place, only as far as that row's own position (ragged), and gives what it gives over the dense cache."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import KimiConfig, Target
from jaxspec.io.drafter_config import draft_config_for
from jaxspec.models.cache import Paged
from jaxspec.models.mla import KV_BLOCK
from jaxspec.runtime import Drafter

B, S, BLOCK, T = 3, 3 * KV_BLOCK, 64, 2
POS = np.asarray([[5], [KV_BLOCK + 100], [2 * KV_BLOCK + 300]], np.int32) + np.arange(T, dtype=np.int32)


@pytest.fixture(scope="module")
def target():
    return Target.random(KimiConfig.preset("tiny"), dtype=jnp.float32, seed=0)


def make_drafter(target, kind: str) -> Drafter:
    cfg = draft_config_for(target.config)
    if kind == "mla":
        mla = target.config.replace(hidden_size=cfg.hidden_size, q_lora_rank=24, kv_lora_rank=40)
        cfg = dataclasses.replace(cfg, mla=mla, format="mla")
    return Drafter.random(cfg, target, dtype=jnp.float32, seed=2)


def pooled(dense: tuple[np.ndarray, ...], rng, read: int) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """The dense cache's entries in a pool of shuffled blocks. Whatever a row's read must not touch is NaN: the null
    block 0, and each row's blocks past the live-prefix blocks (of `read` positions: the target's `kv_block`, which
    its drafter reads by) its position reaches."""
    K = S // BLOCK
    tables = (1 + rng.permutation(B * K)).reshape(B, K).astype(np.int32)
    pools = []
    for c in dense:
        pool = np.full((1 + B * K, BLOCK, *c.shape[2:]), np.nan, np.float32)
        for b in range(B):
            live = -(-(POS[b].max() + 1) // read) * read
            entries = c[b].copy()
            entries[live:] = np.nan
            pool[tables[b]] = entries.reshape(K, BLOCK, *c.shape[2:])
        pools.append(pool)
    return tuple(pools), tables


@pytest.mark.parametrize("kind", ["llama", "mla"])
def test_the_drafter_reads_and_writes_its_pool_in_place_row_by_row(target, kind):
    drafter = make_drafter(target, kind)
    rng = np.random.default_rng(3)
    dense = tuple(rng.standard_normal((B, S, *c.shape[2:])).astype(np.float32) for c in drafter.init_cache(1, 8))
    pools, tables = pooled(dense, rng, target.kv_block)
    tokens = jnp.asarray(rng.integers(0, target.vocab_size, (B, T)), jnp.int32)
    width = len(drafter.capture_layers) * drafter.config.target_hidden_size
    hidden = jnp.asarray(rng.standard_normal((B, T, width)), jnp.float32)
    step = jax.jit(
        lambda cache: drafter.apply(drafter.params, tokens, hidden, jnp.asarray(POS), cache, first_step=True)
    )
    want_logits, want_h2, want_cache = step(tuple(jnp.asarray(c) for c in dense))
    logits, h2, paged = step(Paged(tuple(jnp.asarray(p) for p in pools), jnp.asarray(tables)))
    assert np.isfinite(np.asarray(logits)).all()  # nothing past a row's live blocks was read
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(h2), np.asarray(want_h2), rtol=1e-4, atol=1e-4)
    for pool, want in zip(paged.pool, want_cache, strict=True):
        pool, want = np.asarray(pool), np.asarray(want)
        assert np.isnan(pool[0]).all()  # the null block: never written
        for b in range(B):
            row = pool[tables[b]].reshape(S, *pool.shape[2:])
            live = POS[b].max() + 1
            np.testing.assert_allclose(row[:live], want[b, :live], rtol=1e-5, atol=1e-5)  # the new entries included


@pytest.mark.parametrize("kind", ["llama", pytest.param("mla", marks=pytest.mark.slow)])  # mla: ~10 s, -m slow
def test_a_tree_step_reads_the_pool_in_place(target, kind):
    """A draft tree's step over K nodes per row: each row's cached entries below its prefix, read from its own blocks
    (none past them: those are NaN), and the nodes' scratch entries give what the dense cache gives."""
    drafter = make_drafter(target, kind)
    rng = np.random.default_rng(4)
    dense = tuple(rng.standard_normal((B, S, *c.shape[2:])).astype(np.float32) for c in drafter.init_cache(1, 8))
    pools, tables = pooled(dense, rng, target.kv_block)
    K = 2
    prefix_B = jnp.asarray(POS[:, 0])
    tokens = jnp.asarray(rng.integers(0, target.vocab_size, (B, K)), jnp.int32)
    hidden = jnp.asarray(rng.standard_normal((B, K, drafter.config.hidden_size)), jnp.float32)
    pos = jnp.broadcast_to(prefix_B[:, None], (B, K))
    mask = jnp.broadcast_to(jnp.eye(K, dtype=bool), (B, K, K))  # each node sees itself among the scratch entries
    scratch = drafter.init_scratch(B, K)
    step = jax.jit(
        lambda cache: drafter.apply_tree(drafter.params, tokens, hidden, pos, cache, scratch, 0, mask, prefix_B)
    )
    want = step(tuple(jnp.asarray(c) for c in dense))
    got = step(Paged(tuple(jnp.asarray(p) for p in pools), jnp.asarray(tables)))
    assert np.isfinite(np.asarray(got[0])).all()
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "mla"])
def test_a_first_step_at_one_position_per_row_is_the_full_steps_there(target, kind):
    """A draft-extend runs the drafter's first step over T positions but needs its logits and h2 at one position per
    row (the last accepted one): with `at_B` the step writes every position's cache entry, as the full step does,
    and runs the MLP and the head at `at_B` only. Over the dense cache and the pool, at each row's first position, its
    last, and random ones."""
    drafter = make_drafter(target, kind)
    rng = np.random.default_rng(5)
    T5 = 5
    pos = jnp.asarray(POS[:, :1] + np.arange(T5, dtype=np.int32))
    dense = tuple(rng.standard_normal((B, S, *c.shape[2:])).astype(np.float32) for c in drafter.init_cache(1, 8))
    tables = (1 + rng.permutation(B * (S // BLOCK))).reshape(B, -1).astype(np.int32)
    pools = tuple(np.zeros((1 + tables.size, BLOCK, *c.shape[2:]), np.float32) for c in dense)
    for pool, c in zip(pools, dense, strict=True):
        for b in range(B):
            pool[tables[b]] = c[b].reshape(-1, BLOCK, *c.shape[2:])
    tokens = jnp.asarray(rng.integers(0, target.vocab_size, (B, T5)), jnp.int32)
    width = len(drafter.capture_layers) * drafter.config.target_hidden_size
    hidden = jnp.asarray(rng.standard_normal((B, T5, width)), jnp.float32)
    apply = lambda cache, at=None: drafter.apply(  # noqa: E731
        drafter.params, tokens, hidden, pos, cache, first_step=True, at_B=at
    )
    step = jax.jit(apply)
    for cache in (tuple(map(jnp.asarray, dense)), Paged(tuple(map(jnp.asarray, pools)), jnp.asarray(tables))):
        want_logits, want_h2, want_cache = step(cache)
        for at_B in ([0, 0, 0], [T5 - 1] * B, rng.integers(0, T5, B), rng.integers(0, T5, B)):
            at_B = np.asarray(at_B, np.int32)
            logits, h2, written = step(cache, jnp.asarray(at_B))
            assert logits.shape == (B, 1, want_logits.shape[-1]) and h2.shape == (B, 1, want_h2.shape[-1])
            rows = np.arange(B)
            np.testing.assert_allclose(logits[:, 0], np.asarray(want_logits)[rows, at_B], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(h2[:, 0], np.asarray(want_h2)[rows, at_B], rtol=1e-5, atol=1e-5)
            for got, want in zip(jax.tree.leaves(written), jax.tree.leaves(want_cache), strict=True):
                np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # every position's entry written
    with pytest.raises(ValueError, match="at_B: expected shape"):
        apply(tuple(map(jnp.asarray, dense)), jnp.zeros((B + 1,), jnp.int32))
