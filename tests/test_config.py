import json

import pytest

from jaxspec.config import ConfigError, KimiConfig
from tests.reference.hf_tiny import hf_config

K25_TEXT = {
    "model_type": "kimi_k2",
    "vocab_size": 163840,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 384,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.827,
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 50000.0,
    "max_position_embeddings": 262144,
    "rope_scaling": {
        "type": "yarn",
        "factor": 64.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "quantization_config": {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32},
            }
        },
        "ignore": ["lm_head", "re:.*self_attn.*"],
    },
}
K25 = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "model_type": "kimi_k25",
    "text_config": K25_TEXT,
    "tie_word_embeddings": False,
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "pad_token_id": 163839,
}


def test_k25_nested_layout_equals_preset():
    assert KimiConfig.from_hf_config(K25) == KimiConfig.preset("kimi-k2.5")


def test_k26_config_loads_as_the_preset():
    """Kimi-K2.6's config.json has K2.5's layout and values (its model card: the architecture is unchanged); the
    `kimi-k2.6` preset is that config."""
    k26 = json.loads(json.dumps(K25))
    assert KimiConfig.from_hf_config(k26) == KimiConfig.preset("kimi-k2.6") == KimiConfig.preset("kimi-k2.5")
    # A field jaxspec cannot honour in a K2.6 config is refused by name, as in K2.5's.
    k26["text_config"]["attention_bias"] = True
    with pytest.raises(ConfigError, match=r"attention_bias: only false is supported"):
        KimiConfig.from_hf_config(k26)


def test_flat_k2_layout_with_top_level_quant():
    flat = {k: v for k, v in K25_TEXT.items() if k != "quantization_config"}
    flat |= {
        "model_type": "deepseek_v3",
        "quantization_config": K25_TEXT["quantization_config"],
        "bos_token_id": 163584,
        "eos_token_id": 163585,
        "pad_token_id": 163839,
    }
    assert KimiConfig.from_hf_config(flat) == KimiConfig.preset("kimi-k2.5")


def test_transformers5_rope_parameters_layout():
    cfg = KimiConfig.from_hf_config(json.loads(hf_config("dsv3").to_json_string()))
    assert cfg.rope_theta == 50000.0 and cfg.rope_scaling.factor == 8.0
    assert (cfg.n_group, cfg.topk_group, cfg.quant) == (4, 2, None)


def test_softmax_scale_matches_spec():
    assert KimiConfig.preset("kimi-k2.5").softmax_scale == pytest.approx(0.1446796, abs=1e-7)


def test_beta_fast_is_read_not_assumed():
    text = dict(K25_TEXT, rope_scaling=dict(K25_TEXT["rope_scaling"], beta_fast=1.0))
    assert KimiConfig.from_hf_config(dict(K25, text_config=text)).rope_scaling.beta_fast == 1.0


@pytest.mark.parametrize(
    "change, match",
    [
        ({"model_type": "llama"}, "model_type: 'llama' is not supported"),
        ({"hidden_size": None}, "hidden_size: required field missing"),
        ({"kv_lora_rank": None}, "kv_lora_rank: required field missing"),
        ({"n_group": 5}, "n_group: 5 must divide n_routed_experts"),
        ({"num_key_value_heads": 8}, "num_key_value_heads: MLA expects 64"),
        ({"scoring_func": "softmax"}, "scoring_func: only 'sigmoid'"),
        ({"vocab_size": "big"}, "vocab_size: expected an integer"),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "original_max_position_embeddings: required"),
    ],
)
def test_bad_config_names_the_field(change, match):
    text = {k: v for k, v in {**K25_TEXT, **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=match):
        KimiConfig.from_hf_config(dict(K25, text_config=text))


def test_unknown_top_level_model_type():
    with pytest.raises(ConfigError, match="model_type: 'bert'"):
        KimiConfig.from_hf_config({"model_type": "bert"})


def test_bad_quantization_config():
    q = json.loads(json.dumps(K25_TEXT["quantization_config"]))
    q["config_groups"]["group_0"]["weights"].update(num_bits=8, strategy="channel")
    with pytest.raises(ConfigError, match=r"num_bits=8 .*strategy='channel'"):
        KimiConfig.from_hf_config(dict(K25, text_config=dict(K25_TEXT, quantization_config=q)))


def test_missing_config_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        KimiConfig.from_pretrained(tmp_path)


# Moonlight-16B-A3B's config.json (moonshotai/Moonlight-16B-A3B; sources in the preset's comment, jaxspec/config.py):
# every field but auto_map, ep_size and transformers_version, which the loader does not read.
MOONLIGHT = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 11264,
    "kv_lora_rank": 512,
    "max_position_embeddings": 8192,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 1408,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "norm_topk_prob": True,
    "num_attention_heads": 16,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 27,
    "num_key_value_heads": 16,
    "num_nextn_predict_layers": 0,
    "pretraining_tp": 1,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.446,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 163840,
}


