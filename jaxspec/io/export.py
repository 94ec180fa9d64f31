"""Save a `Target` as a Hugging Face DeepseekV3 checkpoint, routed experts INT4 in compressed-tensors format.

The output is laid out like the published Kimi-K2.5 INT4 checkpoint (text model, flat DeepSeek-V3 config): every
weight under its HF name and shape, routed experts as `weight_packed` (int32, 8 values per word) + `weight_scale`
(bf16, one per group of `group_size` inputs) + `weight_shape`, and a `quantization_config` that compressed-tensors and
transformers read. It is the exact inverse of `jaxspec.io.hf.read_params` (through the same name table):
`load_target(save_target(t))` gives back the same weights (float experts are quantized on the way out with
`quant.quantize` when the config has a quant scheme).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from jaxspec.config import KimiConfig
from jaxspec.io.compressed_tensors import pack_int4
from jaxspec.io.hf import Tensor, expert_name, layer_table, top_table
from jaxspec.models import quant
from jaxspec.models.moe import EXPERT_PROJS
from jaxspec.pytree import get_path, unflatten

# Only routed experts are quantized, as in the published Kimi-K2 / K2.5 INT4 checkpoints.
KIMI_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tiktoken.model", "special_tokens_map.json")


def hf_config(cfg: KimiConfig, dtype=jnp.bfloat16) -> dict[str, Any]:
    """config.json for `cfg` in the flat DeepSeek-V3 layout (the inverse of `KimiConfig.from_hf_config`)."""
    out = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_attention_heads,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "n_routed_experts": cfg.n_routed_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "n_shared_experts": cfg.n_shared_experts,
        "first_k_dense_replace": cfg.first_k_dense_replace,
        "num_nextn_predict_layers": 0,  # MTP layers are not exported (HF's default would be 1)
        "moe_layer_freq": 1,
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "norm_topk_prob": cfg.norm_topk_prob,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": _rope_scaling(cfg),
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": False,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "torch_dtype": jnp.dtype(dtype).name,
    }
    if cfg.quant is not None:
        out["quantization_config"] = _quantization_config(cfg)
    return out


def _rope_scaling(cfg: KimiConfig) -> dict[str, Any] | None:
    if cfg.rope_scaling is None:
        return None
    r = cfg.rope_scaling
    rope = {
        "type": "yarn",
        "rope_type": "yarn",
        "factor": r.factor,
        "original_max_position_embeddings": r.original_max_position_embeddings,
        "beta_fast": r.beta_fast,
        "beta_slow": r.beta_slow,
        "mscale": r.mscale,
        "mscale_all_dim": r.mscale_all_dim,
    }
    if r.attention_factor is not None:
        rope["attention_factor"] = r.attention_factor
    return rope


def _quantization_config(cfg: KimiConfig) -> dict[str, Any]:
    """compressed-tensors pack-quantized INT4, group-wise symmetric, routed experts only (see KIMI_IGNORE)."""
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": cfg.quant.group_size,
                    "dynamic": False,
                    "observer": "minmax",
                },
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": list(KIMI_IGNORE),
        "kv_cache_scheme": None,
    }


def hf_tensors(cfg: KimiConfig, params: dict[str, Any], dtype=jnp.bfloat16) -> dict[str, np.ndarray]:
    """HF-named tensors from a nested dict shaped like `nnx.state(KimiModel)` (numpy or jax leaves), through the
    name table `jaxspec.io.hf.read_params` reads with."""
    np_dtype = np.dtype(jnp.dtype(dtype))
    cast = lambda a: np.ascontiguousarray(np.asarray(a, np.float32).astype(np_dtype))
    out = _write_rows(top_table(cfg), params, cast)
    k = cfg.first_k_dense_replace
    for layer in range(cfg.num_hidden_layers):
        moe = layer >= k
        stack = params["moe_layers" if moe else "dense_layers"]
        i = layer - k if moe else layer
        p = jax.tree.map(lambda a, i=i: a[i], stack)  # this layer's slice (Int4Array slices too)
        out.update(_write_rows(layer_table(cfg, moe), p, cast, prefix=f"model.layers.{layer}."))
        if moe:
            for proj in EXPERT_PROJS:
                out.update(_experts(cfg, layer, proj, p["mlp"][proj], cast))
    return out


def _write_rows(table: list[Tensor], params: dict[str, Any], cast, prefix: str = "") -> dict[str, np.ndarray]:
    out = {}
    for row in table:
        w = row.to_hf(*(get_path(params, path) for path in row.params))
        out[prefix + row.hf] = np.asarray(w, np.float32) if row.fp32 else cast(w)
    return out


def _experts(cfg: KimiConfig, layer: int, proj: str, w: Any, cast) -> dict[str, np.ndarray]:
    if not isinstance(w, quant.Int4Array) and cfg.quant is not None:
        w = quant.quantize(w, cfg.quant.group_size)
    out = {}
    for e in range(w.shape[0]):
        name = expert_name(layer, e, proj)
        if not isinstance(w, quant.Int4Array):
            out[f"{name}.weight"] = cast(np.asarray(w[e]).T)
            continue
        q_OI = np.asarray(w[e].values(jnp.int8)).T  # our [in, out] -> PyTorch [out, in]
        out[f"{name}.weight_packed"] = pack_int4(q_OI)
        out[f"{name}.weight_scale"] = np.ascontiguousarray(np.asarray(w.scale[e]).T)
        out[f"{name}.weight_shape"] = np.asarray(q_OI.shape, np.int32)
    return out


def save_target(target, path: str | Path, *, tokenizer_dir: str | Path | None = None, dtype=jnp.bfloat16) -> Path:
    """Write `target` to `path` as config.json + model.safetensors (+ the tokenizer files found in `tokenizer_dir`).

    Non-expert weights are written in `dtype` (FP8 ones dequantised); routed experts as INT4 (quantized here if they
    are float and the config has a quant scheme). The directory loads with `jaxspec.load_target` and with transformers +
    compressed-tensors.
    """
    path = Path(path)
    host = _host_tree(target.params)
    tensors = hf_tensors(target.config, host, dtype)
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / "model.safetensors.tmp"
    # safetensors writes raw buffers: every tensor must be C-contiguous (transposes and packs often are not).
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
    tmp.replace(path / "model.safetensors")  # never a half-written checkpoint under the real name
    (path / "config.json").write_text(json.dumps(hf_config(target.config, dtype), indent=2) + "\n")
    eos = target.config.eos_token_id
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}, indent=2) + "\n")
    if tokenizer_dir is not None:
        found = [f for f in TOKENIZER_FILES if (Path(tokenizer_dir) / f).is_file()]
        if not found:
            raise FileNotFoundError(f"tokenizer_dir {tokenizer_dir}: none of {TOKENIZER_FILES} found")
        for f in found:
            shutil.copyfile(Path(tokenizer_dir) / f, path / f)
    return path


def _host_tree(state) -> dict[str, Any]:
    """nnx.State -> nested dict of host arrays (Int4Array leaves kept whole; Fp8Array leaves dequantised to float32,
    exactly: the checkpoint written is unquantised, as its config.json says)."""
    host = lambda v: jax.device_get(v.dequantize(jnp.float32) if isinstance(v, quant.Fp8Array) else v)
    return unflatten((keys, host(var.get_value())) for keys, var in nnx.to_flat_state(state))
