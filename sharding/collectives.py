"""Named collective presets: XLA flags (plus the env vars NCCL/libtpu still read) in place of NCCL knobs.

A preset is applied once, before JAX creates its backend, because XLA parses XLA_FLAGS, libtpu parses
LIBTPU_INIT_ARGS and NCCL reads NCCL_* only when they initialise. `apply_preset` refuses to run afterwards
rather than silently doing nothing. Record `describe(preset)` next to every benchmark number.

Every XLA flag below was checked against the installed jaxlib: the name appears in the strings of
`jaxlib/libjax_common.so` (jaxlib 0.10.2), and tests/sharding/test_collectives.py starts a fresh CPU
interpreter with each preset's XLA_FLAGS. XLA aborts the process on an unknown flag or enum value; the CPU
jaxlib parses the whole DebugOptions table, so GPU flags are accepted (and ignored) on CPU and that test
really checks their names and values. TPU flags are not in the CPU jaxlib (only libtpu defines them), so the
TPU preset puts them in LIBTPU_INIT_ARGS, which libtpu parses; they cannot be verified without a TPU.

Merge policy: a flag or env var the user already set wins over the preset (so one knob can be overridden
from the shell); `apply_preset` reports what it added and what it left alone.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

# Env vars whose value is a space-separated list of --flags, merged flag by flag rather than replaced.
FLAG_ENV_VARS = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
PLATFORMS = ("any", "cpu", "gpu", "tpu")


def _flag_name(flag: str) -> str:
    """'--xla_foo=1' -> 'xla_foo'; ValueError on anything that is not a --flag."""
    if not flag.startswith("--") or len(flag) < 3:
        raise ValueError(f"not an XLA flag (expected '--name[=value]'): {flag!r}")
    return flag[2:].split("=", 1)[0]


@dataclass(frozen=True)
class CollectivePreset:
    """A named set of XLA flags (-> XLA_FLAGS) and env vars for one platform."""

    name: str
    description: str
    xla_flags: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict, hash=False)
    platform: str = "any"

    def __post_init__(self) -> None:
        if self.platform not in PLATFORMS:
            raise ValueError(f"preset {self.name!r}: platform {self.platform!r} is not one of {PLATFORMS}")
        for flag in self.xla_flags:
            _flag_name(flag)  # validates the form
        object.__setattr__(self, "xla_flags", tuple(self.xla_flags))
        object.__setattr__(self, "env", MappingProxyType(dict(self.env)))


_MiB = 1 << 20

PRESETS: dict[str, CollectivePreset] = {
    p.name: p
    for p in (
        CollectivePreset(
            name="default",
            description="No changes: XLA's and NCCL's defaults; the baseline other presets are measured by.",
        ),
        CollectivePreset(
            name="gpu-latency",
            description=(
                "Batch-1 decode/verify on one NVLink host: ~2 small (~14 KB) dependent all-reduces per "
                "layer, so latency, not bandwidth, dominates. Latency-hiding scheduler, one-shot all-reduce "
                "kernel, combining only small independent all-reduces, CUDA-graph command buffers over "
                "collectives and loops (fewer launches), NCCL restricted to its low-latency protocols."
            ),
            platform="gpu",
            xla_flags=(
                "--xla_gpu_enable_latency_hiding_scheduler=true",
                # Single-host one-shot all-reduce kernel (XLA calls it unsupported/internal: measure it).
                "--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true",
                f"--xla_gpu_all_reduce_combine_threshold_bytes={1 * _MiB}",
                "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,COLLECTIVES,WHILE,CONDITIONAL",
                "--xla_gpu_enable_highest_priority_async_stream=true",
            ),
            # Read by NCCL when XLA creates its communicators. LL/LL128 are NCCL's low-latency protocols;
            # Simple only pays off for large messages. NCCL_ALGO is left to NCCL's tuner (NVLS/Ring/Tree).
            env={"NCCL_PROTO": "LL,LL128"},
        ),
        CollectivePreset(
            name="gpu-throughput",
            description=(
                "Prefill, batched serving and drafter training: large collectives. Latency-hiding "
                "scheduler, 128 MiB combine thresholds, pipelined (loop-overlapped) all-gather, "
                "reduce-scatter and all-reduce, while-loop double buffering, NCCL LL128/Simple protocols."
            ),
            platform="gpu",
            xla_flags=(
                "--xla_gpu_enable_latency_hiding_scheduler=true",
                f"--xla_gpu_all_reduce_combine_threshold_bytes={128 * _MiB}",
                f"--xla_gpu_all_gather_combine_threshold_bytes={128 * _MiB}",
                f"--xla_gpu_reduce_scatter_combine_threshold_bytes={128 * _MiB}",
                "--xla_gpu_enable_pipelined_all_gather=true",
                "--xla_gpu_enable_pipelined_reduce_scatter=true",
                "--xla_gpu_enable_pipelined_all_reduce=true",
                "--xla_gpu_enable_while_loop_double_buffering=true",
            ),
            env={"NCCL_PROTO": "LL128,Simple"},
        ),
        CollectivePreset(
            name="tpu-async",
            description=(
                "TPU: async collective fusion (collectives overlapped with compute, across loop steps). "
                "These flags exist only in libtpu, not in the CPU/GPU jaxlib (XLA_FLAGS would abort on "
                "them), so they go in LIBTPU_INIT_ARGS; unverified off-TPU."
            ),
            platform="tpu",
            env={
                "LIBTPU_INIT_ARGS": " ".join(
                    (
                        "--xla_tpu_enable_async_collective_fusion=true",
                        "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",
                        "--xla_tpu_enable_async_collective_fusion_multiple_steps=true",
                        "--xla_tpu_overlap_compute_collective_tc=true",
                        "--xla_enable_async_all_gather=true",
                        "--xla_enable_async_collective_permute=true",
                    )
                )
            },
        ),
        CollectivePreset(
            name="cpu-sim",
            description=(
                "Simulated CPU mesh: no flags. The setting that matters (PJRT_NPROC >= 32, so collectives "
                "on 8 simulated devices cannot deadlock on a 2-core machine, plus the device count) is made "
                "by sharding.cpu.simulate_cpu_devices, which must also run before the backend starts. Use "
                "it for correctness and collective counts, never for speed."
            ),
            platform="cpu",
        ),
    )
}


def get_preset(name: str) -> CollectivePreset:
    """The preset registered under `name`; ValueError listing the valid names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        valid = ", ".join(sorted(PRESETS))
        raise ValueError(f"unknown collective preset {name!r}; valid presets: {valid}") from None


