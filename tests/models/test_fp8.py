"""Block-FP8 weights (`quant.Fp8Array`): DeepSeek's dequantisation, the blocks of per-head weights, and a sharded
FP8 target equal to one device. Loading real FP8 checkpoints: tests/converters/test_convert_fp8.py."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxspec import KimiConfig, Target
from jaxspec.config import Fp8Quant
from jaxspec.models.mla import fp8_blocks
from jaxspec.models.quant import Fp8Array, einsum, quantize_fp8
from sharding.mesh import make_mesh


def test_dequantize_is_deepseeks_weight_dequant_with_partial_blocks():
    """float32(value) * its block's scale, rounded once; 40 x 24 in 16 x 16 blocks leaves partial blocks on both
    axes."""
    w = np.random.default_rng(0).normal(0, 0.05, (40, 24)).astype(np.float32)
    q = quantize_fp8(w, (16, 16))
    assert q.values.dtype == jnp.float8_e4m3fn and q.scale.shape == (3, 2)
    scale = np.repeat(np.repeat(np.asarray(q.scale), 16, 0), 16, 1)[:40, :24]
    want = np.asarray(q.values).astype(np.float32) * scale
    np.testing.assert_array_equal(np.asarray(q.dequantize(jnp.float32)), want)
    np.testing.assert_array_equal(np.asarray(q.dequantize(jnp.bfloat16)), want.astype(ml_dtypes.bfloat16))
    np.testing.assert_allclose(want, w, rtol=2**-3, atol=1e-6)  # e4m3 keeps 3 mantissa bits; nothing clips
    x = jnp.ones((2, 40), jnp.float32)
    np.testing.assert_array_equal(np.asarray(einsum("MI,IO->MO", x, q)), np.asarray(x @ want))


def test_deepseek_v3_blocks_never_cross_a_checkpoint_block():
    """q_b rows are 192 per head (a head straddles 128-row blocks: 64-row runs), kv_b 256 (whole blocks), o_proj
    columns 128 per head."""
    b = fp8_blocks(KimiConfig.preset("deepseek-v3"))
    assert b["q_nope"] == b["q_rope"] == (128, 1, 64)
    assert b["kv_b_k"] == b["kv_b_v"] == (128, 1, 128) and b["o"] == (1, 128, 128)
    assert b["q_a"] == b["kv_a_latent"] == b["kv_a_rope"] == (128, 128)


CFG = KimiConfig.preset("tiny-dsv3").replace(quant=None, fp8=Fp8Quant((4, 4)), num_hidden_layers=2)


@pytest.mark.slow  # ~30 s of 8-device compiles on this CPU
def test_sharded_fp8_target_equals_one_device():
    """On a 1x8 mesh each device holds whole blocks of its shard (values and scales sharded alike)."""
    single = Target.random(CFG, dtype=jnp.float32, seed=1)
    sharded = single.on_mesh(make_mesh("1x8"))
    w = sharded.params["moe_layers"]["mlp"]["shared"]["gate"].get_value()
    assert isinstance(w, Fp8Array) and w.values.sharding.spec == w.scale.sharding.spec
    tokens = np.random.default_rng(2).integers(0, CFG.vocab_size, (2, 6)).astype(np.int32)
    logits = [np.asarray(t.logits(tokens)) for t in (single, sharded)]
    np.testing.assert_allclose(logits[1], logits[0], rtol=1e-5, atol=1e-5)


def test_a_shard_of_partial_blocks_is_refused():
    """16-row blocks of the 32-wide shared expert split 8 ways would leave each device a quarter of a block."""
    msg = r"^moe_layers\.mlp\.shared\.down: axis 1 of \[1, 32, 64\] splits into 8 shards of 4, not whole FP8 "
    msg += "blocks of 16"
    with pytest.raises(ValueError, match=msg):
        Target.abstract(CFG.replace(fp8=Fp8Quant((16, 16))), mesh=make_mesh("1x8"))
