"""A DeepSeek-V3-style FP8 checkpoint (e4m3 weights + float32 `weight_scale_inv` blocks) from a tiny HF one, with
torch doing the quantisation, and beside it the float32 model holding torch's dequantisation of those weights."""

import json
import re
import shutil

import torch
from safetensors.torch import load_file, save_file

BLOCK = 16  # small blocks, so tiny weights span several (and partial: 40 rows = 2.5 blocks)
LINEAR = re.compile(r"\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")


def write_fp8(src, dst) -> None:
    """FP8 copy of `src` (every linear weight quantised per BLOCK x BLOCK, as DeepSeek-V3 ships) and, next to it in
    `dst/../dense`, the float32 model holding torch's dequantisation of those weights."""
    tensors = load_file(src / "model.safetensors")
    fp8, dense = {}, {}
    for name, w in tensors.items():
        if not LINEAR.search(name):
            fp8[name] = dense[name] = w
            continue
        r, c = w.shape
        blocks = torch.nn.functional.pad(w.float(), (0, -c % BLOCK, 0, -r % BLOCK))
        blocks = blocks.reshape(blocks.shape[0] // BLOCK, BLOCK, blocks.shape[1] // BLOCK, BLOCK)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
        expand = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:r, :c]
        q = (w.float() / expand).to(torch.float8_e4m3fn)
        fp8[name], fp8[name + "_scale_inv"] = q, scale.float()
        dense[name] = q.float() * expand
    for path, t in ((dst, fp8), (dst.parent / "dense", dense)):
        shutil.copytree(src, path)
        save_file(t, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [BLOCK, BLOCK],
    }
    (dst / "config.json").write_text(json.dumps(cfg))
