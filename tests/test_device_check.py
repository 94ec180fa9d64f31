"""benchmarks/device_check.sh --dry-run: every part of the GPU check on this CPU at small sizes, the GPU programs
lowered for CUDA. The device check runs only when an accelerator is lent; this keeps it from rotting in between."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("versions", "kernels", "steps", "pair", "serve")


@pytest.mark.timeout(400)
def test_dry_run_runs_every_part(tmp_path):
    env = os.environ | {"PYTHON": sys.executable, "PJRT_NPROC": os.environ.get("PJRT_NPROC", "32")}
    env.pop("OUT", None)
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks/device_check.sh"), "--dry-run", "--out", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=380,
    )
    record = json.loads((tmp_path / "device_check.dry_run.json").read_text())
    failed = {n: p.get("error") for n, p in record["parts"].items() if p["status"] not in ("ok",)}
    assert proc.returncode == 0 and not failed, f"{failed}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert tuple(record["parts"]) == PARTS
    parts = record["parts"]
    assert parts["versions"]["install"] == "pip --dry-run: ok"
    assert all(c["ok"] for c in parts["kernels"]["cases"]) and len(parts["kernels"]["cases"]) == 3
    assert [c["triton_calls"] for c in parts["kernels"]["cuda_lowerings"]] == [1, 1, 1, 1]
    assert parts["steps"]["runs"] and parts["steps"]["cuda_lowering"][0]["triton_calls"] == 3
    assert parts["pair"]["batches"] and "best_tree_over_best_chain" in parts["pair"] and parts["pair"]["verify"]
    assert parts["serve"].get("levels"), "the dry run's serve part measured nothing (fastapi and uvicorn are test deps)"
    assert (tmp_path / "device_check.dry_run.md").read_text().startswith("# Device check (dry run")
