"""jaxspec-convert export-drafter: SGLang <-> speculators export then re-import is the identity, and the SGLang files
carry the names, dtypes and config fields SGLang reads; the target is needed only for its config and top weights."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from converters.__main__ import main
from converters.drafter import target_for_drafter
from converters.target import convert_target
from jaxspec.io import load_drafter, load_target, save_drafter
from jaxspec.io.drafter_config import draft_config_for
from jaxspec.runtime import Drafter

U = 64  # draft vocabulary (< target vocab 256): exercises d2t / t2d


@pytest.fixture(scope="module")
def drafter_dir(hf_checkpoint, tmp_path_factory):
    """(target HF dir, drafter written in SGLang format, the drafter)."""
    src = hf_checkpoint("kimi")[0]
    target = load_target(src, dtype=jnp.float32)
    cfg = dataclasses.replace(draft_config_for(target.config), draft_vocab_size=U)
    ids = np.sort(np.random.default_rng(0).choice(target.vocab_size, U, replace=False))
    drafter = Drafter.random(cfg, target, d2t=ids - np.arange(U), dtype=jnp.float32, seed=3)
    path = tmp_path_factory.mktemp("drafter_sglang")
    save_drafter(drafter, path, format="sglang")
    return src, path, drafter


def _same(a: Drafter, b: Drafter) -> None:
    assert a.capture_layers == b.capture_layers and a.shared == b.shared
    for key in a.params:
        np.testing.assert_array_equal(np.asarray(a.params[key].get_value()), np.asarray(b.params[key].get_value()))
    np.testing.assert_array_equal(a.d2t, b.d2t)


def test_export_both_ways_is_identity(drafter_dir, tmp_path, capsys):
    src, sglang, original = drafter_dir
    converted = tmp_path / "target"
    convert_target(src, converted, dtype="float32", progress=False)
    target = load_target(src, dtype=jnp.float32)
    # sglang -> speculators (target given as a conversion output) -> sglang (target given as the HF directory)
    main(
        [
            "export-drafter",
            "--src",
            str(sglang),
            "--target",
            str(converted),
            "--dst",
            str(tmp_path / "spec"),
            "--format",
            "speculators",
            "--dtype",
            "float32",
        ]
    )
    main(
        [
            "export-drafter",
            "--src",
            str(tmp_path / "spec"),
            "--target",
            str(src),
            "--dst",
            str(tmp_path / "back"),
            "--format",
            "sglang",
            "--dtype",
            "float32",
        ]
    )
    assert "exported drafter" in capsys.readouterr().out
    spec_cfg = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert spec_cfg["speculators_config"]["verifier"]["name_or_path"] == str(converted)
    for name in ("spec", "back"):
        _same(original, load_drafter(tmp_path / name, target, dtype=jnp.float32))
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (sglang / "model.safetensors").read_bytes()


def test_sglang_files_carry_what_sglang_reads(drafter_dir, tmp_path):
    src, sglang, _ = drafter_dir
    main(
        [
            "export-drafter",
            "--src",
            str(sglang),
            "--target",
            str(src),
            "--dst",
            str(tmp_path / "o"),
            "--format",
            "sglang",
        ]
    )
    cfg = json.loads((tmp_path / "o" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["torch_dtype"] == "bfloat16"
    assert cfg["draft_vocab_size"] == U and cfg["eagle_config"]["use_aux_hidden_state"] is True
    with safe_open(tmp_path / "o" / "model.safetensors", "numpy") as f:
        names = set(f.keys())
        assert f.get_slice("fc.weight").get_dtype() == "BF16"
        assert f.get_slice("d2t").get_dtype() == "I64" and f.get_slice("t2d").get_dtype() == "BOOL"
    assert {"fc.weight", "d2t", "t2d", "lm_head.weight", "norm.weight"} <= names
    assert any(n.startswith("midlayer.self_attn.") for n in names) and any(n.startswith("midlayer.mlp.") for n in names)


def test_target_for_drafter_reads_only_top_weights(hf_checkpoint, tmp_path):
    src = hf_checkpoint("kimi")[0]
    light, full = target_for_drafter(src, dtype=jnp.float32), load_target(src, dtype=jnp.float32)
    for key in ("embed", "lm_head", "final_norm"):
        got, want = light.params[key].get_value(), full.params[key].get_value()
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert not hasattr(light.params["moe_layers"]["attn"]["q_a"].get_value(), "addressable_shards")  # abstract
