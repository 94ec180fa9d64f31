"""What a server's start-up compiles, and whether the process's memory maps hold it (XLA:CPU).

XLA:CPU JIT-links every compiled kernel of a program as an object of its own, and each object takes about three
memory maps (code, read-only data, data) that stay while the program is loaded. A serving segment program of the
bundled pair holds hundreds of kernels, and `jaxspec serve` keeps every program it compiles (one segment program per
batch bucket x draft shape x greedy/per-row program), so a start-up can run out of maps long before
it runs out of memory: Linux's default `vm.max_map_count` is 65,530, and the next compile past it fails inside LLVM
("Cannot allocate memory") and the process dies (SIGSEGV). The serving programs are therefore compiled with
`CPU_COMPILER_OPTIONS`, which hold the same program in fewer objects, and the start-up is checked against the limit
twice: before anything compiles (`check`, from the per-program estimate below) and while the warm-up compiles
(`MapBudget.check_projection`, from what the programs compiled so far really took). GPU and TPU programs load
their code onto the device: neither check applies there.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

# The serving programs' XLA:CPU options. Without them each fused computation is a kernel of its own (the MLIR fusion
# emitters), compiled and linked as its own object, and the rest is split over up to 32 objects for parallel codegen
# (2 cores here). With them the fusions go into one LLVM module linked as one object. Measured on the bundled pair
# (`python benchmarks/serve_maps.py`, benchmarks/results/serve_maps.md): a segment program's maps fall by 38-53%, its
# first call (compile) takes 0.96-1.20x as long and its run 0.96-1.04x.
# Newer XLA:CPU drops options (jax 0.12 has no xla_cpu_use_fusion_emitters: its fusion emitters are the only ones), so
# a server uses those its jaxlib knows (`cpu_compiler_options`).
CPU_COMPILER_OPTIONS = {"xla_cpu_use_fusion_emitters": False, "xla_cpu_parallel_codegen_split_count": 1}

# The maps one program takes, by kind, measured on the bundled pair (the largest over the batch buckets, rounded up;
# tests/serving/test_startup.py checks the table in use against a compile): a segment program by (chain, per-row),
# and the programs every start-up compiles once (admit, free, the prefill chunks run alone). With the one-module
# option (jax 0.10, 0.11), and without it (jax 0.12: each fusion is an object of its own). Raised by ~12% when the
# programs gained coupled sampling, per-row speculation counters and the drafter's ragged read of its pool (jax 0.10:
# 812, 930, 945 and 1,522 measured; the jax 0.12 table scaled alike, not re-measured); by ~12% again when greedy rows'
# draws became a branch without noise (`sampling.sample_rows`, in every program's prefill chunks: 928, 1,047, 1,066
# and 1,664 measured).
SEGMENT_MAPS = {(False, False): 1020, (False, True): 1150, (True, False): 1170, (True, True): 1820}
SEGMENT_MAPS_PER_FUSION = {(False, False): 1900, (False, True): 2070, (True, False): 2070, (True, True): 2550}
FIXED_MAPS = 1100
# The share of the limit a start-up may plan to use: the rest is for what the process maps besides (threads'
# stacks, sockets, a compile's own working maps).
HEADROOM = 0.9
DEFAULT_MAP_LIMIT = 65_530  # Linux's default vm.max_map_count


@functools.cache
def cpu_compiler_options() -> tuple[tuple[str, Any], ...]:
    """The `CPU_COMPILER_OPTIONS` this jaxlib's XLA:CPU accepts, as (name, value) pairs (each tried on a one-op
    program once per process; an unknown option fails the compile)."""
    import jax
    import numpy as np

    x = jax.device_put(np.float32(0), jax.devices("cpu")[0])
    known = []
    for name, value in CPU_COMPILER_OPTIONS.items():
        try:
            jax.jit(lambda x: x + 1, compiler_options={name: value}).lower(x).compile()
        except jax.errors.JaxRuntimeError:
            continue
        known.append((name, value))
    return tuple(known)


def segment_maps() -> dict[tuple[bool, bool], int]:
    """The per-program table for this jaxlib: `SEGMENT_MAPS` when its XLA:CPU takes the one-module option."""
    one_module = "xla_cpu_use_fusion_emitters" in dict(cpu_compiler_options())
    return SEGMENT_MAPS if one_module else SEGMENT_MAPS_PER_FUSION


class StartupError(RuntimeError):
    """A serving configuration that cannot start in this process (its message names what to change)."""


def map_limit() -> int | None:
    """This system's `vm.max_map_count` (None where there is no such limit to read: not Linux)."""
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return None


