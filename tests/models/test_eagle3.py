"""EAGLE-3 drafter: parity with `speculators`, both checkpoint formats, the capture convention, validation, sharding.

The reference is the published `speculators.models.eagle3.Eagle3DraftModel` (see tests/reference/eagle3_speculators.py);
the tiny target is an HF `DeepseekV3ForCausalLM` with 4 layers, loaded with `load_target`.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file
from speculators.models.eagle3 import Eagle3DraftModel
from transformers import DeepseekV3ForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from jaxspec import generate
from jaxspec.config import ConfigError, KimiConfig
from jaxspec.io import CheckpointError, load_drafter, load_drafter_or_random, load_target, save_drafter
from jaxspec.io.drafter_config import _read_draft_rope, draft_config_for, read_drafter_config
from jaxspec.runtime import Target
from sharding.mesh import make_mesh
from tests.reference import eagle3_speculators as ref
from tests.reference.hf_tiny import hf_config

L, D, V, U, T = 4, 64, 256, 60, 8
SPEC_IDS = [1, 2, 3]  # speculators' input-of-layer ids = outputs of layers 0, 1, 2 (all below L-1, see below)
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
}


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.abs(a - b).max() / b.std())


@pytest.fixture(scope="module")
def hf_target(tmp_path_factory):
    torch.manual_seed(0)
    # The shared tiny HF reference config, with L layers and default (non-yarn) RoPE.
    cfg = hf_config("kimi", vocab_size=V, hidden_size=D, num_hidden_layers=L, rope_scaling=None)
    model = DeepseekV3ForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("target")
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def target(hf_target):
    return load_target(hf_target[0], dtype=jnp.float32)


@pytest.fixture(scope="module")
def embed(hf_target):
    return hf_target[1].model.embed_tokens.weight.detach().numpy().copy()


@pytest.fixture(scope="module")
def spec_ckpt(embed, tmp_path_factory):
    """A drafter written by speculators' own `save_pretrained` (draft vocab U, GQA 8/4, ships embed_tokens)."""
    model = ref.make_model(embed, SPEC_IDS, draft_vocab=U)
    path = tmp_path_factory.mktemp("spec")
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def drafter(spec_ckpt, target):
    return load_drafter(spec_ckpt[0], target, dtype=jnp.float32)


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, V, (T,)), rng.standard_normal((T, 3 * D)).astype(np.float32)


def chain(drafter, aux, ids, steps=3) -> list[np.ndarray]:
    """Our unrolled draft matching speculators' training-time test: one batch row per start position t.

    Row t prefills the whole sequence (its cache entries past t are overwritten or masked by position), then drafts
    steps 1.. at positions t+1.. with token ids[t+k] (0 past the end) and the previous step's h2 at row t.
    """
    cache = drafter.init_cache(T, T + steps)
    rows = np.arange(T)
    logits, h2, cache = drafter.forward(
        np.tile(ids, (T, 1)), np.tile(aux, (T, 1, 1)), np.tile(rows, (T, 1)), cache, first_step=True
    )
    out = [np.asarray(logits)[rows, rows]]
    h = np.asarray(h2)[rows, rows][:, None]
    for k in range(1, steps):
        tokens = np.where(rows + k < T, ids[np.minimum(rows + k, T - 1)], 0)[:, None]
        logits, h, cache = drafter.forward(tokens, h, (rows + k)[:, None], cache, first_step=False)
        out.append(np.asarray(logits)[:, 0])
    return out


# ----------------------------------------------------------------------------------------------- parity
EAGLE31 = {"fc_norm": True, "norm_output": True}  # as the published Kimi EAGLE 3.1 drafters set them
EAGLE31_ONE_NORM = {"norm_before_fc": True, "norm_output": True}  # speculators' `--eagle31` training default


