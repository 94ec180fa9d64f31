"""Loading HF-layout checkpoints: INT4 pack-quantized experts (made by compressed-tensors), K2.5 layout, errors."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxspec import CheckpointError, load_target
from jaxspec.models.quant import Int4Array
from tests.reference.ct_checkpoint import write_int4_checkpoint

TOKENS = np.random.default_rng(3).integers(0, 256, (2, 20))


@pytest.fixture(scope="module")
def int4_pair(hf_checkpoint, tmp_path_factory):
    """(INT4 K2.5-layout checkpoint, bf16-valued checkpoint with the library-dequantised experts)."""
    src, _ = hf_checkpoint("kimi")
    int4_dir = tmp_path_factory.mktemp("int4_k25")
    dequantized = write_int4_checkpoint(
        src, int4_dir, group_size=32, kimi_k25_layout=True, num_shards=3, vision_tensors=True
    )
    # The same checkpoint file with each expert replaced by the library's dequantisation of it.
    dense_dir = tmp_path_factory.mktemp("dequantized")
    shutil.copytree(src, dense_dir, dirs_exist_ok=True)
    tensors = load_file(dense_dir / "model.safetensors")
    assert set(dequantized) <= set(tensors)
    tensors.update({name: w.astype(np.float32) for name, w in dequantized.items()})
    save_file(tensors, dense_dir / "model.safetensors")
    return int4_dir, dense_dir


def test_int4_checkpoint_equals_dequantised_model(int4_pair):
    int4_dir, dense_dir = int4_pair
    int4 = load_target(int4_dir, dtype=jnp.float32)
    dense = load_target(dense_dir, dtype=jnp.float32)
    experts = int4.params["moe_layers"]["mlp"]["gate"].get_value()
    assert isinstance(experts, Int4Array) and experts.packed.dtype == jnp.uint8  # INT4 stays 4-bit on device
    assert int4.config.quant is not None and dense.config.quant is None
    ours, ref = np.asarray(int4.logits(TOKENS)), np.asarray(dense.logits(TOKENS))
    np.testing.assert_allclose(ours, ref, atol=1e-5 * ref.std())


def test_int4_dequant_matches_library(int4_pair, hf_checkpoint):
    """The loaded int4 values x scales reproduce compressed-tensors' own decompression of every expert."""
    int4_dir, dense_dir = int4_pair
    gate = load_target(int4_dir, dtype=jnp.bfloat16).params["moe_layers"]["mlp"]["gate"].get_value()
    ref = load_target(dense_dir, dtype=jnp.float32).params["moe_layers"]["mlp"]["gate"].get_value()
    np.testing.assert_array_equal(np.asarray(gate.dequantize(jnp.float32)), np.asarray(ref))


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_bad_checkpoint_lists_every_problem(hf_checkpoint, tmp_path):
    src, _ = hf_checkpoint("kimi")
    bad = _copy(src, tmp_path / "bad")
    tensors = load_file(bad / "model.safetensors")
    del tensors["model.layers.1.self_attn.q_a_proj.weight"]
    del tensors["model.layers.2.mlp.experts.3.up_proj.weight"]
    tensors["model.layers.0.self_attn.kv_b_proj.weight"] = np.zeros((8, 32), np.float32)
    tensors["model.layers.1.mlp.surprise.weight"] = np.zeros((2,), np.float32)
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        load_target(bad)
    msg = str(err.value)
    assert "4 problem(s)" in msg
    assert "missing tensor model.layers.1.self_attn.q_a_proj.weight (expected shape [32, 64])" in msg
    assert "missing tensor model.layers.2.mlp.experts.3.up_proj.weight (expected shape [32, 64])" in msg
    assert "model.layers.0.self_attn.kv_b_proj.weight: expected shape [256, 32], got [8, 32]" in msg
    assert "unexpected tensor model.layers.1.mlp.surprise.weight" in msg


def test_int4_checkpoint_with_bad_weight_shape_field(int4_pair, tmp_path):
    int4_dir, _ = int4_pair
    bad = _copy(int4_dir, tmp_path / "bad_int4")
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    name = "language_model.model.layers.1.mlp.experts.0.down_proj.weight_shape"
    shard = bad / index["weight_map"][name]
    tensors = load_file(shard)
    tensors[name] = np.array([1, 2], np.int32)
    save_file(tensors, shard)
    with pytest.raises(
        CheckpointError, match=r"experts\.0\.down_proj\.weight_shape: expected \[64, 32\], got \[1, 2\]"
    ):
        load_target(bad)


def test_missing_config_field(hf_checkpoint, tmp_path):
    src, _ = hf_checkpoint("kimi")
    bad = _copy(src, tmp_path / "noconf")
    cfg = json.loads((bad / "config.json").read_text())
    del cfg["moe_intermediate_size"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="moe_intermediate_size: required field missing"):
        load_target(bad)


def test_token_ids_out_of_range(hf_checkpoint):
    target = load_target(hf_checkpoint("kimi")[0], dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, vocab_size=256\); got min 0, max 256"):
        target.logits([[0, 256]])
    with pytest.raises(ValueError, match="got min -1"):
        target.logits([[-1, 3]])
    with pytest.raises(ValueError, match="non-empty integer array"):
        target.logits([[0.5, 1.0]])
