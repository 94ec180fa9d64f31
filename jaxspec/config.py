"""Model configuration: frozen dataclasses read from HF `config.json`, presets, and validation.

`KimiConfig.from_hf_config` accepts the Kimi-K2.5 layout (multimodal, text fields nested in `text_config`,
`quantization_config` inside it) and the flat Kimi-K2 / K2-Thinking / DeepSeek-V3 layout. Every field is read from the
file; model code never hard-codes a Kimi value.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# HF builds q_a_layernorm / kv_a_layernorm with its RMSNorm default eps (1e-6), not the config's rms_norm_eps.
# vLLM/SGLang use the config eps; we follow HF for parity (spec: kimi-k2.5.md, Reference math).
LATENT_NORM_EPS = 1e-6
# How the target's latent KV cache is stored: "auto" in the compute dtype, "fp8" as float8_e4m3fn with a float32
# scale per token (jaxspec/models/mla.py, "FP8 cache").
KV_CACHE_DTYPES = ("auto", "fp8")
INT4_EXPERTS = ("auto", "packed", "dense")  # how an INT4 checkpoint's routed experts are held (io/load.py)

TEXT_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
MULTIMODAL_MODEL_TYPES = ("kimi_k25", "kimi_vl")


class ConfigError(ValueError):
    """A config.json that cannot describe a supported model; the message names the field."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters (`rope_scaling` / `rope_parameters` with type "yarn")."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclasses.dataclass(frozen=True)
class Int4Quant:
    """compressed-tensors pack-quantized INT4 (symmetric, group strategy) for the routed experts."""

    group_size: int = 32
    num_bits: int = 4


@dataclasses.dataclass(frozen=True)
class Fp8Quant:
    """Block-FP8 linear weights (DeepSeek-V3's `quant_method: fp8`): float8_e4m3fn values, one float32 scale
    (`weight_scale_inv`) per `block` = (rows, cols) of PyTorch's [out, in] weight (jaxspec/models/quant.py)."""

    block: tuple[int, int] = (128, 128)


