"""Turn a tiny HF DeepseekV3 checkpoint into a Kimi-style INT4 "pack-quantized" one with compressed-tensors.

Everything INT4-specific goes through the library (scale computation, quantize + pack, unpack + dequantize,
the quantization_config and how it is written into config.json), so checkpoints made here are an independent
reference for jaxspec's own loader and codec rather than a mirror of them.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from compressed_tensors.compressors import ModelCompressor, PackedQuantizationCompressor
from compressed_tensors.config import CompressionFormat
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
)
from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
from compressed_tensors.utils.match import match_name
from safetensors.torch import load_file, save_file

# The ignore list of the published Kimi-K2 / K2.5 INT4 checkpoints: only routed experts are quantized.
KIMI_IGNORE = [
    "lm_head",
    r"re:.*self_attn.*",
    r"re:.*shared_experts.*",
    r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
]
EXPERT_WEIGHT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
TEXT_PREFIX = "language_model."
# K2.5 stores scales in bf16; the library keeps the weight dtype, so a bf16 model gives bf16 scales.
SCALE_DTYPE = torch.bfloat16


def int4_quantization_config(group_size: int) -> QuantizationConfig:
    """The library's own config object for Kimi's scheme: W4 int, symmetric, group-wise, pack-quantized."""
    weights = QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size, observer="minmax"
    )
    return QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
        format=CompressionFormat.pack_quantized.value,
        quantization_status=QuantizationStatus.COMPRESSED,
        ignore=list(KIMI_IGNORE),
    )


def _compress_expert(weight: torch.Tensor, scheme: QuantizationScheme) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Library min-max scale, quantize+pack, and the library's own decompression of the result."""
    # compute_dynamic_scales_and_zp is the min-max observer math (scale = max|w| / 7.5 for symmetric int4).
    scale, _ = compute_dynamic_scales_and_zp(weight, scheme.weights, module=None)
    # Quantize against the scale as stored, so unpack(q) * stored scale is the checkpoint's exact meaning.
    state = {"weight": weight, "weight_scale": scale.to(SCALE_DTYPE)}
    compressed = PackedQuantizationCompressor.compress(state, scheme)
    dequantized = PackedQuantizationCompressor.decompress(compressed, scheme)["weight"]
    # The library writes weight_shape as int64; the published checkpoints (and the spec) use int32.
    compressed["weight_shape"] = compressed["weight_shape"].to(torch.int32)
    return compressed, dequantized


def _vision_tensors(hidden: int) -> dict[str, torch.Tensor]:
    """A few small stand-ins for K2.5's vision tower / projector, which the text loader must skip."""
    g = torch.Generator().manual_seed(0)
    shapes = {
        "vision_tower.patch_embed.proj.weight": (16, 3, 2, 2),
        "vision_tower.patch_embed.proj.bias": (16,),
        "vision_tower.encoder.blocks.0.wqkv.weight": (48, 16),
        "vision_tower.encoder.blocks.0.mlp.fc0.weight": (32, 16),
        "mm_projector.pre_norm.weight": (64,),
        "mm_projector.proj.0.weight": (hidden, 64),
    }
    return {name: torch.randn(shape, generator=g).to(torch.bfloat16) for name, shape in shapes.items()}


def _write_tensors(tensors: dict[str, torch.Tensor], dst: Path, num_shards: int) -> None:
    if num_shards == 1:
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
        return
    names = sorted(tensors)
    if num_shards > len(names):
        raise ValueError(f"num_shards {num_shards} exceeds the number of tensors {len(names)}")
    # Round-robin over sorted names, so one module's weight_packed/weight_scale/weight_shape (and one layer's
    # tensors) land in different shards: the loader has to follow the index, not assume locality.
    weight_map = {}
    for i in range(num_shards):
        file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        shard = {name: tensors[name] for name in names[i::num_shards]}
        save_file(shard, dst / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _kimi_k25_config(text_config: dict) -> dict:
    """Wrap a text config like K2.5's multimodal config.json (quantization_config inside text_config)."""
    text_config = {**text_config, "model_type": "kimi_k2"}
    hidden = text_config["hidden_size"]
    pad = text_config.get("pad_token_id")
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "tie_word_embeddings": False,
        "bos_token_id": text_config.get("bos_token_id"),
        "eos_token_id": text_config.get("eos_token_id"),
        "pad_token_id": text_config["vocab_size"] - 1 if pad is None else pad,
        "text_config": text_config,
        "vision_config": {
            "model_type": "moonvit",
            "patch_size": 2,
            "hidden_size": 16,
            "text_hidden_size": hidden,
        },
    }


def write_int4_checkpoint(
    src_dir: str | Path,
    dst_dir: str | Path,
    *,
    group_size: int = 32,
    kimi_k25_layout: bool = False,
    num_shards: int = 1,
    vision_tensors: bool = False,
) -> dict[str, np.ndarray]:
    """Write an INT4 copy of the HF DeepseekV3 checkpoint in `src_dir` to `dst_dir`.

    Routed experts (`model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`) become `weight_packed` int32
    [out, in/8], `weight_scale` bf16 [out, in/group_size] and `weight_shape` int32 [2]; every other tensor is
    copied unchanged. Returns the library's dequantization of every expert weight, as float32 (bf16-valued),
    keyed by the original HF name.
    """
    src, dst = Path(src_dir), Path(dst_dir)
    if vision_tensors and not kimi_k25_layout:
        raise ValueError("vision_tensors=True needs kimi_k25_layout=True (only K2.5 ships a vision tower)")
    shard_files = sorted(src.glob("*.safetensors"))
    if not shard_files:
        raise FileNotFoundError(f"no *.safetensors files in {src}")
    dst.mkdir(parents=True, exist_ok=True)

    qconfig = int4_quantization_config(group_size)
    scheme = qconfig.config_groups["group_0"]
    prefix = TEXT_PREFIX if kimi_k25_layout else ""
    out: dict[str, torch.Tensor] = {}
    dequantized: dict[str, np.ndarray] = {}
    for file in shard_files:
        for name, tensor in load_file(file).items():
            if not EXPERT_WEIGHT.match(name):
                out[prefix + name] = tensor
                continue
            module = name.removesuffix(".weight")
            # Guard the fixture itself: the ignore list must not cover the experts we quantize.
            assert not any(match_name(module, ignore) for ignore in qconfig.ignore), module
            compressed, deq = _compress_expert(tensor, scheme)
            out.update({f"{prefix}{module}.{param}": t.contiguous() for param, t in compressed.items()})
            dequantized[name] = deq.float().numpy()
    if not dequantized:
        raise ValueError(f"no routed-expert weights matching {EXPERT_WEIGHT.pattern} in {src}")
    if vision_tensors:
        out.update(_vision_tensors(json.loads((src / "config.json").read_text())["hidden_size"]))
    _write_tensors(out, dst, num_shards)

    # config.json: the library writes quantization_config as llm-compressor would; then re-nest it for K2.5.
    for item in src.iterdir():
        if item.is_file() and item.suffix != ".safetensors" and item.name != "model.safetensors.index.json":
            shutil.copy2(item, dst / item.name)
    ModelCompressor(quantization_config=qconfig).update_config(str(dst))
    if kimi_k25_layout:
        config_path = dst / "config.json"
        config_path.write_text(json.dumps(_kimi_k25_config(json.loads(config_path.read_text())), indent=2))
    return dequantized
