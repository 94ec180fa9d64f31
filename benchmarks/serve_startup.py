"""Seconds from launching `jaxspec serve` until /health answers 200, for the defaults (bundled pair) and for a
small configuration: adaptive (`--num-steps auto`, the default) and a fixed k, cold, and with `--compilation-cache`
cold (an empty cache) and restarted (the cache the cold launch wrote); and the defaults as one server of 2 processes
x 4 CPU devices on a 1x8 mesh (`defaults-2proc`, the multi-host rehearsal). Warm-up compiles every program before
/health answers, so this is what a new user waits. With each: the memory maps each process held at /health (XLA:CPU
keeps every compiled program in maps of its own, and Linux's default limit is 65,530 per process: startup.py).

    python benchmarks/serve_startup.py
    python benchmarks/serve_startup.py --configs defaults,defaults-2proc
    python benchmarks/serve_startup.py --configs small-k4,small-auto,small-auto-cache,small-auto-cache-restart

Writes benchmarks/results/serve_startup.{json,md}, with the load average before and after each launch (the
project's machine is shared, so the figures are noisy).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from serve_load import server_env  # this directory (run as a script)

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--max-batch", "4", "--batch-buckets", "1,4", "--max-context", "256"]
CACHE = "{cache}"  # a fresh directory per run of this script, shared by its launches
CONFIGS = {
    "defaults": [],
    "small-k4": [*SMALL, "--num-steps", "4"],  # the chain auto switches to on the bundled pair, alone
    "small-auto": SMALL,
    "small-auto-cache": [*SMALL, "--compilation-cache", CACHE],  # cold: the cache is empty
    "small-auto-cache-restart": [*SMALL, "--compilation-cache", CACHE],  # the programs the launch before wrote
    "defaults-2proc": [],  # as 2 processes (PROCESSES)
}
PROCESSES = {"defaults-2proc": 2}  # the others: one process on one device


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_to_health(flags: list[str], log: Path, limit: float, processes: int = 1) -> tuple[float, list[int]]:
    """Launch `jaxspec serve flags` (as `processes` processes of 4 CPU devices on one 1x8 mesh when more than one),
    wait for /health 200, stop it; (the seconds it took, each process's memory maps then)."""
    port = free_port()
    argv = [[sys.executable, "-m", "jaxspec", "serve", "--port", str(port), *flags]]
    if processes > 1:
        coordinator = f"127.0.0.1:{free_port()}"
        argv = [
            [sys.executable, "-m", "jaxspec", "--cpu-devices", "4", "--coordinator", coordinator, "--num-processes",
             str(processes), "--process-id", str(i), "serve", "--mesh", "1x8", "--port", str(port), *flags]
            for i in range(processes)
        ]  # fmt: skip
    logs = [log.with_suffix(f".{i}.log") if processes > 1 else log for i in range(processes)]
    start = time.monotonic()
    procs = [
        subprocess.Popen(a, stdout=f.open("w"), stderr=subprocess.STDOUT, cwd=ROOT, env=server_env())
        for a, f in zip(argv, logs, strict=True)
    ]
    try:
        while time.monotonic() - start < limit:
            for proc, f in zip(procs, logs, strict=True):
                if proc.poll() is not None:
                    raise SystemExit(f"serve_startup: a server exited ({proc.returncode}):\n{f.read_text()[-3000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    return time.monotonic() - start, [maps(proc.pid) for proc in procs]
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"serve_startup: no /health 200 within {limit:.0f} s; logs: {logs}")
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=120)


def maps(pid: int) -> int:
    """The memory maps process `pid` holds (Linux)."""
    with open(f"/proc/{pid}/maps", "rb") as f:
        return sum(1 for _ in f)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS), help="which of %(default)s to launch")
    p.add_argument("--limit", type=float, default=1800.0, help="seconds to wait for /health (%(default)s)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "serve_startup.json")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="serve_startup-"))
    runs = []
    for name in args.configs.split(","):
        flags = [str(work / "cache") if f == CACHE else f for f in CONFIGS[name]]
        load_before = os.getloadavg()
        processes = PROCESSES.get(name, 1)
        seconds, held = time_to_health(flags, work / f"{name}.log", args.limit, processes)
        command = shlex.join(["jaxspec", "serve", *CONFIGS[name]]).replace("'{cache}'", "DIR")
        if processes > 1:
            command += f" ({processes} processes x 4 CPU devices, --mesh 1x8)"
        runs.append(
            {
                "config": name,
                "command": command,
                "seconds_to_health": round(seconds, 1),
                "maps_per_process": held,
                "loadavg_before": [round(x, 2) for x in load_before],
                "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            }
        )
        print(json.dumps(runs[-1]), flush=True)
    result = {"cpus": os.cpu_count(), "runs": runs}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(report(result))
    return 0


def report(result: dict) -> str:
    lines = [
        "# `jaxspec serve` start-up: seconds until /health answers 200",
        "",
        "Written by `python benchmarks/serve_startup.py`. CPU only, the project's shared "
        f"{result['cpus']}-core machine with other jobs running beside it: the load averages (1, 5, 15 min, "
        "`os.getloadavg()`) say how busy it was, and the times are noisy.",
        "",
        "| configuration | command | seconds to /health | memory maps per process | load before | load after |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        load = [", ".join(f"{x:.1f}" for x in r[k]) for k in ("loadavg_before", "loadavg_after")]
        held = ", ".join(f"{n:,}" for n in r.get("maps_per_process", []))
        lines.append(
            f"| {r['config']} | `{r['command']}` | {r['seconds_to_health']:.0f} | {held} | {load[0]} | {load[1]} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
