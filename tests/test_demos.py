"""The demos run: the Colab/TPU notebook top to bottom in a fresh kernel, and demos/multi_gpu.py's dry runs.

Each runs in its own process (a Jupyter kernel, a subprocess), so it sets up its own devices: on this CPU-only
machine the notebook and the pair dry run simulate 8 CPU devices, as they would for a newcomer without accelerators.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import nbclient
import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "demos" / "colab_tpu.ipynb"
MULTI_GPU = ROOT / "demos" / "multi_gpu.py"


def _outputs(cell) -> str:
    """Text of a code cell's stream and display outputs; images as their MIME type."""
    parts = []
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream":
            parts.append(out["text"])
        elif out["output_type"] in ("display_data", "execute_result"):
            parts.append(out["data"].get("text/plain", ""))
            parts.extend(mime for mime in out["data"] if mime.startswith("image/"))
    return "".join(parts)


@pytest.mark.slow  # ~2.5 min on 2 cores (generate, a k = 0..3 tune and training on 8 simulated devices): -m slow
@pytest.mark.timeout(900)
def test_colab_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the notebook's work directory (tempfile.mkdtemp) goes here
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError on the first failing cell

    text = "\n".join(_outputs(c) for c in nb.cells if c.cell_type == "code")
    assert "platform cpu: 8 device(s)" in text
    assert "on mesh {'data': 1, 'model': 8}" in text
    assert "identical to plain greedy decoding: True" in text
    assert "speedup:" in text and "mean accepted length" in text
    assert "recommended k = " in text
    assert text.count("image/png") >= 2  # the acceptance plot and the tuner's tune.png
    assert "step 8: loss" in text and "exported to" in text
    assert list(tmp_path.glob("jaxspec-demo-*/tune/tune.png")), "the tuner wrote no plot"
    assert list(tmp_path.glob("jaxspec-demo-*/drafter/model.safetensors")), "the trained drafter was not exported"


def _dry_run(*flags: str, timeout: int) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, str(MULTI_GPU), "--dry-run", *flags],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0, f"multi_gpu.py --dry-run {' '.join(flags)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.mark.slow  # ~45 s (convert, tune, generate on 8 simulated devices); the abstract dry run stays in the suite
@pytest.mark.timeout(600)
def test_multi_gpu_dry_run_on_the_bundled_pair(tmp_path):
    flags = ("--max-k", "1", "--trees", "2:2:4", "--max-new-tokens", "40", "--dst", str(tmp_path / "converted"))
    out = _dry_run("pair", *flags, timeout=540)
    for n in range(1, 7):
        assert f"\n[{n}] " in out, f"step {n} missing:\n{out}"
    assert "platform cpu: 8 device(s)" in out and "collective preset 'cpu-sim'" in out
    assert "restore the target on mesh {'data': 1, 'model': 8}" in out
    assert "and 1 tree shape(s)" in out and re.search(r"recommended (k=\d|tree 2x2/4): measured", out), out
    assert "mean accepted length" in out
    assert (tmp_path / "converted" / "jaxspec_checkpoint.json").is_file()  # the conversion completed
    assert (tmp_path / "converted" / "tune" / "tune.json").is_file()


@pytest.mark.timeout(300)
def test_multi_gpu_dry_run_with_abstract_kimi_k25():
    out = _dry_run("abstract", timeout=280)
    assert "plan: 61 layers, 384 experts on mesh {'data': 1, 'model': 8}" in out
    assert "parameters per device: 70.95 GiB (INT4 experts: True)" in out
    assert "compile one decode step" in out and "compile one verify k=3 step" in out
    assert "compile one tree verify (16 nodes) step" in out
    # Two all-reduces per layer plus the vocab-split embedding: nothing else, for decode, verify and tree verify alike.
    assert len(re.findall(r"^all-reduce\s+\d+\s+123\s", out, flags=re.M)) == 3, out


def test_multi_gpu_needs_a_checkpoint_or_dry_run():
    proc = subprocess.run([sys.executable, str(MULTI_GPU)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode != 0 and "give --src, --dst, --drafter and --prompt" in proc.stderr
