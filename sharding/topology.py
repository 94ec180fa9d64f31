"""TPU slices without a TPU: slice names, compile-only devices from libtpu, and what the compiler says about HBM.

With `jax[tpu]` at jax's own version (the `tpu` extra: jax 0.10.2 pairs with libtpu 0.0.42.1) and the CPU backend
(`JAX_PLATFORMS=cpu`, so no TPU is searched for), `jax.experimental.topologies.get_topology_desc` gives compile-only
devices of any slice; a mesh over them lowers and compiles programs for that slice as it would on the pod. This is
how MaxText plans TPU jobs (`train_compile.py`).

Names: libtpu's (`v5:2x2x2`, `tpu7x:2x2x1`, `v6e:4x8`: generation, then the chip grid) or the names Cloud TPU uses
for the same slices (`v5p-16`, `tpu7x-8`, `v6e-32`). The number in a Cloud name counts TensorCores on v4, v5p and
tpu7x (two per chip) and chips on v5e and v6e (one core each).

HBM per device is the compiler's: it states it when a program does not fit ("Ran out of memory on HBM, the total
memory required for HLO temporaries (107.21G) exceeds available HBM (95.74G)"), so `device_hbm_bytes` compiles a
program that cannot fit and reads the figure (G and T there are GiB and TiB, two decimals).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

import jax

# Chip grids of the slices each generation is sold in (libtpu's topology names; MaxText's table).
_GRID_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_GRID_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8"}


def _cloud_names() -> dict[str, str]:
    names = {}
    for cloud, libtpu in (("v5e", "v5e"), ("v5litepod", "v5e"), ("v6e", "v6e")):  # one core per chip
        names.update({f"{cloud}-{chips}": f"{libtpu}:{grid}" for chips, grid in _GRID_2D.items()})
    for cloud, libtpu in (("v4", "v4"), ("v5p", "v5"), ("tpu7x", "tpu7x")):  # two cores per chip
        names.update({f"{cloud}-{2 * chips}": f"{libtpu}:{grid}" for chips, grid in _GRID_3D.items()})
    return names


CLOUD_NAMES: dict[str, str] = _cloud_names()  # "v5p-16" -> "v5:2x2x2"
_LIBTPU_NAME = re.compile(r"^(v4|v5|v5p|v5e|v6e|tpu7x):(\d+x\d+(?:x\d+)?)$")
_OOM = re.compile(
    r"Ran out of memory on HBM, the total memory required(?: for [\w ]+)? \(([\d.]+)([KMGT]?)\) "
    r"exceeds available HBM \(([\d.]+)([KMGT]?)\)"
)
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


class TopologyError(ValueError):
    """An unknown slice name, or a libtpu that cannot describe it."""


def accepted_names() -> str:
    """The accepted names, for error messages and --help."""
    clouds = ", ".join(CLOUD_NAMES)
    return f"Cloud TPU names ({clouds}) or libtpu names GEN:GRID with GEN in v4, v5, v5e, v6e, tpu7x (e.g. v5:2x2x2)"


def libtpu_name(name: str) -> str:
    """The libtpu topology name for `name` (a Cloud TPU name like v5p-16, or a libtpu name like v5:2x2x2)."""
    text = name.strip().lower()
    if text in CLOUD_NAMES:
        return CLOUD_NAMES[text]
    if _LIBTPU_NAME.match(text):
        return text
    raise TopologyError(f"topology: unknown slice {name!r}; accepted: {accepted_names()}")


@functools.cache
def topology_devices(name: str) -> tuple[Any, ...]:
    """Compile-only devices of the slice `name` (needs libtpu: `pip install 'jaxspec[tpu]'`)."""
    from jax.experimental import topologies

    resolved = libtpu_name(name)
    try:
        topo = topologies.get_topology_desc(platform="tpu", topology_name=resolved)
    except Exception as e:  # libtpu missing, or a grid it does not know
        hint = " (is libtpu installed? pip install 'jaxspec[tpu]')" if "tpu" in str(e).lower() else ""
        raise TopologyError(f"topology {name!r} ({resolved}): libtpu could not describe it: {e}{hint}") from None
    return tuple(topo.devices)


def parse_oom(message: str) -> tuple[int, int] | None:
    """(required bytes, available bytes) from the compiler's out-of-HBM error, or None if `message` is not one.
    The compiler prints two decimals of GiB/TiB, so both are exact to about 10 MB."""
    m = _OOM.search(message)
    if m is None:
        return None
    required, available = (float(m.group(i)) * _UNITS[m.group(i + 1)] for i in (1, 3))
    return round(required), round(available)


@functools.cache
def device_hbm_bytes(devices: Sequence[Any]) -> int:
    """HBM per device as the compiler states it: compile a program that cannot fit on `devices[0]` and read the
    'available HBM' its error gives."""
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    big = jax.ShapeDtypeStruct((2**40 // 4,), jnp.float32, sharding=SingleDeviceSharding(devices[0]))
    try:
        jax.jit(lambda x: x * 2 + 1).lower(big).compile()
    except Exception as e:
        parsed = parse_oom(str(e))
        if parsed is not None:
            return parsed[1]
        raise TopologyError(f"HBM probe on {devices[0].device_kind}: unexpected compiler error: {e}") from None
    raise TopologyError(f"HBM probe on {devices[0].device_kind}: a 4 TiB program compiled; cannot read the HBM size")


def kv_capacity_tokens(hbm_bytes: int, step_bytes: int, cache_bytes: int, cache_positions: int) -> int:
    """Cache positions per device that fit beside everything else the step holds.

    `step_bytes`: the step's peak per device (arguments + outputs - aliased + temporaries), its cache included;
    `cache_bytes`: that cache's bytes per device, holding `cache_positions` positions (local rows x cache length,
    every layer). Weights and temporaries are `step_bytes - cache_bytes`; the capacity is what HBM leaves beside
    them, in positions at the cache's bytes per position (0 when they alone do not fit)."""
    if cache_bytes <= 0 or cache_positions <= 0:
        raise ValueError(f"cache_bytes, cache_positions: expected > 0, got {cache_bytes}, {cache_positions}")
    return max(0, (hbm_bytes - (step_bytes - cache_bytes)) * cache_positions // cache_bytes)


def smallest_fitting_dcp(hbm_bytes: int, step_bytes: int, cache_bytes: int, dcp: int, model: int) -> int | None:
    """The smallest --dcp >= `dcp` dividing the `model`-device axis at which a step fits in `hbm_bytes`, estimated
    from one compile at `dcp` (`step_bytes` per device, `cache_bytes` of it the cache): everything but the cache
    stays, the cache shrinks as 1/dcp; None if none fits. Conservative: libtpu's temporaries for Kimi-K2.5 hold about
    one more cache's worth, which shrinks too (v5p-16, batch 32 x 8,192: from --dcp 1's compile this says 4, compiled
    2 fits). A smaller --dcp than the one compiled is not estimated (its temporaries grow): compile it."""
    whole, rest = cache_bytes * dcp, step_bytes - cache_bytes  # the cache at dcp 1; weights and temporaries
    fitting = [n for n in range(dcp, model + 1) if model % n == 0 and rest + whole / n <= hbm_bytes]
    return fitting[0] if fitting else None
