"""Fixtures shared by the loop tests: the tiny random target (float32), a random drafter for it, and a peaky copy.

Session-scoped: the compiled loops live with the target object (`LoopCache.of(target)`), so test files that run
the same configuration (test_spec_loop's plain runs, test_tree_loop's references) compile it once."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from jaxspec import KimiConfig, Target
from tests.decoding.support import random_drafter


@pytest.fixture(scope="session")
def target():
    return Target.random(KimiConfig.preset("tiny"), dtype=jnp.float32, seed=0)


@pytest.fixture(scope="session")
def drafter(target):
    return random_drafter(target)


@pytest.fixture(scope="session")
def peaky(target):
    """The tiny target with its head scaled x25: random init gives near-uniform logits, too flat to test against."""
    params = jax.tree.map(lambda x: x, target.params)
    params["lm_head"] = params["lm_head"].replace(params["lm_head"].get_value() * 25.0)
    return dataclasses.replace(target, params=params)