def test_moonlight_config_reads_as_the_preset():
    assert KimiConfig.from_hf_config(MOONLIGHT) == KimiConfig.preset("moonlight-16b-a3b")


# DeepSeek-V3's config.json (deepseek-ai/DeepSeek-V3; sources in the preset's comment, jaxspec/config.py): every field
# the loader reads.
DEEPSEEK_V3 = {
    **{k: v for k, v in MOONLIGHT.items() if k not in ("seq_aux", "pretraining_tp")},
    "bos_token_id": 0,
    "eos_token_id": 1,
    "first_k_dense_replace": 3,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "topk_group": 4,
    "vocab_size": 129280,
}


def test_deepseek_v3_config_reads_as_the_preset():
    assert KimiConfig.from_hf_config(DEEPSEEK_V3) == KimiConfig.preset("deepseek-v3")
    static = {**DEEPSEEK_V3, "quantization_config": {**DEEPSEEK_V3["quantization_config"], "activation_scheme": "x"}}
    with pytest.raises(ConfigError, match=r"^quantization_config\.activation_scheme: 'x' is not supported"):
        KimiConfig.from_hf_config(static)


def test_mtp_layer_count_is_read():
    assert KimiConfig.from_hf_config({**MOONLIGHT, "num_nextn_predict_layers": 1}).num_nextn_predict_layers == 1
    mtp = {**{k: v for k, v in MOONLIGHT.items() if k != "num_nextn_predict_layers"}, "num_mtp_layers": 2}
    assert KimiConfig.from_hf_config(mtp).num_nextn_predict_layers == 2  # transformers 5 spelling


@pytest.mark.parametrize(
    "changes, pattern",
    [
        ({"model_type": "deepseek_v2"}, r"^model_type: 'deepseek_v2' is not supported"),
        ({"attention_bias": True}, r"^attention_bias: only false is supported"),
        ({"rope_interleave": False}, r"^rope_interleave: only true is supported"),
        ({"q_lora_rank": 0}, r"^q_lora_rank: expected a positive integer, got 0"),
        ({"q_lora_rank": "big"}, r"^q_lora_rank: expected an integer"),
        ({"rope_theta": -5.0}, r"^rope_theta: expected a positive finite number"),
        ({"num_nextn_predict_layers": -1}, r"^num_nextn_predict_layers: expected an integer >= 0"),
        ({"n_routed_experts": 4, "n_group": 4, "topk_group": 1, "num_experts_per_tok": 1}, r"^n_group: .*at least 2"),
    ],
)
def test_unsupported_fields_are_named(changes, pattern):
    with pytest.raises(ConfigError, match=pattern):
        KimiConfig.from_hf_config({**MOONLIGHT, **changes})


def test_q_lora_rank_must_be_stated():
    cfg = {k: v for k, v in MOONLIGHT.items() if k != "q_lora_rank"}
    with pytest.raises(ConfigError, match=r"^q_lora_rank: required field missing .*null for q_proj"):
        KimiConfig.from_hf_config(cfg)