@pytest.mark.parametrize(
    "draft_vocab,rope,norm_before_residual,eagle31",
    [
        (U, "yarn", False, {}),
        (None, "llama3", True, {}),  # default RoPE: vs speculators in the capture test
        (U, "linear", False, EAGLE31),
        (None, "yarn", True, EAGLE31_ONE_NORM),
    ],
    ids=[
        "draft-vocab-yarn",
        "full-vocab-llama3-norm-before-residual",
        "eagle3.1-fc-norm-norm-output",
        "eagle3.1-norm-before-fc-norm-output",
    ],
)
def test_parity_with_speculators(target, embed, tmp_path, draft_vocab, rope, norm_before_residual, eagle31):
    """speculators' own forward (its EAGLE 3.1 flags included): the 1-step draft and the 3-step chain, in which
    each step reads the previous step's output (post-norm with norm_output)."""
    model = ref.make_model(
        embed,
        SPEC_IDS,
        draft_vocab=draft_vocab,
        rope=ROPES[rope],
        norm_before_residual=norm_before_residual,
        eagle31=eagle31,
        seed=1,
    )
    model.save_pretrained(tmp_path)
    drafter = load_drafter(tmp_path, target, dtype=jnp.float32)
    assert drafter.config.norm_before_residual == norm_before_residual and drafter.config.rope.kind == rope
    flags = {name: getattr(drafter.config, name) for name in ("fc_norm", "norm_before_fc", "norm_output")}
    assert flags == {name: eagle31.get(name, False) for name in flags}
    ids, aux = inputs()
    expected = ref.draft_logits(model, aux, ids, steps=3)
    assert rel_err(drafter.logits(aux[None], ids[None])[0], expected[0]) <= 1e-4  # 1-step draft
    for k, (ours, theirs) in enumerate(zip(chain(drafter, aux, ids), expected, strict=True)):  # 3-step draft
        assert rel_err(ours, theirs) <= 1e-4, f"step {k}"
    # Draft ids map to target ids through d2t exactly as the checkpoint's t2d says.
    target_ids = np.asarray(drafter.to_target_ids(jnp.arange(draft_vocab or V)))
    expected_ids = np.flatnonzero(model.t2d.numpy()) if draft_vocab else np.arange(V)
    np.testing.assert_array_equal(target_ids, expected_ids)


