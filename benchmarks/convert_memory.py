"""Conversion throughput and peak host memory: a synthetic Kimi-shaped checkpoint (few layers, many experts)
converted with N and 2N layers, each in a fresh process. Peak RSS must not grow with the layer count.

    python benchmarks/convert_memory.py [--layers 4] [--experts 64] [--hidden 1024] [--work DIR]

Writes benchmarks/results/convert_memory.json and prints a table. The synthetic tensors are random float32 in the
HF DeepSeek-V3 layout (bf16-equivalent structure; INT4 packing does not change the streaming behaviour).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, resource, sys, time
from converters.target import convert_target
src, dst = sys.argv[1], sys.argv[2]
start = time.perf_counter()
result = convert_target(src, dst, dtype="float32", progress=False)
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "bytes_written": result.bytes_written,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def write_synthetic(path: Path, layers: int, experts: int, hidden: int) -> int:
    import numpy as np
    from safetensors.numpy import save_file

    from jaxspec.config import KimiConfig
    from jaxspec.hf import _expert_names, _layer_table
    from tests.reference.hf_tiny import hf_config

    path.mkdir(parents=True, exist_ok=True)
    raw = json.loads(
        hf_config(
            "kimi",
            num_hidden_layers=layers,
            hidden_size=hidden,
            moe_intermediate_size=hidden // 2,
            n_routed_experts=experts,
            intermediate_size=2 * hidden,
            vocab_size=4096,
        ).to_json_string()
    )
    (path / "config.json").write_text(json.dumps(raw))
    cfg = KimiConfig.from_pretrained(path)
    rng = np.random.default_rng(0)
    D, V, F = cfg.hidden_size, cfg.vocab_size, cfg.moe_intermediate_size
    rand = lambda shape: rng.standard_normal(shape, dtype=np.float32)  # noqa: E731
    weight_map: dict[str, str] = {}
    top = {"model.embed_tokens.weight": rand((V, D)), "model.norm.weight": rand((D,)), "lm_head.weight": rand((V, D))}
    save_file(top, path / "top.safetensors")
    weight_map |= dict.fromkeys(top, "top.safetensors")
    for i in range(layers):
        moe = i >= cfg.first_k_dense_replace
        tensors = {f"model.layers.{i}.{suffix}": rand(shape) for _, suffix, shape, _ in _layer_table(cfg, moe)}
        for e in range(cfg.n_routed_experts if moe else 0):
            for proj in ("gate", "up", "down"):
                tensors[f"{_expert_names(i, e, proj)}.weight"] = rand((D, F) if proj == "down" else (F, D))
        save_file(tensors, path / f"layer{i}.safetensors")
        weight_map |= dict.fromkeys(tensors, f"layer{i}.safetensors")
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4, help="the small run; the large one has twice as many")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--work", default=None, help="scratch directory (default: a temporary one, removed after)")
    p.add_argument("--output", default="benchmarks/results/convert_memory.json")
    args = p.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="jaxspec_convert_bench_"))
    rows = []
    try:
        for layers in (args.layers, 2 * args.layers):
            src, dst = work / f"src{layers}", work / f"dst{layers}"
            size = write_synthetic(src, layers, args.experts, args.hidden)
            out = subprocess.run(
                [sys.executable, "-c", CHILD, str(src), str(dst)], check=True, capture_output=True, text=True
            )
            r = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(
                {"layers": layers, "source_bytes": size, **r, "gb_per_s": r["bytes_written"] / r["seconds"] / 1e9}
            )
            shutil.rmtree(src)
            shutil.rmtree(dst)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{'layers':>6} | {'source GB':>9} | {'GB/s':>6} | {'peak RSS GB':>11}")
    for r in rows:
        gb, rss = r["source_bytes"] / 1e9, r["peak_rss_bytes"] / 1e9
        print(f"{r['layers']:>6} | {gb:9.2f} | {r['gb_per_s']:6.3f} | {rss:11.2f}")
    growth = rows[1]["peak_rss_bytes"] / rows[0]["peak_rss_bytes"]
    print(f"peak RSS ratio (2x layers / 1x): {growth:.2f}")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(
        json.dumps({"rows": rows, "peak_rss_ratio": growth, "experts": args.experts, "hidden": args.hidden}, indent=2)
    )
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
