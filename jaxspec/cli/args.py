"""Argument groups shared by the `jaxspec` commands (each flag declared once here) and the helpers that turn them
into a target and a drafter.

Commands differ in which of the target flags they offer (`tune` has no --devices: its preset sweep re-runs itself in
child processes that would not see a device subset; `train-drafter` and `serve` load a directory only) and in what
their defaults mean, so the groups take options instead of being copied.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from jaxspec.decoding.draft_shape import DraftShape

DTYPES = ("bfloat16", "float32")
MODEL_HELP = "HF-layout checkpoint directory (config.json + safetensors)"
MESH_HELP = "mesh shape DATAxMODEL, e.g. 1x8 (default: all devices on MODEL)"
DTYPE_HELP = (
    "compute dtype (default: for a checkpoint, float32 on CPU, which computes it faster than bfloat16, else the "
    "checkpoint's own (bfloat16 when it is neither); for a --preset, bfloat16)"
)
DTYPE_DEFAULT_HELP = (
    "compute dtype (default: float32 on CPU, which computes it faster than bfloat16, else the checkpoint's own, "
    "bfloat16 when it is neither; the start-up log states which and why)"
)


class UsageError(SystemExit):
    """A bad argument or input file, reported as one argparse-style line (no traceback)."""

    def __init__(self, command: str, message: str):
        super().__init__(f"jaxspec {command}: error: {message}")


# ----------------------------------------------------------------------------------------------- argument groups
def add_model_arg(p: argparse.ArgumentParser, help: str = MODEL_HELP) -> None:
    p.add_argument("--model", help=help)


def add_mesh_arg(p: argparse.ArgumentParser, help: str = MESH_HELP) -> None:
    p.add_argument("--mesh", default=None, help=help)


def add_dtype_arg(p: argparse.ArgumentParser, default: str | None = None, help: str = DTYPE_HELP) -> None:
    p.add_argument("--dtype", default=default, choices=list(DTYPES), help=help)


def add_drafter_arg(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--drafter", default=None, help=help)


def add_target_args(p: argparse.ArgumentParser, *, devices: bool = True) -> None:
    """--model, --preset, --mesh, --dtype and (with `devices`) --devices: the target flags of most commands."""
    add_model_arg(p)
    p.add_argument(
        "--preset",
        default=None,
        help="a named config instead of --model: tiny, tiny-dsv3, kimi-k2.5, kimi-k2.6, deepseek-v3",
    )
    add_mesh_arg(p)
    if devices:
        p.add_argument(
            "--devices",
            default=None,
            metavar="SPEC",
            help="use a subset of the devices for the mesh: a count (4 = the first four), ids (0,2,4,6) or a range "
            "(4-7)",
        )
    add_dtype_arg(p)
    add_int4_experts_arg(p)


def add_int4_experts_arg(p: argparse.ArgumentParser) -> None:
    """--int4-experts: how an INT4 checkpoint's routed experts are held (`int4_experts`)."""
    from jaxspec.config import INT4_EXPERTS

    p.add_argument(
        "--int4-experts",
        default="auto",
        choices=INT4_EXPERTS,
        help="routed experts of an INT4 checkpoint: packed = 4-bit on the devices, dequantised in each step; dense = "
        "dequantised once at load to the compute dtype (8x the bytes at float32); auto = dense on CPU, which has no "
        "4-bit kernels, where they take under a quarter of this host's memory, else packed (default: %(default)s)",
    )


def int4_experts(requested: str, model: str | Path | None, platform: str, dtype: Any, command: str) -> tuple[bool, str]:
    """`jaxspec.io.load.int4_experts` for --int4-experts: (load the routed experts dense, why); refusals name the
    flag."""
    from jaxspec.config import ConfigError
    from jaxspec.io.load import int4_experts as decide

    try:
        return decide(requested, model, platform, dtype)
    except ConfigError:
        raise  # the checkpoint's own config: reported as any command reports it
    except ValueError as e:
        raise UsageError(command, f"--int4-experts: {str(e).removeprefix('int4_experts: ')}") from None