@dataclasses.dataclass(frozen=True)
class KimiConfig:
    """The text model of Kimi-K2.5 / K2 / DeepSeek-V3 (DeepseekV3ForCausalLM semantics)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None  # None: one q_proj [D -> N*(H+R)] (DeepSeek-V2-Lite / Moonlight), no query latent
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    first_k_dense_replace: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: RopeScaling | None = None
    quant: Int4Quant | None = None
    # block-FP8 attention, dense/shared MLP and routed-expert weights, kept FP8 on the device (None: unquantised)
    fp8: Fp8Quant | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    # DeepSeek-V3's multi-token-prediction layers, stored after the decoder layers (model.layers.{L..L+n-1}); unused.
    num_nextn_predict_layers: int = 0

    def __post_init__(self) -> None:
        self._check_numbers()
        for ok, name, msg in self._relations():
            if not ok:
                raise ConfigError(f"{name}: {msg}")

    def _check_numbers(self) -> None:
        """Each numeric field on its own: integers in range, finite positive floats."""
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type != "int" and not (f.name == "q_lora_rank" and v is not None):
                continue
            low = 0 if f.name in ("first_k_dense_replace", "num_nextn_predict_layers") else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ConfigError(f"{f.name}: expected {'a positive integer' if low else 'an integer >= 0'}, got {v!r}")
        for name in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
                raise ConfigError(f"{name}: expected a positive finite number, got {v!r}")
        if not (isinstance(self.routed_scaling_factor, int | float) and math.isfinite(self.routed_scaling_factor)):
            raise ConfigError(f"routed_scaling_factor: expected a finite number, got {self.routed_scaling_factor!r}")

    def _relations(self) -> list[tuple[bool, str, str]]:
        """(holds, field to blame, message) for every constraint between fields."""
        checks = [
            (
                self.n_routed_experts % self.n_group == 0,
                "n_group",
                f"{self.n_group} must divide n_routed_experts",
            ),
            (
                self.topk_group <= self.n_group,
                "topk_group",
                f"{self.topk_group} exceeds n_group={self.n_group}",
            ),
            (
                # HF's group score is the sum of each group's two best experts (torch.topk(2) per group).
                self.n_routed_experts // self.n_group >= 2,
                "n_group",
                f"{self.n_group} leaves {self.n_routed_experts // self.n_group} expert(s) per group; "
                "group-limited routing scores each group by its top 2, so each group needs at least 2",
            ),
            (
                self.num_experts_per_tok <= self.n_routed_experts // self.n_group * self.topk_group,
                "num_experts_per_tok",
                f"{self.num_experts_per_tok} exceeds the experts in the kept groups",
            ),
            (
                0 <= self.first_k_dense_replace <= self.num_hidden_layers,
                "first_k_dense_replace",
                f"{self.first_k_dense_replace} not in [0, num_hidden_layers={self.num_hidden_layers}]",
            ),
            (self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", f"{self.qk_rope_head_dim} must be even"),
        ]
        if self.quant is not None:
            g = self.quant.group_size
            checks += [
                (self.hidden_size % g == 0, "quantization_config.group_size", f"{g} must divide hidden_size"),
                (
                    self.moe_intermediate_size % g == 0,
                    "quantization_config.group_size",
                    f"{g} must divide moe_intermediate_size",
                ),
                (
                    self.quant.num_bits == 4,
                    "quantization_config.num_bits",
                    f"{self.quant.num_bits}; only 4 is supported",
                ),
            ]
        return checks

    # Derived sizes (one place, so model code never recomputes them differently).
    @property
    def qk_head_dim(self) -> int:
        """Query/key width per head: the non-rotary part plus the rotary part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def q_lora(self) -> bool:
        """True when queries go through a low-rank latent (q_a -> norm -> q_b); False for a single q_proj."""
        return self.q_lora_rank is not None

    @property
    def latent_dim(self) -> int:
        """Values cached per token per layer: the KV latent plus the shared RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def num_moe_layers(self) -> int:
        """Decoder layers with routed experts (all but the first `first_k_dense_replace`)."""
        return self.num_hidden_layers - self.first_k_dense_replace

    @property
    def softmax_scale(self) -> float:
        """192^-0.5 * mscale^2 with mscale from mscale_all_dim (HF applies it whenever yarn is configured)."""
        scale = self.qk_head_dim**-0.5
        rs = self.rope_scaling
        if rs is not None and rs.mscale_all_dim:
            m = yarn_mscale(rs.factor, rs.mscale_all_dim)
            scale *= m * m
        return scale

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The eos id(s) of config.json as a tuple (empty when there is none)."""
        e = self.eos_token_id
        return () if e is None else (e,) if isinstance(e, int) else tuple(e)

    def replace(self, **changes: Any) -> KimiConfig:
        """A copy with `changes` applied (configs are frozen)."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> KimiConfig:
        """Build from a parsed config.json (K2.5 nested layout or the flat K2 / DeepSeek-V3 layout)."""
        top, cfg = _text_config(cfg)
        req = functools.partial(_required, cfg)
        q_lora_rank, heads = _read_attention(cfg, req)
        _check_supported(cfg)
        nextn = cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers"))

        rope_theta, rope_scaling = read_rope(cfg)
        quant_config = cfg.get("quantization_config") or top.get("quantization_config")
        quant, fp8 = _read_quant(quant_config), read_fp8(quant_config)

        def top_or_text(name: str) -> Any:
            v = top.get(name, cfg.get(name))
            return tuple(v) if isinstance(v, list) else v

        return cls(
            vocab_size=req("vocab_size"),
            hidden_size=req("hidden_size"),
            intermediate_size=req("intermediate_size"),
            moe_intermediate_size=req("moe_intermediate_size"),
            num_hidden_layers=req("num_hidden_layers"),
            num_attention_heads=heads,
            q_lora_rank=q_lora_rank,
            kv_lora_rank=req("kv_lora_rank"),
            qk_nope_head_dim=req("qk_nope_head_dim"),
            qk_rope_head_dim=req("qk_rope_head_dim"),
            v_head_dim=req("v_head_dim"),
            n_routed_experts=req("n_routed_experts"),
            num_experts_per_tok=req("num_experts_per_tok"),
            n_shared_experts=req("n_shared_experts"),
            first_k_dense_replace=cfg.get("first_k_dense_replace", 0),
            n_group=cfg.get("n_group") or 1,
            topk_group=cfg.get("topk_group") or 1,
            routed_scaling_factor=float(req("routed_scaling_factor", float)),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            rms_norm_eps=float(req("rms_norm_eps", float)),
            rope_theta=rope_theta,
            max_position_embeddings=req("max_position_embeddings"),
            rope_scaling=rope_scaling,
            quant=quant,
            fp8=fp8,
            tie_word_embeddings=bool(top.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
            bos_token_id=top_or_text("bos_token_id"),
            eos_token_id=top_or_text("eos_token_id"),
            pad_token_id=top_or_text("pad_token_id"),
            num_nextn_predict_layers=0 if nextn is None else nextn,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> KimiConfig:
        """Read `<path>/config.json` (or a config.json path)."""
        p = Path(path)
        p = p / "config.json" if p.is_dir() else p
        if not p.is_file():
            raise FileNotFoundError(f"config.json not found at {p}")
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}: not valid JSON ({e})") from e
        return cls.from_hf_config(data)

    @classmethod
    def preset(cls, name: str) -> KimiConfig:
        """A named, frozen configuration (see PRESETS)."""
        if name not in PRESETS:
            raise KeyError(f"unknown preset {name!r}; available: {sorted(PRESETS)}")
        return PRESETS[name]


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _text_config(cfg: Mapping[str, Any]) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
    """(top-level config, the text model's config): K2.5 nests the text model in `text_config`."""
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"config: expected a JSON object, got {type(cfg).__name__}")
    model_type = cfg.get("model_type")
    top = cfg
    if model_type in MULTIMODAL_MODEL_TYPES or "text_config" in cfg:
        text = cfg.get("text_config")
        if not isinstance(text, Mapping):
            raise ConfigError(f"text_config: model_type {model_type!r} needs a nested text_config object")
        cfg = text
        model_type = cfg.get("model_type", "deepseek_v3")
    if model_type not in TEXT_MODEL_TYPES:
        raise ConfigError(
            f"model_type: {model_type!r} is not supported (expected one of {TEXT_MODEL_TYPES + MULTIMODAL_MODEL_TYPES})"
        )
    return top, cfg


