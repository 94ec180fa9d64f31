"""Tiny random HF `DeepseekV3ForCausalLM` checkpoints: the independent reference for the target model."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

YARN = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}

# Kimi-like: n_group 1, sigmoid routing, yarn beta_fast 32. DeepSeek-V3-like: group-limited routing.
KINDS = {
    "kimi": dict(n_group=1, topk_group=1, routed_scaling_factor=2.827, rope_scaling=YARN),
    "dsv3": dict(
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        rope_scaling={**YARN, "factor": 8.0, "original_max_position_embeddings": 32},
    ),
}


def hf_config(kind: str, **overrides) -> DeepseekV3Config:
    kw = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=8,
        n_shared_experts=1,
        n_routed_experts=16,
        num_experts_per_tok=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        first_k_dense_replace=1,
        max_position_embeddings=1024,
        rope_theta=50000.0,
        rms_norm_eps=1e-5,
        bos_token_id=0,
        eos_token_id=1,
    )
    kw.update(KINDS[kind])
    kw.update(overrides)
    return DeepseekV3Config(**kw)


def make_hf_model(kind: str, seed: int = 0, **overrides) -> DeepseekV3ForCausalLM:
    """Random weights with non-trivial norms and router bias (HF initialises them to ones / zeros)."""
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(hf_config(kind, **overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0, 0.1)
    return model


def save_hf_model(kind: str, path: Path, seed: int = 0, **overrides) -> DeepseekV3ForCausalLM:
    model = make_hf_model(kind, seed, **overrides)
    model.save_pretrained(path)
    return model
