"""One process of a multi-process test run (tests/sharding/test_multihost.py launches it; one launch per topology).

    python -m tests.sharding.multihost_worker OUT_DIR [--orbax DIR] [--coordinator HOST:PORT --num-processes N
        --process-id I]
        Joins (with N processes), loads the bundled pair once per mesh, runs every case of CASES and writes
        OUT_DIR/process_I.json: {"mesh/case": tokens per prompt}. With --orbax, also the target restored from that
        `jaxspec-convert target` output (chain decoding on a 1x8 mesh).
    python -m tests.sharding.multihost_worker OUT_DIR --only MESH/CASE[,...] [--coordinator ...]
        Runs only those cases (of CASES and EXTRA_CASES; e.g. 1x8/chain-dcp8: the cache striped over all 8 devices).
    python -m tests.sharding.multihost_worker OUT_DIR --hang --coordinator ... --num-processes N --process-id I
        Joins, writes OUT_DIR/ready_I, then runs a cross-process all-reduce every 0.1 s until a peer is lost.

The 8 CPU devices are split evenly between the processes (jax_num_cpu_devices), so every launch has the same 8.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

DEVICES = 8
MESHES = ("1x8", "4x2")  # the model axis spans the processes; the data axis does
NEW_TOKENS = 12
CASES = {
    "plain": dict(num_steps=0),
    "chain": dict(num_steps=3),
    "tree": dict(num_steps=2, topk=2),
    "sampled": dict(num_steps=3, temperature=1.0, seed=11),
}
EXTRA_CASES = {"chain-dcp8": dict(num_steps=3, dcp=8)}  # run with --only (tests/sharding/test_multihost_dcp.py)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--orbax", type=Path, default=None)
    p.add_argument("--hang", action="store_true")
    p.add_argument("--only", default=None, help="comma-separated MESH/CASE to run instead of every case")
    p.add_argument("--coordinator", default=None)
    p.add_argument("--num-processes", type=int, default=1)
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument("--heartbeat", type=int, default=60, help="seconds before a silent peer counts as lost")
    return p.parse_args(argv)


def run_cases(orbax: Path | None = None, only: str | None = None) -> dict[str, list[list[int]]]:
    """Every case on every mesh over all of `jax.devices()` (or `only` those MESH/CASE): {"mesh/case": tokens per
    prompt}."""
    import jax.numpy as jnp

    from jaxspec import bundled, generate, load_drafter, load_target
    from sharding.mesh import make_mesh

    prompts = bundled.prompts()[:4]
    out = {}
    wanted = [c.split("/") for c in only.split(",")] if only else [(m, c) for m in MESHES for c in CASES]
    for mesh in dict.fromkeys(m for m, _ in wanted):
        target, drafter, tokenizer = bundled.load_pair(mesh=make_mesh(mesh))
        for name in [c for m, c in wanted if m == mesh]:
            settings = (CASES | EXTRA_CASES)[name]
            r = generate(target, drafter, prompts, max_new_tokens=NEW_TOKENS, tokenizer=tokenizer, **settings)
            out[f"{mesh}/{name}"] = r.tokens
    if orbax is not None:  # the same drafter on the target restored from the Orbax output: tokens as 1x8/chain
        target = load_target(orbax, mesh=make_mesh("1x8"), dtype=jnp.float32)
        drafter = load_drafter(bundled.paths()[1], target, dtype=jnp.float32)
        r = generate(target, drafter, prompts, max_new_tokens=NEW_TOKENS, tokenizer=tokenizer, **CASES["chain"])
        out["1x8/orbax-chain"] = r.tokens
    return out


def hang(out: Path, process_id: int) -> None:
    """Run a cross-process all-reduce every 0.1 s, forever (until a peer is lost and this process is ended)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from sharding.mesh import make_mesh
    from sharding.multihost import put_global

    mesh = make_mesh("1x8")
    x = put_global(np.ones((8,), np.float32), NamedSharding(mesh, P("model")))
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))
    float(total(x).addressable_data(0))
    (out / f"ready_{process_id}").write_text("ready")
    while True:
        total(x).block_until_ready()
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from sharding.cpu import simulate_cpu_devices

    simulate_cpu_devices(DEVICES // args.num_processes)
    if args.num_processes > 1:
        from sharding.mesh import init_distributed

        init_distributed(args.coordinator, args.num_processes, args.process_id, heartbeat_timeout=args.heartbeat)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.hang:
        hang(args.out, args.process_id)
    start = time.perf_counter()
    tokens = run_cases(args.orbax, args.only)
    record = {"tokens": tokens, "seconds": time.perf_counter() - start}
    (args.out / f"process_{args.process_id}.json").write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
