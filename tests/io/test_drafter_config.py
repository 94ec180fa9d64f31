"""Drafter config.json reading over the space of EAGLE 3.1 flag settings users meet (hypothesis): every format, each
flag absent / false / true / not a boolean, set at the top level, in `eagle_config` or (speculators) in
`transformer_layer_config`, with its older alias `use_aux_norm`. Which settings must be refused is stated here
(`expected`), independently of jaxspec's checks; accepted ones must parse to the flags the config states and
survive an export round trip (`hf_config`). Pure config parsing: no compiles, fast.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from jaxspec.config import ConfigError, KimiConfig
from jaxspec.io.drafter_config import hf_config, read_drafter_config

KIMI = KimiConfig.preset("kimi-k2.5")
FLAGS = ("fc_norm", "use_aux_norm", "norm_before_fc", "norm_output", "tie_word_embeddings")

LAYER = {
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
# The published Kimi MLA drafter's fields (lightseekorg/kimi-k2.5-eagle3-mla; the K2.6 EAGLE 3.1 one adds the flags).
MLA = {
    "architectures": ["Eagle3DeepseekV2ForCausalLM"],
    "model_type": "kimi_k2",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "num_hidden_layers": 1,
    "vocab_size": 163840,
    "draft_vocab_size": 163840,
    "rms_norm_eps": 1e-5,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "rope_theta": 50000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 64.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "max_position_embeddings": 262144,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 58], "use_aux_hidden_state": True},
}


def base(fmt: str) -> dict:
    if fmt == "sglang":
        return {"architectures": ["LlamaForCausalLMEagle3"], **LAYER, "eagle_config": {}}
    if fmt == "speculators":
        return {"speculators_model_type": "eagle3", "transformer_layer_config": dict(LAYER), "eagle_config": {}}
    return {**MLA, "eagle_config": dict(MLA["eagle_config"])}


@st.composite
def flagged_configs(draw) -> tuple[str, dict, dict[str, list]]:
    """(format, config.json, {flag: the values it was given}), the flags set in random places."""
    fmt = draw(st.sampled_from(["sglang", "speculators", "mla"]))
    cfg = base(fmt)
    places = {"top": cfg, "eagle_config": cfg["eagle_config"]}
    if fmt == "speculators":
        places["layer"] = cfg["transformer_layer_config"]
    given_values: dict[str, list] = {}
    for name in FLAGS:
        # tie_word_embeddings is a model field, never in eagle_config
        where = [p for p in places if not (name == "tie_word_embeddings" and p == "eagle_config")]
        count = draw(st.sampled_from([0, 0, 1, 1, 2] if name != "tie_word_embeddings" else [0, 0, 0, 1]))
        for place in draw(
            st.lists(st.sampled_from(where), unique=True, min_size=min(count, len(where)), max_size=count)
        ):
            value = draw(st.sampled_from([False, True, True, None]))
            if draw(st.integers(0, 24)) == 0:  # now and then a value that is not a boolean
                value = draw(st.sampled_from(["true", 1]))
            places[place][name] = value
            if value is not None:
                given_values.setdefault(name, []).append(value)
    return fmt, cfg, given_values


def expected(given_values: dict[str, list]) -> tuple[list[str], dict[str, bool]]:
    """(fields the config must be refused for, the flags an accepted config must parse to)."""
    refused = [n for n, vs in given_values.items() if any(type(v) is not bool for v in vs) or len(set(vs)) > 1]
    on = {n for n, vs in given_values.items() if vs and all(v is True for v in vs)}
    if "tie_word_embeddings" in on:
        refused.append("tie_word_embeddings")
    fc_norm = bool(on & {"fc_norm", "use_aux_norm"})
    if fc_norm and "norm_before_fc" in on:
        refused.append("norm_before_fc")
    return refused, {"fc_norm": fc_norm, "norm_before_fc": "norm_before_fc" in on, "norm_output": "norm_output" in on}


@settings(max_examples=150, deadline=None, derandomize=True)
@given(flagged_configs())
def test_eagle31_flags_load_or_are_refused_by_name(case):
    fmt, cfg, given_values = case
    refused, flags = expected(given_values)
    event(f"{fmt}: " + ("refused" if refused else "accepted, " + "+".join(n for n, on in flags.items() if on)))
    if refused:
        with pytest.raises(ConfigError) as err:
            read_drafter_config(cfg, target_config=KIMI)
        for name in refused:
            assert name in str(err.value), (name, str(err.value))
        return
    parsed = read_drafter_config(cfg, target_config=KIMI)
    assert {name: getattr(parsed, name) for name in flags} == flags
    again = read_drafter_config(hf_config(parsed, fmt), target_config=KIMI)
    assert again == dataclasses.replace(parsed, capture_convention=again.capture_convention)
    assert again.capture_layers == parsed.capture_layers == (1, 29, 57)


def test_published_kimi_k26_eagle31_mla_config():
    """lightseekorg/kimi-k2.6-eagle3.1-mla: the K2.5 MLA drafter's fields plus fc_norm and norm_output, captured at
    the inputs of layers [2, 30, 58] (outputs of 1, 29, 57), for the Kimi-K2.6 target."""
    cfg = read_drafter_config(
        {**MLA, "fc_norm": True, "norm_output": True}, target_config=KimiConfig.preset("kimi-k2.6")
    )
    assert cfg.format == "mla" and cfg.fc_norm and cfg.norm_output and not cfg.norm_before_fc
    assert cfg.capture_layers == (1, 29, 57) and cfg.capture_convention == "input" and cfg.full_vocab
