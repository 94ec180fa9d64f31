"""Collective presets: registry, merge policy, refusal after backend start, and real XLA startup per preset; and
`first_argmax`, the argmax the greedy paths (and `sharded_argmax`) take.

The startup test runs each preset in a fresh interpreter: XLA aborts on an unknown flag name or enum value,
and the CPU jaxlib parses the full DebugOptions table (GPU flags included), so it checks every XLA flag.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sharding.collectives import (
    PRESETS,
    CollectivePreset,
    apply_preset,
    describe,
    first_argmax,
    get_preset,
    merge_flags,
)

ROOT = Path(__file__).resolve().parents[2]


def test_registry_has_required_presets() -> None:
    assert {"default", "gpu-latency", "gpu-throughput", "tpu-async", "cpu-sim"} <= set(PRESETS)
    assert get_preset("default").xla_flags == () and not get_preset("default").env
    assert get_preset("gpu-latency").platform == "gpu"
    assert get_preset("tpu-async").platform == "tpu"
    # TPU flags are not known to the CPU/GPU jaxlib: they must not be in XLA_FLAGS.
    assert get_preset("tpu-async").xla_flags == ()
    assert "--xla_tpu_enable_async_collective_fusion=true" in get_preset("tpu-async").env["LIBTPU_INIT_ARGS"]
    lat = get_preset("gpu-latency").xla_flags
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in lat
    assert any(f.startswith("--xla_gpu_all_reduce_combine_threshold_bytes=") for f in lat)
    assert any(f.startswith("--xla_gpu_enable_command_buffer=") for f in lat)
    assert "NCCL_PROTO" in get_preset("gpu-latency").env


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_is_well_formed(name: str) -> None:
    preset = PRESETS[name]
    assert preset.name == name and preset.description
    names = [f[2:].split("=", 1)[0] for f in preset.xla_flags]
    assert len(names) == len(set(names)), f"duplicate flag in {name}"
    for flag in preset.xla_flags:
        assert flag.startswith("--xla_"), flag
        if preset.platform == "gpu":
            assert flag.startswith("--xla_gpu_"), flag
    with pytest.raises(dataclasses.FrozenInstanceError):
        preset.name = "x"  # type: ignore[misc]


def test_get_preset_unknown_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="unknown collective preset 'gpu-fast'.*gpu-latency"):
        get_preset("gpu-fast")


def test_bad_flag_and_platform_rejected() -> None:
    with pytest.raises(ValueError, match="not an XLA flag"):
        CollectivePreset(name="x", description="x", xla_flags=("xla_gpu_foo=1",))
    with pytest.raises(ValueError, match="platform"):
        CollectivePreset(name="x", description="x", platform="npu")


def test_merge_flags_user_value_wins_and_no_duplicates() -> None:
    merged, added, kept = merge_flags("--xla_a=1 --xla_b=user", ["--xla_b=preset", "--xla_c=3", "--xla_a=1"])
    assert merged == "--xla_a=1 --xla_b=user --xla_c=3"
    assert added == ["--xla_c=3"]
    assert kept == ["--xla_b=user"]


def test_apply_preset_to_mapping() -> None:
    env = {
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_gpu_enable_latency_hiding_scheduler=false",
        "NCCL_PROTO": "Simple",
    }
    result = apply_preset("gpu-latency", environ=env)
    flags = env["XLA_FLAGS"].split()
    assert flags[:2] == [
        "--xla_force_host_platform_device_count=8",
        "--xla_gpu_enable_latency_hiding_scheduler=false",  # the user's explicit value wins
    ]
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in flags
    for flag in get_preset("gpu-latency").xla_flags[1:]:
        assert flags.count(flag) == 1, flag
    assert env["NCCL_PROTO"] == "Simple"
    assert result["kept_user"]["NCCL_PROTO"] == ["NCCL_PROTO=Simple"]
    assert "--xla_gpu_enable_latency_hiding_scheduler=false" in result["kept_user"]["XLA_FLAGS"]
    before = dict(env)
    again = apply_preset(get_preset("gpu-latency"), environ=env)  # idempotent
    assert env == before and again["added"] == {}


def test_apply_tpu_preset_merges_libtpu_args() -> None:
    env = {"LIBTPU_INIT_ARGS": "--xla_tpu_enable_async_collective_fusion=false TPU_MEGACORE=MEGACORE_DENSE"}
    apply_preset("tpu-async", environ=env)
    args = env["LIBTPU_INIT_ARGS"].split()
    assert args[:2] == ["--xla_tpu_enable_async_collective_fusion=false", "TPU_MEGACORE=MEGACORE_DENSE"]
    assert "--xla_tpu_overlap_compute_collective_tc=true" in args
    assert "XLA_FLAGS" not in env


def test_apply_preset_after_backend_init_raises() -> None:
    jax.devices()  # make sure the backend exists
    before = os.environ.get("XLA_FLAGS")
    with pytest.raises(RuntimeError, match="already initialised"):
        apply_preset("gpu-latency")
    assert os.environ.get("XLA_FLAGS") == before


def test_describe_records_versions() -> None:
    import jaxlib

    d = describe("gpu-throughput")
    assert d["name"] == "gpu-throughput" and d["platform"] == "gpu"
    assert d["xla_flags"] == list(get_preset("gpu-throughput").xla_flags)
    assert d["jax"] == jax.__version__ and d["jaxlib"] == jaxlib.__version__
    json.dumps(d)


_CHILD = textwrap.dedent(
    """
    import json, os, sys
    from sharding.collectives import apply_preset
    applied = apply_preset(sys.argv[1])
    import jax, jax.numpy as jnp
    jax.config.update("jax_platforms", "cpu")
    y = jax.jit(lambda x: (x * 2).sum())(jnp.arange(4.0))
    print(json.dumps({"y": float(y), "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
                      "env": {k: os.environ.get(k) for k in sys.argv[2:]}}))
    """
)


def _run_child(name: str, env_keys: list[str], extra_env: dict[str, str] | None = None):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "NCCL_PROTO")}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", **(extra_env or {}))
    return subprocess.run(
        [sys.executable, "-c", _CHILD, name, *env_keys],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_starts_xla_in_fresh_interpreter(name: str) -> None:
    preset = PRESETS[name]
    proc = _run_child(name, list(preset.env))
    assert proc.returncode == 0, f"XLA rejected preset {name}:\n{proc.stderr[-3000:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["y"] == 12.0
    for flag in preset.xla_flags:
        assert flag in out["XLA_FLAGS"].split()
    for key, value in preset.env.items():
        assert out["env"][key] == value


def test_unknown_xla_flag_aborts_startup() -> None:
    """Control for the test above: a misspelt flag must make the child fail, or that test proves nothing."""
    proc = _run_child("default", [], {"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_schedular=true"})
    assert proc.returncode != 0
    assert "Unknown flag" in proc.stderr


@settings(deadline=None, max_examples=60)
@given(
    shape=st.tuples(st.integers(1, 5), st.integers(1, 70)),
    levels=st.integers(1, 6),  # few distinct values: many ties
    nans=st.integers(0, 3),
    dtype=st.sampled_from(["float32", "bfloat16", "int32"]),
    seed=st.integers(0, 2**16),
)
def test_first_argmax_is_jnp_argmax(shape, levels, nans, dtype, seed) -> None:
    """`first_argmax` (max, then the lowest index holding it) gives `jnp.argmax`'s ids: the first maximum among ties,
    the first NaN where a row has one, int32."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.integers(-levels, levels, shape).astype(np.float32) * 0.5
    if dtype != "int32":
        x[rng.integers(0, shape[0], nans), rng.integers(0, shape[1], nans)] = np.nan
    x = jnp.asarray(x, dtype)
    got = jax.jit(first_argmax)(x)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(x, axis=-1)))
