"""`jaxspec serve`: load a target + drafter (default: the bundled pair), compile the engine, serve HTTP with uvicorn."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path

from jaxspec.cli.args import (
    DTYPE_DEFAULT_HELP,
    add_dcp_arg,
    add_drafter_arg,
    add_dtype_arg,
    add_int4_experts_arg,
    add_kv_cache_dtype_arg,
    add_mesh_arg,
    add_model_arg,
    add_num_steps_args,
    add_tree_args,
    default_dtype,
    draft_shape,
    int4_experts,
    recommended_shape,
    striped,
    use_bundled_pair,
)
from jaxspec.decoding.draft_shape import DraftShape
from jaxspec.decoding.sampling_params import SAMPLING_DEFAULT, SAMPLING_MODES

log = logging.getLogger("jaxspec.serving")
HELP = "OpenAI-compatible HTTP server: continuous batching with speculative decoding"
DESCRIPTION = (
    "Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics. Before /health answers, the "
    "engine compiles every program it will run (admit, a prefill chunk, and one segment per batch bucket x draft "
    "shape x greedy/per-row program) and logs each part's time; fewer --batch-buckets start faster (measured "
    "start-up: docs/serving.md)."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arg(p, "target checkpoint directory (default: the bundled pair, assets/kimi-py-tiny)")
    add_drafter_arg(p, "EAGLE-3 drafter directory (default with the bundled pair: its drafter)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: --model)")
    add_num_steps_args(
        p,
        default="auto",
        auto_help="per segment, plain decoding or a chain, whichever the engine's cost model predicts faster for the "
        "rows generating then (from segment times and acceptance it measures while serving); the chain's depth is "
        "the one --tune DIR/tune.json recommends (for the bundled pair its committed tuning result), else 3; with "
        "--topk, a tree of that depth instead of the chain",
    )
    add_tree_args(p)
    p.add_argument(
        "--sampling",
        choices=SAMPLING_MODES,
        default=SAMPLING_DEFAULT,
        help="how sampled requests are verified unless one says (its 'sampling' field): coupled (a seed gives the "
        "same text whatever the load or draft shape), rejection (lossless rejection sampling: more accepted tokens) "
        "or auto (coupled for requests with a seed) (%(default)s)",
    )
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="(%(default)s)")
    p.add_argument("--port", type=int, default=8000, help="(%(default)s)")
    p.add_argument("--served-model-name", help="the model id clients send (default: the model directory's name)")
    p.add_argument(
        "--chat-format",
        default="auto",
        choices=["auto", "kimi", "plain"],
        help="auto: Kimi's chat template when the vocabulary has its tokens, else plain 'role: content' lines",
    )
    add_mesh_arg(p, "mesh shape 1xMODEL (default: one device)")
    add_dtype_arg(p, help=DTYPE_DEFAULT_HELP)
    add_int4_experts_arg(p)
    add_kv_cache_dtype_arg(p)
    add_dcp_arg(p)
    add_access_args(p)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--compilation-cache",
        type=Path,
        metavar="DIR",
        help="JAX's persistent compilation cache in DIR: a restart with the same settings loads the compiled "
        "programs instead of compiling them (start-up: docs/serving.md)",
    )


def add_access_args(p: argparse.ArgumentParser) -> None:
    """Who may call the server and what they may send (jaxspec/serving/access.py; docs/serving.md, Security)."""
    from jaxspec.serving.access import KEY_ENV, AccessConfig

    p.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help=f"require Authorization: Bearer KEY on /v1/*, /tokenize and /detokenize (repeat for several keys; "
        f"default: ${KEY_ENV}, comma-separated, which keeps the keys out of ps)",
    )
    p.add_argument(
        "--prefix-cache-salt-by-key",
        action="store_true",
        help="partition the prefix cache by API key: requests with different keys never share cached blocks",
    )
    default = AccessConfig()
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=default.max_body_bytes,
        help="refuse larger request bodies with 413 (%(default)s)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=default.body_timeout,
        metavar="SECONDS",
        help="answer 408 and close a connection whose request body has not arrived within this time (%(default)s)",
    )
    p.add_argument(
        "--allow-special-tokens",
        action="store_true",
        help="encode special-token text in /v1/completions prompts as those tokens (default: as plain text; chat "
        "messages are always plain text)",
    )


def _access(args: argparse.Namespace):
    """The AccessConfig of the flags (and $JAXSPEC_API_KEY); warns when the host is exposed without a key."""
    import os

    from jaxspec.serving.access import KEY_ENV, AccessConfig, keys_from, warn_if_exposed

    keys = keys_from(args.api_key, dict(os.environ))
    if args.prefix_cache_salt_by_key and not keys:
        raise SystemExit(
            f"jaxspec serve: --prefix-cache-salt-by-key partitions by API key: set --api-key or ${KEY_ENV}"
        )
    try:
        access = AccessConfig(keys, args.prefix_cache_salt_by_key, args.max_body_bytes, args.body_timeout)
    except ValueError as e:
        raise SystemExit(f"jaxspec serve: {e}") from None
    warn_if_exposed(args.host, access)
    return access


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The EngineConfig fields that have a help text, as --<field-name> flags with the config's defaults (a tuple
    field takes comma-separated integers; a bool field, on by default, is turned off by --no-<field-name>)."""
    import typing

    from jaxspec.serving.engine import EngineConfig

    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if "help" not in f.metadata:
            continue
        flag = "--" + f.name.replace("_", "-")
        if hints[f.name] is bool:  # on by default: --no-<field-name> turns it off
            p.add_argument("--no-" + flag[2:], dest=f.name, action="store_false", help=f"don't {f.metadata['help']}")
        elif hints[f.name] is int:
            p.add_argument(flag, type=int, default=f.default, help=f.metadata["help"] + " (%(default)s)")
        else:  # tuple[int, ...]
            p.add_argument(flag, default="", help=f.metadata["help"])