def _required(cfg: Mapping[str, Any], name: str, kind: type = int) -> Any:
    if name not in cfg or cfg[name] is None:
        raise ConfigError(f"{name}: required field missing from config.json")
    v = cfg[name]
    if kind is int and (isinstance(v, bool) or not isinstance(v, int)):
        raise ConfigError(f"{name}: expected an integer, got {v!r}")
    if kind is float and not isinstance(v, int | float):
        raise ConfigError(f"{name}: expected a number, got {v!r}")
    return v


def _read_attention(cfg: Mapping[str, Any], req) -> tuple[int | None, int]:
    """(q_lora_rank or None for a single q_proj, num_attention_heads), after MLA's own requirements."""
    if "q_lora_rank" not in cfg:
        # HF's DeepseekV3Config defaults it to 1536; a file without it is ambiguous, so say which is meant.
        raise ConfigError("q_lora_rank: required field missing from config.json (an integer, or null for q_proj)")
    q_lora_rank = None if cfg["q_lora_rank"] is None else req("q_lora_rank")
    if cfg.get("kv_lora_rank") is None:
        raise ConfigError("kv_lora_rank: required field missing from config.json (MLA needs a KV latent rank)")
    heads = req("num_attention_heads")
    if heads <= 0:
        raise ConfigError(f"num_attention_heads: expected a positive integer, got {heads}")
    kv_heads = cfg.get("num_key_value_heads")
    kv_heads = heads if kv_heads is None else kv_heads
    if kv_heads != heads:
        raise ConfigError(f"num_key_value_heads: MLA expects {heads} (= num_attention_heads), got {kv_heads}")
    return q_lora_rank, heads


def _check_supported(cfg: Mapping[str, Any]) -> None:
    """Fields with one supported value (the architecture's), refused by name otherwise."""
    for name, expected in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("hidden_act", "silu")):
        if cfg.get(name, expected) != expected:
            raise ConfigError(f"{name}: only {expected!r} is supported, got {cfg[name]!r}")
    if cfg.get("moe_layer_freq", 1) != 1:
        raise ConfigError(f"moe_layer_freq: only 1 is supported, got {cfg['moe_layer_freq']}")
    for name, expected in (("attention_bias", False), ("rope_interleave", True)):
        if cfg.get(name) is not None and cfg[name] is not expected:
            raise ConfigError(f"{name}: only {str(expected).lower()} is supported, got {cfg[name]!r}")


