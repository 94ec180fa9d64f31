"""The target on 8 simulated devices: equal to one device, 2 all-reduces per layer, weights never gathered."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxspec import KimiConfig, Target
from sharding import inspect
from sharding.mesh import make_mesh
from tests.sharding.hlo_checks import find_weight_all_gathers

CFG = KimiConfig.preset("tiny").replace(num_hidden_layers=4)
TOKENS = np.random.default_rng(5).integers(0, CFG.vocab_size, (2, 14))


@pytest.fixture(scope="module")
def single():
    return Target.random(CFG, dtype=jnp.float32, seed=3)


def run_steps(target):
    """Prefill 9 tokens, decode 1, verify 4: the logits of every step, concatenated."""
    cache = target.init_cache(2, 16)
    out = []
    for start, n in ((0, 9), (9, 1), (10, 4)):
        pos = np.broadcast_to(np.arange(start, start + n), (2, n))
        logits, cache, _ = target.forward(TOKENS[:, start : start + n], pos, cache)
        out.append(np.asarray(logits))
    return np.concatenate(out, axis=1)


@pytest.mark.parametrize("mesh", ["1x8", "2x4"])
def test_sharded_equals_single_device(single, mesh):
    sharded = single.on_mesh(make_mesh(mesh))
    ref_full, ref_steps = np.asarray(single.logits(TOKENS)), run_steps(single)
    scale = ref_full.std()
    np.testing.assert_allclose(np.asarray(sharded.logits(TOKENS)), ref_full, atol=1e-5 * scale)
    np.testing.assert_allclose(run_steps(sharded), ref_steps, atol=1e-5 * scale)


def test_decode_step_hlo_two_all_reduces_per_layer_and_no_weight_gathers():
    target = Target.abstract(CFG, mesh=make_mesh("1x8"), dtype=jnp.bfloat16)
    mesh = target.mesh
    tok = jax.ShapeDtypeStruct((8, 1), jnp.int32, sharding=NamedSharding(mesh, P("data", None)))
    cache = jax.ShapeDtypeStruct(
        (CFG.num_hidden_layers, 8, 32, CFG.latent_dim), jnp.bfloat16, sharding=NamedSharding(mesh, target.cache_spec())
    )
    compiled = jax.jit(lambda p, t, q, c: target.apply(p, t, q, c)).lower(target.params, tok, tok, cache).compile()
    census = inspect.collective_census(compiled)
    # 2 per decoder layer (attention output; dense MLP or routed + shared experts) + 1 for the vocab-split embedding.
    assert census["all-reduce"]["executed"] == 2 * CFG.num_hidden_layers + 1
    assert census["all-reduce"]["executed_exact"]
    others = {k: v["executed"] for k, v in census.items() if k != "all-reduce" and v.get("executed")}
    assert others == {}, others
    assert find_weight_all_gathers(compiled, target.params) == []


def test_full_preset_is_sharded_as_the_table_says():
    target = Target.abstract(KimiConfig.preset("kimi-k2.5"), mesh=make_mesh("1x8"))
    total = inspect.per_device_param_bytes(target.params)
    large_replicated = []
    for path, var in nnx.to_flat_state(target.params):
        value = var.get_value()
        leaf = value.packed if hasattr(value, "packed") else value
        assert leaf.sharding.spec == target.rules.spec(var.get_metadata()["logical_axes"]), path
        if leaf.sharding.is_fully_replicated and inspect.param_bytes(value) > 0.01 * total:
            large_replicated.append("/".join(path))
    # q_a (7168 -> 1536) is replicated by design: every device needs the whole query latent for its own heads, and
    # splitting it would cost an extra all-gather per layer. It is 1.7% of a device's 76 GB; nothing else is >1%.
    assert large_replicated == ["moe_layers/attn/q_a"]
    assert total <= 80e9


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(num_attention_heads=12), "heads=12 is not divisible by mesh axis 'model' of size 8"),
        (dict(n_routed_experts=20), "experts=20 is not divisible"),
        (dict(vocab_size=260), "vocab=260 is not divisible"),
    ],
)
def test_mesh_that_does_not_divide_the_model(change, match):
    with pytest.raises(ValueError, match=match):
        Target.abstract(CFG.replace(**change), mesh=make_mesh("1x8"))


def test_batch_not_divisible_by_data_axis(single):
    with pytest.raises(ValueError, match="batch 3 is not divisible by the mesh's data axis"):
        single.on_mesh(make_mesh("2x4")).logits(np.zeros((3, 4), np.int32))


@pytest.mark.parametrize("mesh", ["1x8", "2x4"])
def test_greedy_and_top_k_on_vocab_split_logits(single, mesh):
    sharded = single.on_mesh(make_mesh(mesh))
    full = np.asarray(single.logits(TOKENS))
    pos = np.broadcast_to(np.arange(TOKENS.shape[1]), TOKENS.shape)
    run = jax.jit(lambda p, t, q, head: sharded.apply(p, t, q, head=head)[0], static_argnums=3)
    np.testing.assert_array_equal(np.asarray(run(sharded.params, TOKENS, pos, "argmax")), full.argmax(-1))
    vals, ids = run(sharded.params, TOKENS, pos, 3)
    np.testing.assert_array_equal(np.asarray(ids), np.argsort(-full, axis=-1, kind="stable")[..., :3])
    np.testing.assert_allclose(np.asarray(vals), -np.sort(-full, axis=-1)[..., :3], rtol=1e-6)


def test_greedy_head_never_gathers_the_vocabulary():
    target = Target.abstract(CFG, mesh=make_mesh("1x8"), dtype=jnp.bfloat16)
    # argmax: pmax + pmin of [B, T]. top-3: the n*k = 24 candidates per token. No collective ever carries a vocab
    # dimension (V = 256 or the per-device slice of 32).
    vocab_dims = {CFG.vocab_size, CFG.vocab_size // 8}
    for head in ("argmax", 3):
        compiled = target.compile_step(batch=8, tokens=1, cache_len=32, head=head)
        census = inspect.collective_census(compiled)
        assert census["all-reduce"]["executed"] == 2 * CFG.num_hidden_layers + 1 + 2, census
        assert census["all-gather"]["executed"] == 0
        for comp in inspect.parse_hlo(compiled).computations.values():
            for instr in comp.instructions.values():
                if inspect.collective_kind(instr.opcode):
                    dims = {d for _, shape in inspect.parse_hlo_shape(instr.shape) for d in shape}
                    assert not dims & vocab_dims, (head, instr.shape)