@pytest.mark.parametrize("kind", ROPES)
def test_rope_matches_transformers(kind):
    cfg = LlamaConfig(hidden_size=D, num_attention_heads=8, max_position_embeddings=512, rope_parameters=ROPES[kind])
    theirs = LlamaRotaryEmbedding(cfg)
    ours, factor = _read_draft_rope(json.loads(cfg.to_json_string())).inv_freq(D // 8)
    np.testing.assert_allclose(ours, theirs.inv_freq.numpy(), rtol=1e-6)
    assert factor == pytest.approx(theirs.attention_scaling)


# ----------------------------------------------------------------------------------------------- formats
def test_round_trip_between_formats(spec_ckpt, drafter, target, hf_target, tmp_path):
    model, a = spec_ckpt[1], drafter  # written by speculators itself
    save_drafter(a, tmp_path / "sglang", format="sglang")
    save_drafter(a, tmp_path / "spec", format="speculators", verifier=str(hf_target[0]))
    sglang_cfg = json.loads((tmp_path / "sglang" / "config.json").read_text())
    spec_cfg = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert sglang_cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert spec_cfg["eagle_aux_hidden_state_layer_ids"] == SPEC_IDS
    assert "midlayer.self_attn.q_proj.weight" in load_file(tmp_path / "sglang" / "model.safetensors")
    assert "layers.0.self_attn.q_proj.weight" in load_file(tmp_path / "spec" / "model.safetensors")
    # Without embed_tokens the drafter reuses the target's embedding (equal here by construction).
    shutil.copytree(tmp_path / "sglang", tmp_path / "no_embed")
    tensors = load_file(tmp_path / "no_embed" / "model.safetensors")
    del tensors["embed_tokens.weight"]
    save_file(tensors, tmp_path / "no_embed" / "model.safetensors")

    ids, aux = inputs(1)
    want = np.asarray(a.logits(aux[None], ids[None]))
    for name in ("sglang", "spec", "no_embed"):
        b = load_drafter(tmp_path / name, target, dtype=jnp.float32)
        assert b.capture_layers == a.capture_layers == (0, 1, 2)
        assert b.shared == (("embed",) if name == "no_embed" else ())
        for key in a.params:
            np.testing.assert_array_equal(np.asarray(b.params[key].get_value()), np.asarray(a.params[key].get_value()))
        np.testing.assert_array_equal(b.d2t, a.d2t)
        np.testing.assert_array_equal(np.asarray(b.logits(aux[None], ids[None])), want)
    assert load_drafter(tmp_path / "no_embed", target).params["embed"].get_value() is target.params["embed"].get_value()

    # The published implementation loads our speculators export to the same weights it started from.
    reloaded = Eagle3DraftModel.from_pretrained(tmp_path / "spec").state_dict()
    for key, value in model.state_dict().items():
        if not key.startswith("verifier_"):
            assert torch.equal(reloaded[key], value), key


@pytest.mark.parametrize("eagle31", [EAGLE31, EAGLE31_ONE_NORM], ids=["fc-norm", "norm-before-fc"])
def test_eagle31_round_trip_between_formats(target, embed, hf_target, tmp_path, eagle31):
    """An EAGLE 3.1 drafter written by speculators exports to both Llama formats with its flags and norm weights;
    each export loads back to the same drafter, and speculators loads its own format to the weights it wrote."""
    model = ref.make_model(embed, SPEC_IDS, draft_vocab=U, eagle31=eagle31, seed=2)
    model.save_pretrained(tmp_path / "src")
    a = load_drafter(tmp_path / "src", target, dtype=jnp.float32)
    save_drafter(a, tmp_path / "sglang", format="sglang")
    save_drafter(a, tmp_path / "spec", format="speculators", verifier=str(hf_target[0]))
    sglang_cfg = json.loads((tmp_path / "sglang" / "config.json").read_text())
    assert {k: sglang_cfg[k] for k in eagle31} == eagle31  # SGLang and vLLM read the flags at the top level
    norms = (
        {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"} if "fc_norm" in eagle31 else {"input_norm.weight"}
    )
    assert norms <= load_file(tmp_path / "sglang" / "model.safetensors").keys()
    ids, aux = inputs(5)
    for name in ("sglang", "spec"):
        b = load_drafter(tmp_path / name, target, dtype=jnp.float32)
        assert b.config == dataclasses.replace(
            a.config, format=b.config.format, capture_convention=b.config.capture_convention
        )
        for key in a.params:
            np.testing.assert_array_equal(np.asarray(b.params[key].get_value()), np.asarray(a.params[key].get_value()))
        np.testing.assert_array_equal(np.asarray(b.logits(aux[None], ids[None])), a.logits(aux[None], ids[None]))
    reloaded = Eagle3DraftModel.from_pretrained(tmp_path / "spec")
    assert all(getattr(reloaded.config, k) == v for k, v in eagle31.items())
    state = reloaded.state_dict()
    for key, value in model.state_dict().items():
        if not key.startswith("verifier_"):
            assert torch.equal(state[key], value), key
    # A checkpoint whose config lost its flag is refused by its norm weights, not loaded as plain EAGLE-3.
    _edit(tmp_path / "sglang", tmp_path / "no_flag", config=lambda c: {k: v for k, v in c.items() if k not in eagle31})
    with pytest.raises(CheckpointError, match=r"unexpected tensor (fc_norm.0|input_norm).weight"):
        load_drafter(tmp_path / "no_flag", target)


@pytest.mark.slow  # two loop compiles per shape (~1.5 min on 2 cores)
@pytest.mark.parametrize("topk,num_draft_tokens", [(1, None), (2, 6)], ids=["chain", "tree"])
def test_eagle31_greedy_drafting_equals_plain(target, embed, tmp_path, topk, num_draft_tokens):
    model = ref.make_model(embed, SPEC_IDS, draft_vocab=U, eagle31=EAGLE31, seed=3)
    model.save_pretrained(tmp_path)
    drafter, prompts = load_drafter(tmp_path, target, dtype=jnp.float32), [[5, 9, 200, 17], [3, 4, 5, 6, 7, 8]]
    plain = generate(target, None, prompts, max_new_tokens=12, num_steps=0)
    spec = generate(
        target, drafter, prompts, max_new_tokens=12, num_steps=3, topk=topk, num_draft_tokens=num_draft_tokens
    )
    assert spec.tokens == plain.tokens


def test_load_drafter_or_random_loads_a_path(spec_ckpt, target, drafter):
    loaded = load_drafter_or_random(spec_ckpt[0], target)
    assert loaded.config == drafter.config and loaded.dtype == target.dtype
    np.testing.assert_array_equal(
        np.asarray(loaded.params["fc"].get_value()), np.asarray(drafter.params["fc"].get_value())
    )


@pytest.mark.slow  # Drafter.random compiles the initialiser (~12 s on 2 cores)
def test_load_drafter_or_random_without_a_path_is_random(target):
    random = load_drafter_or_random(None, target, seed=3)
    assert random.config == draft_config_for(target.config) and random.dtype == target.dtype
    assert random.params["embed"].get_value() is target.params["embed"].get_value()


def test_full_vocab_drafter_without_head_uses_the_targets(target, hf_target, embed, tmp_path):
    model = ref.make_model(embed, SPEC_IDS)  # no draft vocabulary
    with torch.no_grad():
        model.lm_head.weight.copy_(hf_target[1].lm_head.weight)
    model.save_pretrained(tmp_path / "own")
    _edit(tmp_path / "own", tmp_path / "shared", tensors=lambda t: t.pop("lm_head.weight"))
    own, shared = (load_drafter(tmp_path / name, target, dtype=jnp.float32) for name in ("own", "shared"))
    assert own.shared == () and shared.shared == ("lm_head",) and own.d2t is None
    assert shared.params["lm_head"].get_value() is target.params["lm_head"].get_value()
    ids, aux = inputs(4)
    np.testing.assert_array_equal(np.asarray(shared.logits(aux[None], ids[None])), own.logits(aux[None], ids[None]))


def test_capture_convention_end_to_end(spec_ckpt, drafter, target, hf_target, tmp_path):
    """The drafter's inputs are HF hidden_states[k + 1] for its output-of-layer-k ids, whichever format it came in."""
    path, model = spec_ckpt
    save_drafter(drafter, tmp_path, format="sglang")
    ids = np.random.default_rng(2).integers(0, V, (2, T))
    with torch.no_grad():
        hf_states = hf_target[1](torch.from_numpy(ids), output_hidden_states=True).hidden_states
    for ckpt, convention in ((path, "input"), (tmp_path, "output")):
        d = load_drafter(ckpt, target, dtype=jnp.float32)
        assert d.capture_layers == (0, 1, 2) and d.config.capture_convention == convention
        aux = np.asarray(d.aux_hidden(ids))
        for x, k in enumerate(d.capture_layers):  # k < L-1: HF's last entry has the final norm applied
            assert rel_err(aux[..., x * D : (x + 1) * D], hf_states[k + 1].numpy()) <= 1e-4, (ckpt, k)
    # ... and the drafter on them matches speculators fed the same HF states.
    expected = ref.draft_logits(model, aux[1], ids[1], steps=1)[0]
    assert rel_err(drafter.logits(aux, ids)[1], expected) <= 1e-4
    # An explicit convention overrides the format's: the same ids read as outputs name the next layers.
    assert load_drafter(path, target, capture_convention="output").capture_layers == (1, 2, 3)


def kimi_sglang(**changes) -> dict:
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "num_hidden_layers": 1,
        "vocab_size": 163840,
        "rms_norm_eps": 1e-5,
        "rope_theta": 50000.0,
    }
    return {**cfg, **changes}


def kimi_speculators(layer_changes=None, **changes) -> dict:
    layer = {k: v for k, v in kimi_sglang(**(layer_changes or {})).items() if k != "architectures"}
    return {"speculators_model_type": "eagle3", "transformer_layer_config": layer, **changes}


KIMI = KimiConfig.preset("kimi-k2.5")  # 61 layers


@pytest.mark.parametrize(
    "cfg,kw,layers,convention",
    [
        (kimi_sglang(), {}, (1, 29, 57), "default"),  # SGLang/vLLM default: inputs of [2, L//2, L-3]
        (kimi_speculators(), {}, (1, 29, 57), "default"),
        (kimi_sglang(eagle_config={"eagle_aux_hidden_state_layer_ids": [57, 1, 29]}), {}, (1, 29, 57), "output"),
        (kimi_speculators(eagle_aux_hidden_state_layer_ids=[2, 30, 58]), {}, (1, 29, 57), "input"),
        (
            kimi_speculators(eagle_aux_hidden_state_layer_ids=[2, 30, 58]),
            {"capture_convention": "output"},
            (2, 30, 58),
            "output",
        ),  # noqa: E501
        (
            kimi_sglang(eagle_aux_hidden_state_layer_ids=[2, 30, 58]),
            {"capture_convention": "input"},
            (1, 29, 57),
            "input",
        ),  # noqa: E501
        (kimi_speculators(eagle_aux_hidden_state_layer_ids=[61]), {}, (60,), "input"),  # speculators allows id L
    ],
)
def test_capture_layers_from_config(cfg, kw, layers, convention):
    parsed = read_drafter_config(cfg, target_config=KIMI, **kw)
    assert (parsed.capture_layers, parsed.capture_convention) == (layers, convention)
    assert parsed.full_vocab and parsed.head_dim == 112


# ----------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "cfg,match",
    [
        (kimi_sglang(target_hidden_size=4096), r"target_hidden_size: drafter expects 4096, target hidden_size is 7168"),
        (kimi_sglang(vocab_size=128256), r"vocab_size: drafter has 128256, target has 163840"),
        (kimi_sglang(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 29, 61]}), r"\[61\] out of range \[0, 61\)"),
        (kimi_speculators(eagle_aux_hidden_state_layer_ids=[0, 30, 58]), r"\[0\] out of range \[1, 62\)"),
        (kimi_sglang(eagle_aux_hidden_state_layer_ids=[2, 30, 58]), r"ambiguous.*capture_convention"),
        (
            kimi_sglang(eagle_aux_hidden_state_layer_ids=[2], eagle_config={"eagle_aux_hidden_state_layer_ids": [5]}),
            r"ambiguous",
        ),
        (
            kimi_sglang(architectures=["DeepseekV3ForCausalLMEagle3"]),
            r"architectures: \['DeepseekV3ForCausalLMEagle3'\]",
        ),
        (kimi_speculators(speculators_model_type="mtp"), r"speculators_model_type: 'mtp' is not supported"),
        (kimi_speculators(norm_before_fc=True, fc_norm=True), r"norm_before_fc and fc_norm: both set"),
        (kimi_sglang(use_aux_norm=True, norm_before_fc=True), r"norm_before_fc and fc_norm: both set"),
        (kimi_speculators(norm_output="yes"), r"norm_output: expected true or false, got 'yes'"),
        (
            kimi_speculators({"norm_output": False}, norm_output=True),
            r"norm_output: set differently in norm_output and transformer_layer_config.norm_output",
        ),
        (kimi_sglang(tie_word_embeddings=True), r"tie_word_embeddings: true is not supported"),
        (kimi_speculators({"tie_word_embeddings": True}), r"tie_word_embeddings: true is not supported"),
        (kimi_sglang(num_hidden_layers=2), r"num_hidden_layers: only 1"),
        (kimi_sglang(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), r"rope_type: 'dynamic' is not supported"),
        (kimi_sglang(eagle_config={"use_aux_hidden_state": False}), r"use_aux_hidden_state"),
    ],
)
def test_bad_config(cfg, match):
    with pytest.raises(ConfigError, match=match):
        read_drafter_config(cfg, target_config=KIMI)


