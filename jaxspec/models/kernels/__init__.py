"""Pallas kernels for the target model's hot loops (one module per kernel); the XLA code in the model packages is
the CPU default and the reference they are tested against."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax


@contextlib.contextmanager
def lowering_for_gpu(
    mesh: jax.sharding.Mesh | None = None, device_kind: str = "NVIDIA H200"
) -> Iterator[jax.sharding.AbstractMesh]:
    """Lower the Pallas Triton kernels for a GPU of `device_kind` on a machine without one (inside:
    `jax.export(..., platforms=["cuda"])`). jax >= 0.11 takes the target GPU from the context mesh's device and
    refuses to lower without one; 0.10 assumed compute capability 9.0 (an H100/H200). Yields that context mesh:
    `mesh`'s axes on GPUs of `device_kind` (default: one axis of one device); a sharded program must be built on it
    (e.g. `Target.abstract(cfg, mesh=<it>)`), since shard_map wants its mesh to be the context's."""
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="gpu")
    abstract = jax.sharding.AbstractMesh((1,), ("gpu",)) if mesh is None else mesh.abstract_mesh
    abstract = abstract.update(abstract_device=device)
    with jax.sharding.use_abstract_mesh(abstract):
        yield abstract
