#!/usr/bin/env bash
# Device check for issue 14 (one H200, under 8 minutes): decode and verify step times of a Kimi-shaped target that
# fits one GPU (real Kimi-K2.5 widths, 1 dense + 3 MoE layers, 384 INT4 experts, bf16), with the routed experts on
# the XLA path and on the Pallas grouped INT4 kernel, against the bytes each step must read (non-expert weights +
# the experts it hits + the cache buffer it attends over) and the HBM bandwidth (H200: 4.8 TB/s).
#
#   benchmarks/device_check.sh             # on the GPU machine (needs jax with CUDA); JSON to $OUT or results/
#   benchmarks/device_check.sh --dry-run   # CPU-sized run of the same code here, plus lowering the full device
#                                          # program (both paths) for CUDA without a GPU
#
# Each configuration is compiled once, warmed, then timed over --repeats calls (median).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="${PWD}${PYTHONPATH:+:$PYTHONPATH}"
OUT_DIR="${OUT:-benchmarks/results}"
exec timeout 470 python - --out "$OUT_DIR/device_check.json" "$@" <<'PY'
import argparse, json, statistics, sys, time

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--dry-run", action="store_true")
p.add_argument("--tokens", default="1,2,4,8")
p.add_argument("--repeats", type=int, default=20)
p.add_argument("--cache-len", type=int, default=4096)
p.add_argument("--hbm-bytes-per-s", type=float, default=4.8e12)
args = p.parse_args()
if args.dry_run:
    from sharding.cpu import simulate_cpu_devices

    simulate_cpu_devices(1)
sys.path.insert(0, "benchmarks")
import jax
import jax.numpy as jnp
import numpy as np

import step_cost
from jaxspec import KimiConfig, Target
from jaxspec.models import moe
from sharding.mesh import single_device_mesh

kimi = KimiConfig.preset("kimi-k2.5")
if args.dry_run:  # same structure, CPU-sized widths
    cfg = step_cost.bench_config().replace(num_hidden_layers=2)
    dtype, repeats, tokens = jnp.float32, 2, [1, 4]
else:
    cfg = kimi.replace(num_hidden_layers=4, first_k_dense_replace=1)
    dtype, repeats, tokens = jnp.bfloat16, args.repeats, [int(t) for t in args.tokens.split(",")]
backend = jax.default_backend()
result = dict(backend=backend, devices=[str(d) for d in jax.devices()], dry_run=args.dry_run,
              hbm_bytes_per_s=args.hbm_bytes_per_s, layers=cfg.num_hidden_layers, experts=cfg.n_routed_experts,
              hidden=cfg.hidden_size, cache_len=args.cache_len, runs=[])


def lower_for_cuda(impl):
    """Lower the device-sized decode step (abstract weights, nothing allocated) for CUDA from this machine."""
    full = kimi.replace(num_hidden_layers=4, first_k_dense_replace=1)
    t = moe.with_expert_impl(Target.abstract(full, mesh=single_device_mesh(), dtype=jnp.bfloat16), impl)
    ids = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    cache = jax.ShapeDtypeStruct((full.num_hidden_layers, 1, args.cache_len, full.latent_dim), jnp.bfloat16)
    step = jax.jit(lambda p_, t_, q_, c_: t.apply(p_, t_, q_, c_)[0])
    allow = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    text = jax.export.export(step, platforms=["cuda"], disabled_checks=allow)(t.params, ids, ids, cache).mlir_module()
    return dict(impl=impl, triton_kernel_calls=text.count("__gpu$xla.gpu.triton"))


t0 = time.time()
target = step_cost.random_target(cfg, single_device_mesh(), dtype)
result["init_s"] = time.time() - t0
impls = ["xla"] if args.dry_run else ["xla", "pallas"]
for T in tokens:
    hits = step_cost.routing_hits(target, T)
    floor = step_cost.floor_bytes(target, hits)
    cache_bytes = cfg.num_hidden_layers * args.cache_len * cfg.latent_dim * jnp.dtype(dtype).itemsize
    for impl in impls:
        t = moe.with_expert_impl(target, impl)
        compiled, call_args = step_cost.step_fn(t, T)
        jax.block_until_ready(compiled(*call_args))
        times = []
        for _ in range(repeats):
            s = time.perf_counter()
            jax.block_until_ready(compiled(*call_args))
            times.append(time.perf_counter() - s)
        sec = statistics.median(times)
        run = dict(impl=impl, tokens=T, ms=1e3 * sec, hit_experts_per_layer=[h[0] for h in hits],
                   weight_floor_bytes=floor, cache_buffer_bytes=cache_bytes,
                   bytes_per_s=(floor + cache_bytes) / sec,
                   fraction_of_hbm=(floor + cache_bytes) / sec / args.hbm_bytes_per_s)
        result["runs"].append(run)
        print(f"{impl:6s} T={T}: {run['ms']:8.3f} ms  hit {sum(run['hit_experts_per_layer'])} experts  "
              f"{run['bytes_per_s'] / 1e12:.2f} TB/s ({100 * run['fraction_of_hbm']:.0f}% of HBM)", flush=True)
if args.dry_run:
    # "auto" picks the kernel per lowering platform ("pallas" itself refuses to trace on a CPU host).
    result["cuda_lowering"] = [lower_for_cuda(impl) for impl in ("xla", "auto")]
    print("lowered for cuda:", result["cuda_lowering"])
    assert result["cuda_lowering"][0]["triton_kernel_calls"] == 0 and result["cuda_lowering"][1]["triton_kernel_calls"] > 0
with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
print("wrote", args.out)
PY
