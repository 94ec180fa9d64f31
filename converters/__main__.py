"""`jaxspec-convert` (also `python -m converters`).

jaxspec-convert target --src HF_DIR --dst OUT [--mesh 1x8] [--dtype bfloat16] [--verify]
    HF safetensors target -> Orbax checkpoint (resumable: rerun the same command after an interruption)
jaxspec-convert export-drafter --src DRAFTER_DIR --target TARGET --dst OUT --format sglang|speculators|mla
    an EAGLE-3 drafter -> SGLang/SpecForge or speculators (vLLM) layout; an MLA drafter -> its own (mla)
"""

from __future__ import annotations

import argparse
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxspec-convert",
        description="Checkpoint conversion for jaxspec. Runs as one process (no --coordinator/--distributed): convert "
        "once, onto storage every host reads; a multi-process run then restores the output, each process reading only "
        "its devices' slices.",
    )
    p.add_argument("--cpu-devices", type=int, default=0, metavar="N", help="simulate N CPU devices (for --mesh)")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("target", help="HF safetensors target -> Orbax checkpoint (streamed, resumable)")
    t.add_argument("--src", required=True, help="HF checkpoint directory (config.json + safetensors)")
    t.add_argument("--dst", required=True, help="output directory (empty, or a previous interrupted run to resume)")
    t.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="non-expert weight dtype")
    t.add_argument("--mesh", default=None, help="check the model fits this mesh (DATAxMODEL, e.g. 1x8)")
    t.add_argument("--verify", action="store_true", help="re-read a sample of tensors from both sides and compare")
    t.add_argument(
        "--dequantize-fp8",
        action="store_true",
        help="write a block-FP8 checkpoint's weights dequantised to --dtype (default: kept FP8 with their scales)",
    )
    t.add_argument("--no-progress", action="store_true", help="no progress bar")

    d = sub.add_parser("export-drafter", help="EAGLE-3 drafter -> SGLang or speculators layout")
    d.add_argument("--src", required=True, help="drafter directory (HF layout, either format)")
    d.add_argument("--target", required=True, help="the target it drafts for (HF directory or conversion output)")
    d.add_argument("--dst", required=True, help="output directory")
    d.add_argument(
        "--format",
        required=True,
        choices=["sglang", "speculators", "mla"],
        help="output layout: sglang (midlayer.*, layer ids as outputs of k) or speculators/vLLM (layers.0.*, inputs) "
        "for a Llama drafter; mla (Eagle3DeepseekV2ForCausalLM, midlayer.*, ids as inputs) for an MLA drafter",
    )
    d.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="weight dtype written")
    d.add_argument("--verifier", default=None, help="target name recorded in a speculators config (default --target)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cpu_devices:
        from sharding.cpu import simulate_cpu_devices

        simulate_cpu_devices(args.cpu_devices)
    start = time.perf_counter()
    if args.command == "target":
        _target(args)
    else:
        from converters.drafter import export_drafter

        export_drafter(args.src, args.target, args.dst, format=args.format, dtype=args.dtype, verifier=args.verifier)
        print(f"exported drafter to {args.dst} ({args.format})")
    print(f"done in {time.perf_counter() - start:.1f}s")
    return 0


def _target(args: argparse.Namespace) -> None:
    from converters.target import convert_target

    if args.mesh:
        from pathlib import Path

        from converters.target import open_source
        from jaxspec.io import check_mesh
        from sharding.mesh import make_mesh

        check_mesh(open_source(Path(args.src))[0], make_mesh(args.mesh), _default_rules())
    r = convert_target(
        args.src,
        args.dst,
        dtype=args.dtype,
        progress=not args.no_progress,
        verify=args.verify,
        dequantize_fp8=args.dequantize_fp8,
    )
    print(
        f"wrote {len(r.written)} group(s) ({r.bytes_written / 2**30:.3f} GiB), skipped {len(r.skipped)} already "
        f"complete; skipped {r.skipped_vision} vision and {r.skipped_mtp} MTP tensor(s)"
    )
    if args.verify:
        print(f"verified groups {', '.join(r.verified)}: identical to the source")


def _default_rules():
    from sharding.rules import DEFAULT_RULES

    return DEFAULT_RULES


if __name__ == "__main__":
    sys.exit(main())
