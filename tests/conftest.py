"""Every test runs on 8 simulated CPU devices.

The CPU thread-pool fix (PJRT_NPROC) must be in the environment before JAX creates its CPU backend, or programs
with collectives deadlock on 2-core machines (see sharding/cpu.py). Both settings go through the one helper that
the CLI and benchmarks use too.
"""

import atexit
import os
import shutil
import tempfile

from sharding.cpu import simulate_cpu_devices

simulate_cpu_devices(8)

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)

# One persistent compilation cache per run (JAX's, in a fresh directory removed at exit): the same programs (the
# bundled pair's prefill, segments and warm-up) are compiled by many modules' engines and by every server a test
# starts in a subprocess, which inherits the directory through the environment. A fresh directory, so a run never
# reads what an earlier one compiled; a size limit, because with one JAX locks the directory around each read and
# write (tests start processes that compile the same programs at once); a 0.5 s floor, as writing an executable
# costs more than compiling a small one. A test that measures a compile itself opts out (`without_compilation_cache`).
# Under pytest-xdist (the README's `-n 2`) the workers share the directory of the process that started them (they
# inherit its environment), which alone removes it.
XLA_CACHE = os.environ.get("JAXSPEC_TESTS_XLA_CACHE") if "PYTEST_XDIST_WORKER" in os.environ else None
if not XLA_CACHE:
    XLA_CACHE = os.environ["JAXSPEC_TESTS_XLA_CACHE"] = tempfile.mkdtemp(prefix="jaxspec-tests-xla-")
    atexit.register(shutil.rmtree, XLA_CACHE, ignore_errors=True)
XLA_CACHE_SETTINGS = {
    "jax_compilation_cache_dir": XLA_CACHE,
    "jax_compilation_cache_max_size": 64 << 30,
    "jax_persistent_cache_min_compile_time_secs": 0.5,
}
os.environ.update({name.upper(): str(value) for name, value in XLA_CACHE_SETTINGS.items()})  # for subprocesses
for name, value in XLA_CACHE_SETTINGS.items():  # this process (JAX read its environment at import)
    jax.config.update(name, value)

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


@pytest.fixture
def without_compilation_cache():
    """Compiles from scratch within the test (JAX's persistent cache off, then back on), for a test that measures what
    a compile does."""
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_enable_compilation_cache", True)
    compilation_cache.reset_cache()
