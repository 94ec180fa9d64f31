"""Conversion throughput against the disk, and peak host memory: a synthetic Kimi-shaped checkpoint (few layers,
many experts) converted with N and 2N layers, each in a fresh process. Peak RSS must not grow with the layer count.

    python benchmarks/convert_memory.py [--layers 4] [--experts 64] [--hidden 1024] [--dtype bfloat16] [--work DIR]
        [--repeats 3] [--baseline OLD_CHECKOUT]

For each size, in the same run and on the same disk, with the source's pages evicted from the page cache before
each measurement (posix_fadvise DONTNEED on those files only; everything is os.sync()ed first):
  read     a plain sequential read of the source files (16 MiB reads): the physical limit of any conversion;
  copy     the same files copied into the work directory, then synced: reading plus writing as many bytes;
  ceiling  every source byte read while as many bytes are written, both O_DIRECT in 4 streams, then synced: the
           most a conversion (which reads and writes every byte on the same disk) can reach;
  convert  `convert_target` in a fresh process, then synced (with --baseline: also with older code, same files).
Read and convert alternate for --repeats rounds (medians reported, and each round's convert/read ratio), so a change
in a shared machine's load hits both. Wall-clock rates follow the load; the CPU seconds per GB each conversion used
(all its threads) do not, and show the work it does per byte.
Writes benchmarks/results/convert_memory.json and prints a table. The synthetic tensors are random values in the HF
DeepSeek-V3 layout, stored in --dtype and converted to it (INT4 packing does not change the streaming behaviour).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, os, resource, sys, time
from converters.target import convert_target
src, dst, dtype = sys.argv[1], sys.argv[2], sys.argv[3]
before = resource.getrusage(resource.RUSAGE_SELF)
start = time.perf_counter()
result = convert_target(src, dst, dtype=dtype, progress=False)
os.sync()
seconds = time.perf_counter() - start
use = resource.getrusage(resource.RUSAGE_SELF)
cpu = use.ru_utime + use.ru_stime - before.ru_utime - before.ru_stime
# VmHWM is this process's own peak: ru_maxrss also counts the parent's RSS when it forked (Linux keeps it across exec)
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
print(json.dumps({"seconds": seconds, "bytes_written": result.bytes_written, "cpu_seconds": cpu,
                  "peak_rss_bytes": int(status["VmHWM"].split()[0]) * 1024, "ru_maxrss_bytes": use.ru_maxrss * 1024}))
"""