def _engine_fields(args: argparse.Namespace) -> dict:
    """The EngineConfig fields given by flags (`add_engine_args`)."""
    from jaxspec.serving.engine import EngineConfig

    fields = {}
    for f in dataclasses.fields(EngineConfig):
        if "help" not in f.metadata:
            continue
        value = getattr(args, f.name)
        if isinstance(f.default, tuple):
            flag = "--" + f.name.replace("_", "-")
            try:
                value = tuple(int(x) for x in value.split(",") if x.strip())
            except ValueError:
                raise SystemExit(f"jaxspec serve: {flag}: expected comma-separated integers, got {value!r}") from None
        fields[f.name] = value
    return fields


def _num_steps(args, bundled: bool) -> tuple[int, bool]:
    """(num_steps, adaptive) of --num-steps: an integer, or 'auto' (adaptive, over plain decoding and a chain of the
    depth tune.json recommends, else 3; with --topk a tree of that depth; plain decoding alone without a drafter)."""
    if args.num_steps != "auto":
        try:
            return int(args.num_steps), False
        except ValueError:
            raise SystemExit(
                f"jaxspec serve: --num-steps expects an integer or 'auto', got {args.num_steps!r}"
            ) from None
    if not args.drafter:
        log.info("--num-steps auto without --drafter: plain decoding")
        return 0, False
    path = _tune_json(args, bundled)
    k = recommended_shape(path).num_steps if path is not None else 3
    draft = f"a tree of depth {k} and top-{args.topk}" if args.topk != 1 else f"a chain of k = {k}"
    log.info("--num-steps auto: per segment, plain decoding or %s (%s)", draft, path or "no --tune")
    return k, True


def _tune_json(args, bundled: bool) -> Path | None:
    """--tune DIR's tune.json (for the bundled pair, its committed tuning result), None without one."""
    path = args.tune / "tune.json" if args.tune is not None else None
    if path is None and bundled:
        from jaxspec.bundled import ROOT

        path = ROOT.parent.parent / "benchmarks" / "results" / "tune_bundled" / "tune.json"
    if path is not None and not path.is_file():
        raise SystemExit(f"jaxspec serve: --num-steps auto: {path} not found (run 'jaxspec tune')")
    return path


def _recorded_acceptance(path: Path | None, draft: DraftShape | None = None) -> list[float] | None:
    """The drafter's conditional acceptance per draft position that tune.json measured for `draft` (a chain or None:
    its deepest chain's, as every chain's a_j are the drafter's; a tree: that tree's own), the adaptive policy's
    prior; None without a tune.json or such a measurement."""
    if path is None:
        return None
    record = json.loads(path.read_text())
    if draft is not None and draft.tree:
        rows = [r for r in record.get("tree_rows", []) if DraftShape.from_dict(r) == draft]
    else:
        rows = record.get("rows", [])
    rows = [r for r in rows if r.get("measured_acceptance")]
    return max(rows, key=lambda r: len(r["measured_acceptance"]))["measured_acceptance"] if rows else None


