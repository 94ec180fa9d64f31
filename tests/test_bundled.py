"""The bundled trained pair (assets/kimi-py-tiny): loads like any checkpoint, stays small, really is INT4 in
compressed-tensors format, and its drafter is trained (speculative greedy output == plain, with high acceptance)."""

import json

import jax.numpy as jnp
import pytest

from jaxspec import bundled, generate
from jaxspec.models.quant import Int4Array


@pytest.fixture(scope="module")
def pair():
    return bundled.load_pair()


def test_assets_are_small_and_complete():
    target_dir, drafter_dir = bundled.paths()
    files = [f for f in bundled.ROOT.rglob("*") if f.is_file()]
    total = sum(f.stat().st_size for f in files)
    assert total < 30e6, f"bundled assets are {total / 1e6:.1f} MB (limit 30 MB)"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (target_dir / name).is_file(), name
    qc = json.loads((target_dir / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    drafter_cfg = json.loads((drafter_dir / "config.json").read_text())
    assert drafter_cfg["architectures"] == ["LlamaForCausalLMEagle3"]  # SGLang format
    assert drafter_cfg["draft_vocab_size"] < drafter_cfg["vocab_size"]  # a real draft vocabulary (d2t/t2d)


def test_pair_loads_with_int4_experts_and_held_out_prompts(pair):
    target, drafter, tokenizer = pair
    experts = target.params["moe_layers"]["mlp"]["gate"].get_value()
    assert isinstance(experts, Int4Array) and experts.packed.dtype == jnp.uint8
    assert target.dtype == jnp.float32 and drafter.config.draft_vocab_size < target.config.vocab_size
    assert tokenizer.vocab_size == target.config.vocab_size
    assert len(bundled.prompts()) >= 8


@pytest.mark.slow  # test budget (the default suite reached 31 minutes): ~13 s; test_cli runs the pair against plain
def test_speculative_equals_plain_and_accepts_most_drafts(pair):
    """Greedy speculative decoding is lossless, and a trained drafter gets most of its drafts accepted (an
    untrained one accepts ~none: mean accepted length ~1)."""
    target, drafter, tokenizer = pair
    prompts = bundled.prompts()[:2]
    spec = generate(target, drafter, prompts, max_new_tokens=48, num_steps=3, tokenizer=tokenizer)
    plain = generate(target, None, prompts, max_new_tokens=48, num_steps=0, tokenizer=tokenizer)
    assert spec.tokens == plain.tokens
    assert spec.stats["mean_accepted_length"] >= 2.0, spec.stats
    assert all(t.strip() for t in spec.text)
