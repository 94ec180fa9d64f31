"""`jaxspec train-drafter`: generate the target's responses to a prompt set (or reuse a dataset) and train a drafter.

    jaxspec train-drafter --target DIR --prompts prompts.txt --out OUT [--steps ...]   generate into OUT/data, train
    jaxspec train-drafter --target DIR --data DATA --out OUT                          train on an existing dataset
    jaxspec train-drafter ... --resume                                                 continue both phases

Prompt files: `.jsonl` with one {"prompt": "text"} or {"ids": [token ids]} object per line, or plain text with one
prompt per line (with --ids: comma-separated token ids per line). Text needs the tokenizer of the --target directory
(or --tokenizer DIR). Every argument is checked before the target's weights are loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from pathlib import Path

from jaxspec.cli.args import add_dtype_arg, add_mesh_arg

HELP = (
    "train an EAGLE-3 drafter for a target (optax, Orbax checkpoints, resumable); exports SGLang format "
    "(or Eagle3DeepseekV2ForCausalLM with --attention mla)"
)
DESCRIPTION = (
    "Generate the target's own responses to --prompts (or reuse --data), then train an EAGLE-3 "
    "drafter with the training-time-test unroll and export it to --out."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of `jaxspec train-drafter`; the training group is generated from `TrainConfig`'s fields."""
    p.add_argument("--target", type=Path, required=True, help="target checkpoint directory (HF layout or converted)")
    add_mesh_arg(p, "mesh DATAxMODEL; e.g. 8x1 = 8-way data parallel (default 1xN)")
    add_dtype_arg(p, default="bfloat16", help="target (and drafter) dtype")
    p.add_argument("--out", type=Path, required=True, help="output directory: checkpoints, logs, the trained drafter")
    data = p.add_argument_group("data")
    data.add_argument("--prompts", type=Path, help="prompt file (.jsonl or one prompt per line) to generate data from")
    data.add_argument("--data", type=Path, help="dataset directory (default with --prompts: OUT/data)")
    data.add_argument("--ids", action="store_true", help="prompt lines are comma-separated token ids")
    data.add_argument("--chat", action="store_true", help="wrap text prompts in the tokenizer's chat template")
    data.add_argument("--tokenizer", type=Path, help="tokenizer directory (default: --target)")
    data.add_argument("--max-new-tokens", type=int, default=256, help="response tokens per prompt (%(default)s)")
    data.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of the responses")
    data.add_argument("--shard-size", type=int, default=64, help="prompts per generated shard (%(default)s)")
    add_train_config_args(p.add_argument_group("training"))
    group = p.add_argument_group("run")
    group.add_argument("--checkpoint-every", type=int, default=500, help="steps between checkpoints (%(default)s)")
    group.add_argument("--resume", action="store_true", help="continue an interrupted run in --out")


def add_train_config_args(group) -> None:
    """One flag per `TrainConfig` field (dest = the field name; capture_layers as comma-separated text)."""
    from jaxspec.training.trainer import TrainConfig

    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        flag = f.metadata["flag"] or "--" + f.name.replace("_", "-")
        kind = next((t for t in (float, int) if t in (hints[f.name], *typing.get_args(hints[f.name]))), None)
        help = f.metadata["help"] + (" (%(default)s)" if f.default is not None else "")
        choices = f.metadata["choices"]
        metavar = None if choices else flag[2:].upper().replace("-", "_")
        group.add_argument(flag, dest=f.name, metavar=metavar, type=kind, default=f.default, help=help, choices=choices)


def _fail(msg: str) -> SystemExit:
    return SystemExit(f"jaxspec train-drafter: {msg}")


def read_prompt_file(path: Path, *, ids: bool) -> list[str | list[int]]:
    """Prompts from a .jsonl file ({"prompt": text} or {"ids": [...]}) or one per line (text, or ids with `ids`)."""
    if not path.is_file():
        raise _fail(f"--prompts: {path} is not a file")
    prompts: list[str | list[int]] = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"--prompts {path}:{n}"
        if path.suffix == ".jsonl":
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise _fail(f"{where}: not valid JSON ({e})") from None
            if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
                prompts.append(obj["prompt"])
            elif isinstance(obj, dict) and isinstance(obj.get("ids"), list) and obj["ids"]:
                if not all(isinstance(t, int) and not isinstance(t, bool) for t in obj["ids"]):
                    raise _fail(f'{where}: "ids" must be a list of integers')
                prompts.append(list(obj["ids"]))
            else:
                raise _fail(f'{where}: expected {{"prompt": "text"}} or {{"ids": [token ids]}}')
        elif ids:
            try:
                prompts.append([int(t) for t in line.split(",")])
            except ValueError:
                raise _fail(f"{where}: expected comma-separated token ids, got {line.strip()!r}") from None
        else:
            prompts.append(line)
    if not prompts:
        raise _fail(f"--prompts: {path} holds no prompts")
    return prompts


