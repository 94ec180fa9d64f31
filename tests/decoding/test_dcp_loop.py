"""`generate(..., dcp=N)` on the 1x8 CPU mesh: the cache striped over groups of N devices gives the unstriped greedy
tokens (plain, chain and tree; a ragged batch; float32, bfloat16 and the fp8 cache) and the same seeded samples.
The default suite keeps one case (a chain at --dcp 8: every device a stripe, the merge over 8 stripes); the rest is
slow (each case compiles two loops on 8 devices, about 30 s)."""

from __future__ import annotations

import jax.numpy as jnp
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
    assert run(dcp).tokens == run(1).tokens


@pytest.mark.slow
def test_seeded_sampling_equals_the_unstriped_cache(pair):
    target, drafter = pair
    run = lambda n: generate(  # noqa: E731
        target, drafter, PROMPTS[3], draft=SHAPES["chain"], max_new_tokens=NEW, temperature=1.0, seed=5, dcp=n
    )
    assert run(8).tokens == run(1).tokens
