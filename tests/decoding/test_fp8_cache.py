"""The fp8 latent cache (`kv_cache_dtype="fp8"`, issue 29): its format, and speculative decoding stays lossless
against plain decoding with the same cache (greedy: equal tokens, chain and tree; sampling: the target's
distribution, where the target is the model reading its fp8 cache)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding.generate import generate
from jaxspec.decoding.sampling import Sampling
from jaxspec.models.cache import FP8_MAX, dequantize_entries, quantize_entries
from tests.decoding.support import NEW, PROMPTS, check_pairs_follow_target, random_drafter


def test_format_round_trip():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 5, 40)).astype(np.float32) * np.array([1e-3, 1.0, 300.0])[:, None, None]
    x[0, 0] = 0.0  # an all-zero entry (a fresh cache) stays zero
    packed = quantize_entries(jnp.asarray(x))
    assert packed.dtype == jnp.uint8 and packed.shape == (3, 5, 44)
    scale = np.asarray(jax.lax.bitcast_convert_type(packed[..., 40:], jnp.float32))
    amax = np.abs(x).max(-1)
    np.testing.assert_allclose(scale, np.where(amax > 0, amax / FP8_MAX, 1.0), rtol=1e-6)
    back = np.asarray(dequantize_entries(packed, jnp.float32))
    np.testing.assert_array_equal(back[0, 0], 0.0)
    # e4m3: 3 mantissa bits, so each value is within 2^-4 of itself (relative) above the subnormal range
    big = np.abs(x) > amax[..., None] * 2**-6
    assert np.all(np.abs(back - x)[big] <= 2**-4 * np.abs(x)[big])
    np.testing.assert_allclose(np.abs(back).max(-1), amax, rtol=1e-6)  # each token's max maps to 448: no clipping


def test_cache_shape_and_logits_near_the_compute_dtype_cache(target):
    fp8 = target.with_kv_cache_dtype("fp8")
    cache = fp8.init_cache(2, 32)
    assert cache.dtype == jnp.uint8 and cache.shape == (3, 2, 32, 44)
    tokens = np.random.default_rng(1).integers(0, 256, (2, 20))
    pos = np.broadcast_to(np.arange(20), (2, 20))
    ref = np.asarray(target.logits(tokens))
    out = np.asarray(fp8.forward(tokens, pos, cache)[0])
    err = np.abs(out - ref) / ref.std()  # random weights: 0.17 at most, 0.02 on average when measured
    assert 0 < err.max() < 0.3 and err.mean() < 0.05, (err.max(), err.mean())  # rounded (not exact), and close
    # per-token scales: a prefill then decode steps read the same cache entries as one prefill
    cache = fp8.init_cache(2, 32)
    first, cache, _ = fp8.forward(tokens[:, :12], pos[:, :12], cache)
    steps = [np.asarray(first)]
    for i in range(12, 20):
        logits, cache, _ = fp8.forward(tokens[:, i : i + 1], pos[:, i : i + 1], cache)
        steps.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), out, atol=1e-5 * ref.std())


def test_bad_kv_cache_dtype(target):
    with pytest.raises(ValueError, match="kv_cache_dtype: expected one of"):
        target.with_kv_cache_dtype("int8")


@pytest.fixture(scope="module")
def fp8(target):
    return target.with_kv_cache_dtype("fp8")


# The chain case runs with -m slow (tests/serving/test_engine_fp8.py covers chains through the engine); the tree case
# also covers through_cache (the fresh nodes rounded as a chain verify reads them back).
@pytest.mark.parametrize("tree", [pytest.param(False, marks=pytest.mark.slow), True])
def test_greedy_speculative_equals_plain_with_the_same_cache(fp8, tree):
    plain = generate(fp8, None, PROMPTS[3], max_new_tokens=NEW, num_steps=0).tokens
    shape = dict(num_steps=2, topk=2, num_draft_tokens=5) if tree else dict(num_steps=3)
    out = generate(fp8, random_drafter(fp8), PROMPTS[3], max_new_tokens=NEW, **shape)
    assert out.tokens == plain


class Fp8Reference:
    """The target as plain decoding with the fp8 cache sees it: `logits` of a prompt run through that cache (one
    prefill; per-token scales make it read the entries a token-by-token decode would)."""

    def __init__(self, target):
        self.target = target

    def logits(self, prompts):
        n = len(prompts[0])
        assert all(len(p) == n for p in prompts)
        cache = self.target.init_cache(len(prompts), n)
        pos = np.broadcast_to(np.arange(n), (len(prompts), n))
        return self.target.forward(np.asarray(prompts), pos, cache)[0]


@pytest.mark.slow  # ~40 s unloaded, 2 min on a busy 2-core machine: run with -m slow
def test_sampling_is_lossless_against_the_fp8_target(peaky):
    target, prompt, n = peaky.with_kv_cache_dtype("fp8"), [17, 4, 99], 20_000
    sampling = dict(temperature=1.0)
    out = generate(target, random_drafter(target), [prompt] * n, max_new_tokens=2, num_steps=2, seed=3, **sampling)
    pairs = np.array([t for t in out.tokens if len(t) == 2])
    assert len(pairs) > 0.9 * n
    check_pairs_follow_target(Fp8Reference(target), prompt, pairs, Sampling(**sampling))