def write_synthetic(path: Path, layers: int, experts: int, hidden: int, dtype: str = "float32") -> int:
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    from jaxspec.config import KimiConfig
    from jaxspec.io.hf import expert_name, layer_table
    from tests.reference.hf_tiny import hf_config

    path.mkdir(parents=True, exist_ok=True)
    raw = json.loads(
        hf_config(
            "kimi",
            num_hidden_layers=layers,
            hidden_size=hidden,
            moe_intermediate_size=hidden // 2,
            n_routed_experts=experts,
            intermediate_size=2 * hidden,
            vocab_size=4096,
        ).to_json_string()
    )
    (path / "config.json").write_text(json.dumps(raw))
    cfg = KimiConfig.from_pretrained(path)
    rng = np.random.default_rng(0)
    D, V, F = cfg.hidden_size, cfg.vocab_size, cfg.moe_intermediate_size
    np_dtype = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    rand = lambda shape: rng.standard_normal(shape, dtype=np.float32).astype(np_dtype)
    weight_map: dict[str, str] = {}
    top = {"model.embed_tokens.weight": rand((V, D)), "model.norm.weight": rand((D,)), "lm_head.weight": rand((V, D))}
    save_file(top, path / "top.safetensors")
    weight_map |= dict.fromkeys(top, "top.safetensors")
    for i in range(layers):
        moe = i >= cfg.first_k_dense_replace
        tensors = {f"model.layers.{i}.{row.hf}": rand(row.shape) for row in layer_table(cfg, moe)}
        for e in range(cfg.n_routed_experts if moe else 0):
            for proj in ("gate", "up", "down"):
                tensors[f"{expert_name(i, e, proj)}.weight"] = rand((D, F) if proj == "down" else (F, D))
        save_file(tensors, path / f"layer{i}.safetensors")
        weight_map |= dict.fromkeys(tensors, f"layer{i}.safetensors")
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def evict(files: list[Path]) -> None:
    """Drop these files' pages from the page cache (after a sync, so none is dirty)."""
    os.sync()
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sequential_read(files: list[Path]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) to read `files` start to end with 16 MiB reads into one buffer."""
    buf = memoryview(bytearray(1 << 24))
    start, cpu = time.perf_counter(), time.process_time()
    for f in files:
        with open(f, "rb", buffering=0) as h:
            while h.readinto(buf):
                pass
    return time.perf_counter() - start, time.process_time() - cpu


def copy_files(files: list[Path], dst: Path) -> float:
    """Seconds to copy `files` into `dst` and sync them to disk."""
    dst.mkdir(parents=True)
    start = time.perf_counter()
    for f in files:
        shutil.copyfile(f, dst / f.name)
    os.sync()
    return time.perf_counter() - start


def read_write_ceiling(files: list[Path], dst: Path, streams: int = 4, window: int = 16 << 20) -> float:
    """Seconds to read every byte of `files` while writing as many bytes to `dst`, both O_DIRECT, several streams,
    no work in between, then sync: what any conversion (it reads and writes every byte) can at best reach here."""
    import mmap
    import threading

    def read(f: Path, lo: int, hi: int) -> None:
        buf, fd = mmap.mmap(-1, window, flags=mmap.MAP_PRIVATE), os.open(f, os.O_RDONLY | os.O_DIRECT)
        pos = lo // 4096 * 4096
        while pos < hi and (n := os.preadv(fd, [buf], pos)) > 0:
            pos += n
        os.close(fd)

    def write(path: Path, nbytes: int) -> None:
        buf, fd = mmap.mmap(-1, window, flags=mmap.MAP_PRIVATE), os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
        for _ in range(-(-nbytes // window)):
            os.write(fd, buf)
        os.close(fd)

    dst.mkdir(parents=True)
    size = sum(f.stat().st_size for f in files)
    jobs = [(write, (dst / f"w{i}", size // streams)) for i in range(streams)]
    for f in files:
        part = -(-f.stat().st_size // streams)
        jobs += [(read, (f, k * part, min(f.stat().st_size, (k + 1) * part))) for k in range(streams)]
    threads = [threading.Thread(target=fn, args=a) for fn, a in jobs]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    os.sync()
    seconds = time.perf_counter() - start
    shutil.rmtree(dst)
    return seconds


def measure(work: Path, layers: int, args: argparse.Namespace) -> dict:
    """Read, copy and convert one synthetic checkpoint; `--repeats` alternating (read, convert[, baseline]) rounds,
    so that a change in the machine's load hits both sides: the medians and the per-round ratios are reported."""
    src, dst = work / f"src{layers}", work / f"dst{layers}"
    size = write_synthetic(src, layers, args.experts, args.hidden, args.dtype)
    files = sorted(src.glob("*.safetensors"))
    evict(files)
    copy_s = copy_files(files, work / f"copy{layers}")
    shutil.rmtree(work / f"copy{layers}")
    load_before = os.getloadavg()
    reads, runs, bases, ceilings = [], [], [], []
    for _ in range(args.repeats):
        evict(files)
        reads.append(sequential_read(files))
        evict(files)
        ceilings.append(read_write_ceiling(files, work / f"ceiling{layers}"))
        runs.append(convert(src, dst, files, args.dtype, None))
        if args.baseline:
            bases.append(convert(src, dst, files, args.dtype, args.baseline))
    load_after = os.getloadavg()
    shutil.rmtree(src)
    read_s, convert_s = statistics.median(r[0] for r in reads), statistics.median(r["seconds"] for r in runs)
    out = {
        "layers": layers,
        "source_bytes": size,
        "bytes_written": runs[0]["bytes_written"],
        "load_average_1_5_15_before": load_before,
        "load_average_1_5_15_after": load_after,
        "read_gb_per_s": size / read_s / 1e9,
        "copy_gb_per_s": size / copy_s / 1e9,
        "read_write_ceiling_gb_per_s": size / statistics.median(ceilings) / 1e9,
        "fraction_of_ceiling": statistics.median(ceilings) / convert_s,
        "gb_per_s": size / convert_s / 1e9,
        "fraction_of_read": read_s / convert_s,
        "fraction_of_read_per_round": [r[0] / c["seconds"] for r, c in zip(reads, runs, strict=True)],
        "read_seconds": [r[0] for r in reads],
        "read_cpu_seconds": [r[1] for r in reads],
        "cpu_seconds_per_gb": statistics.median(r["cpu_seconds"] for r in runs) / (size / 1e9),
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in runs),
        "runs": runs,
    }
    if bases:
        base_s = statistics.median(b["seconds"] for b in bases)
        out |= {"baseline_gb_per_s": size / base_s / 1e9, "baseline_fraction_of_read": read_s / base_s}
        out |= {"baseline_cpu_seconds_per_gb": statistics.median(b["cpu_seconds"] for b in bases) / (size / 1e9)}
        out |= {"baseline_peak_rss_bytes": max(b["peak_rss_bytes"] for b in bases), "baseline_runs": bases}
    return out