def backend_initialized() -> bool:
    """True once JAX has created a backend (after which XLA_FLAGS/NCCL env changes have no effect)."""
    xla_bridge = sys.modules.get("jax._src.xla_bridge")
    if xla_bridge is None:  # jax's backend module not even imported yet
        return False
    try:
        return bool(xla_bridge._backends)
    except Exception:  # private attribute moved: assume not initialised rather than block every run
        return False


def apply_preset(
    preset_or_name: CollectivePreset | str, *, environ: MutableMapping[str, str] = os.environ
) -> dict[str, Any]:
    """Merge a preset into `environ` (default: the process environment) before JAX starts its backend.

    XLA flags are appended to XLA_FLAGS; a flag whose name is already there keeps the user's value. Env vars
    are set unless already present (the user's value wins); LIBTPU_INIT_ARGS is merged flag by flag like
    XLA_FLAGS. Raises RuntimeError when applied to os.environ after the JAX backend exists, since nothing
    would change then (a custom `environ` mapping, e.g. for a subprocess, is always allowed).
    Returns what was added and what was kept from the user.
    """
    preset = get_preset(preset_or_name) if isinstance(preset_or_name, str) else preset_or_name
    if not preset.xla_flags and not preset.env:  # nothing to set: valid at any time
        return {"preset": preset.name, "added": {}, "kept_user": {}}
    if environ is os.environ and backend_initialized():
        raise RuntimeError(
            f"apply_preset({preset.name!r}): the JAX backend is already initialised, and XLA_FLAGS, NCCL_* "
            "and LIBTPU_INIT_ARGS are only read when it starts. Apply the preset before the first "
            "jax.devices(), jit call or array creation (importing jax is fine), e.g. at the top of main."
        )
    added: dict[str, list[str]] = {}
    kept_user: dict[str, list[str]] = {}
    env_items: list[tuple[str, str]] = [("XLA_FLAGS", " ".join(preset.xla_flags))] if preset.xla_flags else []
    env_items += list(preset.env.items())
    for key, value in env_items:
        if key in FLAG_ENV_VARS:
            merged, new, kept = merge_flags(environ.get(key, ""), shlex.split(value))
            if new:
                environ[key] = merged
                added.setdefault(key, []).extend(new)
            if kept:
                kept_user.setdefault(key, []).extend(kept)
        elif key in environ and environ[key] != value:
            kept_user.setdefault(key, []).append(f"{key}={environ[key]}")
        elif key not in environ:
            environ[key] = value
            added.setdefault(key, []).append(f"{key}={value}")
    return {"preset": preset.name, "added": added, "kept_user": kept_user}


