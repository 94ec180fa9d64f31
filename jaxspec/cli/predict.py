"""`jaxspec predict`: load a target and print its next-token candidates after each position of a prompt of ids."""

from __future__ import annotations

import argparse
import time

from jaxspec.cli.args import UsageError, add_target_args, build_target, check_target_args, int_list

HELP = "print next-token predictions of a target for a prompt of token ids"
DESCRIPTION = (
    "Load a target (--model DIR, or random weights of --preset, default tiny) "
    "and print the top next-token candidates after each prompt position."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_target_args(p)
    p.add_argument("--prompt", default="1,17,42,7,99", help="comma-separated token ids (default: %(default)s)")
    p.add_argument("--top", type=int, default=5, help="candidates per position (default: %(default)s)")


def check(args: argparse.Namespace) -> None:
    """Everything checkable without a model: raise UsageError on the first problem."""

    def fail(message: str):
        raise UsageError("predict", message)

    check_target_args(args, fail)
    int_list(args.prompt, "--prompt", fail)
    if args.top < 1:
        fail(f"--top: expected an integer >= 1, got {args.top}")


def run(args: argparse.Namespace) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sharding.multihost import to_host

    try:
        tokens = [int(t) for t in args.prompt.split(",")]
    except ValueError:
        raise SystemExit(f"jaxspec predict: --prompt expects comma-separated integers, got {args.prompt!r}") from None
    start = time.perf_counter()
    target, source = build_target(args, abstract=False)
    logits = to_host(target.logits([tokens]).astype(jnp.float32))[0]  # gathered from every process
    elapsed = time.perf_counter() - start
    cfg = target.config
    print(
        f"target: {source}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.n_routed_experts} experts (top-{cfg.num_experts_per_tok}), vocab {cfg.vocab_size}, "
        f"experts {'INT4' if cfg.quant else (args.dtype or 'bfloat16')}"
    )
    print(f"mesh: {dict(target.mesh.shape)} on {jax.devices()[0].platform}; load + compile + run {elapsed:.1f}s")
    for pos, row in enumerate(logits):
        top = np.argsort(-row)[: args.top]
        print(f"after {tokens[: pos + 1]}: next token candidates " + ", ".join(f"{t} ({row[t]:.2f})" for t in top))
    return 0
