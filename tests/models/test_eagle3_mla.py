"""MLA EAGLE-3 drafters (`Eagle3DeepseekV2ForCausalLM`, as published for Kimi-K2.5): loading the published config and
tensor names, parity with a reference built from HF DeepseekV3 classes (tests/reference/eagle3_mla.py), cached
steps, the training-time-test unroll, 8 devices, drafting in `generate`, and export. (Training one end to end:
tests/training/test_training.py.)

The tiny target is an HF `DeepseekV3ForCausalLM` (yarn RoPE, 4 layers); the drafter has the full vocabulary (no
d2t/t2d) and reuses the target's embedding, as the published checkpoint does.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file, save_file
from transformers import DeepseekV3ForCausalLM, DynamicCache

from converters.__main__ import main as convert_main
from jaxspec import ConfigError, generate
from jaxspec.io import load_drafter, load_target, save_drafter
from jaxspec.training.ttt import ttt_logits
from sharding.mesh import make_mesh
from tests.reference import eagle3_mla as ref
from tests.reference.hf_tiny import hf_config

L, V, T = 4, 256, 9
VLLM_IDS = [1, 2, 3]  # as published: vLLM reads eagle_config ids as inputs of layers 1..3 = outputs of 0..2


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.abs(a - b).max() / b.std())


def published_config(cfg, **overrides) -> dict:
    """config.json in the published layout (fields as in the Kimi-K2.5 MLA drafter's), for the tiny sizes."""
    rope = {k: v for k, v in cfg.rope_parameters.items() if k not in ("rope_theta", "rope_type")}
    out = {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"],
        "model_type": "kimi_k2",
        "attention_bias": False,
        "draft_vocab_size": V,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": VLLM_IDS, "use_aux_hidden_state": True},
        "head_dim": cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
        "hidden_act": "silu",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "mlp_bias": False,
        "num_attention_heads": cfg.num_attention_heads,
        "num_hidden_layers": 1,
        "num_key_value_heads": cfg.num_attention_heads,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_scaling": rope,  # {"type": "yarn", ...} as published
        "rope_theta": cfg.rope_parameters["rope_theta"],
        "tie_word_embeddings": False,
        "vocab_size": V,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "v_head_dim": cfg.v_head_dim,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
    }
    return {**out, **overrides}


@pytest.fixture(scope="module")
def hf_target(tmp_path_factory):
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(hf_config("kimi", num_hidden_layers=L)).eval()
    path = tmp_path_factory.mktemp("mla_target")
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def target(hf_target):
    return load_target(hf_target[0], dtype=jnp.float32)


@pytest.fixture(scope="module")
def drafter_ckpt(hf_target, tmp_path_factory):
    """(path, reference model): drafter hidden 64, 8 heads, its own MLA ranks, yarn RoPE."""
    model = hf_target[1]
    cfg = hf_config("kimi", q_lora_rank=24, kv_lora_rank=40, intermediate_size=96, first_k_dense_replace=1)
    embed = model.model.embed_tokens.weight.detach().numpy()
    drafter = ref.make_drafter(cfg, model.config.hidden_size, len(VLLM_IDS), embed)
    path = tmp_path_factory.mktemp("mla_drafter")
    save_file(ref.checkpoint_tensors(drafter), path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(published_config(cfg)))
    return path, drafter


@pytest.fixture(scope="module")
def inputs(hf_target):
    ids = np.random.default_rng(3).integers(2, V, (1, T))
    with torch.no_grad():
        states = hf_target[1](torch.from_numpy(ids), output_hidden_states=True).hidden_states
    aux = torch.cat([states[k + 1] for k in (0, 1, 2)], dim=-1)  # outputs of layers 0..2, low -> high
    return ids, aux


def test_published_config_and_names_load_as_input_of_layer_ids(drafter_ckpt, target):
    drafter = load_drafter(drafter_ckpt[0], target, dtype=jnp.float32)
    cfg = drafter.config
    assert cfg.format == "mla" and cfg.capture_convention == "input" and cfg.capture_layers == (0, 1, 2)
    assert cfg.full_vocab and drafter.d2t is None and drafter.shared == ("embed",)
    assert (cfg.mla.q_lora_rank, cfg.mla.kv_lora_rank, cfg.mla.num_attention_heads) == (24, 40, 8)
    assert cfg.mla.rope_scaling is not None  # yarn, as published


def test_matches_reference_first_and_cached_steps(drafter_ckpt, target, inputs):
    path, model = drafter_ckpt
    ids, aux = inputs
    drafter = load_drafter(path, target, dtype=jnp.float32)
    pos = torch.arange(T)[None]
    with torch.no_grad():
        want, h2 = model(torch.from_numpy(ids), aux, pos)
    assert rel_err(drafter.logits(aux.numpy(), ids), want.numpy()) < 1e-4

    # Cached: the first step over T-1 tokens, then one step from its last h2 (absorbed attention over the latent
    # cache), against HF's own DynamicCache.
    cache, hf_cache = drafter.init_cache(1, 32), DynamicCache()
    with torch.no_grad():
        want1, h2_ref = model(torch.from_numpy(ids[:, :-1]), aux[:, :-1], pos[:, :-1], hf_cache)
        want2, _ = model(torch.from_numpy(ids[:, -1:]), h2_ref[:, -1:], pos[:, -1:], hf_cache)
    got1, h2_got, cache = drafter.forward(ids[:, :-1], aux[:, :-1].numpy(), pos[:, :-1].numpy(), cache, first_step=True)
    assert rel_err(got1, want1.numpy()) < 1e-4 and rel_err(h2_got, h2_ref.numpy()) < 1e-4
    got2, _, _ = drafter.forward(ids[:, -1:], np.asarray(h2_got)[:, -1:], pos[:, -1:].numpy(), cache, first_step=False)
    assert rel_err(got2, want2.numpy()) < 1e-4


def test_ttt_unroll_matches_inference_and_reference(drafter_ckpt, target, inputs):
    """The MLA drafter's training-time-test unroll: step 0 is its own uncached inference forward (row t pairs the
    state of position t with token t+1), and every step equals the reference unroll, which runs HF's
    DeepseekV3Attention (a dense masked softmax) over the steps' attention inputs laid end to end under the TTT mask
    (`ref.ttt_mask`: step-0 keys causally, then row t's own keys of steps 1..j)."""
    path, model = drafter_ckpt
    ids, aux = inputs
    drafter, J = load_drafter(path, target, dtype=jnp.float32), 3
    got = np.asarray(ttt_logits(drafter, ids, aux.numpy(), J))[:, 0]
    first = np.asarray(drafter.logits(aux.numpy(), np.append(ids[0, 1:], 0)[None]))[0]
    np.testing.assert_allclose(got[0], first, atol=2e-5, rtol=0)
    with torch.no_grad():
        want = ref.ttt_logits(model, torch.from_numpy(ids), aux, J)[:, 0].numpy()
    for j in range(J):
        assert rel_err(got[j], want[j]) < 1e-4, f"TTT step {j}"
    assert rel_err(got[2], got[1]) > 1e-2  # the steps differ: a wrong mask or shift would show


@pytest.fixture(scope="module")
def target8(hf_target):
    return load_target(hf_target[0], mesh=make_mesh("1x8"), dtype=jnp.float32)


def test_eight_devices_match_reference(drafter_ckpt, target8, inputs):
    drafter = load_drafter(drafter_ckpt[0], target8, dtype=jnp.float32)
    assert drafter.split.heads  # 8 heads over 8 devices
    ids, aux = inputs
    with torch.no_grad():
        want, _ = drafter_ckpt[1](torch.from_numpy(ids), aux, torch.arange(T)[None])
    assert rel_err(drafter.logits(aux.numpy(), ids), want.numpy()) < 1e-4


PROMPTS = [[5, 9, 200, 17], [3, 4, 5, 6, 7, 8]]


def _greedy_drafting_equals_plain(target, drafter_path):
    drafter = load_drafter(drafter_path, target, dtype=jnp.float32)
    plain = generate(target, None, PROMPTS, max_new_tokens=12, num_steps=0)
    spec = generate(target, drafter, PROMPTS, max_new_tokens=12, num_steps=3)
    assert spec.tokens == plain.tokens


@pytest.mark.slow  # two loop compiles (~45 s on 2 cores); the drafter's loop entry points are checked above
def test_greedy_drafting_equals_plain(drafter_ckpt, target):
    _greedy_drafting_equals_plain(target, drafter_ckpt[0])


@pytest.mark.slow
def test_greedy_drafting_equals_plain_on_eight_devices(drafter_ckpt, target8):
    _greedy_drafting_equals_plain(target8, drafter_ckpt[0])


def test_export_round_trip(drafter_ckpt, hf_target, target, tmp_path):
    drafter = load_drafter(drafter_ckpt[0], target, dtype=jnp.float32)
    with pytest.raises(ValueError, match="MLA drafter is written as 'mla'"):
        save_drafter(drafter, tmp_path / "x", format="sglang")
    save_drafter(drafter, tmp_path / "out", format="mla")
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    assert raw["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == VLLM_IDS
    again = load_drafter(tmp_path / "out", target, dtype=jnp.float32)
    assert again.config == drafter.config
    want = dict(nnx.to_flat_state(drafter.params))
    for path, var in nnx.to_flat_state(again.params):
        np.testing.assert_array_equal(np.asarray(var.get_value()), np.asarray(want[path].get_value()), str(path))
    # The CLI writes the same files (the target's decoder layers stay abstract there).
    args = ["--src", str(drafter_ckpt[0]), "--target", str(hf_target[0]), "--dst", str(tmp_path / "cli")]
    assert convert_main(["export-drafter", *args, "--format", "mla", "--dtype", "float32"]) == 0
    a, b = load_file(tmp_path / "out" / "model.safetensors"), load_file(tmp_path / "cli" / "model.safetensors")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_bad_mla_configs_are_named(target):
    cfg = hf_config("kimi")
    with pytest.raises(ConfigError, match="q_lora_rank: an MLA drafter without a query LoRA"):
        from jaxspec.io.drafter_config import read_drafter_config

        read_drafter_config(published_config(cfg, q_lora_rank=None), target_config=target.config)
    with pytest.raises(ConfigError, match="kv_lora_rank: an MLA drafter needs a positive integer, got 0"):
        read_drafter_config(published_config(cfg, kv_lora_rank=0), target_config=target.config)
    with pytest.raises(ConfigError, match=r"tie_word_embeddings: true is not supported"):
        read_drafter_config(published_config(cfg, tie_word_embeddings=True), target_config=target.config)


# ----------------------------------------------------------------------------------------------- EAGLE 3.1
# The published Kimi EAGLE 3.1 MLA drafters (lightseekorg/kimi-k2.6-eagle3.1-mla and its K2.7 continuation) are the
# K2.5 MLA drafter's layout with two more config fields, both served by vLLM (PRs #42764, #43482) and SGLang.
EAGLE31 = {"fc_norm": True, "norm_output": True}


@pytest.fixture(scope="module")
def drafter31_ckpt(hf_target, tmp_path_factory):
    """(path, reference model): the `drafter_ckpt` drafter with EAGLE 3.1's per-state norms (`fc_norm.{i}.weight`)
    and its post-norm output fed back."""
    model = hf_target[1]
    cfg = hf_config("kimi", q_lora_rank=24, kv_lora_rank=40, intermediate_size=96, first_k_dense_replace=1)
    embed = model.model.embed_tokens.weight.detach().numpy()
    drafter = ref.make_drafter(cfg, model.config.hidden_size, len(VLLM_IDS), embed, seed=1, eagle31=True)
    path = tmp_path_factory.mktemp("mla_drafter31")
    save_file(ref.checkpoint_tensors(drafter), path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(published_config(cfg, **EAGLE31)))
    return path, drafter


def test_eagle31_matches_reference_first_cached_and_ttt_steps(drafter31_ckpt, target, inputs):
    """First step, a cached step from the previous step's output (post-norm), and the TTT unroll, against the
    reference's vLLM formulas (per-state RMSNorm before fc; the final norm's output fed back)."""
    path, model = drafter31_ckpt
    ids, aux = inputs
    drafter = load_drafter(path, target, dtype=jnp.float32)
    assert (drafter.config.fc_norm, drafter.config.norm_output, drafter.config.norm_before_fc) == (True, True, False)
    pos = torch.arange(T)[None]
    cache, hf_cache = drafter.init_cache(1, 32), DynamicCache()
    with torch.no_grad():
        want1, out_ref = model(torch.from_numpy(ids[:, :-1]), aux[:, :-1], pos[:, :-1], hf_cache)
        want2, _ = model(torch.from_numpy(ids[:, -1:]), out_ref[:, -1:], pos[:, -1:], hf_cache)
    got1, out, cache = drafter.forward(ids[:, :-1], aux[:, :-1].numpy(), pos[:, :-1].numpy(), cache, first_step=True)
    assert rel_err(got1, want1.numpy()) < 1e-4 and rel_err(out, out_ref.numpy()) < 1e-4
    got2, _, _ = drafter.forward(ids[:, -1:], np.asarray(out)[:, -1:], pos[:, -1:].numpy(), cache, first_step=False)
    assert rel_err(got2, want2.numpy()) < 1e-4
    got = np.asarray(ttt_logits(drafter, ids, aux.numpy(), 3))[:, 0]
    with torch.no_grad():
        want = ref.ttt_logits(model, torch.from_numpy(ids), aux, 3)[:, 0].numpy()
    for j in range(3):
        assert rel_err(got[j], want[j]) < 1e-4, f"TTT step {j}"


def test_eagle31_eight_devices_match_reference(drafter31_ckpt, target8, inputs):
    """Heads split over 8 devices; the per-state norms (replicated) and the post-norm output as on one device."""
    path, model = drafter31_ckpt
    drafter = load_drafter(path, target8, dtype=jnp.float32)
    assert drafter.split.heads
    ids, aux = inputs
    with torch.no_grad():
        want, out_ref = model(torch.from_numpy(ids), aux, torch.arange(T)[None])
    got, out, _ = drafter.forward(ids, aux.numpy(), np.arange(T)[None], drafter.init_cache(1, 16), first_step=True)
    assert rel_err(got, want.numpy()) < 1e-4 and rel_err(out, out_ref.numpy()) < 1e-4


def test_eagle31_export_round_trip(drafter31_ckpt, target, tmp_path):
    drafter = load_drafter(drafter31_ckpt[0], target, dtype=jnp.float32)
    save_drafter(drafter, tmp_path / "out", format="mla")
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    assert {k: raw.get(k) for k in EAGLE31} == EAGLE31
    assert (
        load_file(tmp_path / "out" / "model.safetensors").keys()
        == load_file(drafter31_ckpt[0] / "model.safetensors").keys()
    )  # the published names: fc_norm.{0,1,2}.weight
    again = load_drafter(tmp_path / "out", target, dtype=jnp.float32)
    assert again.config == drafter.config
    want = dict(nnx.to_flat_state(drafter.params))
    for path, var in nnx.to_flat_state(again.params):
        np.testing.assert_array_equal(np.asarray(var.get_value()), np.asarray(want[path].get_value()), str(path))


@pytest.mark.slow  # two loop compiles per shape (~1.5 min on 2 cores)
@pytest.mark.parametrize("topk,num_draft_tokens", [(1, None), (2, 6)], ids=["chain", "tree"])
def test_eagle31_greedy_drafting_equals_plain(drafter31_ckpt, target, topk, num_draft_tokens):
    drafter = load_drafter(drafter31_ckpt[0], target, dtype=jnp.float32)
    plain = generate(target, None, PROMPTS, max_new_tokens=12, num_steps=0)
    spec = generate(
        target, drafter, PROMPTS, max_new_tokens=12, num_steps=3, topk=topk, num_draft_tokens=num_draft_tokens
    )
    assert spec.tokens == plain.tokens
