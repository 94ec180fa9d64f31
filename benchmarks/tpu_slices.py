"""Which TPU slices hold full-size Kimi-K2.5, measured by `jaxspec inspect --topology` (libtpu, no TPU needed).

    python benchmarks/tpu_slices.py          # writes benchmarks/results/tpu_slices.{json,md}

Each row is one `jaxspec inspect --topology SLICE --preset kimi-k2.5 --batch B --tokens T --cache-len C
--kv-cache-dtype KV --json ...` run in its own process on the CPU backend (the command is recorded per row):
the compiler's HBM per device, what the step needs, whether it fits, the collectives and Mosaic kernels it runs,
and kv_capacity_tokens (cache positions per device that fit beside the weights and temporaries at that batch).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# (slice, batch, tokens, cache length): a verify step of 3 draft tokens at batch 8, then batch 32 at 8k positions
RUNS = [(s, 8, 4, 4096) for s in ("v5p-8", "v5p-16", "tpu7x-8", "v6e-32", "v5e-8")] + [("v5p-16", 32, 4, 8192)]


def inspect(name: str, batch: int, tokens: int, cache_len: int, kv: str, out: Path) -> dict:
    argv = ["inspect", "--topology", name, "--preset", "kimi-k2.5", "--batch", str(batch), "--tokens", str(tokens)]
    argv += ["--cache-len", str(cache_len), "--kv-cache-dtype", kv]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "jaxspec", *argv, "--json", str(out)]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    report = json.loads(out.read_text())
    report["command"] = "jaxspec " + " ".join(argv)
    report["wall_seconds"] = time.perf_counter() - start
    return report


def row(r: dict) -> str:
    gib = lambda n: f"{n / 2**30:.2f}"
    ar = r.get("collectives", {}).get("all-reduce", {}).get("executed", "-")
    mosaic = r.get("kernels", {}).get("tpu_custom_call", "-")
    fits = "yes" if r["fits"] else "no"
    return (
        f"| {r['topology']} ({r['libtpu_topology']}, {r['devices']} x {r['device_kind']}) | {r['batch']} x "
        f"{r['tokens']}, cache {r['cache_len']} | {r['kv_cache_dtype']} | {gib(r['required_bytes_per_device'])} / "
        f"{gib(r['hbm_bytes_per_device'])} | {fits} | {r['kv_capacity_tokens']:,} | {ar} | {mosaic} |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", type=Path, default=Path("benchmarks/results/tpu_slices"))
    args = p.parse_args()
    reports = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, batch, tokens, cache_len) in enumerate(RUNS):
            for kv in ("auto", "fp8"):
                r = inspect(name, batch, tokens, cache_len, kv, Path(tmp) / f"{i}_{kv}.json")
                print(row(r), flush=True)
                reports.append(r)
    header = [
        "| slice | step (batch x tokens) | KV cache | GiB per device (needed / HBM) | fits | kv_capacity_tokens "
        "| all-reduces | Mosaic calls |",
        "|---|---|---|---:|---|---:|---:|---:|",
    ]
    md = "\n".join(
        ["# Kimi-K2.5 on TPU slices (`python benchmarks/tpu_slices.py`)", "", *header, *map(row, reports), ""]
    )
    args.output.with_suffix(".md").write_text(md)
    args.output.with_suffix(".json").write_text(json.dumps(reports, indent=2, default=str))
    print(f"wrote {args.output.with_suffix('.md')}")


if __name__ == "__main__":
    main()
