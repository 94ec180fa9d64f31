"""`generate(..., dcp=N)` on the 1x8 CPU mesh: the cache striped over groups of N devices gives the unstriped greedy
tokens (plain, chain and tree; a ragged batch; float32, bfloat16 and the fp8 cache) and the same seeded samples.
The default suite keeps one case (a chain at --dcp 8: every device a stripe, the merge over 8 stripes); the rest is
slow (each case compiles two loops on 8 devices, about 30 s)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import KimiConfig, Target, generate
from jaxspec.decoding.draft_shape import DraftShape
from sharding.mesh import make_mesh
from tests.decoding.support import NEW, PROMPTS, random_drafter

SHAPES = {"plain": DraftShape(0), "chain": DraftShape(3), "tree": DraftShape(3, topk=2, num_draft_tokens=6)}


@pytest.fixture(scope="module")
def pair():
    cfg = KimiConfig.preset("tiny").replace(num_hidden_layers=2)  # a dense layer and a MoE one: compiles faster
    target = Target.random(cfg, mesh=make_mesh("1x8"), dtype=jnp.float32, seed=0)
    return target, random_drafter(target)


@pytest.mark.parametrize(
    "shape, dcp, kv, dtype",
    [
        ("chain", 8, "auto", jnp.float32),
        pytest.param("tree", 2, "fp8", jnp.float32, marks=pytest.mark.slow),
        pytest.param("plain", 4, "fp8", jnp.bfloat16, marks=pytest.mark.slow),
        pytest.param("tree", 8, "auto", jnp.bfloat16, marks=pytest.mark.slow),
        pytest.param("chain", 2, "fp8", jnp.float32, marks=pytest.mark.slow),
        pytest.param("plain", 8, "auto", jnp.float32, marks=pytest.mark.slow),
    ],
)
def test_greedy_tokens_equal_the_unstriped_cache(pair, shape, dcp, kv, dtype):
    target, drafter = pair
    if dtype != jnp.float32:
        target = Target.random(target.config, mesh=target.mesh, dtype=dtype, seed=0)
        drafter = random_drafter(target)
    target = target.with_kv_cache_dtype(kv)
    run = lambda n: generate(target, drafter, PROMPTS[3], draft=SHAPES[shape], max_new_tokens=NEW, dcp=n)  # noqa: E731
    got, want = run(dcp).tokens, run(1).tokens
    if dtype == jnp.float32:
        assert got == want
    else:
        assert_same_up_to_near_ties(target, PROMPTS[3], got, want)


def assert_same_up_to_near_ties(target, prompts, got, want) -> None:
    """bfloat16: the striped cache sums each row's attention in another order (each stripe's online softmax, then the
    merge), so a greedy token may flip where the top two logits are within bfloat16's rounding (random weights give
    such near-ties: one at 0.3652 against 0.3633 here). Each row must equal the unstriped one up to its first
    difference, and there the two tokens' logits (a cache-free forward over the agreed prefix) must be that close.
    Weaker than float32's equality: the tiny random model attends almost uniformly, so a merge without its
    log-sum-exp rescale moves logits by about bfloat16's rounding and passes here; the float32 cases catch it."""
    for prompt, g, w in zip(prompts, got, want, strict=True):
        i = next((i for i, (a, b) in enumerate(zip(g, w, strict=False)) if a != b), None)
        if i is None:
            assert len(g) == len(w)
            continue
        logits = np.asarray(target.logits(jnp.asarray([prompt + w[:i]], jnp.int32)), np.float32)[0, -1]
        top = np.abs(logits).max()
        close = abs(logits[g[i]] - logits[w[i]]) <= 2 * 2**-7 * top  # two bfloat16 ulps of the largest logit
        assert close, (i, g[i], w[i], logits[g[i]], logits[w[i]])


@pytest.mark.slow
def test_seeded_sampling_equals_the_unstriped_cache(pair):
    target, drafter = pair
    run = lambda n: generate(  # noqa: E731
        target, drafter, PROMPTS[3], draft=SHAPES["chain"], max_new_tokens=NEW, temperature=1.0, seed=5, dcp=n
    )
    assert run(8).tokens == run(1).tokens