def merge_flags(existing: str, flags: list[str] | tuple[str, ...]) -> tuple[str, list[str], list[str]]:
    """Append `flags` to the flag string `existing`, skipping any whose name is already present.

    Returns (merged string, flags added, existing flags that overrode a preset flag of the same name).
    """
    current = shlex.split(existing)
    present = {_flag_name(f): f for f in current if f.startswith("--")}
    added, kept = [], []
    for flag in flags:
        name = _flag_name(flag)
        if name in present:
            if present[name] != flag:
                kept.append(present[name])
            continue
        present[name] = flag
        added.append(flag)
    return " ".join(current + added), added, kept


def describe(preset_or_name: CollectivePreset | str) -> dict[str, Any]:
    """A JSON-ready record of the preset and the JAX/jaxlib versions, for benchmark output."""
    preset = get_preset(preset_or_name) if isinstance(preset_or_name, str) else preset_or_name
    try:
        import jax
        import jaxlib

        versions = {"jax": jax.__version__, "jaxlib": jaxlib.__version__}
    except ImportError:  # pragma: no cover - jax is a hard dependency
        versions = {"jax": None, "jaxlib": None}
    return {
        "name": preset.name,
        "platform": preset.platform,
        "description": preset.description,
        "xla_flags": list(preset.xla_flags),
        "env": dict(preset.env),
        **versions,
    }


# ----------------------------------------------------------------------------------------------------------
# Reductions over vocab-split logits (call inside shard_map). Each device holds V/n consecutive vocabulary
# entries; these combine per-device results with collectives on [B, T]-sized (or [B, T, k]-sized) values, so
# the [B, T, V] logits are never gathered.


def first_argmax(x: Any) -> Any:
    """`jnp.argmax(x, axis=-1)` as int32 (the first maximum; the first NaN where there is one), as two plain
    reductions: the maximum, then the lowest index holding it. XLA:CPU runs argmax as one reduction over (value,
    index) pairs, which it does not vectorise: `benchmarks/first_argmax.py` measured this 1.87x as fast over a 4-row
    k = 4 verify's [20, 4096] float32 logits and 3.4x over the bundled drafter's [4, 2048] (2-core CPU)."""
    import jax
    import jax.numpy as jnp

    top = jnp.max(x, axis=-1, keepdims=True)
    hit = (x == top) | jnp.isnan(x) if jnp.issubdtype(x.dtype, jnp.floating) else x == top
    ids = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(hit, ids, x.shape[-1]), axis=-1)


def sharded_argmax(logits_local: Any, axis_name: str) -> Any:
    """Global argmax over the last (vocab-split) axis; ties resolve to the lowest id, as `jnp.argmax` does."""
    import jax
    import jax.numpy as jnp

    v_local = logits_local.shape[-1]
    local_max = jnp.max(logits_local, axis=-1)
    local_arg = first_argmax(logits_local) + jax.lax.axis_index(axis_name) * v_local
    best = jax.lax.pmax(local_max, axis_name)
    candidate = jnp.where(local_max == best, local_arg, jnp.iinfo(jnp.int32).max)
    return jax.lax.pmin(candidate, axis_name)


def sharded_top_k(logits_local: Any, k: int, axis_name: str) -> tuple[Any, Any]:
    """Global top-k (values, ids) over the last (vocab-split) axis: local top-k, combine n*k candidates, top-k.

    The candidates are combined with a psum of one-hot-placed slots (an all-gather of n*k values per token written
    as an all-reduce), whose result is provably replicated, as shard_map's out_specs require."""
    import jax
    import jax.numpy as jnp

    v_local = logits_local.shape[-1]
    if k > v_local:
        raise ValueError(f"sharded_top_k: k={k} exceeds the per-device vocabulary slice ({v_local})")
    n, me = jax.lax.psum(1, axis_name), jax.lax.axis_index(axis_name)
    vals, ids = jax.lax.top_k(logits_local, k)
    ids = ids.astype(jnp.int32) + me * v_local
    slots = (*vals.shape[:-1], n * k)
    place = lambda x: jax.lax.dynamic_update_slice_in_dim(jnp.zeros(slots, x.dtype), x, me * k, axis=-1)
    all_vals = jax.lax.psum(place(vals.astype(jnp.float32)), axis_name)
    all_ids = jax.lax.psum(place(ids), axis_name)
    top_vals, pos = jax.lax.top_k(all_vals, k)
    return top_vals.astype(logits_local.dtype), jnp.take_along_axis(all_ids, pos, axis=-1)