def maps_in_use() -> int:
    """The memory maps this process holds now (0 where it cannot be read)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


@dataclasses.dataclass(frozen=True)
class Programs:
    """The segment programs a serving configuration compiles: batch buckets x draft shapes x (greedy, per-row)
    programs, besides the few every start-up compiles once."""

    buckets: tuple[int, ...]
    shapes: tuple  # DraftShape
    greedy_program: bool

    @classmethod
    def of(cls, config) -> Programs:
        """Of an `EngineConfig`."""
        return cls(config.buckets, config.shapes, config.greedy_program)

    @property
    def programs(self) -> tuple[bool, ...]:
        """Per (bucket, shape): the programs compiled (True: the static-greedy one)."""
        return (True, False) if self.greedy_program else (False,)

    @property
    def count(self) -> int:
        return len(self.buckets) * len(self.shapes) * len(self.programs)

    def estimated_maps(self, table: dict | None = None) -> int:
        """The memory maps these programs take on XLA:CPU (`table`, default `segment_maps()`; `FIXED_MAPS`)."""
        table = table or segment_maps()
        per_cell = sum(table[(not s.plain, not greedy)] for s in self.shapes for greedy in self.programs)
        return FIXED_MAPS + len(self.buckets) * per_cell

    def describe(self) -> str:
        return (
            f"{self.count} segment programs ({len(self.buckets)} batch buckets {list(self.buckets)} x "
            f"{len(self.shapes)} draft shapes x {len(self.programs)} programs)"
        )


@dataclasses.dataclass
class MapBudget:
    """The maps a start-up may use in this process: `limit` (vm.max_map_count) x HEADROOM, less what the process
    held before it compiled (`start`)."""

    limit: int
    start: int

    @classmethod
    def here(cls, backend: str) -> MapBudget | None:
        """This process's budget; None where maps do not bound a start-up (not XLA:CPU, or no limit to read)."""
        limit = map_limit()
        return cls(limit, maps_in_use()) if backend == "cpu" and limit is not None else None

    @property
    def usable(self) -> int:
        return int(self.limit * HEADROOM) - self.start

    def check(self, programs: Programs) -> int:
        """The maps `programs` are estimated to take; raises StartupError when they do not fit."""
        need = programs.estimated_maps()
        if need > self.usable:
            raise StartupError(self._refusal(programs, f"need about {need:,} memory maps (XLA:CPU, estimated)"))
        return need

    def check_projection(self, programs: Programs, compiled: int, used: int) -> None:
        """During the warm-up: `compiled` of the segment programs took `used` maps in all; raises StartupError when
        the rest, at the same rate, would pass the budget (before compiling them)."""
        if not compiled:
            return
        projected = used + (programs.count - compiled) * used / compiled
        if projected > self.usable:
            measured = f"would take about {projected:,.0f} memory maps ({used / compiled:,.0f} per program measured)"
            raise StartupError(self._refusal(programs, measured))

    def _refusal(self, programs: Programs, need: str) -> str:
        return (
            f"{programs.describe()} {need}, more than this process can hold: vm.max_map_count is {self.limit:,}, "
            f"{self.start:,} maps were in use before compiling, and {HEADROOM:.0%} of the limit is the most a "
            "start-up plans for. Compile fewer programs: fewer --batch-buckets, a smaller "
            "--max-batch or --max-context, or a fixed --num-steps (one draft shape instead of auto's two); or raise "
            "the limit (as root: sysctl -w vm.max_map_count=262144). Start-up costs: docs/serving.md#start-up"
        )