def test_disagreeing_ids_refused():
    cfg = kimi_sglang(eagle_aux_hidden_state_layer_ids=[2], eagle_config={"eagle_aux_hidden_state_layer_ids": [5]})
    with pytest.raises(ConfigError, match=r"layer ids disagree"):
        read_drafter_config(cfg, target_config=KIMI, capture_convention="output")


def _edit(src, dst, config=None, tensors=None):
    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps(config(cfg)))
    if tensors:
        t = load_file(dst / "model.safetensors")
        tensors(t)
        save_file(t, dst / "model.safetensors")
    return dst


def test_bad_checkpoints(spec_ckpt, target, tmp_path):
    src = spec_ckpt[0]
    fc = "fc.weight"
    cases = [
        (
            dict(tensors=lambda t: t.update({fc: t[fc][:, : 2 * D]})),
            r"fc.weight: expected shape \[64, 192\] \(3 captured states x target hidden_size 64\), got \[64, 128\]",
        ),  # noqa: E501
        (dict(tensors=lambda t: t.pop("layers.0.hidden_norm.weight")), r"missing tensor layers.0.hidden_norm.weight"),
        (dict(tensors=lambda t: t.update(extra=t["norm.weight"])), r"unexpected tensor extra"),
        (dict(tensors=lambda t: t.update(t2d=~t["t2d"])), r"t2d: disagrees with d2t"),
        (
            dict(tensors=lambda t: t.pop("d2t")),
            r"missing tensor d2t \(expected shape \[60\]\) \(draft_vocab_size 60 < vocab_size 256 needs the map\)",
        ),
        (dict(tensors=lambda t: t["embed_tokens.weight"].fill(np.nan)), r"embed_tokens.weight: contains non-finite"),
        (
            dict(tensors=lambda t: t.update({"midlayer.norm.weight": t["norm.weight"]})),
            r"both midlayer.\* and layers.0.\* tensors present",
        ),
    ]
    for i, (edit, match) in enumerate(cases):
        with pytest.raises(CheckpointError, match=match):
            load_drafter(_edit(src, tmp_path / str(i), **edit), target)
    # A drafter narrower than the target can only run with its own embedding.
    narrow = ref.make_model(np.zeros((V, 32), np.float32), SPEC_IDS, hidden=32, intermediate=48, draft_vocab=U)
    narrow.save_pretrained(tmp_path / "narrow")
    narrow_cfg = lambda c: {**c, "target_hidden_size": D}
    bad = _edit(
        tmp_path / "narrow", tmp_path / "narrow_bad", config=narrow_cfg, tensors=lambda t: t.pop("embed_tokens.weight")
    )  # noqa: E501
    with pytest.raises(
        CheckpointError, match=r"hidden_size: drafter 32 != target 64, and the checkpoint ships no embed"
    ):
        load_drafter(bad, target)


