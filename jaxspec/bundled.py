"""The bundled model pair: a small Kimi-architecture target trained on Python standard library source (INT4 routed
experts, compressed-tensors format) and an EAGLE-3 drafter trained for it with `jaxspec.training`.

They live in the repository under `assets/kimi-py-tiny/` (`target/`, `drafter/`, `prompts.json` with held-out
prompts) and load like any downloaded checkpoint; `assets/build/` holds the seeded scripts that reproduce them.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "assets" / "kimi-py-tiny"


def paths() -> tuple[Path, Path]:
    """(target directory, drafter directory) of the bundled pair."""
    target, drafter = ROOT / "target", ROOT / "drafter"
    for d in (target, drafter):
        if not (d / "config.json").is_file():
            raise FileNotFoundError(
                f"bundled pair: {d / 'config.json'} not found. The pair ships in the jaxspec repository "
                "(assets/kimi-py-tiny); install from a checkout with `pip install -e .`, or pass --model/--drafter."
            )
    return target, drafter


def prompts() -> list[str]:
    """Held-out prompts (functions from standard-library files the pair never trained on)."""
    path = ROOT / "prompts.json"
    if not path.is_file():
        raise FileNotFoundError(f"bundled pair: {path} not found")
    return json.loads(path.read_text())["held_out"]


def load_pair(mesh=None, dtype=None, int4_experts: str = "auto"):
    """(target, drafter, tokenizer) of the bundled pair on `mesh` (default: one device).

    dtype defaults to float32: the weights are bf16 on disk, and CPUs compute float32 faster than bfloat16.
    `int4_experts` as `jaxspec serve --int4-experts` takes it: "packed" (4-bit, dequantised in each step), "dense"
    (dequantised at load), "auto" (dense on CPU, which has no 4-bit kernels, else packed).
    """
    import jax.numpy as jnp

    from jaxspec.io import load_drafter, load_target
    from jaxspec.io.load import int4_experts as dense_experts
    from jaxspec.tokenizer import load_tokenizer
    from sharding.mesh import platform_of, single_device_mesh

    dtype = jnp.float32 if dtype is None else dtype
    mesh = mesh or single_device_mesh()
    target_dir, drafter_dir = paths()
    dense, _ = dense_experts(int4_experts, target_dir, platform_of(mesh), dtype)
    target = load_target(target_dir, mesh=mesh, dtype=dtype, dequantize_int4=dense)
    return target, load_drafter(drafter_dir, target, dtype=dtype), load_tokenizer(target_dir)
