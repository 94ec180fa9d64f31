"""Decode context parallelism (models/dcp.py): a cache striped by position over DCP groups of the model axis gives
the unstriped cache's logits, on sampled small configurations, for every path over the cache (prefill chunks, ragged
verify, tree verify, the commit of a tree's path), dense and paged, bf16-exact layouts in float32 and fp8; and the
refusals name --dcp's field."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxspec import KimiConfig, Target
from jaxspec.models.cache import Paged
from sharding.mesh import make_mesh

S, BLOCK, KV_BLOCK = 32, 8, 4  # positions per row, a pool block, the attention loop's block


@st.composite
def cases(draw) -> dict:
    cfg = dataclasses.replace(
        KimiConfig.preset("tiny"),
        num_attention_heads=draw(st.sampled_from([8, 16])),
        kv_lora_rank=draw(st.sampled_from([16, 32, 48])),
        qk_rope_head_dim=draw(st.sampled_from([4, 8])),
        num_hidden_layers=draw(st.integers(1, 2)),
    )
    return dict(
        cfg=cfg,
        dcp=draw(st.sampled_from([2, 4, 8])),
        kv=draw(st.sampled_from(["auto", "fp8"])),
        paged=draw(st.booleans()),
        prompt=draw(st.lists(st.integers(1, 20), min_size=2, max_size=2)),  # ragged rows
        seed=draw(st.integers(0, 100)),
    )


def _cache(target: Target, paged: bool, rows: int):
    if not paged:
        return target.init_cache(rows, S)
    pool = target.init_cache(rows * S // BLOCK + 1, BLOCK)
    order = np.random.default_rng(0).permutation(np.arange(1, rows * S // BLOCK + 1))  # blocks out of order
    return Paged(pool, jnp.asarray(order.reshape(rows, S // BLOCK), jnp.int32))


def _steps(target: Target, cache, prompt: list[int], seed: int):
    """Logits of a prefill (more than 16 tokens: the expanded form unstriped), a ragged verify of 4 and a tree verify
    of 5 nodes after it, then a decode step after the tree's path is committed."""
    rng, B = np.random.default_rng(seed), len(prompt)
    tokens = lambda T: jnp.asarray(rng.integers(0, target.vocab_size, (B, T)), jnp.int32)  # noqa: E731
    step = jax.jit(lambda p, t, q, c, m=None: target.apply(p, t, q, c, kv_block=KV_BLOCK, tree_mask_BTS=m)[:2])
    lens = np.asarray(prompt)
    out, cache = step(target.params, tokens(20), jnp.minimum(jnp.arange(20)[None], lens[:, None] - 1), cache)
    logits = [out]
    out, cache = step(target.params, tokens(4), jnp.asarray(lens[:, None] + np.arange(4)), cache)
    logits.append(out)
    prefix = lens + 4
    mask = jnp.asarray(np.tril(np.ones((5, 5), bool)) & np.array([1, 1, 1, 0, 1], bool)[None] | np.eye(5, dtype=bool))
    depth = np.array([0, 1, 2, 1, 2])
    tree_BTT = jnp.broadcast_to(mask, (B, 5, 5))
    out, cache = step(target.params, tokens(5), jnp.asarray(prefix[:, None] + depth), cache, tree_BTT)
    logits.append(out)
    path, accepted = jnp.asarray([[0, 3, 4]] * B, jnp.int32), jnp.asarray([2, 1][:B], jnp.int32)
    cache = jax.jit(target.compact_cache)(cache, jnp.asarray(prefix, jnp.int32), path, accepted)
    out, _ = step(target.params, tokens(1), jnp.asarray(prefix + np.asarray(accepted) + 1)[:, None], cache)
    return [*logits, out]


@pytest.mark.slow  # two compiles of five steps per example
@settings(max_examples=4, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(cases())
def test_striped_cache_gives_the_unstriped_logits(case):
    target = Target.random(
        case["cfg"], mesh=make_mesh("1x8"), dtype=jnp.float32, seed=case["seed"], kv_cache_dtype=case["kv"]
    )
    striped = target.with_dcp(case["dcp"])
    want = _steps(target, _cache(target, case["paged"], 2), case["prompt"], case["seed"])
    got = _steps(striped, _cache(striped, case["paged"], 2), case["prompt"], case["seed"])
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-4, atol=2e-4, err_msg=f"step {i}")


@pytest.fixture(scope="module")
def abstract_target():
    return Target.abstract(KimiConfig.preset("tiny"), mesh=make_mesh("1x8"), dtype=jnp.float32)


def test_each_device_holds_its_stripe_only(abstract_target):
    target = abstract_target
    for n in (1, 2, 8):
        cache = target.with_dcp(n).init_cache(2, S)
        assert cache.sharding.shard_shape(cache.shape)[2] == S // n
        assert target.with_dcp(n).cache_positions(cache) == S


def test_refusals_name_the_field(abstract_target):
    target = abstract_target
    with pytest.raises(ValueError, match=r"dcp: 3 does not divide the mesh's 'model' axis of 8"):
        target.with_dcp(3)
    with pytest.raises(ValueError, match=r"dcp: expected a whole number >= 1, got 0"):
        target.with_dcp(0)
    with pytest.raises(ValueError, match=r"dcp: a cache of 12 positions .* does not split into 8 stripes"):
        target.with_dcp(8).init_cache(1, 12)
    with pytest.raises(ValueError, match=r"dcp: a cache of 4 positions \(or a pool block"):
        target.with_dcp(8).abstract_pool(2, 16, 4)
    assert target.with_dcp(8) is target.with_dcp(8)  # one striped target, so its compiled programs are kept
