"""`jaxspec inspect`: compile one decode/verify step of a target config with abstract weights (nothing allocated)
and report its collectives and per-device memory."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from jaxspec.cli.args import UsageError, add_target_args, build_target, check_target_args

HELP = "collectives and per-device memory of a compiled decode/verify step"
DESCRIPTION = (
    "Compile one cached step of a target config on a mesh with abstract weights "
    "and report collectives (counted per execution) and per-device memory."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_target_args(p)
    p.add_argument("--batch", type=int, default=1, help="sequences per step (default: %(default)s)")
    p.add_argument(
        "--tokens", type=int, default=1, help="query tokens per step: 1 = decode, k+1 = verify (default: %(default)s)"
    )
    p.add_argument("--cache-len", type=int, default=4096, help="KV cache positions (default: %(default)s)")
    p.add_argument("--json", type=Path, help="also write the report as JSON to this path")


def check(args: argparse.Namespace) -> None:
    """Everything checkable without a model: raise UsageError on the first problem."""

    def fail(message: str):
        raise UsageError("inspect", message)

    check_target_args(args, fail)
    for name in ("batch", "tokens", "cache_len"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')}: expected an integer >= 1, got {getattr(args, name)}")


def run(args: argparse.Namespace) -> int:
    from sharding import inspect
    from sharding.multihost import is_leader

    target, source = build_target(args, abstract=True)
    start = time.perf_counter()
    compiled = target.compile_step(args.batch, args.tokens, args.cache_len)
    seconds = time.perf_counter() - start
    census, memory = inspect.collective_census(compiled), inspect.memory_report(compiled)
    params = inspect.per_device_param_bytes(target.params)
    print(
        f"{source} on mesh {dict(target.mesh.shape)}: batch {args.batch}, {args.tokens} token(s)/step, "
        f"cache {args.cache_len}; compiled in {seconds:.1f}s"
    )
    print(f"parameters per device: {params / 1e9:.2f} GB (4-bit experts counted as 4 bits)")
    print(inspect.format_report(census, memory))
    if args.json and is_leader():  # in a run of several processes, process 0 writes
        report = {
            "source": source,
            "mesh": dict(target.mesh.shape),
            "batch": args.batch,
            "tokens": args.tokens,
            "cache_len": args.cache_len,
            "compile_seconds": seconds,
            "per_device_param_bytes": params,
            "collectives": census,
            "memory": memory,
            "collective_preset": args.preset_record,
        }
        args.json.write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {args.json}")
    return 0