# ----------------------------------------------------------------------------------------------- sharding
@pytest.mark.parametrize("shape,split", [("1x8", (False, True, False)), ("2x4", (True, True, True))])
def test_sharded_matches_single_device(spec_ckpt, target, drafter, shape, split):
    """1x8: 4 KV heads and U=60 do not divide 8, so attention and lm_head are replicated; 2x4: everything split.

    The checkpoint ships its embedding and head, so an abstract target (config + mesh, no weights) is enough.
    """
    sharded_target = Target.abstract(target.config, mesh=make_mesh(shape), dtype=jnp.float32)
    sharded = load_drafter(spec_ckpt[0], sharded_target, dtype=jnp.float32)
    assert (sharded.split.heads, sharded.split.mlp, sharded.split.vocab) == split
    assert sharded.params["gate"].get_value().sharding.spec == P(None, "model")
    ids, aux = inputs(3)
    ids2, aux2 = np.stack([ids, ids[::-1]]), np.stack([aux, -aux])  # batch 2 for the data axis
    assert rel_err(sharded.logits(aux2, ids2), drafter.logits(aux2, ids2)) <= 1e-5
    if shape == "2x4":  # the cached 3-step draft too, on the plan a real drafter gets (compiles are the cost here)
        for ours, want in zip(chain(sharded, aux, ids), chain(drafter, aux, ids), strict=True):
            assert rel_err(ours, want) <= 1e-5
    # to_target_ids works on batch-sharded ids under jit and inside shard_map (per-device ids).
    draft_ids = jax.device_put(jnp.asarray(ids2 % U), NamedSharding(sharded.mesh, P("data", None)))
    want = np.asarray(drafter.to_target_ids(ids2 % U))
    np.testing.assert_array_equal(jax.jit(sharded.to_target_ids)(draft_ids), want)
    local = jax.shard_map(sharded.to_target_ids, mesh=sharded.mesh, in_specs=P("data", None), out_specs=P("data", None))
    np.testing.assert_array_equal(jax.jit(local)(draft_ids), want)
