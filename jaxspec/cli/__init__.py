"""The `jaxspec` command: one module per subcommand, the shared flags in `jaxspec.cli.args`.

    jaxspec generate  speculative (or plain) generation with a target and an EAGLE-3 drafter
    jaxspec predict   load a target and print its next-token predictions for a prompt of token ids
    jaxspec tune      sweep the draft depth, time each phase, model the trade-off and recommend k
    jaxspec train-drafter  train an EAGLE-3 drafter on the target's own responses (exports SGLang format)
    jaxspec serve     OpenAI-compatible HTTP server (continuous batching, speculative decoding, /metrics)
    jaxspec inspect   compile one decode/verify step (abstract weights: nothing allocated) and report its
                      collectives and per-device memory

Each command module has HELP, DESCRIPTION, add_arguments(parser) and run(args), and, where arguments can be checked
before anything loads, check(args). Process-wide settings (simulated CPU devices, collective presets) must be made
before JAX starts its backend, so they are global options handled before anything touches a device.

Several processes (a TPU slice of several hosts, GPUs over several nodes): every process runs the same command with
`--coordinator HOST:PORT --num-processes N --process-id I` (or `--distributed`, where JAX finds the cluster itself:
TPU pod slices, SLURM, Open MPI) before the command; the mesh then spans every process's devices. Only process 0
prints and writes files (docs/multi-host.md).
"""

from __future__ import annotations

import argparse
import os
import sys

from jaxspec.cli import generate, inspect, predict, serve, train_drafter, tune
from jaxspec.cli.args import UsageError

# Subcommand name -> module, in the order `jaxspec --help` lists them.
COMMANDS = {
    "predict": predict,
    "generate": generate,
    "tune": tune,
    "train-drafter": train_drafter,
    "serve": serve,
    "inspect": inspect,
}
# Commands whose bad input files (config, checkpoint) are reported as one usage line instead of a traceback.
INPUT_ERRORS_AS_USAGE = ("generate", "predict", "inspect")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxspec", description="EAGLE-3 speculative decoding for Kimi-K2.5 in JAX.")
    p.add_argument(
        "--cpu-devices",
        type=int,
        default=0,
        metavar="N",
        help="simulate N CPU devices (try meshes without accelerators; sets PJRT_NPROC too)",
    )
    p.add_argument(
        "--collective-preset",
        default="default",
        metavar="NAME",
        help="XLA collective preset applied before JAX starts: default, gpu-latency, gpu-throughput, "
        "tpu-async, cpu-sim (see sharding/collectives.py)",
    )
    group = p.add_argument_group("several processes (one program over several hosts; docs/multi-host.md)")
    group.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address, the same for every process")
    group.add_argument("--num-processes", type=int, metavar="N", help="processes in the run (with --coordinator)")
    group.add_argument("--process-id", type=int, metavar="I", help="this process, 0..N-1 (with --coordinator)")
    group.add_argument(
        "--distributed",
        action="store_true",
        help="join a multi-process run JAX detects itself (TPU pod slices, SLURM, Open MPI)",
    )
    sub = p.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        module.add_arguments(sub.add_parser(name, help=module.HELP, description=module.DESCRIPTION))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from jaxspec.config import ConfigError
    from jaxspec.io import CheckpointError
    from sharding.collectives import PRESETS, apply_preset, describe

    if args.collective_preset not in PRESETS:
        valid = ", ".join(sorted(PRESETS))
        raise UsageError(
            args.command, f"--collective-preset: unknown collective preset {args.collective_preset!r} (valid: {valid})"
        )
    command = COMMANDS[args.command]
    if hasattr(command, "check"):
        command.check(args)  # everything checkable without loading a model, before anything loads
    applied = apply_preset(args.collective_preset)
    if args.cpu_devices:
        from sharding.cpu import simulate_cpu_devices

        simulate_cpu_devices(args.cpu_devices)
    args.preset_record = describe(applied["preset"])
    _join_processes(args)
    if args.command not in INPUT_ERRORS_AS_USAGE:
        return command.run(args)
    try:
        return command.run(args)
    except (ConfigError, CheckpointError, FileNotFoundError) as e:  # bad input files: one line, not a traceback
        raise UsageError(args.command, str(e)) from None


def _join_processes(args: argparse.Namespace) -> None:
    """--coordinator / --num-processes / --process-id, or --distributed: join the run before any device is touched;
    processes other than 0 then print nothing (their output would repeat process 0's)."""
    given = {"--coordinator": args.coordinator, "--num-processes": args.num_processes, "--process-id": args.process_id}
    named = [flag for flag, value in given.items() if value is not None]
    if not named and not args.distributed:
        return
    if args.distributed and named:
        raise UsageError(args.command, f"--distributed detects the cluster itself: drop {', '.join(named)}")
    if named and len(named) < 3:
        missing = ", ".join(flag for flag in given if flag not in named)
        raise UsageError(args.command, f"{', '.join(named)} needs {missing} too (or --distributed alone)")
    if named and not 0 <= args.process_id < args.num_processes:
        raise UsageError(args.command, f"--process-id: expected 0..{args.num_processes - 1}, got {args.process_id}")
    import jax

    from sharding.mesh import init_distributed

    init_distributed(args.coordinator, args.num_processes, args.process_id)
    if jax.process_index() != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115  (for the rest of the process: process 0 prints)


if __name__ == "__main__":
    sys.exit(main())
