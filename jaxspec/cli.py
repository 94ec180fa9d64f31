"""The `jaxspec` command.

    jaxspec predict   load a target and print its next-token predictions for a prompt of token ids
    jaxspec inspect   compile one decode/verify step (abstract weights: nothing allocated) and report its
                      collectives and per-device memory

Process-wide settings (simulated CPU devices, collective presets) must be made before JAX starts its backend,
so they are global options handled before anything touches a device.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="HF-layout checkpoint directory (config.json + safetensors)")
    p.add_argument("--preset", default=None, help="a named config instead of --model: tiny, tiny-dsv3, kimi-k2.5")
    p.add_argument("--mesh", default=None, help="mesh shape DATAxMODEL, e.g. 1x8 (default: all devices on MODEL)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])


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
    sub = p.add_subparsers(dest="command", required=True)

    pr = sub.add_parser(
        "predict",
        help="print next-token predictions of a target for a prompt of token ids",
        description="Load a target (--model DIR, or random weights of --preset, default tiny) "
        "and print the top next-token candidates after each prompt position.",
    )
    _add_target_args(pr)
    pr.add_argument("--prompt", default="1,17,42,7,99", help="comma-separated token ids (default: %(default)s)")
    pr.add_argument("--top", type=int, default=5, help="candidates per position (default: %(default)s)")

    ins = sub.add_parser(
        "inspect",
        help="collectives and per-device memory of a compiled decode/verify step",
        description="Compile one cached step of a target config on a mesh with abstract weights "
        "and report collectives (counted per execution) and per-device memory.",
    )
    _add_target_args(ins)
    ins.add_argument("--batch", type=int, default=1)
    ins.add_argument("--tokens", type=int, default=1, help="query tokens per step: 1 = decode, k+1 = verify")
    ins.add_argument("--cache-len", type=int, default=4096)
    ins.add_argument("--json", type=Path, help="also write the report as JSON to this path")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from sharding.collectives import apply_preset, describe

    applied = apply_preset(args.collective_preset)
    if args.cpu_devices:
        from sharding.cpu import simulate_cpu_devices

        simulate_cpu_devices(args.cpu_devices)
    args.preset_record = describe(applied["preset"])
    return {"predict": cmd_predict, "inspect": cmd_inspect}[args.command](args)


def _target(args, *, abstract: bool):
    import jax.numpy as jnp

    from jaxspec import KimiConfig, Target, load_target
    from sharding.mesh import make_mesh

    if args.model and args.preset:
        raise SystemExit("jaxspec: give --model or --preset, not both")
    mesh = make_mesh(args.mesh)
    dtype = jnp.dtype(args.dtype)
    if args.model:
        if abstract:
            return Target.abstract(KimiConfig.from_pretrained(args.model), mesh=mesh, dtype=dtype), args.model
        return load_target(args.model, mesh=mesh, dtype=dtype), args.model
    name = args.preset or "tiny"
    cfg = KimiConfig.preset(name)
    if abstract:
        return Target.abstract(cfg, mesh=mesh, dtype=dtype), f"preset {name!r}"
    return Target.random(cfg, mesh=mesh, dtype=dtype), f"preset {name!r} (random weights)"


def cmd_predict(args) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    try:
        tokens = [int(t) for t in args.prompt.split(",")]
    except ValueError:
        raise SystemExit(f"jaxspec predict: --prompt expects comma-separated integers, got {args.prompt!r}") from None
    start = time.perf_counter()
    target, source = _target(args, abstract=False)
    logits = np.asarray(target.logits([tokens]).astype(jnp.float32))[0]
    elapsed = time.perf_counter() - start
    cfg = target.config
    print(
        f"target: {source}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.n_routed_experts} experts (top-{cfg.num_experts_per_tok}), vocab {cfg.vocab_size}, "
        f"experts {'INT4' if cfg.quant else args.dtype}"
    )
    print(f"mesh: {dict(target.mesh.shape)} on {jax.devices()[0].platform}; load + compile + run {elapsed:.1f}s")
    for pos, row in enumerate(logits):
        top = np.argsort(-row)[: args.top]
        print(f"after {tokens[: pos + 1]}: next token candidates " + ", ".join(f"{t} ({row[t]:.2f})" for t in top))
    return 0


def cmd_inspect(args) -> int:
    from sharding import inspect

    target, source = _target(args, abstract=True)
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
    if args.json:
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


if __name__ == "__main__":
    sys.exit(main())
