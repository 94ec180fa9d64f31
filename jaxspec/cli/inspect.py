"""`jaxspec inspect`: compile one decode/verify step of a target config with abstract weights (nothing allocated)
and report its collectives and per-device memory; with --topology, for a TPU slice's devices (libtpu, deviceless),
with the chip's HBM, whether the step fits, its kernels and the KV cache positions that fit beside it."""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

from jaxspec.cli.args import (
    UsageError,
    add_dcp_arg,
    add_kv_cache_dtype_arg,
    add_target_args,
    build_target,
    check_target_args,
)

HELP = "collectives and per-device memory of a compiled decode/verify step"
DESCRIPTION = (
    "Compile one cached step of a target config on a mesh with abstract weights "
    "and report collectives (counted per execution) and per-device memory. With --topology the step is compiled "
    "for a TPU slice without a TPU (libtpu): the report adds the chip's HBM, whether the step fits, its kernels "
    "and kv_capacity_tokens."
)
_CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_target_args(p)
    add_kv_cache_dtype_arg(p)
    add_dcp_arg(p)
    p.add_argument("--batch", type=int, default=1, help="sequences per step (default: %(default)s)")
    p.add_argument(
        "--tokens", type=int, default=1, help="query tokens per step: 1 = decode, k+1 = verify (default: %(default)s)"
    )
    p.add_argument("--cache-len", type=int, default=4096, help="KV cache positions (default: %(default)s)")
    p.add_argument(
        "--pool-block",
        type=int,
        metavar="N",
        help="compile the step over serving's layout: the cache a pool of blocks of N positions read in place "
        "(the paged MLA kernel on TPU and GPU; the pool row-major on TPU); needs a mesh whose data axis is 1",
    )
    p.add_argument(
        "--topology",
        metavar="NAME",
        help="compile for a TPU slice without one (needs the tpu extra): a Cloud TPU name (v5p-16, v6e-32, "
        "tpu7x-8, ...) or libtpu's (v5:2x2x2, v6e:4x8, tpu7x:2x2x1)",
    )
    p.add_argument(
        "--find-dcp",
        action="store_true",
        help="with --topology, where the step does not fit: compile it at each larger --dcp dividing the model axis "
        "until one fits, and name that one as smallest_fitting_dcp (default: an estimate from this compile)",
    )
    p.add_argument("--json", type=Path, help="also write the report as JSON to this path")


