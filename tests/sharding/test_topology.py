"""TPU slices without a TPU (issue 29): slice names, the compiler's out-of-HBM message, KV capacity, and
`jaxspec inspect --topology` compiling for a v5p-16 through libtpu (the `tpu` extra).

The libtpu compiles run in a subprocess with JAX_PLATFORMS=cpu and no simulated devices, so this process (and the
rest of the suite) keeps its 8-device CPU backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxspec import KimiConfig
from sharding.topology import (
    CLOUD_NAMES,
    TopologyError,
    kv_capacity_tokens,
    libtpu_name,
    parse_oom,
    smallest_fitting_dcp,
)

ROOT = Path(__file__).resolve().parents[2]
V5P_HBM = round(95.74 * 2**30)  # what libtpu 0.0.42.1 states for a v5p chip


@pytest.mark.parametrize(
    ("name", "libtpu"),
    [
        ("v5p-16", "v5:2x2x2"),
        ("v5p-8", "v5:2x2x1"),
        ("tpu7x-8", "tpu7x:2x2x1"),
        ("v6e-32", "v6e:4x8"),
        ("v5e-8", "v5e:2x4"),
        ("v5litepod-16", "v5e:4x4"),
        ("v4-8", "v4:2x2x1"),
        ("V5:2x2x2", "v5:2x2x2"),  # libtpu's own names pass through
        ("v6e:4x8", "v6e:4x8"),
    ],
)
def test_slice_names(name, libtpu):
    assert libtpu_name(name) == libtpu


def test_unknown_slice_lists_the_accepted_names():
    with pytest.raises(TopologyError, match=r"unknown slice 'v5p-17'; accepted: .*v5p-16.*v5:2x2x2"):
        libtpu_name("v5p-17")
    assert len(CLOUD_NAMES) == len(set(CLOUD_NAMES.values())) + 8  # v5litepod-N duplicates v5e-N


def test_parse_oom_reads_both_figures():
    msg = (
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (107.21G) "
        "exceeds available HBM (95.74G)."
    )
    assert parse_oom(msg) == (round(107.21 * 2**30), V5P_HBM)
    v5e = "Ran out of memory on HBM, the total memory required for HLO temporaries (1.76T) exceeds available HBM "
    v5e += "(15.75G)"
    assert parse_oom(v5e) == (round(1.76 * 2**40), round(15.75 * 2**30))
    assert parse_oom("INVALID_ARGUMENT: something else") is None


def test_kv_capacity_by_hand():
    # 10 GiB of HBM; the step holds 6 GiB, of which 2 GiB is a cache of 1000 positions: weights and temporaries
    # are 4 GiB, so 6 GiB is left for cache positions of 2 GiB / 1000 each: 3000 positions.
    gib = 2**30
    assert kv_capacity_tokens(10 * gib, 6 * gib, 2 * gib, 1000) == 3000
    # a step that needs more than HBM still has a capacity: what is left beside weights + temporaries (4 GiB)
    assert kv_capacity_tokens(5 * gib, 6 * gib, 2 * gib, 1000) == 500
    assert kv_capacity_tokens(3 * gib, 6 * gib, 2 * gib, 1000) == 0  # weights + temporaries alone do not fit
    with pytest.raises(ValueError, match="cache_bytes"):
        kv_capacity_tokens(gib, gib, 0, 10)


def test_smallest_fitting_dcp_by_hand():
    gib = 2**30
    # 10 GiB of HBM, a step of 12 GiB at --dcp 1 of which 4 GiB is the cache: 8 GiB stays, the cache at --dcp n is
    # 4/n GiB: n = 2 needs exactly 10 GiB (fits), on a model axis of 8 or of 6 (divisors 1, 2, 3, 6).
    assert smallest_fitting_dcp(10 * gib, 12 * gib, 4 * gib, 1, 8) == 2
    assert smallest_fitting_dcp(10 * gib - 1, 12 * gib, 4 * gib, 1, 8) == 4
    assert smallest_fitting_dcp(9 * gib, 12 * gib, 4 * gib, 1, 6) == 6  # 4 and 5 do not divide 6; 3 needs 9.33 GiB
    assert smallest_fitting_dcp(8 * gib, 12 * gib, 4 * gib, 1, 8) is None  # 8.5 GiB at dcp 8
    # compiled at --dcp 4 (a cache of 1 GiB per device, 4 GiB at dcp 1): never a smaller one, even where it would fit
    assert smallest_fitting_dcp(100 * gib, 9 * gib, 1 * gib, 4, 8) == 4
    assert smallest_fitting_dcp(8.6 * gib, 9 * gib, 1 * gib, 4, 8) == 8
    assert smallest_fitting_dcp(8.4 * gib, 9 * gib, 1 * gib, 4, 8) is None
    # libtpu's figures for Kimi-K2.5 on a v5p-16, batch 32 x 8,192, verify of 4 (results/inspect_dcp{1,8}_v5p16_*):
    # from the --dcp 1 compile (107.21 GiB, 17.16 GiB of cache) 4 fits by the estimate; from --dcp 8's, 8
    hbm = 102800042230
    assert smallest_fitting_dcp(hbm, 115115860951, 18421383168, 1, 8) == 4
    assert smallest_fitting_dcp(hbm, 81138636352, 2302672896, 8, 8) == 8


def inspect_slice(tmp_path: Path, name: str, *argv: str, timeout: int = 240) -> dict:
    """`jaxspec inspect --topology ... --json` in a fresh process on the CPU backend; the JSON report."""
    out = tmp_path / f"{name}.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "jaxspec", "inspect", *argv, "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    report["stdout"] = proc.stdout
    return report


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_tiny_on_v5p16_fits_with_hand_computed_cache_bytes(tmp_path, kv):
    report = inspect_slice(
        tmp_path, kv, "--topology", "v5p-16", "--preset", "tiny", "--batch", "2", "--tokens", "4",
        "--cache-len", "128", "--kv-cache-dtype", kv,
    )  # fmt: skip
    cfg = KimiConfig.preset("tiny")
    assert (report["device_kind"], report["devices"], report["libtpu_topology"]) == ("TPU v5", 8, "v5:2x2x2")
    assert report["hbm_bytes_per_device"] == V5P_HBM and report["fits"] is True
    assert report["margin_bytes"] == V5P_HBM - report["memory"]["total_bytes"] > 0
    assert report["kernels"]["tpu_custom_call"] >= 1  # the grouped-INT4 Mosaic kernel
    assert report["collectives"]["all-reduce"]["executed"] == 2 * 3 + 1  # 2 per layer + the embedding
    # Bytes per cached position (all 3 layers, one device; batch is not split on a 1x8 mesh):
    #   bf16: 40 values x 2 bytes; fp8: 40 e4m3 bytes + a 4-byte scale = 44, which TPU tiling pads to 48.
    assert cfg.num_hidden_layers == 3 and cfg.latent_dim == 40
    per_layer = {"auto": 40 * 2, "fp8": 48}[kv]
    assert report["cache_token_bytes_per_device"] == 3 * per_layer
    assert report["cache_logical_bytes_per_device"] == 3 * 2 * 128 * {"auto": 80, "fp8": 44}[kv]
    free = V5P_HBM - (report["memory"]["total_bytes"] - report["cache_bytes_per_device"])
    assert report["kv_capacity_tokens"] == free // (3 * per_layer)
    assert "fits, margin" in report["stdout"] and "kv_capacity_tokens" in report["stdout"]


def test_kimi_k25_decode_on_v5p16(tmp_path):
    """The full-size decode step compiles for a v5p-16 and fits: 2 all-reduces per layer + the embedding, and the
    grouped-INT4 Mosaic kernel."""
    report = inspect_slice(
        tmp_path, "decode", "--topology", "v5p-16", "--preset", "kimi-k2.5", "--batch", "1", "--tokens", "1",
        "--cache-len", "4096",
    )  # fmt: skip
    assert report["fits"] is True and report["margin_bytes"] > 10 * 2**30
    assert report["collectives"]["all-reduce"]["executed"] == 2 * 61 + 1
    assert report["kernels"]["tpu_custom_call"] == 3
    assert report["cache_token_bytes_per_device"] == 61 * 576 * 2


def test_kimi_k25_serving_layout_on_v5p16_reads_the_pool_with_the_kernel(tmp_path):
    """Serving's layout at full size (8 rows of 8,192 positions in a pool of 64-position blocks, a verify of 4): libtpu
    compiles the paged MLA kernel into both layer stacks, with the pool pinned row-major nothing of it is copied (the
    dense cache's XLA loop needs GiBs of temporaries), and a position costs the 576-wide entry padded to 640 lanes."""
    argv = ("--topology", "v5p-16", "--preset", "kimi-k2.5", "--batch", "8", "--tokens", "4", "--cache-len", "8192")
    dense = inspect_slice(tmp_path, "dense", *argv)
    paged = inspect_slice(tmp_path, "paged", *argv, "--pool-block", "64")
    assert paged["kernels"]["tpu_custom_call"] == dense["kernels"]["tpu_custom_call"] + 2  # dense + MoE layer scans
    assert paged["memory"]["temp_bytes"] < 2**30 < dense["memory"]["temp_bytes"]
    assert paged["fits"] is True and paged["kv_capacity_tokens"] > dense["kv_capacity_tokens"]
    assert 61 * 640 * 2 <= paged["cache_token_bytes_per_device"] < 1.01 * 61 * 640 * 2  # + the null block, tables


@pytest.mark.slow  # the same full-size compile as K2.5's above (its config is K2.5's: tests/test_config.py)
def test_kimi_k26_decode_on_v5p16(tmp_path):
    report = inspect_slice(
        tmp_path, "decode", "--topology", "v5p-16", "--preset", "kimi-k2.6", "--batch", "1", "--tokens", "1",
        "--cache-len", "4096",
    )  # fmt: skip
    assert report["fits"] is True and report["margin_bytes"] > 10 * 2**30
    assert report["collectives"]["all-reduce"]["executed"] == 2 * 61 + 1


def test_fp8_cache_holds_1_7x_the_positions_at_batch_32_x_8k(tmp_path):
    """Issue 29's done-when: at batch 32 x 8k the bf16 step does not fit a v5p-16 (a report, not a traceback), and
    fp8's kv_capacity_tokens is >= 1.7x bf16's."""
    argv = ("--topology", "v5p-16", "--preset", "kimi-k2.5", "--batch", "32", "--tokens", "4", "--cache-len", "8192")
    bf16 = inspect_slice(tmp_path, "bf16", *argv)
    fp8 = inspect_slice(tmp_path, "fp8", *argv, "--kv-cache-dtype", "fp8")
    assert bf16["fits"] is False and bf16["margin_bytes"] < 0 and "does NOT fit" in bf16["stdout"]
    assert bf16["required_source"].startswith("compiler error")
    assert fp8["kv_capacity_tokens"] >= 1.7 * bf16["kv_capacity_tokens"] > 0


@pytest.mark.slow  # three full-size compiles (~1-3 minutes on this CPU)
def test_dcp_fits_batch_32_x_8k_and_find_dcp_names_the_smallest(tmp_path):
    """Issue 46's done-when: at batch 32 x 8k, --dcp 8 fits a v5p-16 and its slice holds >= 7x the positions of
    --dcp 1; --find-dcp from --dcp 1 compiles --dcp 2, which fits (the estimate alone says 4)."""
    argv = ("--topology", "v5p:2x2x2", "--preset", "kimi-k2.5", "--batch", "32", "--tokens", "4", "--cache-len", "8192")
    one = inspect_slice(tmp_path, "dcp1", *argv, "--dcp", "1", "--find-dcp", timeout=600)
    eight = inspect_slice(tmp_path, "dcp8", *argv, "--dcp", "8", timeout=600)
    assert one["fits"] is False and eight["fits"] is True
    assert eight["kv_capacity_tokens"] >= 7 * one["kv_capacity_tokens"] > 0
    assert eight["kv_capacity_tokens"] == 8 * eight["kv_capacity_tokens_per_device"]
    assert one["smallest_fitting_dcp"] == 2 and "compiled" in one["smallest_fitting_dcp_scope"]
    assert eight["smallest_fitting_dcp"] == 8


@pytest.mark.slow  # ~70 s of compile on this CPU (benchmarks/results/deepseek_v3_fp8.md)
def test_deepseek_v3_fp8_decode_on_v5p16(tmp_path):
    """Issue 29: DeepSeek-V3 with its FP8 weights kept FP8 fits a v5p-16 (bf16 weights alone would need 156 GiB per
    device); 2 all-reduces per layer + the embedding."""
    report = inspect_slice(
        tmp_path, "dsv3", "--topology", "v5p-16", "--preset", "deepseek-v3", "--batch", "1", "--tokens", "1",
        "--cache-len", "4096", timeout=600,
    )  # fmt: skip
    assert report["fits"] is True and report["margin_bytes"] > 10 * 2**30
    assert report["per_device_param_bytes"] < 90 * 2**30  # one byte per FP8 value, not two
    assert report["collectives"]["all-reduce"]["executed"] == 2 * 61 + 1
    assert report["cache_token_bytes_per_device"] == 61 * 576 * 2