def add_kv_cache_dtype_arg(p: argparse.ArgumentParser) -> None:
    """--kv-cache-dtype: how the target's latent KV cache is stored."""
    from jaxspec.config import KV_CACHE_DTYPES

    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=list(KV_CACHE_DTYPES),
        help="target KV cache: auto = the compute dtype, fp8 = float8_e4m3 with a per-token scale, half the bytes "
        "(default: %(default)s)",
    )


def add_dcp_arg(p: argparse.ArgumentParser) -> None:
    """--dcp: decode context parallelism, the target's latent cache striped by position over the model axis."""
    p.add_argument(
        "--dcp",
        type=int,
        default=1,
        help="decode context parallelism: stripe the target's KV cache by position over groups of N devices of the "
        "model axis, each holding 1/N of every row's positions (N divides the model axis; default: %(default)s, "
        "every device holds every position)",
    )


def add_num_steps_args(p: argparse.ArgumentParser, *, default: str, auto_help: str) -> None:
    """--num-steps (an integer or 'auto') and --tune DIR (where 'auto' reads the recommended configuration)."""
    p.add_argument(
        "--num-steps",
        default=default,
        help=f"draft tokens per cycle, 0 = plain decoding, or 'auto': {auto_help} (default: %(default)s)",
    )
    p.add_argument("--tune", type=Path, help="directory holding tune.json from 'jaxspec tune' (for --num-steps auto)")


def add_tree_args(p: argparse.ArgumentParser) -> None:
    """--topk and --num-draft-tokens (tree drafts; --num-steps is then the tree's depth)."""
    p.add_argument(
        "--topk",
        type=int,
        default=1,
        help="tree drafts: children kept per frontier node, 1 = a chain (%(default)s); --num-steps is the tree depth",
    )
    p.add_argument(
        "--num-draft-tokens",
        type=int,
        default=None,
        help="tree drafts: nodes verified per cycle, the root included (default: every candidate, at most 64)",
    )


# Commands that refuse --coordinator/--distributed, and why.
SINGLE_PROCESS = {
    "train-drafter": "the trainer places its batches on local devices",
}


def add_distributed_args(p: argparse.ArgumentParser) -> None:
    """The global flags that join a run of several processes (one per host; every process runs the same command)."""
    p.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="join a multi-process run whose process 0 listens at HOST:PORT (give --num-processes and --process-id)",
    )
    p.add_argument("--num-processes", type=int, metavar="N", help="processes in the run (with --coordinator)")
    p.add_argument("--process-id", type=int, metavar="I", help="this process's index, 0..N-1 (with --coordinator)")
    p.add_argument(
        "--distributed",
        action="store_true",
        help="join a multi-process run described by the environment (TPU pod slices, SLURM, Open MPI)",
    )


def check_distributed_args(args: argparse.Namespace, fail: Callable[[str], NoReturn] | None = None) -> None:
    """The flags of `add_distributed_args`, checked before anything starts (`fail`: default a UsageError of
    `args.command`)."""

    def usage(message: str) -> NoReturn:
        raise UsageError(args.command, message)

    fail = fail or usage
    given = [name for name in ("coordinator", "num_processes", "process_id") if getattr(args, name) is not None]
    flags = ", ".join("--" + name.replace("_", "-") for name in given)
    if args.distributed and given:
        fail(f"--distributed reads the cluster from the environment: drop {flags}")
    if given and len(given) < 3:
        fail(f"{flags}: give --coordinator, --num-processes and --process-id together")
    command = getattr(args, "command", None)
    if (given or args.distributed) and command in SINGLE_PROCESS:
        fail(f"runs as one process only ({SINGLE_PROCESS[command]})")
    if (given or args.distributed) and command == "tune" and args.presets:
        fail("--presets re-runs tune in child processes: sweep presets as one process")
    if given:
        host, _, port = args.coordinator.rpartition(":")
        if not host or not port.isdigit():
            fail(f"--coordinator: expected HOST:PORT, got {args.coordinator!r}")
        if args.num_processes < 1:
            fail(f"--num-processes: expected an integer >= 1, got {args.num_processes}")
        if not 0 <= args.process_id < args.num_processes:
            fail(f"--process-id: expected 0..{args.num_processes - 1}, got {args.process_id}")


