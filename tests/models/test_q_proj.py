"""Checkpoints with `q_lora_rank: null` (one q_proj, as DeepSeek-V2-Lite and Moonlight-16B-A3B publish), made by
transformers: parity with HF on 1 and 8 devices, conversion, export and reload."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import DeepseekV3ForCausalLM

from converters import target as conv
from jaxspec import KimiConfig, Target, load_target
from jaxspec.io import save_target
from sharding.mesh import make_mesh
from tests.reference.hf_tiny import save_hf_model

TOKENS = np.random.default_rng(11).integers(0, 256, (2, 16))


@pytest.fixture(scope="module")
def q_proj_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_q_proj")
    model = save_hf_model("dsv3", path, seed=3, q_lora_rank=None)
    with torch.no_grad():
        ref = model(torch.as_tensor(TOKENS)).logits.numpy()
    return path, ref


@pytest.fixture(scope="module")
def loaded(q_proj_checkpoint):
    return load_target(q_proj_checkpoint[0], dtype=jnp.float32)


def _rel(ours, ref) -> float:
    return float(np.abs(np.asarray(ours, np.float64) - ref).max() / ref.std())


def _assert_same_params(a, b):
    flat_a, flat_b = dict(nnx.to_flat_state(a.params)), dict(nnx.to_flat_state(b.params))
    assert flat_a.keys() == flat_b.keys()
    for key, var in flat_a.items():
        np.testing.assert_array_equal(np.asarray(var.get_value()), np.asarray(flat_b[key].get_value()), str(key))


def test_config_and_parameters(q_proj_checkpoint, loaded):
    raw = json.loads((q_proj_checkpoint[0] / "config.json").read_text())
    assert raw["q_lora_rank"] is None and loaded.config.q_lora_rank is None and not loaded.config.q_lora
    attn = loaded.params["moe_layers"]["attn"]
    assert "q_a" not in attn and attn["q_nope"].get_value().shape == (2, 64, 8, 16)  # [L, D, N, H]


def test_matches_hf_on_1_and_8_devices(q_proj_checkpoint, loaded):
    path, ref = q_proj_checkpoint
    assert _rel(loaded.logits(TOKENS), ref) <= 1e-4
    sharded = loaded.on_mesh(make_mesh("1x8"))
    assert sharded.params["moe_layers"]["attn"]["q_nope"].get_value().sharding.spec[2] == "model"  # heads split
    assert _rel(sharded.logits(TOKENS), ref) <= 1e-4


def test_converts_and_restores_the_same_weights(q_proj_checkpoint, loaded, tmp_path):
    conv.convert_target(q_proj_checkpoint[0], tmp_path / "orbax", dtype="float32", progress=False, verify=True)
    _assert_same_params(load_target(tmp_path / "orbax", dtype=jnp.float32), loaded)


def test_exports_and_reloads_in_jaxspec_and_transformers(q_proj_checkpoint, loaded, tmp_path):
    path, ref = q_proj_checkpoint
    out = save_target(loaded, tmp_path / "export", dtype=jnp.float32)
    raw = json.loads((out / "config.json").read_text())
    assert raw["q_lora_rank"] is None
    back = load_target(out, dtype=jnp.float32)
    assert back.config == loaded.config.replace(num_nextn_predict_layers=0)
    _assert_same_params(back, loaded)
    hf = DeepseekV3ForCausalLM.from_pretrained(out).eval()
    assert hf.model.layers[0].self_attn.q_proj is not None
    with torch.no_grad():
        np.testing.assert_allclose(hf(torch.as_tensor(TOKENS)).logits.numpy(), ref, atol=1e-5 * ref.std())


def test_moonlight_preset_builds_abstractly():
    cfg = KimiConfig.preset("moonlight-16b-a3b")
    assert cfg.q_lora_rank is None and cfg.n_routed_experts == 64 and cfg.num_experts_per_tok == 6
    # Published size: 15.29B parameters besides the two 163840 x 2048 vocabulary matrices ("16B" with them).
    total = sum(int(np.prod(v.get_value().shape)) for _, v in nnx.to_flat_state(Target.abstract(cfg).params))
    assert abs(total - 2 * cfg.vocab_size * cfg.hidden_size - 15.29e9) < 0.01e9, total
    target = Target.abstract(cfg, mesh=make_mesh("1x8"))
    q = target.params["moe_layers"]["attn"]["q_nope"].get_value()
    assert q.shape == (26, 2048, 16, 128) and q.sharding.spec[2] == "model"