def run(args: argparse.Namespace) -> int:
    """Load the pair, compile the engine (warm-up), then serve until interrupted."""
    import jax
    import uvicorn

    from jaxspec.io import load_drafter
    from jaxspec.serving.app import create_app
    from jaxspec.serving.engine import Engine
    from jaxspec.serving.metrics import Metrics
    from jaxspec.serving.startup import StartupError
    from jaxspec.tokenizer import load_tokenizer

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
    )
    if args.compilation_cache is not None:  # before anything compiles; every program, however small or quick
        jax.config.update("jax_compilation_cache_dir", str(args.compilation_cache))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    access = _access(args)
    bundled = use_bundled_pair(args)
    num_steps, adaptive = _num_steps(args, bundled)
    if num_steps and not args.drafter:
        raise SystemExit("jaxspec serve: --num-steps > 0 needs --drafter (or --num-steps 0)")
    config = _engine_config(args, num_steps, adaptive)
    target = _load_target(args, config)
    drafter = load_drafter(args.drafter, target, dtype=target.dtype) if num_steps else None
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    channel = None
    if jax.process_count() > 1:  # one server over several processes: process 0 decides, the others follow
        from jaxspec.serving.fanout import PlanChannel

        channel = PlanChannel()
        if jax.process_index() != 0:
            return _follow(target, drafter, config, tokenizer.stop_ids, channel)
    metrics = Metrics(config.draft, config.max_batch, pool_blocks=config.pool_blocks)
    acceptance = _recorded_acceptance(_tune_json(args, bundled), config.draft) if adaptive else None
    engine = Engine(
        target, drafter, config, stop_ids=tokenizer.stop_ids, metrics=metrics, channel=channel, acceptance=acceptance
    )
    try:
        engine.warmup(log.info)
    except StartupError as e:
        engine.stop()  # the other processes, if any, stop too
        raise SystemExit(f"jaxspec serve: {e}") from None
    name = args.served_model_name or ("kimi-py-tiny" if bundled else Path(args.model).resolve().name)
    app = create_app(
        engine,
        tokenizer,
        name,
        chat_format=args.chat_format,
        access=access,
        allow_special=args.allow_special_tokens,
        sampling=args.sampling,
    )
    drafts = " or ".join(shape.label for shape in config.shapes)
    log.info("serving %s on http://%s:%d (draft %s)", name, args.host, args.port, drafts)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=60)
    return 0


def _load_target(args: argparse.Namespace, config):
    """The target on the mesh of --mesh (default: one device), in the compute dtype, its INT4 experts packed or dense
    (both logged), its cache striped as --dcp asks; after refusing, before anything loads, a configuration whose
    programs this process cannot hold (startup.py)."""
    import jax

    from jaxspec.io import load_target
    from jaxspec.serving.startup import MapBudget, Programs, StartupError
    from sharding.mesh import make_mesh

    mesh = make_mesh(args.mesh) if args.mesh else None
    platform = (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform
    budget = MapBudget.here(platform)
    try:
        if budget is not None:
            budget.check(Programs.of(config))
    except StartupError as e:
        raise SystemExit(f"jaxspec serve: {e}") from None
    dtype, why = default_dtype(args.dtype, args.model, platform)
    dense, experts = int4_experts(args.int4_experts, args.model, platform, dtype, "serve")
    log.info("loading %s (%s: %s; routed experts: %s)", args.model, dtype.name, why, experts)
    kv = args.kv_cache_dtype
    return striped(args, load_target(args.model, mesh=mesh, dtype=dtype, kv_cache_dtype=kv, dequantize_int4=dense))


def _follow(target, drafter, config, stop_ids: tuple[int, ...], channel) -> int:
    """A process other than 0: run process 0's plans on an executor built as process 0's engine builds its own (the
    same programs), until process 0 stops."""
    import jax

    from jaxspec.serving.executor import Executor
    from jaxspec.serving.fanout import LostLeader, follow

    executor = Executor.of(target, drafter, config, stop_ids=stop_ids)
    log.info("process %d: running process 0's plans", jax.process_index())
    try:
        follow(executor, channel)
    except LostLeader as e:
        raise SystemExit(f"jaxspec serve (process {jax.process_index()}): {e}") from None
    return 0


def _engine_config(args: argparse.Namespace, num_steps: int, adaptive: bool):
    """The engine settings of the flags (errors as one line naming the problem)."""
    from jaxspec.serving.engine import EngineConfig

    def fail(message: str):
        raise SystemExit(f"jaxspec serve: {message}")

    draft = draft_shape(argparse.Namespace(**(vars(args) | {"num_steps": num_steps})), fail)
    try:
        return EngineConfig(draft=draft, adaptive=adaptive, **_engine_fields(args))
    except ValueError as e:
        raise SystemExit(f"jaxspec serve: {e}") from None