def _check_args(args) -> tuple:
    """Everything that can be checked without the target's weights: (config, prompts or None, data dir, TrainConfig)."""
    from jaxspec.config import ConfigError, KimiConfig
    from jaxspec.training.trainer import DEFAULT_DRAFT_VOCAB

    if not args.target.is_dir():
        raise _fail(f"--target: {args.target} is not a directory")
    try:
        cfg = KimiConfig.from_pretrained(args.target)
    except (FileNotFoundError, ConfigError) as e:
        raise _fail(f"--target: {e}") from None
    V = cfg.vocab_size
    if args.draft_vocab_size is None:
        args.draft_vocab_size = min(DEFAULT_DRAFT_VOCAB, V)
    if not 0 < args.draft_vocab_size <= V:
        raise _fail(f"--draft-vocab: {args.draft_vocab_size} must be in [1, {V}] (the target's vocab_size)")
    for flag in ("ttt_depth", "steps", "batch_size", "max_new_tokens", "checkpoint_every", "shard_size"):
        if getattr(args, flag) < 1:
            raise _fail(f"--{flag.replace('_', '-')}: expected a positive integer, got {getattr(args, flag)}")
    config = train_config(args)
    if config.attention == "mla" and cfg.q_lora_rank is None:
        raise _fail("--attention mla: an MLA drafter needs a query LoRA, and this target has q_lora_rank null")
    if config.capture_layers and not all(0 <= x < cfg.num_hidden_layers for x in config.capture_layers):
        layers = list(config.capture_layers)
        raise _fail(f"--capture-layers: {layers} must be layer outputs in [0, {cfg.num_hidden_layers})")
    if (args.out / "train_config.json").is_file() and not args.resume:
        raise _fail(f"--out: {args.out} holds an earlier training run; pass --resume to continue it, or another --out")
    prompts, data_dir = _data_source(args, V)
    return cfg, prompts, data_dir, config


def train_config(args: argparse.Namespace):
    """The TrainConfig of the parsed flags (one flag per field; --capture-layers parsed from comma-separated text)."""
    from jaxspec.training.trainer import TrainConfig

    layers = None
    if args.capture_layers:
        try:
            layers = tuple(int(x) for x in args.capture_layers.split(","))
        except ValueError:
            raise _fail(f"--capture-layers: expected comma-separated integers, got {args.capture_layers!r}") from None
    settings = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**settings | {"capture_layers": layers})


def _data_source(args, vocab_size: int) -> tuple[list | None, Path]:
    """(prompts to generate from or None, dataset directory): --prompts, or an existing --data for this vocabulary."""
    from jaxspec.training.data import DatasetError, read_manifest

    if args.prompts is not None:
        return read_prompt_file(args.prompts, ids=args.ids), args.data or args.out / "data"
    if args.data is None:
        raise _fail("give --prompts FILE (generate the data) or --data DIR (an existing dataset)")
    try:
        manifest = read_manifest(args.data)
    except DatasetError as e:
        raise _fail(f"--data: {e}") from None
    if manifest["target"]["vocab_size"] != vocab_size:
        raise _fail(
            f"--data: {args.data} was generated for a vocabulary of {manifest['target']['vocab_size']} tokens, "
            f"the target has {vocab_size}"
        )
    return None, args.data


def _encode(args, prompts: list, vocab_size: int) -> tuple[list[list[int]], tuple[int, ...]]:
    """Token ids of every prompt (text through the tokenizer) and the tokenizer's stop ids."""
    from jaxspec.tokenizer import load_tokenizer

    tokenizer, stop = None, ()
    if args.chat or any(isinstance(p, str) for p in prompts):
        try:
            tokenizer = load_tokenizer(args.tokenizer or args.target)
        except (OSError, ValueError) as e:
            raise _fail(f"text prompts need a tokenizer: {e}") from None
        stop = tuple(tokenizer.stop_ids)
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            p = tokenizer.apply_chat_template([{"role": "user", "content": p}]) if args.chat else tokenizer.encode(p)
        if not p or min(p) < 0 or max(p) >= vocab_size:
            raise _fail(f"--prompts: prompt {i + 1} has token ids outside [0, {vocab_size}) or is empty")
        out.append(list(p))
    return out, stop


def run(args: argparse.Namespace) -> int:
    """`jaxspec train-drafter`: check the arguments, load the target, generate data if asked, train, export."""
    import jax.numpy as jnp

    from jaxspec.io import load_target
    from jaxspec.training.data import generate_dataset
    from jaxspec.training.trainer import train_drafter
    from sharding.mesh import make_mesh

    cfg, prompts, data_dir, config = _check_args(args)
    if prompts is not None:
        prompts, stop = _encode(args, prompts, cfg.vocab_size)
    try:
        mesh = make_mesh(args.mesh)
    except ValueError as e:
        raise _fail(f"--mesh: {e}") from None
    target = load_target(args.target, mesh=mesh, dtype=jnp.dtype(args.dtype))
    print(f"target: {args.target} ({cfg.num_hidden_layers} layers, vocab {cfg.vocab_size}); mesh {dict(mesh.shape)}")
    try:
        if prompts is not None:
            data = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, shard_size=args.shard_size)
            generate_dataset(target, prompts, data_dir, seed=config.seed, stop=stop, **data)
            print(f"dataset: {data_dir}")
        options = dict(checkpoint_every=args.checkpoint_every, resume=args.resume)
        drafter = train_drafter(target, data_dir, args.out, config, **options)
    except (ValueError, FileExistsError) as e:
        raise _fail(str(e)) from None
    last = (args.out / "train_log.jsonl").read_text().splitlines()[-1]
    m = json.loads(last)
    acc = "/".join(f"{a:.3f}" for a in m["acc_j"])
    print(f"step {m['step']}: loss {m['loss']:.4f}, accuracy per depth {acc}")
    print(f"drafter ({drafter.config.draft_vocab_size}-token draft vocabulary) written to {args.out}")
    return 0
