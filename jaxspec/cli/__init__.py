"""The `jaxspec` command: one module per subcommand, the shared flags in `jaxspec.cli.args`.

    jaxspec generate  speculative (or plain) generation with a target and an EAGLE-3 drafter
    jaxspec predict   load a target and print its next-token predictions for a prompt of token ids
    jaxspec tune      sweep the draft depth, time each phase, model the trade-off and recommend k
    jaxspec train-drafter  train an EAGLE-3 drafter on the target's own responses (exports SGLang format)
    jaxspec serve     OpenAI-compatible HTTP server (continuous batching, speculative decoding, /metrics)
    jaxspec inspect   compile one decode/verify step (abstract weights: nothing allocated) and report its
                      collectives and per-device memory

Each command module has HELP, DESCRIPTION, add_arguments(parser) and run(args), and, where arguments can be checked
before anything loads, check(args). Process-wide settings (simulated CPU devices, collective presets, joining a run of
several processes) must be made before JAX starts its backend, so they are global options handled before anything
touches a device. In a run of several processes every process runs the command; only process 0 prints and writes
files (the others' standard output is discarded; errors still show on each).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from jaxspec.cli import generate, inspect, predict, serve, train_drafter, tune
from jaxspec.cli.args import UsageError, add_distributed_args, check_distributed_args, join_distributed

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
    add_distributed_args(p)
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
    check_distributed_args(args)
    if hasattr(command, "check"):
        command.check(args)  # everything checkable without loading a model, before anything loads
    applied = apply_preset(args.collective_preset)
    if args.cpu_devices:
        from sharding.cpu import simulate_cpu_devices

        simulate_cpu_devices(args.cpu_devices)
    args.preset_record = describe(applied["preset"])
    leader = join_distributed(args)
    with contextlib.ExitStack() as quiet:
        if not leader:  # every process computes; process 0 alone prints
            quiet.enter_context(contextlib.redirect_stdout(quiet.enter_context(open(os.devnull, "w"))))
        if args.command not in INPUT_ERRORS_AS_USAGE:
            return command.run(args)
        try:
            return command.run(args)
        except (ConfigError, CheckpointError, FileNotFoundError) as e:  # bad input files: one line, not a traceback
            raise UsageError(args.command, str(e)) from None


if __name__ == "__main__":
    sys.exit(main())
