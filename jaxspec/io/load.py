"""Loading checkpoints into runtime objects: `load_target`, `load_drafter`, and `load_drafter_or_random`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxspec.config import INT4_EXPERTS, ConfigError, KimiConfig
from jaxspec.io.drafter_config import Convention, draft_config_for, read_drafter_config
from jaxspec.io.drafter_hf import read_tensors
from jaxspec.io.fp8 import open_checkpoint
from jaxspec.io.hf import read_params
from jaxspec.io.orbax import check_complete, read_marker, restore_params
from jaxspec.models.quant import Int4Array
from jaxspec.pytree import flatten
from jaxspec.runtime import Drafter, Target, check_mesh
from sharding.mesh import single_device_mesh
from sharding.rules import DEFAULT_RULES, ShardingRules


def load_target(
    path: str | Path,
    *,
    mesh: Mesh | None = None,
    dtype=jnp.bfloat16,
    rules: ShardingRules = DEFAULT_RULES,
    kv_cache_dtype: str = "auto",
    dequantize_fp8: bool = False,
    dequantize_int4: bool = False,
) -> Target:
    """Load an HF-layout checkpoint directory (config.json + safetensors; bf16, INT4 pack-quantized experts, or block
    FP8), or a `jaxspec-convert target` output (Orbax), restored straight into the mesh's shardings. `kv_cache_dtype`:
    "auto" (the compute dtype) or "fp8" (float8_e4m3fn latent cache with a per-token scale).

    Block-FP8 weights (DeepSeek-V3/R1, Kimi-K2-Instruct) stay FP8 on the devices with their block scales and are
    dequantised inside each matmul; `dequantize_fp8=True` dequantises them on read to `dtype` instead (twice the
    bytes at bf16, and no dequantisation per step). Likewise INT4 pack-quantized routed experts stay 4-bit, dequantised
    per step; `dequantize_int4=True` dequantises them on read to `dtype`, to the values each step computes
    (bf16(q x scale), then `dtype`): 4x the bytes at bf16, 8x at float32, and no dequantisation per step (outputs
    agree with the packed experts' up to the order XLA sums a matmul in). XLA:CPU has no 4-bit kernels: the CLI's
    `--int4-experts auto` dequantises there (docs/cli.md)."""
    mesh = mesh or single_device_mesh()
    if read_marker(path) is not None:  # a conversion output (None for an HF directory)
        cfg = KimiConfig.from_pretrained(path)
        if dequantize_int4 and cfg.quant is not None:
            raise ConfigError(
                f"{path}: dequantize_int4 applies to HF checkpoints; this conversion keeps its experts INT4 (load the "
                "HF checkpoint to dequantise them)"
            )
        if dequantize_fp8 and cfg.fp8 is not None:
            raise ConfigError(
                f"{path}: dequantize_fp8 applies to HF checkpoints; this conversion keeps its weights FP8 (convert "
                "the HF checkpoint with --dequantize-fp8 for an unquantised one)"
            )
        check_complete(path, cfg)
        abstract = Target.abstract(cfg, mesh=mesh, dtype=dtype, int4_experts=cfg.quant is not None, rules=rules)
        params = restore_params(path, cfg, abstract.params)
        return Target(cfg, mesh, abstract.graphdef, params, rules, kv_cache_dtype)
    cfg = KimiConfig.from_pretrained(path).replace(**({"fp8": None} if dequantize_fp8 else {}))
    check_mesh(cfg, mesh, rules)  # before reading anything
    np_dtype = np.dtype(jnp.dtype(dtype))
    host = read_params(open_checkpoint(path, np_dtype), cfg, int4_experts=cfg.quant is not None, dtype=np_dtype)
    host = dict(flatten(host))
    if dequantize_int4 and cfg.quant is not None:
        host, cfg = {k: _dense(v, dtype) for k, v in host.items()}, cfg.replace(quant=None)
    return Target.from_host(cfg, host, mesh=mesh, dtype=dtype, rules=rules, kv_cache_dtype=kv_cache_dtype)


def _dense(value, dtype):
    """A host weight with INT4 values as a numpy array of `dtype` (dequantised on the host's CPU device, as a step
    would: `Int4Array.dequantize`); any other weight as it is."""
    if not isinstance(value, Int4Array):
        return value
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        int4 = Int4Array(jnp.asarray(value.packed), jnp.asarray(value.scale), value.group_size)
        return np.asarray(int4.dequantize(dtype))


def int4_experts(requested: str, path: str | Path | None, platform: str, dtype) -> tuple[bool, str]:
    """(dequantise the routed experts at load: `load_target(dequantize_int4=)`, why) for `requested` (INT4_EXPERTS)
    and the checkpoint at `path` run in `dtype` on `platform`: "packed" keeps them 4-bit, "dense" dequantises them,
    "auto" dequantises on CPU (XLA:CPU has no 4-bit kernels, so each step dequantised every expert it hit: a plain
    step of the bundled pair took 1.6x as long) where the dense experts take under a quarter of the host's memory.
    A conversion output keeps its INT4 ("dense" is refused, naming it)."""
    if requested not in INT4_EXPERTS:
        raise ValueError(f"int4_experts: expected one of {', '.join(INT4_EXPERTS)}, got {requested!r}")
    cfg = KimiConfig.from_pretrained(path) if path else None
    if requested == "packed" or cfg is None or cfg.quant is None:
        return False, "packed" if requested == "packed" else "no INT4 experts"
    if read_marker(path) is not None:
        if requested == "dense":
            raise ValueError(
                f"int4_experts: dense: {path} is a conversion output (its experts stay INT4); load the HF checkpoint"
            )
        return False, "a conversion output keeps its INT4 experts"
    if requested == "dense":
        return True, "dense as asked"
    if platform != "cpu":
        return False, f"packed, the default on {platform}"
    layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
    dense = 3 * layers * cfg.n_routed_experts * cfg.hidden_size * cfg.moe_intermediate_size * np.dtype(dtype).itemsize
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if 4 * dense > host:
        return False, f"packed: dense experts would take {dense / 2**30:.1f} GiB, over a quarter of this host's memory"
    return True, "dense, the default on CPU, which has no 4-bit kernels"


def load_drafter(
    path: str | Path,
    target: Target,
    *,
    capture_convention: Convention | None = None,
    dtype=jnp.bfloat16,
) -> Drafter:
    """Load an HF-layout EAGLE-3 drafter directory (config.json + safetensors) for `target`, on its mesh.

    `capture_convention` ("output" | "input") states how the checkpoint's layer ids are meant when the format does
    not say it unambiguously (or overrides it). Every problem is reported before anything is placed on devices.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"config.json not found in {path}")
    try:
        raw = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path / 'config.json'}: not valid JSON ({e})") from e
    cfg = read_drafter_config(raw, target_config=target.config, capture_convention=capture_convention)
    host, d2t = read_tensors(path, cfg, target.config.hidden_size, np.dtype(jnp.dtype(dtype)))
    return Drafter.from_host(cfg, target, host, d2t, dtype=dtype)


def load_drafter_or_random(path: str | Path | None, target: Target, *, seed: int = 0) -> Drafter:
    """The drafter in `path` for `target`, or (no path) a random one shaped by `draft_config_for(target.config)`;
    either way in the target's dtype. A random drafter drafts badly: for presets, smoke runs and timing."""
    if path:
        return load_drafter(path, target, dtype=target.dtype)
    return Drafter.random(draft_config_for(target.config), target, dtype=target.dtype, seed=seed)
