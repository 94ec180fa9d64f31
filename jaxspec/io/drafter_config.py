"""EAGLE-3 drafter `config.json`s: SGLang/SpecForge, speculators/vLLM and MLA (Eagle3DeepseekV2), read into an
`Eagle3Config` checked against the target (`read_drafter_config`) and written back (`hf_config`).

Capture-layer ids: the internal convention is the target's (`jaxspec/models/kimi.py`): id k = the residual stream at
the OUTPUT of target layer k, 0-indexed. SGLang/SpecForge ids (`eagle_config.eagle_aux_hidden_state_layer_ids`) use it
already; speculators/vLLM ids (top-level `eagle_aux_hidden_state_layer_ids`) name the INPUT of layer j, i.e. internal
j - 1. The tensors of those checkpoints are `drafter_hf.py`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

import jax.numpy as jnp

from jaxspec.config import ConfigError, KimiConfig, read_rope
from jaxspec.models.eagle3 import DraftRope, Eagle3Config

SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"
# MLA drafters (one DeepSeek-V3 MLA decoder layer; vLLM's `deepseek_eagle3` names them, V3 is an alias).
MLA_ARCHITECTURES = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")
MLA_MODEL_TYPES = ("kimi_k2", "deepseek_v3", "deepseek_v2")
SPECULATORS_TYPE = "eagle3"
# EAGLE 3.1 flags (all default to off; `Eagle3Config` says what each does). A config may set them at its top level,
# in speculators' `transformer_layer_config` or in `eagle_config` (NVIDIA's checkpoints put norm_before_fc there).
EAGLE31_FLAGS = ("fc_norm", "norm_before_fc", "norm_output")
FLAG_ALIASES = {"use_aux_norm": "fc_norm"}  # the older name of fc_norm (same weights, fc_norm.{i}.weight)
# Published variant flags this port does not implement; refused by name when set.
UNSUPPORTED_FLAGS = ("tie_word_embeddings",)


Convention = Literal["output", "input"]
Format = Literal["sglang", "speculators", "mla"]


def read_drafter_config(
    cfg: Mapping[str, Any],
    *,
    target_config: KimiConfig,
    capture_convention: Convention | None = None,
) -> Eagle3Config:
    """Parse an SGLang/SpecForge or speculators `config.json` and check it against the target's config.

    `capture_convention` states how the checkpoint's layer ids are meant ("output" of layer k, or "input" of
    layer j); without it the format decides, and a config whose convention cannot be determined is refused.
    """
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"drafter config: expected a JSON object, got {type(cfg).__name__}")
    if capture_convention not in (None, "output", "input"):
        raise ConfigError(f"capture_convention: expected 'output', 'input' or None, got {capture_convention!r}")
    layer, fmt = _layer_and_format(cfg)
    problems = _unsupported(cfg, layer, fmt)
    flags = _eagle31_flags(cfg, layer, problems)

    def req(name: str) -> Any:
        if not isinstance(layer.get(name), int) or isinstance(layer.get(name), bool) or layer[name] <= 0:
            problems.append(f"{name}: expected a positive integer, got {layer.get(name)!r}")
            return 1
        return layer[name]

    D, F, N, V = req("hidden_size"), req("intermediate_size"), req("num_attention_heads"), req("vocab_size")
    O = N if fmt == "mla" else layer.get("num_key_value_heads") or N  # noqa: E741
    mla = _read_mla(layer, target_config, D, N, problems) if fmt == "mla" else None
    if N % O:
        problems.append(f"num_key_value_heads: {O} must divide num_attention_heads={N}")
    U = cfg.get("draft_vocab_size") or layer.get("draft_vocab_size") or V
    Dt = cfg.get("target_hidden_size") or layer.get("target_hidden_size") or D
    problems += _target_misfits(target_config, V, U, Dt)
    try:
        draft_rope = _read_draft_rope(layer)
    except ConfigError as e:
        problems.append(str(e))
        draft_rope = DraftRope(10000.0)
    layers, convention = _capture_layers(cfg, fmt, target_config.num_hidden_layers, capture_convention, problems)
    if problems:
        raise ConfigError("drafter config does not fit the target:\n  " + "\n  ".join(problems))
    return Eagle3Config(
        hidden_size=D,
        intermediate_size=F,
        num_attention_heads=N,
        num_key_value_heads=O,
        head_dim=mla.qk_head_dim if mla is not None else layer.get("head_dim") or D // N,
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        vocab_size=V,
        draft_vocab_size=U,
        target_hidden_size=Dt,
        rope=draft_rope,
        max_position_embeddings=int(layer.get("max_position_embeddings", 2048)),
        capture_layers=layers,
        capture_convention=convention,
        norm_before_residual=bool(cfg.get("norm_before_residual") or layer.get("norm_before_residual")),
        **flags,
        format=fmt,
        mla=mla,
    )


def _target_misfits(target: KimiConfig, V: int, U: int, Dt: int) -> list[str]:
    """Problems with the drafter's vocabulary (V), draft vocabulary (U) and target hidden size (Dt) for `target`."""
    problems = []
    if V != target.vocab_size:
        problems.append(f"vocab_size: drafter has {V}, target has {target.vocab_size}")
    if not 0 < U <= V:
        problems.append(f"draft_vocab_size: expected 1..vocab_size={V}, got {U}")
    if Dt != target.hidden_size:
        problems.append(f"target_hidden_size: drafter expects {Dt}, target hidden_size is {target.hidden_size}")
    return problems