def join_distributed(args: argparse.Namespace) -> bool:
    """Join the run the flags describe (before anything touches a device); True when this process prints and writes
    (process 0, or the only one)."""
    if not (args.distributed or args.coordinator):
        return True
    from sharding.mesh import init_distributed
    from sharding.multihost import is_leader

    init_distributed(args.coordinator, args.num_processes, args.process_id)
    return is_leader()


# ----------------------------------------------------------------------------------------------- checks
def int_list(text: str, flag: str, fail: Callable[[str], NoReturn]) -> list[int]:
    """Comma-separated non-negative token ids, or `fail` with a message naming `flag`."""
    try:
        ids = [int(t) for t in text.split(",")]
    except ValueError:
        fail(f"{flag}: expected comma-separated integers, got {text!r}")
    if min(ids) < 0:
        fail(f"{flag}: token ids must be >= 0, got {text!r}")
    return ids


def check_target_args(args: argparse.Namespace, fail: Callable[[str], NoReturn]) -> None:
    """The target flags of `add_target_args`, checked without loading anything."""
    if args.model and args.preset:
        fail("give --model or --preset, not both")
    if args.model:
        model = Path(args.model)
        if not model.is_dir():
            fail(f"--model: {model} is not a directory")
        if not (model / "config.json").is_file():
            fail(f"--model: {model} holds no config.json")
    if args.preset:
        from jaxspec.config import PRESETS

        if args.preset not in PRESETS:
            fail(f"--preset: unknown preset {args.preset!r} (available: {', '.join(sorted(PRESETS))})")
    if args.mesh is not None:
        from sharding.mesh import parse_shape

        try:
            parse_shape(args.mesh)
        except ValueError as e:
            fail(f"--mesh: {e}")
    if getattr(args, "devices", None) is not None:
        from sharding.mesh import parse_devices

        try:
            parse_devices(args.devices)
        except ValueError as e:
            fail(f"--{e}")


def draft_shape(args: argparse.Namespace, fail: Callable[[str], NoReturn]) -> DraftShape:
    """The one draft shape of --num-steps (an integer by now), --topk and --num-draft-tokens, or `fail` with
    DraftShape's message in flag names."""
    try:
        return DraftShape(args.num_steps, args.topk, args.num_draft_tokens)
    except ValueError as e:
        fail(re.sub(r"\b(topk|num_steps|num_draft_tokens)\b", lambda m: "--" + m[1].replace("_", "-"), str(e)))


def auto_num_steps(args: argparse.Namespace, path: Path) -> int:
    """--num-steps auto: the num_steps of the shape tune.json at `path` recommends; when it is a tree and neither
    --topk nor --num-draft-tokens was given, they are set to the tree's (an explicit one wins)."""
    shape = recommended_shape(path)
    if shape.tree and args.topk == 1 and args.num_draft_tokens is None:
        args.topk, args.num_draft_tokens = shape.topk, shape.num_draft_tokens
    return shape.num_steps


def recommended_shape(path: Path) -> DraftShape:
    """The draft shape a tune.json recommends (`recommended`: num_steps, topk, num_draft_tokens). A tune.json from
    before tree sweeps holds a chain depth only (`recommended_k`)."""
    report = json.loads(path.read_text())
    try:
        if "recommended" in report:
            return DraftShape.from_dict(report["recommended"])
        if "recommended_k" in report:
            return DraftShape(int(report["recommended_k"]))
    except (KeyError, TypeError, ValueError) as e:
        raise SystemExit(f"jaxspec: --num-steps auto: {path}: the recommended draft shape is unreadable: {e}") from None
    raise SystemExit(
        f"jaxspec: --num-steps auto: {path} holds no recommendation (is it the tune.json of 'jaxspec tune'?)"
    )


# ----------------------------------------------------------------------------------------------- target, drafter
def use_bundled_pair(args: argparse.Namespace) -> bool:
    """With neither --model nor --preset, point the arguments at the bundled trained pair (target, drafter) and
    return True; otherwise leave them alone and return False. Its compute dtype is any checkpoint's
    (`default_dtype`)."""
    if args.model or getattr(args, "preset", None):
        return False
    from jaxspec import bundled

    target_dir, drafter_dir = bundled.paths()
    args.model, args.drafter = str(target_dir), args.drafter or str(drafter_dir)
    return True


