"""FP8 block-quantised (DeepSeek-V3 layout: e4m3 weights + float32 `weight_scale_inv` blocks), loaded directly and
through conversion: equal to the same model with torch's own dequantisation of every weight written as float32."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file, save_file

from converters.target import convert_target
from jaxspec import CheckpointError, ConfigError, load_target
from jaxspec.io import save_target
from jaxspec.io.fp8 import open_checkpoint
from jaxspec.models.moe import ROUTED_PATHS
from jaxspec.models.quant import Fp8Array
from tests.reference.fp8_checkpoint import BLOCK, write_fp8

# our parameters holding those weights, and a decoder layer's others (stored unquantised)
LINEAR_PARAMS = {"q_a", "q_b_nope", "q_b_rope", "kv_a_latent", "kv_a_rope", "kv_b_k", "kv_b_v", "o", "gate", "up"}
LINEAR_PARAMS |= {"down"}
UNQUANTISED = {"input_norm", "post_attn_norm", "q_a_norm", "kv_a_norm", "router", "router_bias"}


@pytest.fixture(scope="module")
def fp8_dir(hf_checkpoint, tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8") / "fp8"
    write_fp8(hf_checkpoint("dsv3")[0], path)
    return path


def _assert_same_params(ours, ref):
    want = dict(nnx.to_flat_state(ref.params))
    for path, var in nnx.to_flat_state(ours.params):
        got = var.get_value()
        assert got.dtype == want[path].get_value().dtype, path
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want[path].get_value()), str(path))


def _logits(target, tokens):
    pos = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    return np.asarray(jax.jit(lambda p, ids: target.apply(p, ids, pos, impl="expanded")[0])(target.params, tokens))


def _bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint8)


def _assert_kept_fp8(target, src):
    """Every linear weight of `target` is an Fp8Array on the device holding the source's float8 bytes (in our layout)
    and its float32 scales; no parameter is a dequantised copy."""
    params = dict(nnx.to_flat_state(target.params))
    fp8 = {p: v.get_value() for p, v in params.items() if isinstance(v.get_value(), Fp8Array)}
    linear = {p for p in params if p[-1] in LINEAR_PARAMS or p[-2:-1] == ("shared",) or p[-2:] in ROUTED_PATHS}
    linear -= {("moe_layers", "mlp", "router")}
    assert set(fp8) == linear
    for w in fp8.values():
        assert isinstance(w.values, jax.Array) and w.values.dtype == jnp.float8_e4m3fn and w.scale.dtype == jnp.float32
    # what is not FP8 is what the checkpoint stores unquantised: embedding, head, norms and router
    assert {p[-1] for p in params if p not in fp8} == {*UNQUANTISED, "final_norm", "embed", "lm_head"}
    q_a = src["model.layers.0.self_attn.q_a_proj.weight"]  # ours [in, out] = the stored [out, in] transposed
    np.testing.assert_array_equal(_bits(fp8["dense_layers", "attn", "q_a"].values[0]), _bits(q_a.view(torch.uint8).T))
    up = torch.stack([src[f"model.layers.1.mlp.experts.{e}.up_proj.weight"] for e in range(16)]).view(torch.uint8)
    np.testing.assert_array_equal(_bits(fp8["moe_layers", "mlp", "up"].values[0]), _bits(up.transpose(1, 2)))


def test_fp8_weights_stay_fp8_and_match_torch_dequantisation(fp8_dir):
    """Loaded directly, FP8 stays FP8 (with its scales) and the logits equal those of torch's dequantisation of every
    weight (written as float32), in float32 and bfloat16."""
    src, dense = load_file(fp8_dir / "model.safetensors"), fp8_dir.parent / "dense"
    tokens = np.random.default_rng(0).integers(0, 256, (2, 10)).astype(np.int32)
    for dtype in (jnp.float32, jnp.bfloat16):
        direct = load_target(fp8_dir, dtype=dtype)
        _assert_kept_fp8(direct, src)
        np.testing.assert_array_equal(_logits(direct, tokens), _logits(load_target(dense, dtype=dtype), tokens))


def test_conversion_keeps_the_fp8_bytes(fp8_dir, tmp_path):
    """jaxspec-convert writes the source's FP8 values and scales bit for bit (routed experts in the stored [E, out,
    in] layout, the rest in ours) and keeps the quantization_config; loaded, it equals the direct load."""
    report = convert_target(fp8_dir, tmp_path / "out", dtype="bfloat16", progress=False, verify=True)
    assert report.verified
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [BLOCK, BLOCK]
    src = load_file(fp8_dir / "model.safetensors")
    stored = ocp.StandardCheckpointer().restore(tmp_path / "out" / "params" / "layer_00001")
    for proj in ("gate", "up", "down"):
        names = [f"model.layers.1.mlp.experts.{e}.{proj}_proj.weight" for e in range(16)]
        values = torch.stack([src[n] for n in names])
        scales = torch.stack([src[n + "_scale_inv"] for n in names])
        np.testing.assert_array_equal(_bits(stored["mlp"][proj]["values"]), _bits(values.view(torch.uint8)))
        np.testing.assert_array_equal(stored["mlp"][proj]["scale"], scales.numpy())
    kv_b = src["model.layers.1.self_attn.kv_b_proj.weight"].view(torch.uint8).numpy()
    np.testing.assert_array_equal(  # [N * (H + A), C] -> ours [C, N, H]: head n's first H rows
        _bits(stored["attn"]["kv_b_k"]["values"]), kv_b.reshape(8, 32, 32)[:, :16].transpose(2, 0, 1)
    )
    converted, direct = load_target(tmp_path / "out"), load_target(fp8_dir)
    _assert_kept_fp8(converted, src)
    for path, var in nnx.to_flat_state(direct.params):
        got = dict(nnx.to_flat_state(converted.params))[path].get_value()
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(var.get_value()), strict=True):
            np.testing.assert_array_equal(_bits(a), _bits(b), str(path))


def test_dequantize_fp8_gives_the_unquantised_model(fp8_dir, tmp_path):
    """`dequantize_fp8`: the float32 product rounded once to the compute dtype (DeepSeek's weight_dequant), equal to
    rounding torch's product; the conversion drops the quantization_config."""
    dense = fp8_dir.parent / "dense"
    for dtype in (jnp.float32, jnp.bfloat16):
        _assert_same_params(load_target(fp8_dir, dtype=dtype, dequantize_fp8=True), load_target(dense, dtype=dtype))
    convert_target(fp8_dir, tmp_path / "out", dtype="float32", progress=False, verify=True, dequantize_fp8=True)
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    _assert_same_params(load_target(tmp_path / "out", dtype=jnp.float32), load_target(dense, dtype=jnp.float32))
    with pytest.raises(ConfigError, match=r"dequantize_fp8 applies to HF checkpoints"):
        load_target(convert_target(fp8_dir, tmp_path / "fp8", progress=False) and tmp_path / "fp8", dequantize_fp8=True)
    # save_target writes an FP8 target's weights dequantised (exactly, in float32), as its config.json says
    saved = save_target(load_target(fp8_dir, dtype=jnp.float32), tmp_path / "saved", dtype=jnp.float32)
    _assert_same_params(load_target(saved, dtype=jnp.float32), load_target(dense, dtype=jnp.float32))


def test_fp8_config_errors_are_named(fp8_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(fp8_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["fmt"] = "e5m2"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"quantization_config\.fmt: 'e5m2' is not supported"):
        load_target(bad)
    cfg["quantization_config"].update(fmt="e4m3", weight_block_size=[128])
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"weight_block_size: expected \[rows, cols\], got \[128\]"):
        convert_target(bad, tmp_path / "out", progress=False)


def test_fp8_scale_of_wrong_shape_is_reported(fp8_dir, tmp_path):
    fp8_dir = shutil.copytree(fp8_dir, tmp_path / "fp8")
    tensors = load_file(fp8_dir / "model.safetensors")
    tensors["model.layers.0.self_attn.q_a_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(tensors, fp8_dir / "model.safetensors")
    for load in (lambda: convert_target(fp8_dir, tmp_path / "out", progress=False), lambda: load_target(fp8_dir)):
        with pytest.raises(CheckpointError, match=r"q_a_proj\.weight_scale_inv: expected shape \[2, 4\]"):
            load()


def test_raw_reader_reads_every_dtype_as_safetensors_does(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        f"t.{dt}": (torch.randn(3, 5, generator=gen) * 4).to(dt)
        for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int8, torch.uint8, torch.bool)
    }
    tensors["t.e4m3"] = torch.randn(4, 6, generator=gen).to(torch.float8_e4m3fn)
    tensors["t.scalar_like"] = torch.ones(1)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{}")
    reader = open_checkpoint(tmp_path)
    assert sorted(reader.names()) == sorted(tensors)
    for name, t in tensors.items():
        got = reader.get(name)
        assert reader.shape(name) == tuple(t.shape) and got.shape == tuple(t.shape), name
        want = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
        have = got.view(np.uint8) if t.dtype == torch.float8_e4m3fn else got
        np.testing.assert_array_equal(have, want.float().numpy() if t.dtype == torch.bfloat16 else want.numpy())
    reader.release()
