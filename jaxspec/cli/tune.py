"""`jaxspec tune`: sweep the draft depth k on a prompt set (the bundled pair's held-out prompts by default), print the
table and write DIR/tune.json and DIR/tune.png; with --presets, the same sweep once per collective preset, each in its
own process. The measurement itself is `jaxspec.profiling.tune.tune`."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from jaxspec.cli.args import add_dcp_arg, add_drafter_arg, add_target_args, build_target, use_bundled_pair
from jaxspec.profiling.cost_model import DEFAULT_TREES

HELP = "sweep the draft depth k (and tree shapes), time every phase, fit the cost model and recommend one"
DESCRIPTION = (
    "Run the real loop for k = 0..K (and with --trees, tree drafts) on a prompt set, time each phase alone, predict "
    "tokens/s with the step-count cost model, and write DIR/tune.json and DIR/tune.png."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of `jaxspec tune`. No --devices: --presets re-runs the command in child processes per preset."""
    add_target_args(p, devices=False)
    add_drafter_arg(p, "EAGLE-3 drafter directory (default with --preset: random drafter)")
    add_dcp_arg(p)
    p.add_argument("--max-k", type=int, default=4, help="sweep k = 0..MAX_K draft tokens (default: %(default)s)")
    p.add_argument(
        "--trees",
        metavar="SHAPES",
        help="also sweep tree drafts: comma-separated STEPS:TOPK:TOKENS (num_steps, topk, num_draft_tokens with the "
        "root; a field may be a range A-B: every shape of the product that holds its tokens), or 'default' for "
        + ", ".join(t.spec for t in DEFAULT_TREES)
        + "; each shape is one more run per round",
    )
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens generated per prompt and k (%(default)s)")
    p.add_argument(
        "--rounds", type=int, default=3, help="sweeps over all k, alternating order, pooled (default: %(default)s)"
    )
    p.add_argument(
        "--stream-cycles",
        type=int,
        default=4,
        help="cycles per measured chunk; the phases are timed after each chunk (default: %(default)s)",
    )
    p.add_argument(
        "--prompts-file",
        type=Path,
        help="one prompt per line: comma-separated token ids (default: fixed ids; with the bundled pair, its held-out "
        "prompts)",
    )
    p.add_argument("--output", type=Path, help="write DIR/tune.json and DIR/tune.png")
    p.add_argument(
        "--presets",
        help="comma-separated collective presets to sweep (see sharding/collectives.py), each in its own process "
        "(XLA reads the flags when its backend starts) writing DIR/<preset>/; DIR/presets.json ranks them",
    )


def read_prompts(path: str | Path) -> list[list[int]]:
    """Prompts from a file: one per non-empty line, comma-separated token ids."""
    prompts = []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            prompts.append([int(t) for t in line.split(",")])
        except ValueError:
            raise ValueError(f"{path}:{n}: expected comma-separated token ids, got {line.strip()!r}") from None
    if not prompts:
        raise ValueError(f"{path}: no prompts (expected one line of comma-separated token ids per prompt)")
    return prompts


def _child_argv(args: argparse.Namespace, preset: str, output: Path) -> list[str]:
    """`jaxspec --collective-preset PRESET tune ...` with this invocation's tune arguments (for --presets)."""
    argv = ["--collective-preset", preset]
    if getattr(args, "cpu_devices", 0):
        argv += ["--cpu-devices", str(args.cpu_devices)]
    argv.append("tune")
    for flag in ("model", "preset", "mesh", "dtype", "drafter", "prompts_file", "trees"):
        if getattr(args, flag) is not None:
            argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    for flag in ("max_k", "max_new_tokens", "rounds", "stream_cycles", "dcp"):
        argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return argv + ["--output", str(output)]


def sweep_presets(args: argparse.Namespace, presets: Sequence[str]) -> int:
    """`jaxspec tune --presets a,b`: the same sweep once per collective preset, each in a fresh process, then
    DIR/presets.json with every preset's recommended k and its measured rate, and the best (preset, k). Exit status 1
    (and `"complete": false`) when a preset's run failed; the others are still reported."""
    results = [_run_preset(args, name) for name in presets]
    ok = [r for r in results if "error" not in r]
    best = max(ok, key=lambda r: r["measured_tok_s"]) if ok else None
    summary = {
        "presets": results,
        "best": {"preset": best["preset"], "k": best["recommended_k"]} if best else None,
        "complete": len(ok) == len(results),
    }
    (args.output / "presets.json").write_text(json.dumps(summary, indent=2) + "\n")
    _print_presets(results)
    if best:
        print(f"best: preset {best['preset']} with k = {best['recommended_k']}")
    print(f"wrote {args.output / 'presets.json'}")
    return 0 if summary["complete"] else 1


