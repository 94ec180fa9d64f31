"""The bundled pair as vLLM's CPU build can load it (benchmarks/serve_vs_vllm.py): the target with its INT4
pack-quantized routed experts dequantized to bf16 (vLLM has no CPU kernel for them), the drafter with its
capture-layer ids in vLLM's convention."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

PACKED = ".weight_packed"


def dequantize_int4(packed: np.ndarray, scale: np.ndarray, group: int) -> np.ndarray:
    """One compressed-tensors INT4 weight [out, in / 8] int32 with scales [out, in / group] as jaxspec computes with
    it: bf16(q * scale) (`Int4Array.dequantize`), returned [out, in] as ml_dtypes bfloat16."""
    import jax.numpy as jnp

    from jaxspec.io.compressed_tensors import unpack_int4
    from jaxspec.models.quant import Int4Array

    q = unpack_int4(packed, packed.shape[-1] * 8)
    return np.asarray(Int4Array.from_values(q.T, scale.T, group).dequantize(jnp.bfloat16)).T


def write_dequantized(src: Path, dst: Path) -> int:
    """`src` (a checkpoint with INT4 pack-quantized weights) as an unquantized bf16 checkpoint in `dst`: each
    `X.weight_packed/_scale/_shape` becomes `X.weight`, config.json loses its quantization_config, the other files
    are copied. Returns how many weights it dequantized."""
    import torch
    from safetensors.torch import load_file, save_file

    from jaxspec.io.fp8 import dequantized_config

    config = json.loads((src / "config.json").read_text())
    (group_args,) = [g["weights"] for g in config["quantization_config"]["config_groups"].values()]
    if (group_args["num_bits"], group_args["type"], group_args["strategy"]) != (4, "int", "group"):
        raise SystemExit(f"serve_vs_vllm: {src}: expected 4-bit int group quantization, got {group_args}")
    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(src / "model.safetensors")
    out, done = {}, 0
    for name, t in tensors.items():
        if name.endswith((".weight_scale", ".weight_shape")) and name.rsplit(".", 1)[0] + PACKED in tensors:
            continue
        if not name.endswith(PACKED):
            out[name] = t
            continue
        base = name.removesuffix(PACKED)
        scale, shape = tensors[f"{base}.weight_scale"], tensors[f"{base}.weight_shape"].tolist()
        w = dequantize_int4(t.numpy(), scale.float().numpy().astype(_bf16()), group_args["group_size"])
        if list(w.shape) != shape:
            raise SystemExit(f"serve_vs_vllm: {base}: weight_shape says {shape}, unpacked {list(w.shape)}")
        out[f"{base}.weight"] = torch.from_numpy(np.ascontiguousarray(w).view(np.int16)).view(torch.bfloat16)
        done += 1
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(dequantized_config(config), indent=2) + "\n")
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, dst / f.name)
    return done


def write_vllm_drafter(src: Path, target: Path, dst: Path) -> list[int]:
    """`src` (an SGLang/SpecForge EAGLE-3 drafter) with its capture-layer ids as vLLM reads them: vLLM takes
    `eagle_config.eagle_aux_hidden_state_layer_ids` as inputs of layers, SGLang as outputs (jaxspec/io/
    drafter_config.py), so the bundled drafter's [0, 2, 3] would make vLLM capture the embeddings (it fails to
    start). Writes the ids jaxspec reads, plus one; returns them."""
    from jaxspec.config import KimiConfig
    from jaxspec.io.drafter_config import read_drafter_config

    config = json.loads((src / "config.json").read_text())
    layers = read_drafter_config(config, target_config=KimiConfig.from_pretrained(target)).capture_layers
    inputs = [k + 1 for k in layers]
    config["eagle_config"] = {**config.get("eagle_config", {}), "eagle_aux_hidden_state_layer_ids": inputs}
    shutil.copytree(src, dst, dirs_exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return inputs


def _bf16():
    import ml_dtypes

    return ml_dtypes.bfloat16