def convert(src: Path, dst: Path, files: list[Path], dtype: str, code: str | None) -> dict:
    """Convert in a fresh process, with the code checked out at `code` if given (run from there: `python -c` puts
    the working directory first on sys.path, ahead of PYTHONPATH)."""
    evict(files)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [code, os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-c", CHILD, str(src), str(dst), dtype]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=code)
    shutil.rmtree(dst)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4, help="the small run; the large one has twice as many")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="source and output dtype")
    p.add_argument("--work", default=None, help="scratch directory (default: a temporary one, removed after)")
    p.add_argument("--baseline", default=None, help="a checkout of older code to convert with too (before/after)")
    p.add_argument("--repeats", type=int, default=3, help="alternating read/convert rounds per size (medians)")
    p.add_argument("--output", default="benchmarks/results/convert_memory.json")
    args = p.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="jaxspec_convert_bench_"))
    try:
        rows = [measure(work, layers, args) for layers in (args.layers, 2 * args.layers)]
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(
        f"{'layers':>6} | {'source GB':>9} | {'read GB/s':>9} | {'copy GB/s':>9} | {'ceiling GB/s':>12} | "
        f"{'convert GB/s':>12} | {'of read':>7} | {'of ceiling':>10} | {'peak RSS GB':>11}"
    )
    for r in rows:
        print(
            f"{r['layers']:>6} | {r['source_bytes'] / 1e9:9.2f} | {r['read_gb_per_s']:9.3f} | {r['copy_gb_per_s']:9.3f}"
            f" | {r['read_write_ceiling_gb_per_s']:12.3f} | {r['gb_per_s']:12.3f} | {r['fraction_of_read']:7.0%}"
            f" | {r['fraction_of_ceiling']:10.0%} | {r['peak_rss_bytes'] / 1e9:11.2f}"
        )
    for r in rows:
        rounds = ", ".join(f"{f:.0%}" for f in r["fraction_of_read_per_round"])
        print(f"{r['layers']} layers: {r['cpu_seconds_per_gb']:.1f} CPU s/GB; of read per round: {rounds}", end="")
        if "baseline_gb_per_s" in r:
            print(
                f"; baseline {r['baseline_gb_per_s']:.3f} GB/s ({r['baseline_fraction_of_read']:.0%} of read), "
                f"{r['baseline_cpu_seconds_per_gb']:.1f} CPU s/GB",
                end="",
            )
        load = r["load_average_1_5_15_before"][0], r["load_average_1_5_15_after"][0]
        print(f"; load average {load[0]:.1f} -> {load[1]:.1f}")
    growth = rows[1]["peak_rss_bytes"] / rows[0]["peak_rss_bytes"]
    print(f"peak RSS ratio (2x layers / 1x): {growth:.2f}")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/convert_memory.py " + " ".join(sys.argv[1:])
    result = {"command": command.strip(), "rows": rows, "peak_rss_ratio": growth, **vars(args)}
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
