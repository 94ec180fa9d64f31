"""Global arrays for runs of several processes (one program, every process running it: multi-controller SPMD).

With one process every sharding is addressable and these are `jax.device_put` and `np.asarray`. With several
(after `sharding.mesh.init_distributed`) a mesh spans devices this process cannot touch: `put_global` builds the
array from the slices this process's devices hold (no communication), and `to_host` gathers a result onto every
host: for an array that is not replicated that is a collective, so every process must call it in the same order.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Sharding


def is_leader() -> bool:
    """True on the process that prints and writes files (process 0; the only one in a single-process run)."""
    return jax.process_index() == 0


def put_global(host: Any, sharding: Sharding) -> Any:
    """Place host values (a pytree of numpy arrays, the same on every process) into `sharding`, which may span
    every process: each process copies only the slices its own devices hold."""

    def put(x):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # typed PRNG keys
            return jax.random.wrap_key_data(put(np.asarray(jax.random.key_data(x))), impl=jax.random.key_impl(x))
        if sharding.is_fully_addressable:
            return jax.device_put(x, sharding)
        x = np.asarray(x) if not isinstance(x, jax.Array) else x
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return jax.tree.map(put, host)


def zeros(shape: tuple[int, ...], dtype: Any, sharding: Sharding) -> jax.Array:
    """Zeros made in their shards by each device (nothing crosses processes; `jax.device_put` of a device array onto
    a sharding spanning processes would first gather it everywhere to check that the processes agree)."""
    return _zeros_program(tuple(shape), jnp.dtype(dtype), sharding)()


@functools.lru_cache(maxsize=64)  # one small compiled program per (shape, dtype, sharding), as jax caches its own
def _zeros_program(shape: tuple[int, ...], dtype: jnp.dtype, sharding: Sharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def to_host(tree: Any) -> Any:
    """The full value of every array in `tree` as numpy, on every process (gathered across processes if needed)."""

    def get(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return np.asarray(x)
        if x.is_fully_replicated:  # every process holds all of it
            return np.asarray(x.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(get, tree)