def _layer_and_format(cfg: Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
    """(the mapping holding the decoder layer's fields, the checkpoint format) of a drafter `config.json`."""
    archs = list(cfg.get("architectures") or [])
    if "speculators_model_type" in cfg:
        if cfg["speculators_model_type"] != SPECULATORS_TYPE:
            raise ConfigError(
                f"speculators_model_type: {cfg['speculators_model_type']!r} is not supported "
                f"(expected {SPECULATORS_TYPE!r})"
            )
        layer = cfg.get("transformer_layer_config")
        if not isinstance(layer, Mapping):
            raise ConfigError("transformer_layer_config: a speculators eagle3 config needs this nested object")
        return layer, "speculators"
    if SGLANG_ARCHITECTURE in archs:
        return cfg, "sglang"
    if any(a in MLA_ARCHITECTURES for a in archs):
        return cfg, "mla"
    raise ConfigError(
        f"architectures: {archs} is not a supported EAGLE-3 drafter (expected [{SGLANG_ARCHITECTURE!r}] "
        f"for SGLang/SpecForge, one of {list(MLA_ARCHITECTURES)} for an MLA drafter, or a speculators config "
        f"with speculators_model_type {SPECULATORS_TYPE!r})"
    )


def _unsupported(cfg: Mapping[str, Any], layer: Mapping[str, Any], fmt: str) -> list[str]:
    """Problems with the architecture variant: model type, activation, layer count, biases, variant flags."""
    problems = []
    if fmt == "mla" and layer.get("model_type", "deepseek_v3") not in MLA_MODEL_TYPES:
        problems.append(f"model_type: an MLA drafter needs one of {list(MLA_MODEL_TYPES)}, got {layer['model_type']!r}")
    checks = (("hidden_act", "silu"), ("num_hidden_layers", 1)) + ((("model_type", "llama"),) if fmt != "mla" else ())
    for name, expected in checks:
        if layer.get(name, expected) != expected:
            problems.append(f"{name}: only {expected!r} is supported, got {layer[name]!r}")
    for name in ("attention_bias", "mlp_bias"):
        if layer.get(name):
            problems.append(f"{name}: biases are not supported (published EAGLE-3 drafters have none)")
    for name in UNSUPPORTED_FLAGS:
        if cfg.get(name) or layer.get(name):
            problems.append(
                f"{name}: true is not supported (the drafter's lm_head would be its embedding; published EAGLE-3 "
                "drafters have their own lm_head)"
            )
    eagle = cfg.get("eagle_config") or {}
    if not eagle.get("use_aux_hidden_state", True):
        problems.append("eagle_config.use_aux_hidden_state: false (an EAGLE-1/2 drafter) is not supported")
    return problems


def _eagle31_flags(cfg: Mapping[str, Any], layer: Mapping[str, Any], problems: list[str]) -> dict[str, bool]:
    """The EAGLE 3.1 flags ({fc_norm, norm_before_fc, norm_output}: bool), from wherever the config sets them."""
    places = {"": cfg, "eagle_config.": cfg.get("eagle_config") or {}}
    if layer is not cfg:  # speculators
        places["transformer_layer_config."] = layer
    flags = dict.fromkeys(EAGLE31_FLAGS, False)
    for name in (*EAGLE31_FLAGS, *FLAG_ALIASES):
        found = {where + name: m[name] for where, m in places.items() if m.get(name) is not None}
        bad = {k: v for k, v in found.items() if type(v) is not bool}
        if bad:
            problems.append(f"{', '.join(bad)}: expected true or false, got {', '.join(map(repr, bad.values()))}")
        elif len(set(found.values())) > 1:
            problems.append(f"{name}: set differently in {' and '.join(found)} ({list(found.values())})")
        elif any(found.values()):
            flags[FLAG_ALIASES.get(name, name)] = True
    if flags["fc_norm"] and flags["norm_before_fc"]:
        problems.append(
            "norm_before_fc and fc_norm: both set; they are exclusive (one RMSNorm over the concatenated captured "
            "states, or one per state)"
        )
    return flags


def _read_mla(layer: Mapping[str, Any], target: KimiConfig, D: int, N: int, problems: list[str]) -> KimiConfig | None:
    """The MLA drafter's attention as a KimiConfig (the target's, with the drafter's attention fields)."""
    if layer.get("q_lora_rank") is None:
        problems.append("q_lora_rank: an MLA drafter without a query LoRA (q_proj) is not supported")
        return None
    fields = {}
    for name in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        v = layer.get(name)
        if type(v) is not int or v <= 0:
            problems.append(f"{name}: an MLA drafter needs a positive integer, got {v!r}")
            return None
        fields[name] = v
    kv_heads = layer.get("num_key_value_heads", N)
    if kv_heads != N:
        problems.append(f"num_key_value_heads: MLA expects {N} (= num_attention_heads), got {kv_heads}")
    try:
        theta, scaling = read_rope(layer)
        return target.replace(  # the drafter's attention weights are unquantised, whatever the target's
            hidden_size=D,
            num_attention_heads=N,
            fp8=None,
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(layer.get("max_position_embeddings", target.max_position_embeddings)),
            **fields,
        )
    except ConfigError as e:
        problems.append(str(e))
        return None


def draft_config_for(target: KimiConfig, *, heads: int = 8, kv_heads: int = 4, capture_layers=None) -> Eagle3Config:
    """A one-layer drafter config sized for `target` (same hidden size, full vocabulary), e.g. to train from scratch
    or as a random drafter. Capture layers default to the outputs of [1, L//2-1, L-4] (first/middle/last for targets
    too shallow for that)."""
    L = target.num_hidden_layers
    ids = capture_layers or (default_capture_layers(L) if L >= 8 else tuple(sorted({0, L // 2, L - 1})))
    return read_drafter_config(
        {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_size": target.hidden_size,
            "intermediate_size": 2 * target.hidden_size,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "num_hidden_layers": 1,
            "vocab_size": target.vocab_size,
            "rms_norm_eps": target.rms_norm_eps,
            "rope_theta": 10000.0,
            "max_position_embeddings": target.max_position_embeddings,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(ids)},
        },
        target_config=target,
    )


def default_capture_layers(num_layers: int) -> tuple[int, ...]:
    """SGLang/vLLM/speculators default: inputs of layers [2, L//2, L-3] = outputs of [1, L//2-1, L-4]."""
    return (1, num_layers // 2 - 1, num_layers - 4)


def _capture_layers(
    cfg: Mapping[str, Any], fmt: str, L: int, override: Convention | None, problems: list[str]
) -> tuple[tuple[int, ...], str]:
    """Internal (output-of-layer-k, ascending) capture ids and the convention they were read with."""
    nested = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    top = cfg.get("eagle_aux_hidden_state_layer_ids")
    # Each field's convention. SGLang reads eagle_config ids as outputs (it captures the input of layer k + 1).
    # speculators/vLLM read top-level ids as inputs; in a flat SGLang-style config a top-level list is ambiguous
    # (vLLM reads it as inputs, SGLang ignores it, and SpecForge output ids have been put there too).
    # MLA drafters (vLLM's Eagle3DeepseekV2ForCausalLM) are served by vLLM, which reads either field as input ids:
    # the published Kimi-K2.5 MLA drafter's [2, 30, 58] are the inputs of those layers = outputs of [1, 29, 57].
    fields = [
        ("eagle_config.eagle_aux_hidden_state_layer_ids", nested, "input" if fmt == "mla" else "output"),
        ("eagle_aux_hidden_state_layer_ids", top, "input" if fmt in ("speculators", "mla") else None),
    ]
    found = [(field, ids, override or conv) for field, ids, conv in fields if ids]
    if not found:
        ids = default_capture_layers(L)
        if min(ids) < 0 or len(set(ids)) < len(ids):
            problems.append(
                f"eagle_aux_hidden_state_layer_ids: absent, and the default outputs of {list(ids)} do not fit a "
                f"target with {L} layers; state the ids in the drafter config"
            )
        return tuple(sorted(ids)), "default"
    results = []
    for field, ids, conv in found:
        if conv is None:
            problems.append(
                f"{field}: {ids} at the top level of a {fmt} config is ambiguous (vLLM reads input-of-layer ids, "
                "SGLang ignores it); pass capture_convention='output' or 'input'"
            )
        elif not isinstance(ids, list | tuple) or not all(type(i) is int for i in ids):
            problems.append(f"{field}: expected a list of integers, got {ids!r}")
        else:
            lo = 1 if conv == "input" else 0  # input of layer 0 is the embedding output: never captured
            bad = [i for i in ids if not lo <= i < L + lo]
            if bad:
                problems.append(f"{field}: {bad} out of range [{lo}, {L + lo}) for {conv}-of-layer ids ({L} layers)")
            elif len(set(ids)) != len(ids):
                problems.append(f"{field}: duplicate layer ids {list(ids)}")
            results.append((field, tuple(sorted(i - lo for i in ids)), conv))
    if len({internal for _, internal, _ in results}) > 1:
        problems.append("layer ids disagree: " + "; ".join(f"{f} -> outputs of {list(i)}" for f, i, _ in results))
    return (results[0][1], results[0][2]) if results else ((), "default")


def _read_draft_rope(layer: Mapping[str, Any]) -> DraftRope:
    params = dict(layer.get("rope_parameters") or {})
    scaling = dict(layer.get("rope_scaling") or {}) or params
    theta = float(layer.get("rope_theta", params.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"rope partial_rotary_factor: only 1.0 is supported, got {scaling['partial_rotary_factor']}")
    orig = scaling.get("original_max_position_embeddings") or layer.get("max_position_embeddings")  # HF default
    if kind == "default":
        return DraftRope(theta)
    if kind == "linear":
        return DraftRope(theta, "linear", factor=float(scaling["factor"]))
    if kind == "llama3":
        return DraftRope(
            theta,
            "llama3",
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(orig),
        )
    if kind == "yarn":
        _, yarn = read_rope(
            {"rope_theta": theta, "rope_scaling": {**scaling, "original_max_position_embeddings": orig}}
        )
        return DraftRope(theta, "yarn", yarn=yarn)
    raise ConfigError(f"rope_scaling.rope_type: {kind!r} is not supported (expected default, linear, llama3 or yarn)")


# ----------------------------------------------------------------------------------------------- the model


def rope_parameters(rope: DraftRope) -> dict[str, Any]:
    """The drafter RoPE's `rope_parameters` dict (transformers >= 5 layout, theta inside)."""
    out: dict[str, Any] = {"rope_theta": rope.theta, "rope_type": rope.kind}
    if rope.kind in ("linear", "llama3"):
        out["factor"] = rope.factor
    if rope.kind == "llama3":
        out.update(
            low_freq_factor=rope.low_freq_factor,
            high_freq_factor=rope.high_freq_factor,
            original_max_position_embeddings=rope.original_max_position_embeddings,
        )
    if rope.yarn is not None:
        out.update({k: v for k, v in dataclasses.asdict(rope.yarn).items() if v is not None})
    return out


def _mla_hf_config(cfg: Eagle3Config, layer: dict[str, Any], dtype_name: str) -> dict[str, Any]:
    """vLLM's Eagle3DeepseekV2ForCausalLM layout: DeepSeek-V3 attention fields; layer ids as inputs of layer k + 1."""
    m = cfg.mla
    rope = None
    if m.rope_scaling is not None:
        rope = {"type": "yarn", **{k: v for k, v in dataclasses.asdict(m.rope_scaling).items() if v is not None}}
    return {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"],
        **{k: v for k, v in layer.items() if k not in ("head_dim", "num_key_value_heads")},
        "model_type": "deepseek_v3",
        "num_key_value_heads": m.num_attention_heads,
        "q_lora_rank": m.q_lora_rank,
        "kv_lora_rank": m.kv_lora_rank,
        "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_rope_head_dim,
        "v_head_dim": m.v_head_dim,
        "rope_theta": m.rope_theta,
        "rope_scaling": rope,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": cfg.norm_before_residual,
        **_set_flags(cfg),
        "torch_dtype": dtype_name,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [k + 1 for k in cfg.capture_layers],
            "use_aux_hidden_state": True,
        },
    }


def _set_flags(cfg: Eagle3Config) -> dict[str, bool]:
    """The EAGLE 3.1 flags this drafter sets, as SGLang and vLLM read them (top level; absent means off)."""
    return {name: True for name in EAGLE31_FLAGS if getattr(cfg, name)}


def hf_config(cfg: Eagle3Config, format: Format, dtype=jnp.bfloat16, verifier: str | None = None) -> dict[str, Any]:
    """config.json contents for `cfg` in the given format (the inverse of `read_drafter_config`)."""
    layer = {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }
    rope, dtype_name = rope_parameters(cfg.rope), jnp.dtype(dtype).name
    if format == "mla":
        return _mla_hf_config(cfg, layer, dtype_name)
    common = {
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": cfg.norm_before_residual,
    }
    if format == "sglang":
        theta = rope.pop("rope_theta")
        return {
            "architectures": [SGLANG_ARCHITECTURE],
            **layer,
            "rope_theta": theta,
            "rope_scaling": None if rope["rope_type"] == "default" else rope,
            **common,
            **_set_flags(cfg),
            "torch_dtype": dtype_name,
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": list(cfg.capture_layers),
                "use_aux_hidden_state": True,
            },
        }
    return {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": SPECULATORS_TYPE,
        **common,
        **{name: getattr(cfg, name) for name in EAGLE31_FLAGS},  # speculators writes all three
        "eagle_aux_hidden_state_layer_ids": [k + 1 for k in cfg.capture_layers],  # inputs of layer k + 1
        "transformer_layer_config": {**layer, "rope_parameters": rope},
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "verifier": {"name_or_path": verifier, "architectures": ["DeepseekV3ForCausalLM"]},
        },
        "dtype": dtype_name,
        "tie_word_embeddings": False,
    }
