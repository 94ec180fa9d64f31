"""FP8 block-quantised (DeepSeek-V3 layout: e4m3 weights + float32 `weight_scale_inv` blocks), loaded directly and
through conversion: equal to the same model with torch's own dequantisation of every weight written as float32."""

import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file, save_file

from converters.target import convert_target
from jaxspec import CheckpointError, ConfigError, load_target
from jaxspec.io.fp8 import open_checkpoint

BLOCK = 16  # small blocks, so tiny weights span several (and partial: 40 rows = 2.5 blocks)
LINEAR = re.compile(r"\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")


def write_fp8(src, dst) -> None:
    """FP8 copy of `src` (every linear weight quantised per BLOCK x BLOCK, as DeepSeek-V3 ships) and, next to it in
    `dst/../dense`, the float32 model holding torch's dequantisation of those weights."""
    tensors = load_file(src / "model.safetensors")
    fp8, dense = {}, {}
    for name, w in tensors.items():
        if not LINEAR.search(name):
            fp8[name] = dense[name] = w
            continue
        r, c = w.shape
        blocks = torch.nn.functional.pad(w.float(), (0, -c % BLOCK, 0, -r % BLOCK))
        blocks = blocks.reshape(blocks.shape[0] // BLOCK, BLOCK, blocks.shape[1] // BLOCK, BLOCK)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
        expand = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:r, :c]
        q = (w.float() / expand).to(torch.float8_e4m3fn)
        fp8[name], fp8[name + "_scale_inv"] = q, scale.float()
        dense[name] = q.float() * expand
    for path, t in ((dst, fp8), (dst.parent / "dense", dense)):
        shutil.copytree(src, path)
        save_file(t, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [BLOCK, BLOCK],
    }
    (dst / "config.json").write_text(json.dumps(cfg))


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


def test_fp8_loads_directly_and_through_conversion_to_the_same_logits(fp8_dir, tmp_path):
    report = convert_target(fp8_dir, tmp_path / "out", dtype="float32", progress=False, verify=True)
    assert report.verified
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    dense = fp8_dir.parent / "dense"
    direct, converted = load_target(fp8_dir, dtype=jnp.float32), load_target(tmp_path / "out", dtype=jnp.float32)
    ref = load_target(dense, dtype=jnp.float32)
    _assert_same_params(direct, ref)
    _assert_same_params(converted, ref)
    tokens = np.random.default_rng(0).integers(0, 256, (2, 10)).astype(np.int32)
    pos = np.broadcast_to(np.arange(10, dtype=np.int32), tokens.shape)
    fwd = jax.jit(lambda params, ids: ref.apply(params, ids, pos, impl="expanded")[0])
    want = np.asarray(fwd(ref.params, tokens))
    np.testing.assert_array_equal(np.asarray(fwd(direct.params, tokens)), want)
    np.testing.assert_array_equal(np.asarray(fwd(converted.params, tokens)), want)
    # bfloat16: the float32 product rounded once (as DeepSeek's weight_dequant), equal to rounding torch's product.
    _assert_same_params(load_target(fp8_dir), load_target(dense))


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
