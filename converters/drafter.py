"""Export an EAGLE-3 drafter to the SGLang/SpecForge or speculators (vLLM) layout (an MLA drafter to its own).

A drafter is checked against its target (hidden size, vocabulary, shared embedding / lm_head), but exporting needs
only the target's config and its top-level weights: the decoder layers stay abstract (nothing allocated, nothing
read), so exporting a Kimi-K2.5 drafter does not load the 1T-parameter target.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from jaxspec.config import KimiConfig
from jaxspec.io import Target, load_drafter, save_drafter
from jaxspec.io.orbax import flatten_quant, group_dir, read_marker

TOP = ("embed", "final_norm", "lm_head")


def target_for_drafter(path: str | Path, *, dtype=jnp.bfloat16) -> Target:
    """A single-device Target whose top-level weights (embed, final_norm, lm_head) are real and whose decoder layers
    are abstract: enough to load, check and export a drafter, not to run the target."""
    from converters.target import check_names, open_source, read_group

    path = Path(path)
    converted = read_marker(path) is not None
    cfg, reader = (KimiConfig.from_pretrained(path), None) if converted else open_source(path)[:2]
    int4 = cfg.quant is not None
    abstract = Target.abstract(cfg, dtype=dtype, int4_experts=int4)
    wanted = {k: flatten_quant(abstract.params[k].get_value()) for k in TOP}
    if reader is None:
        top = ocp.StandardCheckpointer().restore(group_dir(path, "top"), wanted)
    else:
        check_names(reader, cfg, int4, path)
        host = read_group(reader, cfg, "top", int4, np.dtype(jnp.dtype(dtype)))
        top = {k: jax.device_put(host[k], wanted[k].sharding) for k in TOP}
    params = nnx.from_flat_state(
        [(p, var.replace(top[p[0]]) if p[0] in TOP else var) for p, var in nnx.to_flat_state(abstract.params)]
    )
    return dataclasses.replace(abstract, params=params)


def export_drafter(
    src: str | Path,
    target: str | Path,
    dst: str | Path,
    *,
    format: str,
    dtype: str = "bfloat16",
    verifier: str | None = None,
) -> None:
    """Load the drafter in `src` (either HF format) for `target` and write it to `dst` in `format`."""
    dt = jnp.dtype(dtype)
    drafter = load_drafter(src, target_for_drafter(target, dtype=dt), dtype=dt)
    save_drafter(drafter, dst, format=format, verifier=verifier or str(target))
