"""Cached decoding equals the full forward; the absorbed and expanded attention forms agree."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import KimiConfig, Target
from sharding.mesh import make_mesh


@pytest.fixture(scope="module")
def target():
    return Target.random(KimiConfig.preset("tiny"), dtype=jnp.float32, seed=1)


def positions(start, n, batch=2):
    return np.broadcast_to(np.arange(start, start + n), (batch, n))


def test_prefill_then_decode_then_verify_equals_full_forward(target):
    tokens = np.random.default_rng(0).integers(0, 256, (2, 26))
    full = np.asarray(target.logits(tokens))
    cache = target.init_cache(batch=2, max_len=32)
    steps = [(0, 16)] + [(i, 1) for i in range(16, 22)] + [(22, 4)]  # prefill, 1-token decode, a 4-token verify
    out = []
    for start, n in steps:
        logits, cache, _ = target.forward(tokens[:, start : start + n], positions(start, n), cache)
        out.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(out, axis=1), full, atol=1e-5 * full.std())


def test_ragged_batch_positions(target):
    """Sequences at different positions in one call (b right-padded): each sees only its own prefix."""
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 256, 10), rng.integers(0, 256, 7)
    cache = target.init_cache(batch=2, max_len=16)
    _, cache, _ = target.forward(np.stack([a[:8], np.concatenate([b[:5], [0, 0, 0]])]), positions(0, 8), cache)
    for step in range(2):  # a continues at 8, 9; b at 5, 6 (overwriting its padding)
        pos = np.array([[8 + step], [5 + step]])
        logits, cache, _ = target.forward(np.array([[a[8 + step]], [b[5 + step]]]), pos, cache)
    logits = np.asarray(logits)
    np.testing.assert_allclose(logits[0, -1], np.asarray(target.logits(a[None]))[0, -1], atol=1e-4)
    np.testing.assert_allclose(logits[1, -1], np.asarray(target.logits(b[None]))[0, -1], atol=1e-4)


@pytest.mark.parametrize("mesh", ["1x8", "2x4"])
def test_absorbed_equals_expanded(target, mesh):
    tokens = np.random.default_rng(2).integers(0, 256, (2, 12))
    sharded = target.on_mesh(make_mesh(mesh))
    results = []
    for impl in ("expanded", "absorbed"):
        cache = sharded.init_cache(2, 16)
        logits, _, _ = sharded.forward(tokens, positions(0, 12), cache, impl=impl)
        results.append(np.asarray(logits))
    np.testing.assert_allclose(results[0], results[1], atol=1e-5 * results[0].std())
