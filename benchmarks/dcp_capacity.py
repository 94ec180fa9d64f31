"""The libtpu capacity table for --dcp: Kimi-K2.5, a verify of 4 tokens, batch 32 x 8,192 positions, compiled with
`jaxspec inspect --topology` for v5p-16, v6e-16 and tpu7x-8 at --dcp 1, 2, 4, 8 (no TPU needed; the tpu extra).

    PYTHONPATH=$PWD python benchmarks/dcp_capacity.py   # writes benchmarks/results/dcp_capacity.{json,md}
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SLICES, DCPS = ("v5p-16", "v6e-16", "tpu7x-8"), (1, 2, 4, 8)
WORKLOAD = ("--preset", "kimi-k2.5", "--batch", "32", "--tokens", "4", "--cache-len", "8192")
FIELDS = ("fits", "required_bytes_per_device", "hbm_bytes_per_device", "kv_capacity_tokens_per_device")


def inspect(topology: str, dcp: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "jaxspec", "inspect", "--topology", topology, *WORKLOAD, "--dcp", str(dcp)]
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
        proc = subprocess.run([*cmd, "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode:
            return {"topology": topology, "dcp": dcp, "error": proc.stderr.strip().splitlines()[-1]}
        report = json.loads(out.read_text())
    return {"topology": topology, "dcp": dcp, "kv_capacity_tokens_slice": report["kv_capacity_tokens"]} | {
        k: report[k] for k in FIELDS
    }


def table(rows: list[dict]) -> str:
    gib = lambda n: f"{n / 2**30:.2f}"  # noqa: E731
    lines = [
        "| slice | dcp | step GiB / device (HBM) | fits | kv_capacity_tokens per device | for the slice |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['topology']} | {r['dcp']} | {r['error']} | | | |")
            continue
        need = f"{gib(r['required_bytes_per_device'])} ({gib(r['hbm_bytes_per_device'])})"
        lines.append(
            f"| {r['topology']} | {r['dcp']} | {need} | {r['fits']} | {r['kv_capacity_tokens_per_device']:,} | "
            f"{r['kv_capacity_tokens_slice']:,} |"
        )
    return "\n".join(lines)


def main() -> None:
    rows = [inspect(t, n) for t in SLICES for n in DCPS]
    results = ROOT / "benchmarks" / "results"
    command = "PYTHONPATH=$PWD python benchmarks/dcp_capacity.py"
    report = {"command": command, "workload": WORKLOAD, "rows": rows}
    (results / "dcp_capacity.json").write_text(json.dumps(report, indent=2))
    (results / "dcp_capacity.md").write_text(f"`{command}`; workload: `{' '.join(WORKLOAD)}`\n\n{table(rows)}\n")
    print(table(rows))


if __name__ == "__main__":
    main()
