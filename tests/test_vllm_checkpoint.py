"""benchmarks/vllm_checkpoint.py: the bundled pair as vLLM's CPU build loads it. The dequantized target against the
compressed-tensors library's own decompression (a tensor, and the whole checkpoint), and the drafter's capture ids
against jaxspec's reading of the original."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import torch
from compressed_tensors.entrypoints.convert.converters import CompressedTensorsDequantizer
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from benchmarks.vllm_checkpoint import PACKED, dequantize_int4, write_dequantized, write_vllm_drafter
from jaxspec import bundled
from jaxspec.config import KimiConfig
from jaxspec.io.compressed_tensors import pack_int4
from jaxspec.io.drafter_config import read_drafter_config


@settings(max_examples=12, deadline=None)
@given(
    rows=st.integers(1, 6),
    groups=st.integers(1, 3),
    group=st.sampled_from([8, 32, 128]),
    seed=st.integers(0, 2**16),
)
def test_dequantize_int4_is_the_librarys(rows: int, groups: int, group: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    q = rng.integers(-8, 8, size=(rows, groups * group), dtype=np.int8)
    q[0, :2] = (-8, 7)  # the extremes, in every example
    scale = (rng.uniform(0.5, 2.0, (rows, groups)) * 10.0 ** rng.integers(-4, 1)).astype(ml_dtypes.bfloat16)
    ours = dequantize_int4(pack_int4(q), scale, group)

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group)
    scale_t = torch.from_numpy(scale.astype(np.float32)).to(torch.bfloat16)
    lib = dequantize(torch.from_numpy(q), scale_t, args=args, dtype=torch.bfloat16)
    assert ours.dtype == ml_dtypes.bfloat16 and ours.shape == q.shape
    np.testing.assert_array_equal(ours.astype(np.float32), lib.float().numpy())


def test_dequantized_target_is_the_librarys(tmp_path) -> None:
    target = bundled.paths()[0]
    assert write_dequantized(target, tmp_path) == 3 * 8 * 3  # 3 MoE layers x 8 experts x 3 projections
    ours = load_file(tmp_path / "model.safetensors")
    lib = CompressedTensorsDequantizer(target).process(load_file(target / "model.safetensors"))

    assert set(ours) == set(lib) and not any(PACKED in name for name in ours)
    for name, w in lib.items():
        assert ours[name].dtype == w.dtype and torch.equal(ours[name], w), name
    config = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" not in config
    original = json.loads((target / "config.json").read_text())
    assert config == {k: v for k, v in original.items() if k != "quantization_config"}
    assert (tmp_path / "tokenizer.json").read_bytes() == (target / "tokenizer.json").read_bytes()


def test_vllm_drafter_captures_the_same_layers(tmp_path) -> None:
    target, drafter = bundled.paths()[:2]
    ids = write_vllm_drafter(drafter, target, tmp_path)
    target_config = KimiConfig.from_pretrained(target)
    original = read_drafter_config(json.loads((drafter / "config.json").read_text()), target_config=target_config)
    written = json.loads((tmp_path / "config.json").read_text())
    as_vllm_reads = read_drafter_config(written, target_config=target_config, capture_convention="input")

    assert ids == written["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert as_vllm_reads.capture_layers == original.capture_layers == (0, 2, 3)
    assert (tmp_path / "model.safetensors").read_bytes() == (drafter / "model.safetensors").read_bytes()
