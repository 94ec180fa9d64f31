"""2 processes x 4 CPU devices against 1 process x 8, in ONE run: start-up time and per-token cost, as ratios.

    python benchmarks/multihost.py [--mesh 1x8] [--new-tokens 48] [--repeats 3] [--out RESULT.json]

Each topology is one launch of this script in --worker mode (the 2-process one over gloo on a free local port),
run one after the other so they do not share the cores: start-up is launch to the first generated token (join,
load the bundled pair, compile plain and chain decoding); per-token cost is warm greedy generation (batch 1, the
held-out prompt; plain and chain k = 3) divided by the tokens generated, the median of --repeats. Each worker also
times one 8-device all-reduce of the decode step's activation ([1, hidden] float32) and a `to_host` of the done flags,
the pieces a step adds across processes. The 8 devices share the machine's cores either way: compare the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

START = time.perf_counter()
ROOT = Path(__file__).resolve().parent.parent
DEVICES = 8


def worker(args: argparse.Namespace) -> dict:
    """One process of a topology: the timings (process 0 reports them)."""
    sys.path.insert(0, str(ROOT))
    from sharding.cpu import simulate_cpu_devices

    simulate_cpu_devices(DEVICES // args.num_processes)
    if args.num_processes > 1:
        from sharding.mesh import init_distributed

        init_distributed(args.coordinator, args.num_processes, args.process_id)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxspec import bundled, generate
    from sharding.mesh import make_mesh
    from sharding.multihost import put_global, to_host

    mesh = make_mesh(args.mesh)
    target, drafter, tokenizer = bundled.load_pair(mesh=mesh)
    prompts = bundled.prompts()[:1]
    run = {
        k: (lambda k=k: generate(target, drafter if k else None, prompts, max_new_tokens=args.new_tokens,
                                 num_steps=k, tokenizer=tokenizer))
        for k in (0, 3)
    }  # fmt: skip
    for f in run.values():
        f()  # compile
    startup = time.perf_counter() - START
    per_token = {}
    for k, f in run.items():
        times = []
        for _ in range(args.repeats):
            stats = f().stats
            times.append(stats["seconds"] / stats["new_tokens"])
        per_token[f"k={k}"] = statistics.median(times) * 1e3

    # The cross-process pieces of a step: one all-reduce over the 8 devices, one host read of replicated flags.
    row_per_device = NamedSharding(mesh, P(("data", "model")))
    x = put_global(np.ones((DEVICES, 1, target.config.hidden_size), np.float32), row_per_device)
    reduce = jax.jit(lambda x: jnp.sum(x, axis=0), out_shardings=NamedSharding(mesh, P()))
    flags = put_global(np.zeros((8,), bool), NamedSharding(mesh, P()))
    pieces = {}
    for name, fn in (("all_reduce", lambda: reduce(x).block_until_ready()), ("to_host", lambda: to_host(flags))):
        fn()
        times = []
        for _ in range(50):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        pieces[name] = statistics.median(times) * 1e3
    return {"startup_s": startup, "per_token_ms": per_token, "piece_ms": pieces, "processes": jax.process_count()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(processes: int, args: argparse.Namespace, out: Path) -> dict:
    """Run one topology; process 0's record."""
    env = os.environ | {"PJRT_NPROC": "32", "PYTHONPATH": str(ROOT)}
    join = ["--coordinator", f"127.0.0.1:{free_port()}"] if processes > 1 else []
    base = [sys.executable, __file__, "--worker", "--mesh", args.mesh, "--new-tokens", str(args.new_tokens)]
    base += ["--repeats", str(args.repeats), "--num-processes", str(processes), *join]
    procs = [
        subprocess.Popen([*base, "--process-id", str(i), "--record", str(out / f"p{processes}_{i}.json")], env=env)
        for i in range(processes)
    ]
    codes = [p.wait(timeout=1800) for p in procs]
    if codes != [0] * processes:
        raise SystemExit(f"multihost benchmark: {processes}-process run exited with {codes}")
    return json.loads((out / f"p{processes}_0.json").read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mesh", default="1x8")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "multihost.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--record", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--coordinator", help=argparse.SUPPRESS)
    p.add_argument("--num-processes", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        record = worker(args)
        args.record.write_text(json.dumps(record))
        return 0
    import tempfile

    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        single = launch(1, args, Path(tmp))
        load.append(os.getloadavg()[0])
        pair = launch(2, args, Path(tmp))
        load.append(os.getloadavg()[0])
    ratio = lambda key: {k: pair[key][k] / single[key][k] for k in single[key]}
    result = {
        "command": "python benchmarks/multihost.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "mesh": args.mesh,
        "one_process_x8": single,
        "two_processes_x4": pair,
        "ratio_two_over_one": {
            "startup": pair["startup_s"] / single["startup_s"],
            "per_token": ratio("per_token_ms"),
            "pieces": ratio("piece_ms"),
        },
        "load_average_1min": load,  # before, between and after: the machine's other work
        "cores": os.cpu_count(),
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["ratio_two_over_one"], indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
