"""Guard for the simulated 8-device CPU mesh: many unsynchronised collectives must not deadlock.

Without PJRT_NPROC (sharding/cpu.py) XLA's CPU all-reduce waits forever for threads that are busy dispatching
("Expected 8 threads to join the rendezvous"); the per-test timeout turns such a hang into a failure.
"""

import os

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sharding.cpu import MIN_PJRT_NPROC
from sharding.mesh import make_mesh


def test_environment_has_8_devices_and_thread_pool():
    assert jax.device_count() == 8
    assert int(os.environ["PJRT_NPROC"]) >= MIN_PJRT_NPROC


@pytest.mark.timeout(120)
def test_200_unsynchronised_collectives_complete():
    mesh = make_mesh("1x8")
    step = jax.jit(
        jax.shard_map(
            lambda x: jax.lax.psum(x, "model") / 8 + 1, mesh=mesh, in_specs=P(None, "model"), out_specs=P(None, "model")
        )
    )
    x = jax.device_put(jnp.ones((4, 64)), NamedSharding(mesh, P(None, "model")))
    for _ in range(200):
        x = step(x)  # no block_until_ready: dispatch runs ahead of execution
    assert float(x.block_until_ready().addressable_data(0)[0, 0]) == 201.0


def test_mesh_layouts_and_errors():
    from sharding.mesh import init_distributed, parse_shape

    assert dict(make_mesh("2x4").shape) == {"data": 2, "model": 4} and dict(make_mesh().shape)["model"] == 8
    with pytest.raises(ValueError, match="needs 12 devices, 8 available"):
        make_mesh("3x4")
    with pytest.raises(ValueError, match="expected 'DATAxMODEL'"):
        parse_shape("8")
    with pytest.raises(ValueError, match="together"):
        init_distributed("localhost:1234")
    with pytest.raises(ValueError, match="process_id 2 not in"):
        init_distributed("localhost:1234", 2, 2)
