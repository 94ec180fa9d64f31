"""save_target writes an HF DeepseekV3 + compressed-tensors INT4 checkpoint: jaxspec reads it back exactly, and
transformers + the compressed-tensors library (the independent references) compute the same logits from it."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from compressed_tensors.compressors import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationConfig
from compressed_tensors.utils.match import match_name
from flax import nnx
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3ForCausalLM

from jaxspec import KimiConfig, Target, load_target
from jaxspec.io import save_target

TOKENS = np.random.default_rng(5).integers(0, 256, (2, 24))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    target = Target.random(KimiConfig.preset("tiny"), dtype=jnp.float32, int4_experts=True, seed=7)
    path = save_target(target, tmp_path_factory.mktemp("export"), dtype=jnp.float32)
    return target, path


def test_round_trip_is_exact(saved):
    target, path = saved
    back = load_target(path, dtype=jnp.float32)
    assert back.config == target.config
    ours, theirs = dict(nnx.to_flat_state(target.params)), dict(nnx.to_flat_state(back.params))
    assert ours.keys() == theirs.keys()
    for key, var in ours.items():
        for a, b in zip(jax.tree.leaves(var.get_value()), jax.tree.leaves(theirs[key].get_value()), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(key))


def _hf_model_from_export(path, tmp_path) -> DeepseekV3ForCausalLM:
    """Load the export with transformers, its experts decompressed by compressed-tensors itself."""
    raw = json.loads((path / "config.json").read_text())
    qconfig = QuantizationConfig.model_validate(raw.pop("quantization_config"))
    scheme = qconfig.config_groups["group_0"]
    state, tensors = {}, load_file(path / "model.safetensors")
    for name, t in tensors.items():
        if name.endswith((".weight_scale", ".weight_shape")):
            continue
        if name.endswith(".weight_packed"):
            module = name.removesuffix(".weight_packed")
            assert not any(match_name(module, ig) for ig in qconfig.ignore), f"{module} is quantized but ignored"
            parts = {p: tensors[f"{module}.{p}"] for p in ("weight_packed", "weight_scale", "weight_shape")}
            state[f"{module}.weight"] = PackedQuantizationCompressor.decompress(parts, scheme)["weight"].float()
        else:
            assert ".mlp.experts." not in name, f"{name}: a routed expert left unquantized"
            state[name] = t.float()
    (tmp_path / "config.json").write_text(json.dumps(raw))
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    # from_pretrained maps the per-expert names onto transformers' own layout and reports anything left over.
    model, info = DeepseekV3ForCausalLM.from_pretrained(tmp_path, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def test_transformers_and_compressed_tensors_read_the_export(saved, tmp_path):
    target, path = saved
    model = _hf_model_from_export(path, tmp_path)
    with torch.no_grad():
        ref = model(torch.as_tensor(TOKENS)).logits.numpy()
    ours = np.asarray(target.logits(TOKENS))
    np.testing.assert_allclose(ours, ref, atol=2e-5 * ref.std() + 1e-6)


def test_float_experts_are_quantized_on_export(tmp_path):
    cfg = KimiConfig.preset("tiny")
    target = Target.random(cfg, dtype=jnp.float32, int4_experts=False, seed=2)
    back = load_target(save_target(target, tmp_path, dtype=jnp.float32), dtype=jnp.float32)
    gate = back.params["moe_layers"]["mlp"]["gate"].get_value()
    w = np.asarray(target.params["moe_layers"]["mlp"]["gate"].get_value())
    # Symmetric group INT4 (scale = max|w| / 7): every weight is within half a step of its quantized value, plus
    # the bf16 rounding of the stored scale (<= 7 * step * 2^-8) and of the product.
    deq = np.asarray(gate.dequantize(jnp.float32))
    step = np.abs(w).reshape(*w.shape[:2], -1, cfg.quant.group_size, w.shape[-1]).max(-2) / 7
    bound = np.repeat(step, cfg.quant.group_size, axis=-2) * (0.5 + 8 * 2.0**-8)
    assert np.all(np.abs(deq - w) <= bound)
    assert np.abs(deq - w).max() > 0  # really quantized, not passed through


def test_tokenizer_files_are_copied_and_missing_ones_refused(tmp_path):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer_config.json").write_text("{}")
    target = Target.random(KimiConfig.preset("tiny"), dtype=jnp.float32, int4_experts=True)
    out = save_target(target, tmp_path / "out", tokenizer_dir=tok)
    assert (out / "tokenizer_config.json").is_file() and (out / "model.safetensors").is_file()
    assert not list(out.glob("*.tmp"))
    with pytest.raises(FileNotFoundError, match="tokenizer_dir"):
        save_target(target, tmp_path / "out2", tokenizer_dir=tmp_path / "empty")
