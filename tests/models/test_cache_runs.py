"""A paged cache's writes of consecutive positions (cache.py's `_put_runs`, what XLA:CPU runs in place of a scatter)
put exactly the scatter's values: every block size, run length, offset, block crossing, position outside the table,
row sharing a block with another, pool layout and cache format."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxspec.models.cache import PACKED, Paged, _put_runs, _set, quantize_entries, write_cache


@st.composite
def pools(draw):
    blk = draw(st.sampled_from([1, 2, 4, 8, 16]))
    rows, K = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    T = draw(st.integers(1, 2 * blk + 3))
    N = draw(st.integers(K + 1, rows * K + 2))
    # tables: a row's own blocks are distinct, or the null block 0 where it owns none; rows may share a block (a
    # prefix cached for both)
    own = lambda: draw(st.lists(st.integers(1, N - 1), min_size=K, max_size=K, unique=True))  # noqa: E731
    null = lambda: draw(st.lists(st.booleans(), min_size=K, max_size=K))  # noqa: E731
    tables = np.asarray([np.where(null(), 0, own()) for _ in range(rows)], np.int32)
    # starts anywhere in the table and past it: what is past it is dropped
    starts = draw(st.lists(st.integers(0, K * blk + 2), min_size=rows, max_size=rows))
    return blk, N, tables.reshape(rows, K), np.asarray(starts, np.int32), T, draw(st.integers(0, 2**31 - 1))


def scattered(pool, lead, cache, new, pos):
    blocks, offsets = cache.slots(pos)
    return _set(pool, (*lead, blocks, offsets), new)


@settings(max_examples=40, deadline=None)
@given(pools(), st.sampled_from(["stacked", "drafter"]), st.sampled_from([jnp.float32, jnp.bfloat16]))
def test_runs_put_the_scatters_values(case, layout, dtype):
    blk, N, tables, starts, T, seed = case
    rng = np.random.default_rng(seed)
    rows = len(starts)
    lead, shape = ((1,), (3, N, blk, 5)) if layout == "stacked" else ((), (N, blk, 2, 3))
    pool = jnp.asarray(rng.normal(size=shape), dtype)
    new = jnp.asarray(rng.normal(size=(rows, T, *shape[len(lead) + 2 :])), dtype)
    pos = jnp.asarray(starts[:, None] + np.arange(T), jnp.int32)
    cache = Paged(pool if lead else (pool,), jnp.asarray(tables))  # a drafter's pool: a tuple of arrays
    want = scattered(pool, lead, cache, new, pos)
    got = jax.jit(lambda p, n: _put_runs(p, lead, cache.tables, n, pos[:, 0]))(pool, new)
    live = (slice(None),) * len(lead) + (np.arange(N) > 0,)  # the null block 0: what lands there is never read
    np.testing.assert_array_equal(np.asarray(got)[live], np.asarray(want)[live])


def test_an_fp8_pool_takes_the_runs_packed_entries():
    rng = np.random.default_rng(0)
    pool = jnp.zeros((2, 6, 4, 9), PACKED)  # entries of 5 values, packed with their scale
    tables = jnp.asarray([[1, 2, 3], [4, 5, 0]], jnp.int32)
    new = jnp.asarray(rng.normal(size=(2, 6, 5)), jnp.float32)
    pos = jnp.asarray([[3], [1]]) + jnp.arange(6)  # row 0 crosses into its third block; row 1 into its second
    cache = Paged(pool, tables)
    got = jax.jit(lambda c: write_cache(c, 1, new, pos).pool)(cache)
    want = scattered(pool, (1,), cache, quantize_entries(new), pos)
    np.testing.assert_array_equal(np.asarray(got)[:, 1:], np.asarray(want)[:, 1:])
    assert np.asarray(got)[0].max() == 0  # the other layer untouched
