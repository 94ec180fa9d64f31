"""Every `Target` constructor builds its model with the rules it is given: the model reduces over the mesh axis the
rules name, so a target built with default rules on a swapped mesh would psum over the wrong axis."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec import KimiConfig, Target
from jaxspec.models.moe import MoE
from sharding.mesh import DATA, make_mesh
from sharding.rules import ShardingRules

CFG = KimiConfig.preset("tiny").replace(num_hidden_layers=2)
TOKENS = np.random.default_rng(3).integers(0, CFG.vocab_size, (2, 5)).astype(np.int32)
# Heads, experts, MLP and vocabulary split over "data" (size 2) instead of "model" (size 1 on this mesh).
SWAPPED = ShardingRules(batch=None, vocab=DATA, heads=DATA, experts=DATA, mlp=DATA)


@pytest.fixture(scope="module")
def reference():
    """(host weights {path: array}, their logits) from a default-rules target on a 1x2 mesh."""
    target = Target.random(CFG, mesh=make_mesh((1, 2), jax.devices()[:2]), dtype=jnp.float32)
    host = {path: jax.tree.map(np.asarray, var.get_value()) for path, var in nnx.to_flat_state(target.params)}
    return host, np.asarray(target.logits(TOKENS))


def _check(target: Target, ref: np.ndarray) -> None:
    assert target.rules == SWAPPED
    for path, var in nnx.to_flat_state(target.params):
        for array in jax.tree.leaves(var.get_value()):
            assert array.sharding.spec == SWAPPED.spec(var.get_metadata()["logical_axes"]), path
    np.testing.assert_allclose(np.asarray(target.logits(TOKENS)), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_from_host_builds_with_the_rules(reference):
    host, ref = reference
    target = Target.from_host(CFG, host, mesh=make_mesh((2, 1), jax.devices()[:2]), dtype=jnp.float32, rules=SWAPPED)
    _check(target, ref)


def test_abstract_builds_with_the_rules(reference):
    """An abstract target's graphdef is what a restore (io.load_target's Orbax path) runs the weights with."""
    host, ref = reference
    mesh = make_mesh((2, 1), jax.devices()[:2])
    abstract = Target.abstract(CFG, mesh=mesh, dtype=jnp.float32, rules=SWAPPED)
    placed = Target.from_host(CFG, host, mesh=mesh, dtype=jnp.float32, rules=SWAPPED)
    for path, var in nnx.to_flat_state(abstract.params):
        for struct in jax.tree.leaves(var.get_value()):
            assert struct.sharding.spec == SWAPPED.spec(var.get_metadata()["logical_axes"]), path
    _check(Target(CFG, mesh, abstract.graphdef, placed.params, SWAPPED), ref)


def test_random_builds_with_the_rules():
    mesh = make_mesh((2, 1), jax.devices()[:2])
    swapped = Target.random(CFG, mesh=mesh, dtype=jnp.float32, rules=SWAPPED)
    default = Target.random(CFG, mesh=make_mesh((1, 2), jax.devices()[:2]), dtype=jnp.float32)
    _check(swapped, np.asarray(default.logits(TOKENS)))  # same seed: the same weights


def test_with_expert_impl_sets_the_path_of_every_moe_layer(reference):
    """The copy's MoE layers run the path asked for (on CPU, "pallas" has no lowering and says so); the original's
    graphdef is untouched."""
    host, ref = reference
    target = Target.from_host(CFG, host, mesh=make_mesh((1, 2), jax.devices()[:2]), dtype=jnp.float32)
    xla = target.with_expert_impl("xla")
    np.testing.assert_allclose(np.asarray(xla.logits(TOKENS)), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    with pytest.raises(ValueError, match=r"impl='pallas' has no lowering for backend 'cpu'"):
        target.with_expert_impl("pallas").logits(TOKENS)
    impls = lambda t: {m.impl for _, m in nnx.iter_modules(nnx.merge(t.graphdef, t.params)) if isinstance(m, MoE)}
    assert (impls(target), impls(xla)) == ({"auto"}, {"xla"})
    with pytest.raises(ValueError, match=r"with_expert_impl: impl must be one of .* got 'triton'"):
        target.with_expert_impl("triton")
