"""jaxspec.io.compressed_tensors against the compressed-tensors library, and the INT4 test-checkpoint writer."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.entrypoints.convert.converters import CompressedTensorsDequantizer
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
from safetensors import safe_open
from safetensors.torch import load_file

from jaxspec.io.compressed_tensors import pack_int4, unpack_int4
from jaxspec.models.quant import Int4Array
from jaxspec.models.quant import quantize as jquantize
from tests.reference.ct_checkpoint import KIMI_IGNORE, write_int4_checkpoint

GROUP = 32
GROUP_ARGS = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP)


def _random_q(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    q = rng.integers(-8, 8, size=shape, dtype=np.int8)
    q[..., 0, :] = 7  # every nibble 0xF: all words are -1
    q[..., 1, :] = -8  # every nibble 0x0: all words are 0
    return q


# ------------------------------------------------------------------------------------- pack / unpack


@pytest.mark.parametrize("shape", [(16, 64), (3, 8, 32)])
def test_pack_unpack_bit_exact_against_library(shape: tuple[int, ...]) -> None:
    q = _random_q(np.random.default_rng(0), shape)
    ours = pack_int4(q)
    lib = pack_to_int32(torch.from_numpy(q), num_bits=4).numpy()

    assert ours.dtype == np.int32 and ours.shape == (*shape[:-1], shape[-1] // 8)
    assert (ours < 0).any(), "test data must include words with the top nibble >= 8 (negative int32)"
    assert (ours == -1).any() and (ours == 0).any()
    np.testing.assert_array_equal(ours, lib)
    np.testing.assert_array_equal(unpack_from_int32(torch.from_numpy(ours), 4, torch.Size(shape)).numpy(), q)
    np.testing.assert_array_equal(unpack_int4(lib, shape[-1]), q)


def test_pack_layout_is_lowest_column_in_lowest_nibble() -> None:
    q = np.array([[-8, -7, -6, -5, -4, -3, -2, 7]], dtype=np.int8)  # nibbles 0..6 then 0xF on top
    assert pack_int4(q)[0, 0] == np.int32(np.uint32(0xF6543210).view(np.int32))


# ------------------------------------------------------------------------------------- quantize / dequantize


def _weights(rng: np.random.Generator) -> np.ndarray:
    w = rng.standard_normal((32, 128)).astype(np.float32) * 0.02
    w[0, :GROUP] = 0.0  # all-zero group: the scale guard
    w[1, GROUP : 2 * GROUP] *= 1e4  # an outlier group next to normal ones
    return w


def quantize_int4(w: np.ndarray, group: int, scale_dtype=jnp.float32) -> tuple[np.ndarray, np.ndarray]:
    """jaxspec's quantizer (our [in, out] layout) seen in the library's [out, in] layout: q int8, scale."""
    a = jquantize(w.T, group, scale_dtype)
    return np.array(a.values()).T, np.array(a.scale).T  # copies: torch warns on read-only arrays


def dequantize_int4(q: np.ndarray, scale: np.ndarray, group: int) -> np.ndarray:
    """jaxspec's Int4Array.dequantize (float32 out) in the library's layout."""
    return np.asarray(Int4Array.from_values(q.T, scale.T, group).dequantize(jnp.float32)).T


def test_quantize_matches_library_given_the_same_scale() -> None:
    w = _weights(np.random.default_rng(1))
    q, scale = quantize_int4(w, GROUP)
    assert q.dtype == np.int8 and scale.dtype == np.float32 and scale.shape == (32, 128 // GROUP)
    assert q.min() >= -8 and q.max() <= 7 and (np.abs(q) == 7).any()

    # Same float32 division and round-half-even in both, so q and the fp32 dequant are bit-exact.
    lib_q = quantize(torch.from_numpy(w), torch.from_numpy(scale), None, GROUP_ARGS, dtype=torch.int8)
    np.testing.assert_array_equal(q, lib_q.numpy())
    lib_w = dequantize(torch.from_numpy(q), torch.from_numpy(scale), args=GROUP_ARGS)
    np.testing.assert_array_equal(dequantize_int4(q, scale, GROUP), lib_w.numpy())
    np.testing.assert_array_equal(dequantize_int4(q, scale, GROUP)[0, :GROUP], 0.0)


def test_scale_agrees_with_library_observer_up_to_its_divisor() -> None:
    # The library's min-max scale is max|w| / 7.5 ((qmax - qmin) / 2); ours is max|w| / 7 (never clips +max).
    # Both recover max|w| after multiplying back; each side rounds twice in fp32 (divide, multiply), so the
    # relative gap is at most ~2 * 2^-23: rtol 2^-21 leaves room without hiding a wrong divisor (7/7.5 is 7%).
    w = _weights(np.random.default_rng(2))
    _, scale = quantize_int4(w, GROUP)
    lib_scale, _ = compute_dynamic_scales_and_zp(torch.from_numpy(w), GROUP_ARGS, module=None)
    nonzero = np.abs(w).reshape(32, -1, GROUP).max(-1) > 0
    np.testing.assert_allclose((scale * 7)[nonzero], (lib_scale.numpy() * 7.5)[nonzero], rtol=2**-21, atol=0)


def test_bf16_scale_dequant_is_exact_then_rounds_like_library() -> None:
    # With the scale stored as bf16 (8-bit mantissa) q * scale fits in fp32 exactly; the library multiplies in
    # bf16, i.e. rounds that exact product once. So ours rounded to bf16 must equal the library bit for bit.
    w = _weights(np.random.default_rng(3))
    q, scale_bf16 = quantize_int4(w, GROUP, jnp.bfloat16)
    ours = dequantize_int4(q, scale_bf16, GROUP)  # bf16(q * scale): the exact product, rounded once
    exact = q.astype(np.float64) * np.repeat(scale_bf16.astype(np.float64), GROUP, axis=-1)
    np.testing.assert_array_equal(ours, exact.astype(ml_dtypes.bfloat16).astype(np.float32))
    lib_scale = torch.from_numpy(scale_bf16.astype(np.float32)).bfloat16()
    lib = dequantize(torch.from_numpy(q), lib_scale, args=GROUP_ARGS)
    assert lib.dtype == torch.bfloat16
    np.testing.assert_array_equal(ours.astype(ml_dtypes.bfloat16).astype(np.float32), lib.float().numpy())


@pytest.mark.parametrize("group, scale_dtype", [(32, jnp.bfloat16), (8, jnp.float32), (1, jnp.bfloat16)])
def test_int4_matmul_equals_x_times_library_dequant(group: int, scale_dtype) -> None:
    # quant.matmul never builds the interleaved W: it multiplies each nibble half on its own (group 1 is odd:
    # the plain dequantize-then-einsum path). Either way the result is x @ W with W as the library dequantises it.
    from jaxspec.models.quant import matmul

    rng = np.random.default_rng(group)
    w = _weights(rng)  # [out 32, in 128] in the library's layout
    q, scale = quantize_int4(w, group, scale_dtype)
    lib_w = dequantize(
        torch.from_numpy(q),
        torch.from_numpy(scale.astype(np.float32)),
        args=GROUP_ARGS.model_copy(update=dict(group_size=group)),
    )
    if scale_dtype == jnp.bfloat16:  # the library multiplies in the scale dtype: round the exact product once
        lib_w = lib_w.bfloat16().float()
    x = rng.standard_normal((5, 128)).astype(np.float32)
    ours = matmul(jnp.asarray(x), Int4Array.from_values(q.T, scale.T, group))
    assert ours.shape == (5, 32) and ours.dtype == jnp.float32
    np.testing.assert_allclose(
        np.asarray(ours),
        x.astype(np.float64) @ lib_w.numpy().T.astype(np.float64),
        rtol=1e-5,
        atol=1e-5 * np.abs(x @ lib_w.numpy().T).max(),
    )


# ------------------------------------------------------------------------------------- bad input


def test_bad_input_raises_clear_errors() -> None:
    with pytest.raises(ValueError, match=r"out of range \[-8, 7\].*max 8"):
        pack_int4(np.full((2, 8), 8, dtype=np.int8))
    with pytest.raises(ValueError, match=r"out of range \[-8, 7\].*min -9"):
        pack_int4(np.full((2, 8), -9, dtype=np.int16))
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_int4(np.zeros((2, 12), dtype=np.int8))
    with pytest.raises(ValueError, match="integer"):
        pack_int4(np.zeros((2, 8), dtype=np.float32))
    with pytest.raises(ValueError, match="int32"):
        unpack_int4(np.zeros((2, 1), dtype=np.int64), 8)
    with pytest.raises(ValueError, match="in_features=16"):
        unpack_int4(np.zeros((2, 1), dtype=np.int32), 16)
    with pytest.raises(ValueError, match="input dim 48 is not divisible by group_size 32"):
        quantize_int4(np.zeros((2, 48), dtype=np.float32), 32)
    with pytest.raises(ValueError, match="disagree for group 32"):
        dequantize_int4(np.zeros((2, 64), dtype=np.int8), np.ones((2, 3), dtype=np.float32), 32)


# ------------------------------------------------------------------------------------- checkpoint writer


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = transformers.DeepseekV3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("hf_dsv3")
    transformers.DeepseekV3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def _load_dir(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        shard = load_file(file)
        assert not tensors.keys() & shard.keys(), f"tensor in two shards: {tensors.keys() & shard.keys()}"
        tensors.update(shard)
    return tensors


@pytest.mark.parametrize(
    ("kimi", "num_shards"),
    [pytest.param(False, 1, id="deepseek-1-shard"), pytest.param(True, 3, id="k25-3-shards")],
)
def test_write_int4_checkpoint(hf_checkpoint: Path, tmp_path: Path, kimi: bool, num_shards: int) -> None:
    dst = tmp_path / "int4"
    deq = write_int4_checkpoint(hf_checkpoint, dst, kimi_k25_layout=kimi, num_shards=num_shards, vision_tensors=kimi)
    src = load_file(hf_checkpoint / "model.safetensors")
    out = _load_dir(dst)
    prefix = "language_model." if kimi else ""

    # Only the routed experts of the 2 MoE layers are quantized: 2 layers x 8 experts x 3 projections.
    assert len(deq) == 2 * 8 * 3 and all(".mlp.experts." in name for name in deq)
    for name, w in src.items():
        if name in deq:
            continue
        assert prefix + name in out, name
        assert out[prefix + name].dtype == w.dtype and torch.equal(out[prefix + name], w), name
    assert not any(name.endswith(".weight") and ".mlp.experts." in name for name in out)

    for name, w_deq in deq.items():
        base = prefix + name.removesuffix(".weight")
        packed, scale, shape = (out[f"{base}.weight_{p}"] for p in ("packed", "scale", "shape"))
        rows, cols = src[name].shape
        assert packed.dtype == torch.int32 and tuple(packed.shape) == (rows, cols // 8)
        assert scale.dtype == torch.bfloat16 and tuple(scale.shape) == (rows, cols // GROUP)
        assert shape.dtype == torch.int32 and shape.tolist() == [rows, cols]
        q = unpack_int4(packed.numpy(), cols)
        ours = dequantize_int4(q, scale.float().numpy().astype(ml_dtypes.bfloat16), GROUP)
        np.testing.assert_array_equal(ours, w_deq, err_msg=name)
        # It really quantized this weight: error within ~half a step (a rounded bf16 scale clips a hair more).
        step = np.repeat(scale.float().numpy(), GROUP, axis=-1)
        assert (np.abs(w_deq - src[name].float().numpy()) <= 0.6 * step).all(), name
    assert any((out[f"{prefix}{n.removesuffix('.weight')}.weight_packed"] < 0).any() for n in deq)

    # The library reads our config.json (text_config for K2.5) and tensors: it must dequantize to the same.
    lib = CompressedTensorsDequantizer(dst).process(dict(out))
    for name, w_deq in deq.items():
        np.testing.assert_array_equal(lib[prefix + name].float().numpy(), w_deq, err_msg=name)

    config = json.loads((dst / "config.json").read_text())
    assert (dst / "generation_config.json").is_file()
    if kimi:
        assert config["architectures"] == ["KimiK25ForConditionalGeneration"]
        assert config["model_type"] == "kimi_k25"
        assert "quantization_config" not in config and "vision_config" in config
        text = config["text_config"]
        assert text["model_type"] == "kimi_k2" and text["hidden_size"] == 64
        assert {n.split(".")[0] for n in out} == {"language_model", "vision_tower", "mm_projector"}
    else:
        text = config
        assert not any(n.startswith(("language_model.", "vision_tower.", "mm_projector.")) for n in out)
    qc = text["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert qc["ignore"] == KIMI_IGNORE
    (group,) = QuantizationConfig.model_validate(qc).config_groups.values()
    assert group.targets == ["Linear"]
    weights = group.weights
    assert (weights.num_bits, weights.type, weights.symmetric, weights.strategy, weights.group_size) == (
        4,
        "int",
        True,
        "group",
        GROUP,
    )

    index_path = dst / "model.safetensors.index.json"
    if num_shards == 1:
        assert not index_path.exists()
        assert [p.name for p in dst.glob("*.safetensors")] == ["model.safetensors"]
        return
    index = json.loads(index_path.read_text())
    files = sorted(p.name for p in dst.glob("*.safetensors"))
    assert files == [f"model-{i:05d}-of-{num_shards:05d}.safetensors" for i in range(1, num_shards + 1)]
    assert sorted(set(index["weight_map"].values())) == files
    for file in files:
        with safe_open(dst / file, "pt") as f:
            assert set(f.keys()) == {n for n, fl in index["weight_map"].items() if fl == file}, file
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in out.values())
    # One module's packed/scale/shape split across shards: a loader must follow the index.
    layer1 = {fl for n, fl in index["weight_map"].items() if ".layers.1.mlp.experts.0.gate_proj." in n}
    assert len(layer1) > 1
