"""Loading checkpoints into runtime objects: `load_target`, `load_drafter`, and `load_drafter_or_random`."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxspec.config import ConfigError, KimiConfig
from jaxspec.io.drafter_config import Convention, draft_config_for, read_drafter_config
from jaxspec.io.drafter_hf import read_tensors
from jaxspec.io.fp8 import open_checkpoint
from jaxspec.io.hf import read_params
from jaxspec.io.orbax import check_complete, read_marker, restore_params
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
) -> Target:
    """Load an HF-layout checkpoint directory (config.json + safetensors; bf16, INT4 pack-quantized experts, or block
    FP8), or a `jaxspec-convert target` output (Orbax), restored straight into the mesh's shardings. `kv_cache_dtype`:
    "auto" (the compute dtype) or "fp8" (float8_e4m3fn latent cache with a per-token scale).

    Block-FP8 weights (DeepSeek-V3/R1, Kimi-K2-Instruct) stay FP8 on the devices with their block scales and are
    dequantised inside each matmul; `dequantize_fp8=True` dequantises them on read to `dtype` instead (twice the
    bytes at bf16, and no dequantisation per step)."""
    mesh = mesh or single_device_mesh()
    if read_marker(path) is not None:  # a conversion output (None for an HF directory)
        cfg = KimiConfig.from_pretrained(path)
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
    return Target.from_host(
        cfg, dict(flatten(host)), mesh=mesh, dtype=dtype, rules=rules, kv_cache_dtype=kv_cache_dtype
    )


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
