"""The bundled trained pair (assets/kimi-py-tiny): loads like any checkpoint, stays small, really is INT4 in
compressed-tensors format (dense on CPU by default), and its drafter is trained (speculative greedy output == plain,
with high acceptance)."""

import json

import jax.numpy as jnp
import numpy as np
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
    """INT4 on disk; on CPU (no 4-bit kernels) the experts load dense by default, to the values a packed step
    dequantises to, and `int4_experts="packed"` keeps them 4-bit: the two forwards agree up to summation order."""
    target, drafter, tokenizer = pair
    dense = target.params["moe_layers"]["mlp"]["gate"].get_value()
    packed_target, _, _ = bundled.load_pair(int4_experts="packed")
    packed = packed_target.params["moe_layers"]["mlp"]["gate"].get_value()
    assert isinstance(packed, Int4Array) and packed.packed.dtype == jnp.uint8
    assert not isinstance(dense, Int4Array) and dense.dtype == jnp.float32 and dense.shape == packed.shape
    assert target.config.quant is None and packed_target.config.quant is not None
    np.testing.assert_array_equal(np.asarray(dense), np.asarray(packed.dequantize(jnp.float32)))
    tokens = jnp.asarray([tokenizer.encode(bundled.prompts()[0])[:24]], jnp.int32)
    pos = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    logits = [t.apply(t.params, tokens, pos, None, head="logits")[0] for t in (target, packed_target)]
    np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(logits[1]), atol=1e-4, rtol=1e-4)
    assert target.dtype == jnp.float32 and drafter.config.draft_vocab_size < target.config.vocab_size
    assert tokenizer.vocab_size == target.config.vocab_size
    assert len(bundled.prompts()) >= 8


def test_int4_experts_load_dense_on_cpu_where_they_fit(monkeypatch, tmp_path):
    """`int4_experts`: auto is dense on CPU only, and packed where the dense experts would take over a quarter of the
    host's memory; packed and dense as asked; a conversion output stays INT4 (dense refused, naming the path); an
    unknown mode and a checkpoint without INT4 experts."""
    from jaxspec.io import load as io_load

    target_dir, _ = bundled.paths()
    decide = lambda mode, platform="cpu", path=target_dir: io_load.int4_experts(mode, path, platform, jnp.float32)
    assert decide("auto")[0] and not decide("auto", "tpu")[0] and not decide("auto", "gpu")[0]
    assert decide("dense", "tpu")[0] and not decide("packed")[0]
    config = json.loads((target_dir / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert decide("auto", path=tmp_path) == (False, "no INT4 experts")  # nothing to dequantise
    with pytest.raises(ValueError, match="int4_experts: expected one of auto, packed, dense, got 'int8'"):
        decide("int8")
    monkeypatch.setattr(io_load, "read_marker", lambda path: {"kind": "target"})
    with pytest.raises(ValueError, match="conversion output"):
        decide("dense")
    assert not decide("auto")[0]
    monkeypatch.undo()
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 256}  # a 1 MiB host: the pair's dense experts are 3 MiB
    monkeypatch.setattr(io_load.os, "sysconf", pages.get)
    dense, why = decide("auto")
    assert not dense and "over a quarter of this host's memory" in why


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