def read_rope(cfg: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, its RopeScaling or None) from a config's RoPE fields (also the drafter's, `models/eagle3.py`)."""
    # Hub files: top-level rope_theta + rope_scaling. transformers>=5 writes rope_parameters with theta inside.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {}) or params
    theta = cfg.get("rope_theta", params.get("rope_theta"))
    if theta is None:
        raise ConfigError("rope_theta: required field missing from config.json")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", None) or not scaling:
        return float(theta), None
    if kind != "yarn":
        raise ConfigError(f"rope_scaling.type: only 'yarn' (or none) is supported, got {kind!r}")
    for name in ("factor", "original_max_position_embeddings"):
        if scaling.get(name) is None:
            raise ConfigError(f"rope_scaling.{name}: required for yarn")
    opt = lambda k: None if scaling.get(k) is None else float(scaling[k])
    return float(theta), RopeScaling(
        factor=float(scaling["factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        # HF: `get("beta_fast") or 32`; a 0 means the default there too.
        beta_fast=float(scaling.get("beta_fast") or 32),
        beta_slow=float(scaling.get("beta_slow") or 1),
        mscale=opt("mscale"),
        mscale_all_dim=opt("mscale_all_dim"),
        attention_factor=opt("attention_factor"),
        truncate=bool(scaling.get("truncate", True)),
    )


def read_fp8(q: Mapping[str, Any] | None) -> Fp8Quant | None:
    """The block-FP8 scheme of a `quantization_config` (None for any other method, or none)."""
    if not q or q.get("quant_method") != "fp8":
        return None
    if q.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"quantization_config.fmt: {q.get('fmt')!r} is not supported (expected 'e4m3')")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        raise ConfigError(f"quantization_config.weight_block_size: expected [rows, cols], got {block!r}")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise ConfigError(
            f"quantization_config.activation_scheme: {q['activation_scheme']!r} is not supported (expected "
            "'dynamic': activations stay in the compute dtype)"
        )
    return Fp8Quant(block=(block[0], block[1]))


def _read_quant(q: Mapping[str, Any] | None) -> Int4Quant | None:
    """The INT4 routed-expert scheme (compressed-tensors) of a `quantization_config`; None for none or FP8."""
    if not q:
        return None
    method = q.get("quant_method")
    if method == "fp8":  # block FP8 (`read_fp8`), not the INT4 experts' scheme
        return None
    if method != "compressed-tensors":
        raise ConfigError(
            f"quantization_config.quant_method: {method!r} is not supported (expected 'compressed-tensors' "
            "INT4 or 'fp8' block quantisation)"
        )
    if q.get("format") not in ("pack-quantized", None):
        raise ConfigError(f"quantization_config.format: expected 'pack-quantized', got {q.get('format')!r}")
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        raise ConfigError(f"quantization_config.config_groups: expected exactly one group, got {len(groups)}")
    w = next(iter(groups.values())).get("weights") or {}
    problems = []
    if w.get("num_bits") != 4:
        problems.append(f"num_bits={w.get('num_bits')} (expected 4)")
    if w.get("type", "int") != "int":
        problems.append(f"type={w.get('type')!r} (expected 'int')")
    if not w.get("symmetric", True):
        problems.append("symmetric=false (expected true)")
    if w.get("strategy") != "group":
        problems.append(f"strategy={w.get('strategy')!r} (expected 'group')")
    if not isinstance(w.get("group_size"), int) or w["group_size"] <= 0:
        problems.append(f"group_size={w.get('group_size')!r} (expected a positive integer)")
    if problems:
        raise ConfigError("quantization_config.config_groups.weights: " + "; ".join(problems))
    return Int4Quant(group_size=w["group_size"], num_bits=4)


_KIMI_K25 = KimiConfig(
    vocab_size=163840,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    num_attention_heads=64,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=384,
    num_experts_per_tok=8,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=2.827,
    norm_topk_prob=True,
    rms_norm_eps=1e-5,
    rope_theta=50000.0,
    max_position_embeddings=262144,
    rope_scaling=RopeScaling(
        factor=64.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
    quant=Int4Quant(group_size=32),
    bos_token_id=163584,
    eos_token_id=163585,
    pad_token_id=163839,
)

# Moonlight-16B-A3B, the base model (https://huggingface.co/moonshotai/Moonlight-16B-A3B, config.json): DeepSeek-V3
# architecture with q_lora_rank null (one q_proj), 27 layers (1 dense), 64 routed experts top-6 + 2 shared, sigmoid
# noaux_tc routing, no rope scaling, bf16. Checked value by value (2026-11-30) against copies, as the Hub file itself
# is not in the searchable corpora:
# - every value but eos_token_id: a verbatim copy of Moonlight-16B-A3B-Instruct's config.json at Hub revision
#   4e735b07a89f73647dfab71ab91b840f362ede5b, vendored in a public Rust test (same architecture fields; no
#   rope_scaling key, no pad_token_id; its eos_token_id is 163586, the Instruct's <|im_end|>);
# - eos_token_id 163585: the base model's generation_config.json as re-published with a quantised copy of it
#   (https://huggingface.co/nm-testing/Moonlight-16B-A3B.w4a16/blob/main/generation_config.json: [163585],
#   max_length 8192);
# - the shape, router and RoPE numbers again (not bos/eos, max_position_embeddings or norm_topk_prob): NVIDIA-NeMo/
#   Megatron-Bridge src/megatron/bridge/models/deepseek/deepseek_provider.py (MoonlightModelProvider16B) and
#   zyzshishui/slime (a THUDM/slime fork) scripts/models/moonlight.sh. NeMo's Moonlight docs page is NOT a source:
#   it lists 8 shared experts, intermediate size 10944 and vocabulary 151,936, none of which the checkpoint has.
_MOONLIGHT = KimiConfig(
    vocab_size=163840,
    hidden_size=2048,
    intermediate_size=11264,
    moe_intermediate_size=1408,
    num_hidden_layers=27,
    num_attention_heads=16,
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=64,
    num_experts_per_tok=6,
    n_shared_experts=2,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=2.446,
    norm_topk_prob=True,
    rms_norm_eps=1e-5,
    rope_theta=50000.0,
    max_position_embeddings=8192,
    bos_token_id=163584,
    eos_token_id=163585,
)

# DeepSeek-V3 (https://huggingface.co/deepseek-ai/DeepSeek-V3, config.json; DeepSeek-R1 and V3-0324 share every field
# here): 61 layers (3 dense), 128 heads, 256 routed experts top-8 in 8 groups (4 kept) + 1 shared, yarn x40, and the
# FP8 block quantisation its weights ship in (128x128 e4m3 blocks, dynamic activations). The Hub file is not in the
# searchable corpora; checked value by value (2026-12-03) against: deepseek-ai/DeepSeek-V3's README_WEIGHTS.md (the
# quantization_config, 61 main layers + 1 MTP layer: num_nextn_predict_layers 1), a field-by-field description of
# deepseek-ai/DeepSeek-V3-Base/blob/main/config.json (https://gist.github.com/vinhnx/40eaf98b4bb51f0770276020a690bad5:
# vocabulary 129280, 163840 positions, rope_theta 10000, yarn factor 40, mscale 1.0), and DeepSeek-R1's config.json as
# quoted in a public model card (bos 0, eos 1, first_k_dense_replace 3). Copies of the file with shuffled keys exist on
# the web; none was used.
_DEEPSEEK_V3 = KimiConfig(
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    num_attention_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=256,
    num_experts_per_tok=8,
    n_shared_experts=1,
    first_k_dense_replace=3,
    n_group=8,
    topk_group=4,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=163840,
    rope_scaling=RopeScaling(
        factor=40.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
    fp8=Fp8Quant(block=(128, 128)),
    bos_token_id=0,
    eos_token_id=1,
    num_nextn_predict_layers=1,
)

# Small configs with the same structure, for tests and examples. "tiny" is Kimi-like (n_group 1, sigmoid routing,
# yarn beta_fast 32); "tiny-dsv3" is DeepSeek-V3-like (group-limited routing, n_group 4 / topk_group 2).
_TINY = KimiConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=8,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=2.827,
    norm_topk_prob=True,
    rms_norm_eps=1e-5,
    rope_theta=50000.0,
    max_position_embeddings=1024,
    rope_scaling=RopeScaling(
        factor=4.0,
        original_max_position_embeddings=64,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
    quant=Int4Quant(group_size=32),
    bos_token_id=0,
    eos_token_id=1,
)

PRESETS: dict[str, KimiConfig] = {
    "kimi-k2.5": _KIMI_K25,
    # Kimi-K2.6 (moonshotai/Kimi-K2.6, 2026): the same text model as K2.5 in the same multimodal layout (kimi_k25 with
    # a kimi_k2 text_config, INT4 routed experts). Its model card states the architecture unchanged (61 layers, 1
    # dense, hidden 7168, 64 heads, MLA, 384 experts top 8 + 1 shared, expert width 2048, 160K vocabulary, 256K
    # context, SwiGLU); the checkpoint's config.json itself is not in this project's searchable sources, so the
    # values are K2.5's and `from_hf_config` reads (and checks) the file whenever a checkpoint is loaded.
    "kimi-k2.6": _KIMI_K25,
    "deepseek-v3": _DEEPSEEK_V3,
    "moonlight-16b-a3b": _MOONLIGHT,
    "tiny": _TINY,
    "tiny-dsv3": _TINY.replace(
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        rope_scaling=RopeScaling(
            factor=8.0,
            original_max_position_embeddings=32,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    ),
}
