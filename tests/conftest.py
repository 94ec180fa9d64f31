"""Every test runs on 8 simulated CPU devices.

The CPU thread-pool fix (PJRT_NPROC) must be in the environment before JAX creates its CPU backend, or programs
with collectives deadlock on 2-core machines (see sharding/cpu.py). Both settings go through the one helper that
the CLI and benchmarks use too.
"""

from sharding.cpu import simulate_cpu_devices

simulate_cpu_devices(8)

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)

import functools  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """hf_checkpoint(kind) -> (path, torch model): a tiny random HF DeepseekV3 checkpoint, built once per session."""
    from tests.reference.hf_tiny import save_hf_model

    @functools.cache
    def build(kind: str):
        path = tmp_path_factory.mktemp(f"hf_{kind}")
        return path, save_hf_model(kind, path)

    return build


# Every compiled CPU program keeps its machine code in memory mappings of its own, and one pytest process compiles
# thousands of programs: measured on this suite, the process passed 56,000 mappings, near Linux's default
# vm.max_map_count (65,530), where the next compile segfaults inside XLA. So after a module, when the mappings pass
# MAX_MAPPINGS, JAX's compiled programs are dropped (the later modules recompile what they need).
MAX_MAPPINGS = 30_000


def _mappings() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: no such limit to watch
        return 0


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    yield
    if _mappings() > MAX_MAPPINGS:
        import gc

        jax.clear_caches()
        gc.collect()