def check(args: argparse.Namespace) -> None:
    """Everything checkable without a model: raise UsageError on the first problem."""

    def fail(message: str):
        raise UsageError("inspect", message)

    check_target_args(args, fail)
    for name in ("batch", "tokens", "cache_len"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')}: expected an integer >= 1, got {getattr(args, name)}")
    if args.pool_block is not None and (args.pool_block < 1 or args.cache_len % args.pool_block):
        fail(f"--pool-block: expected a divisor of --cache-len {args.cache_len}, got {args.pool_block}")
    if args.topology is not None:
        from sharding.topology import TopologyError, libtpu_name

        try:
            libtpu_name(args.topology)
        except TopologyError as e:
            fail(f"--{e}")
        if args.cpu_devices:
            fail("--topology compiles for the slice's own devices; drop --cpu-devices")
    elif args.find_dcp:
        fail("--find-dcp needs --topology (a slice's HBM to fit)")


def run(args: argparse.Namespace) -> int:
    from sharding import inspect
    from sharding.multihost import is_leader

    devices = slice_devices(args.topology) if args.topology else None
    target, source = build_target(args, abstract=True, devices=devices)
    start = time.perf_counter()
    compiled, oom = compile_or_oom(target, args, devices)
    seconds = time.perf_counter() - start
    report: dict[str, Any] = {
        "source": source,
        "mesh": dict(target.mesh.shape),
        "batch": args.batch,
        "tokens": args.tokens,
        "cache_len": args.cache_len,
        "kv_cache_dtype": target.kv_cache_dtype,
        "dcp": target.dcp,
        "compile_seconds": seconds,
        "per_device_param_bytes": inspect.per_device_param_bytes(target.params),
        "collective_preset": args.preset_record,
    }
    if compiled is not None:
        report["collectives"] = inspect.collective_census(compiled)
        report["memory"] = inspect.memory_report(compiled)
    if devices is not None:
        report.update(slice_report(target, args, devices, compiled, oom))
    print(
        f"{source} on mesh {report['mesh']}"
        + (f" of {report['topology']} ({report['device_kind']})" if devices is not None else "")
        + f": batch {args.batch}, {args.tokens} token(s)/step, cache {args.cache_len} ({target.kv_cache_dtype}); "
        f"compiled in {seconds:.1f}s"
    )
    print(f"parameters per device: {report['per_device_param_bytes'] / 1e9:.2f} GB (4-bit experts counted as 4 bits)")
    if compiled is not None:
        print(inspect.format_report(report["collectives"], report["memory"]))
    if devices is not None:
        print(format_slice_report(report))
    if args.json and is_leader():  # in a run of several processes, process 0 writes
        args.json.write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {args.json}")
    return 0


def slice_devices(name: str) -> tuple[Any, ...]:
    """The slice's compile-only devices, on the CPU backend (the compile must not look for a TPU)."""
    import jax

    from sharding.collectives import backend_initialized
    from sharding.topology import TopologyError, topology_devices

    if not backend_initialized():
        jax.config.update("jax_platforms", "cpu")
    # libtpu takes a machine-wide lock file when it loads; compile-only use needs no exclusive TPU access.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        return topology_devices(name)
    except TopologyError as e:
        raise UsageError("inspect", f"--{e}") from None


def compile_or_oom(target: Any, args: argparse.Namespace, devices: Any) -> tuple[Any, tuple[int, int] | None]:
    """(compiled step, None), or on a slice where it does not fit (None, (required, available) bytes)."""
    from sharding.topology import parse_oom

    try:
        return target.compile_step(args.batch, args.tokens, args.cache_len, pool_block=args.pool_block), None
    except Exception as e:
        oom = parse_oom(str(e)) if devices is not None else None
        if oom is None:
            raise
        return None, oom


def slice_report(
    target: Any, args: argparse.Namespace, devices: Any, compiled: Any, oom: tuple[int, int] | None
) -> dict[str, Any]:
    """What the slice's compiler says: HBM, fits and margin, kernels, and the cache positions that fit."""
    from sharding import inspect
    from sharding.topology import device_hbm_bytes, libtpu_name

    hbm = oom[1] if oom is not None else device_hbm_bytes(devices)
    required = oom[0] if oom is not None else compiled_total(compiled)
    data = target.mesh.shape["data"]
    positions = args.batch // data * args.cache_len // target.dcp  # the positions one device holds
    logical = target.cache_bytes_per_device(args.batch, args.cache_len)
    # The cache is the step's only donated argument: the compiler's aliased bytes are the cache as laid out in HBM
    # (tiling may pad a small minor dimension); without a compiled step, its logical bytes.
    laid_out = inspect.memory_report(compiled)["alias_bytes"] if compiled is not None else None
    cache_bytes = laid_out or logical
    out = {
        "topology": args.topology,
        "libtpu_topology": libtpu_name(args.topology),
        "device_kind": devices[0].device_kind,
        "devices": len(devices),
        "hbm_bytes_per_device": hbm,
        "required_bytes_per_device": required,
        "required_source": "compiler error (2 decimals of GiB)" if oom is not None else "memory_analysis",
        "fits": required <= hbm,
        "margin_bytes": hbm - required,
        "cache_bytes_per_device": cache_bytes,
        "cache_bytes_source": "compiler (aliased bytes)" if laid_out else "logical shape",
        "cache_logical_bytes_per_device": logical,
        "cache_token_bytes_per_device": cache_bytes / positions,
    }
    out |= capacity(target, hbm, required, cache_bytes, positions)
    if args.find_dcp and not out["fits"]:
        out |= find_dcp(target, args, devices, hbm)
    if compiled is not None:
        out["kernels"] = dict(sorted(Counter(_CUSTOM_CALL.findall(compiled.as_text())).items()))
    return out


def capacity(target: Any, hbm: int, required: int, cache_bytes: int, positions: int) -> dict[str, Any]:
    """Cache positions that fit, per device and for the slice, and the smallest --dcp (>= this one) at which this
    step's cache fits. A device holds its data shard's rows and 1/dcp of their positions; the devices of a DCP group
    hold different positions, the groups of the model axis the same ones, so the slice holds per device x data x
    dcp."""
    from sharding.topology import kv_capacity_tokens, smallest_fitting_dcp

    per_device = kv_capacity_tokens(hbm, required, cache_bytes, positions)
    model = target.mesh.shape[target.rules.model_axis]
    return {
        "kv_capacity_tokens": per_device * target.mesh.shape["data"] * target.dcp,
        "kv_capacity_tokens_per_device": per_device,
        "kv_capacity_scope": "kv_capacity_tokens: positions the whole slice holds; _per_device: one device's",
        "smallest_fitting_dcp": smallest_fitting_dcp(hbm, required, cache_bytes, target.dcp, model),
        "smallest_fitting_dcp_scope": f"among --dcp >= {target.dcp}, estimated from this compile with only the cache "
        "shrinking (conservative: a smaller --dcp may fit; compile it to know)",
    }


def find_dcp(target: Any, args: argparse.Namespace, devices: Any, hbm: int) -> dict[str, Any]:
    """--find-dcp: the smallest --dcp above this one (dividing the model axis) whose compiled step fits in HBM."""
    model = target.mesh.shape[target.rules.model_axis]
    scope = f"among --dcp >= {target.dcp}, each compiled (--find-dcp)"
    for n in range(target.dcp + 1, model + 1):
        if model % n:
            continue
        print(f"--find-dcp: compiling at --dcp {n}", flush=True)
        compiled, oom = compile_or_oom(target.with_dcp(n), args, devices)
        if oom is None and compiled_total(compiled) <= hbm:
            return {"smallest_fitting_dcp": n, "smallest_fitting_dcp_scope": scope}
    return {"smallest_fitting_dcp": None, "smallest_fitting_dcp_scope": scope}


def compiled_total(compiled: Any) -> int:
    from sharding import inspect

    total = inspect.memory_report(compiled)["total_bytes"]
    if total is None:
        raise UsageError("inspect", "--topology: the compiler reported no memory analysis for this step")
    return total


def format_slice_report(report: dict[str, Any]) -> str:
    gib = lambda n: f"{n / 2**30:.2f} GiB"
    fits = "fits" if report["fits"] else "does NOT fit"
    lines = [
        "",
        f"slice {report['topology']} = {report['libtpu_topology']}: {report['devices']} x {report['device_kind']}, "
        f"{gib(report['hbm_bytes_per_device'])} HBM per device",
        f"step needs {gib(report['required_bytes_per_device'])} per device ({report['required_source']}): {fits}, "
        f"margin {gib(report['margin_bytes'])}",
        f"kv cache: {report['cache_token_bytes_per_device']:.1f} B per position per device (all layers; "
        f"{report['cache_bytes_source']}); "
        f"kv_capacity_tokens {report['kv_capacity_tokens']} for the slice at --dcp {report['dcp']} "
        f"({report['kv_capacity_tokens_per_device']} per device) beside weights and temporaries",
        f"smallest --dcp >= {report['dcp']} at which this batch x cache length fits: "
        f"{report['smallest_fitting_dcp'] or 'none'} ({report['smallest_fitting_dcp_scope']})",
    ]
    if "kernels" in report:
        kernels = ", ".join(f"{name} x{n}" for name, n in report["kernels"].items()) or "(none)"
        lines.append(f"kernels (custom calls, static): {kernels}")
    return "\n".join(lines)
