"""Who keeps the compiled decoding loops: a `LoopCache` per owner, the target's own by default. (That a second call
compiles nothing is tested on real loops in test_spec_loop.py; here only the ownership, without compiling.)"""

import gc
import weakref

import jax.numpy as jnp

from jaxspec import KimiConfig, Target
from jaxspec.decoding.generate import LoopCache
from tests.decoding.support import OracleDrafter

CFG = KimiConfig.preset("tiny")


def test_one_loop_per_pair_in_a_cache():
    target, other = (Target.abstract(CFG, dtype=jnp.float32) for _ in range(2))
    drafter = OracleDrafter(target, jnp.zeros((1, 8), jnp.int32))
    cache = LoopCache()
    plain, spec = cache.loop(target, None), cache.loop(target, drafter)
    assert cache.loop(target, None) is plain and cache.loop(target, drafter) is spec and plain is not spec
    assert (plain.target, plain.drafter, spec.drafter) == (target, None, drafter)
    assert cache.loop(other, None) is not plain and cache.loop(other, None).target is other
    assert LoopCache().loop(target, None) is not plain  # another owner, other programs


def test_default_cache_is_held_by_the_target_and_dies_with_it():
    target, other = (Target.abstract(CFG, dtype=jnp.float32) for _ in range(2))
    assert LoopCache.of(target) is LoopCache.of(target) and LoopCache.of(other) is not LoopCache.of(target)
    loop = weakref.ref(LoopCache.of(target).loop(target, None))
    del target
    gc.collect()
    assert loop() is None  # no registry outside the target keeps its programs alive