def default_dtype(requested: str | None, model: str | Path | None, platform: str) -> tuple[Any, str]:
    """(compute dtype, why) for a checkpoint at `model` run on `platform`: --dtype when given; else float32 on CPU
    (CPUs compute it faster than bfloat16, and bfloat16's rounding can turn a near-tie between two logits into a
    different greedy token, so plain and speculative texts of one checkpoint could differ); else the checkpoint's
    own dtype (config.json's `torch_dtype` or `dtype`) when it is one of DTYPES, and bfloat16 when it is not. The
    same however the path is spelled: the bundled pair is a checkpoint like any other."""
    import jax.numpy as jnp

    if requested:
        return jnp.dtype(requested), "--dtype"
    if platform == "cpu":
        return jnp.dtype("float32"), "the default on CPU, which computes float32 faster than bfloat16"
    config = Path(model) / "config.json" if model else None
    saved = None
    if config is not None and config.is_file():
        fields = json.loads(config.read_text())
        saved = fields.get("torch_dtype") or fields.get("dtype")
    if saved in DTYPES:
        return jnp.dtype(saved), f"the checkpoint's dtype on {platform}"
    return jnp.dtype("bfloat16"), f"the default on {platform} (the checkpoint's dtype: {saved or 'not stated'})"


def build_target(args: argparse.Namespace, *, abstract: bool, devices: Any = None) -> tuple[Any, str]:
    """`_build_target`'s target, its cache striped as --dcp asks (where the command has the flag)."""
    target, source = _build_target(args, abstract=abstract, devices=devices)
    return striped(args, target), source


def _build_target(args: argparse.Namespace, *, abstract: bool, devices: Any = None) -> tuple[Any, str]:
    """(Target, where it came from) for the target flags: --model's checkpoint, or --preset (default tiny) with random
    weights; `abstract`: shapes only (nothing allocated). `devices`: what the mesh (and --devices) draws from
    (default: all of JAX's), e.g. a TPU slice's compile-only devices. --kv-cache-dtype, where the command has it,
    sets the cache format, and --dcp the cache's striping."""
    import jax.numpy as jnp

    from jaxspec import KimiConfig, Target, load_target
    from sharding.mesh import make_mesh, platform_of, select_devices

    if args.model and args.preset:
        raise UsageError(args.command, "give --model or --preset, not both")
    try:
        if getattr(args, "devices", None):
            devices = select_devices(args.devices, devices)
        mesh = make_mesh(args.mesh, devices)
    except ValueError as e:
        raise UsageError(args.command, f"--mesh/--devices: {e}") from None
    kv = getattr(args, "kv_cache_dtype", "auto")
    dtype = jnp.dtype(args.dtype or "bfloat16")  # a preset, or a plan: the deployment's dtype
    if args.model:
        if abstract:
            cfg = KimiConfig.from_pretrained(args.model)
            return Target.abstract(cfg, mesh=mesh, dtype=dtype, kv_cache_dtype=kv), args.model
        platform = platform_of(mesh)
        dtype, _ = default_dtype(args.dtype, args.model, platform)  # a checkpoint run here
        dense, _ = int4_experts(getattr(args, "int4_experts", "auto"), args.model, platform, dtype, args.command)
        return load_target(args.model, mesh=mesh, dtype=dtype, kv_cache_dtype=kv, dequantize_int4=dense), args.model
    name = args.preset or "tiny"
    cfg = KimiConfig.preset(name)
    if abstract:
        return Target.abstract(cfg, mesh=mesh, dtype=dtype, kv_cache_dtype=kv), f"preset {name!r}"
    return Target.random(cfg, mesh=mesh, dtype=dtype, kv_cache_dtype=kv), f"preset {name!r} (random weights)"


def striped(args: argparse.Namespace, target: Any) -> Any:
    """`target` with the cache striping --dcp asks for (where the command has the flag); a usage error naming --dcp
    when it does not divide the mesh's model axis."""
    try:
        return target.with_dcp(getattr(args, "dcp", 1))
    except ValueError as e:
        raise UsageError(args.command, f"--dcp: {e}") from None
