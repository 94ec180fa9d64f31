"""Simulated multi-device meshes on the CPU backend.

XLA's CPU client runs every per-device launch and every collective on one thread pool of
max(cores, device_count) threads. With 8 simulated devices on a 2-core machine that pool is exactly 8 threads; a
launch blocked on the per-device in-flight semaphore holds one of them and an all-reduce can then never gather its 8
participants ("Expected 8 threads to join the rendezvous"). PJRT_NPROC raises the pool size. It must be set before
the CPU backend is created, so this is the one place that does both.
"""

from __future__ import annotations

import os

# (dispatching threads + 1) x devices is enough; 32 covers 8 devices with headroom and costs nothing measurable.
MIN_PJRT_NPROC = 32


def simulate_cpu_devices(n: int = 8) -> None:
    """Give the CPU backend `n` devices and a thread pool large enough for their collectives.

    Must run before JAX creates its backend (before the first `jax.devices()`); `import jax` beforehand is fine.
    """
    if n < 1:
        raise ValueError(f"simulate_cpu_devices: n must be >= 1, got {n}")
    current = int(os.environ.get("PJRT_NPROC", "0") or 0)
    if current < MIN_PJRT_NPROC:
        os.environ["PJRT_NPROC"] = str(MIN_PJRT_NPROC)
    import jax

    from sharding.collectives import backend_initialized

    if backend_initialized():
        if jax.device_count() != n:
            raise RuntimeError(
                f"simulate_cpu_devices({n}) called after JAX initialised its backend with {jax.device_count()} "
                "devices; call it before the first jax.devices()"
            )
        return
    jax.config.update("jax_num_cpu_devices", n)
    jax.config.update("jax_platforms", "cpu")