def _run_preset(args: argparse.Namespace, name: str) -> dict:
    """One child `jaxspec --collective-preset NAME tune ...` writing DIR/NAME/; its result row (or its error)."""
    import subprocess
    import sys

    out = args.output / name
    argv = [sys.executable, "-m", "jaxspec", *_child_argv(args, name, out)]
    print(f"== collective preset {name}: jaxspec {' '.join(argv[3:])}", flush=True)
    code = subprocess.run(argv, check=False).returncode
    path = out / "tune.json"
    if code != 0 or not path.is_file():
        return {"preset": name, "error": f"jaxspec tune exited with status {code}"}
    report = json.loads(path.read_text())
    from jaxspec.decoding.draft_shape import DraftShape
    from jaxspec.profiling.tune import report_rows, row_shape

    rows = {row_shape(r): r for r in report_rows(report)}
    k = report["recommended_k"]
    record = report.get("collective_preset_record") or {}
    return {
        "preset": name,
        "preset_platform": record.get("platform"),
        "platform": report["platform"],
        "recommended_k": k,
        "recommended": report["recommended"],
        "measured_tok_s": rows[DraftShape(k)]["measured_tok_s"],
        "predicted_tok_s": rows[DraftShape(k)]["predicted_tok_s"],
        "plain_tok_s": rows[DraftShape(0)]["measured_tok_s"] if DraftShape(0) in rows else None,
        "tune_json": str(path),
    }


def _print_presets(results: list[dict]) -> None:
    print("preset | platform | k* | measured tok/s at k* | predicted | plain tok/s")
    for r in results:
        if "error" in r:
            print(f"{r['preset']} | - | - | {r['error']}")
            continue
        plain = "-" if r["plain_tok_s"] is None else f"{r['plain_tok_s']:.1f}"
        where = r["platform"]
        if r["preset_platform"] not in (None, "any", r["platform"]):
            where += f" (a {r['preset_platform']} preset: its flags do nothing here)"
        print(
            f"{r['preset']} | {where} | {r['recommended_k']} | {r['measured_tok_s']:.1f} | "
            f"{r['predicted_tok_s']:.1f} | {plain}"
        )


def run(args: argparse.Namespace) -> int:
    """`jaxspec tune`: build target + drafter from the arguments, sweep, print the table, write the outputs."""
    from jaxspec.profiling.tune import tune
    from sharding.multihost import is_leader

    _check(args)
    if args.presets:
        return sweep_presets(args, _preset_names(args))
    prompts = _prompts(args)
    target, source = build_target(args, abstract=False)
    from jaxspec.io import load_drafter_or_random

    drafter = load_drafter_or_random(args.drafter, target)
    print(f"target: {source}; drafter: {args.drafter or 'random'}; mesh {dict(target.mesh.shape)}, --dcp {target.dcp}")
    tune(
        target,
        drafter,
        prompts,
        [*range(0, args.max_k + 1), *args.tree_shapes],
        max_new_tokens=args.max_new_tokens,
        repeats=args.rounds,
        stream_cycles=args.stream_cycles,
        output_dir=args.output if is_leader() else None,  # every process measures; process 0 writes
        collective_preset=getattr(args, "preset_record", None),
    )
    if args.output:
        print(f"wrote {args.output / 'tune.json'}")
    return 0


def _check(args: argparse.Namespace) -> None:
    """The numeric flags and --trees (parsed into `args.tree_shapes`, DraftShapes), or SystemExit naming the flag."""
    from jaxspec.decoding.draft_shape import MAX_NUM_STEPS
    from jaxspec.profiling.tune import parse_trees

    if not 0 <= args.max_k <= MAX_NUM_STEPS:
        raise SystemExit(f"jaxspec tune: --max-k must be in [0, {MAX_NUM_STEPS}], got {args.max_k}")
    try:
        args.tree_shapes = parse_trees(args.trees) if args.trees else []
    except ValueError as e:
        raise SystemExit(f"jaxspec tune: --trees: {e}") from None
    for name in ("rounds", "stream_cycles", "max_new_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"jaxspec tune: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")


def _preset_names(args: argparse.Namespace) -> list[str]:
    """The checked names of --presets (each must exist; the sweep needs --output and no --collective-preset)."""
    from sharding.collectives import get_preset

    names = [n.strip() for n in args.presets.split(",") if n.strip()]
    if not names:
        raise SystemExit("jaxspec tune: --presets: expected comma-separated preset names")
    try:
        for n in names:
            get_preset(n)
    except ValueError as e:
        raise SystemExit(f"jaxspec tune: --presets: {e}") from None
    if not args.output:
        raise SystemExit("jaxspec tune: --presets needs --output DIR (each preset writes DIR/<preset>/)")
    if getattr(args, "collective_preset", "default") != "default":
        raise SystemExit("jaxspec tune: --presets sweeps the presets itself; drop --collective-preset")
    return names


def _prompts(args: argparse.Namespace) -> list[list[int]]:
    """--prompts-file's prompts; else the bundled pair's held-out ones (without --model/--preset); else fixed ids."""
    from jaxspec.profiling.tune import BUNDLED_PROMPTS, DEFAULT_PROMPTS

    prompts = None
    if use_bundled_pair(args):  # the bundled trained pair, on its held-out prompts
        from jaxspec import bundled
        from jaxspec.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.model)
        prompts = [tokenizer.encode(p) for p in bundled.prompts()[:BUNDLED_PROMPTS]]
    if args.model and not args.drafter and args.max_k > 0:
        raise SystemExit("jaxspec tune: --model needs --drafter DIR (random drafters are only for --preset)")
    try:
        if args.prompts_file:
            prompts = read_prompts(args.prompts_file)
    except (OSError, ValueError) as e:
        raise SystemExit(f"jaxspec tune: --prompts-file: {e}") from None
    return prompts or [list(p) for p in DEFAULT_PROMPTS]
