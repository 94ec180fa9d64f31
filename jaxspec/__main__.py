"""`python -m jaxspec`: load a target and print its next-token predictions for a prompt of token ids.

With `--model DIR` it loads an HF-layout checkpoint (config.json + safetensors, bf16 or INT4 experts); without it,
a randomly initialised model of a named preset (default `tiny`), which shows the machinery, not language.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxspec", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="HF-layout checkpoint directory (default: random weights of --preset)")
    p.add_argument("--preset", default="tiny", help="preset for random weights: tiny, tiny-dsv3 (default: tiny)")
    p.add_argument("--prompt", default="1,17,42,7,99", help="comma-separated token ids (default: %(default)s)")
    p.add_argument("--mesh", default=None, help="mesh shape DATAxMODEL, e.g. 1x8 (default: one device)")
    p.add_argument(
        "--cpu-devices",
        type=int,
        default=0,
        help="simulate this many CPU devices (for trying meshes without accelerators)",
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--top", type=int, default=5, help="how many candidates to print per position")
    args = p.parse_args(argv)

    if args.cpu_devices:
        from sharding.cpu import simulate_cpu_devices

        simulate_cpu_devices(args.cpu_devices)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxspec import KimiConfig, Target, load_target
    from sharding.mesh import make_mesh

    try:
        tokens = [int(t) for t in args.prompt.split(",")]
    except ValueError:
        p.error(f"--prompt: expected comma-separated integers, got {args.prompt!r}")
    mesh = make_mesh(args.mesh) if args.mesh else None
    dtype = jnp.dtype(args.dtype)
    start = time.perf_counter()
    if args.model:
        target = load_target(args.model, mesh=mesh, dtype=dtype)
        source = args.model
    else:
        target = Target.random(KimiConfig.preset(args.preset), mesh=mesh, dtype=dtype)
        source = f"preset {args.preset!r} (random weights)"
    logits = np.asarray(target.logits([tokens]).astype(jnp.float32))[0]
    elapsed = time.perf_counter() - start
    cfg = target.config
    print(
        f"target: {source}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.n_routed_experts} experts (top-{cfg.num_experts_per_tok}), vocab {cfg.vocab_size}, "
        f"experts {'INT4' if cfg.quant else str(dtype)}"
    )
    print(f"mesh: {dict(target.mesh.shape)} on {jax.devices()[0].platform}; load + compile + run {elapsed:.1f}s")
    for pos, row in enumerate(logits):
        top = np.argsort(-row)[: args.top]
        cands = ", ".join(f"{t} ({row[t]:.2f})" for t in top)
        print(f"after {tokens[: pos + 1]}: next token candidates {cands}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
