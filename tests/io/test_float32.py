"""A tensor the model declares float32 (the router's `e_score_correction_bias`) keeps the checkpoint's float32 values
bit for bit at every compute dtype: loaded directly (HF safetensors, FP8 block checkpoints) and through
`jaxspec-convert`, with source values bf16 cannot hold."""

import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from converters.target import convert_target
from jaxspec import KimiConfig, Target, load_target
from jaxspec.io.hf import layer_table, top_table
from tests.reference.fp8_checkpoint import write_fp8

BIAS = "mlp.gate.e_score_correction_bias"


@pytest.fixture(scope="module")
def sources(hf_checkpoint, tmp_path_factory):
    """(HF dir, FP8 dir, {MoE layer index: its float32 bias as written}), the biases away from any bf16 value."""
    root = tmp_path_factory.mktemp("f32")
    src = root / "hf"
    shutil.copytree(hf_checkpoint("dsv3")[0], src)
    tensors = load_file(src / "model.safetensors")
    rng, biases = np.random.default_rng(0), {}
    for name in sorted(n for n in tensors if n.endswith(BIAS)):
        bias = rng.normal(0, 0.1, tensors[name].shape).astype(np.float32)
        bias[0] = -0.04077965  # the value a held-out FP8 checkpoint stores; bf16 rounds it to -0.04077148
        biases[int(name.split(".")[2])] = tensors[name] = bias
    assert all((b.astype(ml_dtypes.bfloat16).astype(np.float32) != b).all() for b in biases.values())
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    write_fp8(src, root / "fp8")
    return src, root / "fp8", biases


def _assert_exact(target: Target, biases: dict[int, np.ndarray]) -> None:
    got = target.params["moe_layers"]["mlp"]["router_bias"].get_value()
    assert got.dtype == jnp.float32
    first = target.config.first_k_dense_replace
    want = np.stack([biases[i] for i in range(first, target.config.num_hidden_layers)])
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("fmt", ["hf", "fp8"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_direct_load_keeps_float32_tensors_exact(sources, fmt, dtype):
    src, fp8, biases = sources
    _assert_exact(load_target(src if fmt == "hf" else fp8, dtype=dtype), biases)


@pytest.mark.parametrize("fmt", ["hf", "fp8"])
def test_conversion_keeps_float32_tensors_exact(sources, fmt, tmp_path):
    src, fp8, biases = sources
    convert_target(src if fmt == "hf" else fp8, tmp_path / "out", dtype="bfloat16", progress=False, verify=True)
    for dtype in (jnp.bfloat16, jnp.float32):
        _assert_exact(load_target(tmp_path / "out", dtype=dtype), biases)


def test_the_name_table_keeps_exactly_the_tensors_the_model_declares_float32():
    """At a bf16 compute dtype, the parameters the model declares float32 are the name table's float32 rows (so a
    new float32 parameter cannot be rounded through the compute dtype unnoticed)."""
    cfg = KimiConfig.preset("tiny")
    state = nnx.state(Target.abstract_model(cfg, jnp.bfloat16, int4_experts=False))
    declared = {
        path[1:] if path[0] in ("dense_layers", "moe_layers") else path
        for path, var in nnx.to_flat_state(state)
        if var.get_value().dtype == jnp.float32
    }
    rows = [*top_table(cfg), *layer_table(cfg, moe=False), *layer_table(cfg, moe=True)]
    assert declared and declared == {p for row in rows if row.fp32 for p in row.params}
