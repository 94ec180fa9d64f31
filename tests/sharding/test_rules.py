"""The model code takes its tensor/expert-parallel mesh axis from the sharding rules, not from sharding.mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxspec import KimiConfig, Target
from jaxspec.models.kimi import KimiModel
from sharding.mesh import DATA, MODEL, make_mesh
from sharding.rules import DEFAULT_RULES, ShardingRules

CFG = KimiConfig.preset("tiny").replace(num_hidden_layers=2)
TOKENS = np.random.default_rng(7).integers(0, CFG.vocab_size, (2, 6)).astype(np.int32)


def test_model_axis_is_the_one_axis_of_the_split_dims():
    assert DEFAULT_RULES.model_axis == MODEL
    assert ShardingRules(batch=None, vocab=DATA, heads=None, experts=DATA, mlp=DATA).model_axis == DATA
    with pytest.raises(ValueError, match=r"must map to one mesh axis .* got \['data', 'model'\]"):
        _ = ShardingRules(heads=DATA).model_axis
    with pytest.raises(ValueError, match=r"at least one to an axis .* got \[\]"):
        _ = ShardingRules(vocab=None, heads=None, experts=None, mlp=None).model_axis


def _logits(params, rules: ShardingRules, mesh) -> np.ndarray:
    """The per-device forward in a shard_map whose weights are split as `rules` say."""
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: KimiModel(CFG, dtype=jnp.float32, rules=rules, rngs=nnx.Rngs(0))))
    specs = Target.param_specs(params, rules)
    params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    pos = np.broadcast_to(np.arange(TOKENS.shape[1], dtype=np.int32), TOKENS.shape)
    local = lambda p, t, q: nnx.merge(graphdef, p)(t, q)[0]
    out = PartitionSpec(None, None, rules.vocab)
    fn = jax.shard_map(local, mesh=mesh, in_specs=(specs, PartitionSpec(), PartitionSpec()), out_specs=out)
    return np.asarray(jax.jit(fn)(params, TOKENS, pos))


def test_model_reduces_over_the_axis_the_rules_name():
    """Heads, experts, MLP and vocabulary split over "data" instead of "model": the same logits. (Psums and
    axis_index over a hard-coded "model" axis, of size 1 here, would read the wrong embedding rows and drop terms.)"""
    params = nnx.state(KimiModel(CFG, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    ref = _logits(params, DEFAULT_RULES, make_mesh((1, 2), jax.devices()[:2]))
    swapped = ShardingRules(batch=None, vocab=DATA, heads=DATA, experts=DATA, mlp=DATA)
    got = _logits(params, swapped, make_mesh((2, 1), jax.devices()[:2]))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
