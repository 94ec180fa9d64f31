"""Mesh construction: a ("data", "model") mesh over local or global devices (multi-host: `init_distributed` first;
`jax.devices()` then lists every process's devices and the same program runs on one CPU process, one 8-GPU host or a
TPU slice)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

DATA, MODEL = "data", "model"
AXES = (DATA, MODEL)


def parse_shape(shape: str | Sequence[int]) -> tuple[int, int]:
    """'1x8' or (1, 8) -> (data, model)."""
    if isinstance(shape, str):
        try:
            parts = tuple(int(p) for p in shape.lower().split("x"))
        except ValueError:
            parts = ()
    else:
        parts = tuple(int(p) for p in shape)
    if len(parts) != 2 or min(parts) < 1:
        raise ValueError(f"mesh shape: expected 'DATAxMODEL' like '1x8' or '2x4', got {shape!r}")
    return parts  # type: ignore[return-value]


def make_mesh(shape: str | Sequence[int] | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 2-D mesh (data, model). Default: all devices on the model axis (1 x N)."""
    devices = list(jax.devices() if devices is None else devices)
    data, model = parse_shape(shape) if shape is not None else (1, len(devices))
    if data * model != len(devices):
        hint = (
            f"; to use a subset pass devices=jax.devices()[:{data * model}] (CLI: --devices {data * model})"
            if data * model < len(devices)
            else ""
        )
        raise ValueError(f"mesh shape {data}x{model} needs {data * model} devices, {len(devices)} available{hint}")
    return Mesh(np.asarray(devices).reshape(data, model), AXES, axis_types=(AxisType.Explicit,) * 2)


def parse_devices(spec: str) -> list[int]:
    """Device ids named by `spec`: a count ("4": ids 0-3), ids ("0,2,4,6") or ranges ("4-7"); distinct, >= 0."""
    text = spec.strip()
    try:
        if "," in text or "-" in text:
            ids = []
            for part in text.split(","):
                lo, _, hi = part.partition("-")
                ids += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
        else:
            ids = list(range(int(text)))
    except ValueError:
        ids = []
    if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
        raise ValueError(
            f"devices: expected a count like '4', distinct ids like '0,2,4,6' or a range like '4-7', got {spec!r}"
        )
    return ids


def select_devices(spec: str, devices: Sequence[jax.Device] | None = None) -> list[jax.Device]:
    """The devices `spec` names (see `parse_devices`), from `devices` (default: all of them)."""
    devices = list(jax.devices() if devices is None else devices)
    ids = parse_devices(spec)
    if max(ids) >= len(devices):
        raise ValueError(f"devices {spec!r}: ids must be in [0, {len(devices)}) ({len(devices)} devices)")
    return [devices[i] for i in ids]


def init_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    initialization_timeout: int = 300,
    heartbeat_timeout: int = 60,
) -> None:
    """Join a multi-host run before anything touches a device; `make_mesh` then spans every process's devices.

    With no arguments JAX reads the cluster from the environment (TPU pod slices, SLURM, Open MPI, or
    JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID). On one host with local devices, skip this call.
    Every process waits up to `initialization_timeout` seconds for the others to join; once joined, a process that
    stops answering for `heartbeat_timeout` seconds (killed, or its host lost) makes the coordination service end
    every other process with an error naming it, instead of leaving them waiting in a collective.
    """
    given = [coordinator_address is not None, num_processes is not None, process_id is not None]
    if any(given) and not all(given):
        raise ValueError("init_distributed: give coordinator_address, num_processes and process_id together (or none)")
    if num_processes is not None and not 0 <= process_id < num_processes:
        raise ValueError(f"init_distributed: process_id {process_id} not in [0, num_processes={num_processes})")
    for name, value in (("initialization_timeout", initialization_timeout), ("heartbeat_timeout", heartbeat_timeout)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"init_distributed: {name} must be a whole number of seconds >= 1, got {value!r}")
    jax.distributed.initialize(
        coordinator_address,
        num_processes,
        process_id,
        initialization_timeout=initialization_timeout,
        heartbeat_timeout_seconds=heartbeat_timeout,
    )


def single_device_mesh() -> Mesh:
    return make_mesh((1, 1), jax.devices()[:1])


def platform_of(mesh: Mesh | jax.sharding.AbstractMesh) -> str | None:
    """The platform ("cpu", "gpu", "tpu", ...) of `mesh`'s devices; of an abstract mesh (`jax.export`, deviceless
    lowering) its abstract device's, or None where it names none."""
    if isinstance(mesh, jax.sharding.AbstractMesh):
        device = mesh.abstract_device
        return None if device is None else device.platform
    return mesh.devices.flat[0].platform
