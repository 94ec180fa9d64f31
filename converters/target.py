"""HF safetensors target -> Orbax checkpoint, one layer at a time, resumable (layout: `jaxspec.io.orbax`).

Every tensor's name and shape is checked from the safetensors headers before anything is written (all problems in
one `CheckpointError`). Then each group (top-level weights, then each decoder layer) is read lazily through the
index, built with `jaxspec.io.hf`'s name table, saved as its own Orbax checkpoint and released: host memory holds at
most the layer being read plus the one being written. A rerun skips finalized groups; the completion marker is
written last.

Speed (benchmarks/results/convert_memory.md has the profile): routed experts are read in file order with O_DIRECT
straight into [E, out, in] stacks that the next layers reuse, and written by `shard_writer` with O_DIRECT; reading
group i+1 overlaps Orbax writing group i.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import re
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from safetensors import safe_open
from tqdm import tqdm

from converters.shard_writer import DirectNumpyHandler, aligned_empty
from jaxspec.config import KimiConfig
from jaxspec.io import Target
from jaxspec.io.fp8 import dequantized_config, fp8_block, open_checkpoint
from jaxspec.io.hf import (
    CheckpointError,
    Reader,
    caster,
    expected_tensors,
    is_ignorable,
    layer_table,
    model_fp8_blocks,
    read_float_experts,
    read_fp8_experts,
    read_layer,
    top_table,
)
from jaxspec.io.orbax import (
    FORMAT,
    MARKER,
    PLAN,
    VERSION,
    done_file,
    flatten_quant,
    group_dir,
    group_names,
    is_group_complete,
    layer_group,
    stack_of,
)
from jaxspec.models.quant import Fp8Array
from jaxspec.pytree import flatten, set_path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5")


@dataclasses.dataclass
class ConvertReport:
    """What a conversion run did."""

    written: list[str]
    skipped: list[str]  # groups already complete from an earlier run
    skipped_vision: int
    skipped_mtp: int
    bytes_written: int
    verified: list[str] = dataclasses.field(default_factory=list)


def convert_target(
    src: str | Path,
    dst: str | Path,
    *,
    dtype: str = "bfloat16",
    progress: bool = True,
    verify: bool = False,
    on_group_written: Callable[[str], None] | None = None,
    dequantize_fp8: bool = False,
) -> ConvertReport:
    """Convert the HF checkpoint in `src` to an Orbax checkpoint in `dst` (resuming a previous run into `dst`).

    `dtype` is the storage dtype of unquantised weights: INT4 experts stay INT4 and block-FP8 weights stay FP8, each
    with its stored scales and values bit for bit (`dequantize_fp8=True`: FP8 weights dequantised to `dtype`).
    `on_group_written(name)` is called after each group is finalized (progress hooks, tests).
    """
    src, dst = Path(src), Path(dst)
    if (dst / MARKER).is_file():
        raise FileExistsError(f"{dst} already holds a complete conversion ({MARKER}); remove it to convert again")
    cfg, reader, dequantized = open_source(src, dtype, dequantize_fp8)
    int4 = cfg.quant is not None
    mtp = check_names(reader, cfg, int4, src)

    plan = _start(src, dst, dtype, cfg, reader, dequantized)
    todo = [g for g in plan["groups"] if not is_group_complete(dst, g)]
    done = [g for g in plan["groups"] if g not in todo]
    sizes: dict[str, int] = {}
    # Objects that exist now (JAX, Orbax, ...) are left out of garbage collection while converting: a full collection
    # re-scanned them all, a tenth of the conversion's CPU time in a profile (Orbax allocates per array and group).
    gc.freeze()
    try:
        written = _write_groups(
            reader, cfg, src, dst, todo, sizes, np.dtype(jnp.dtype(dtype)), progress, on_group_written
        )
    finally:
        gc.unfreeze()
    report = ConvertReport(written, done, reader.skipped, mtp, sum(sizes[g] for g in written))
    if verify:
        report.verified = verify_conversion(src, dst)
    marker = {**plan, "skipped_vision_tensors": reader.skipped, "skipped_mtp_tensors": mtp}
    tmp = dst / (MARKER + ".tmp")
    tmp.write_text(json.dumps(marker, indent=2) + "\n")
    tmp.replace(dst / MARKER)  # atomic: the marker appears complete or not at all
    return report


def _start(src: Path, dst: Path, dtype: str, cfg: KimiConfig, reader: Reader, dequantized: dict | None) -> dict:
    """Write the plan (or check a previous run's) and the small files; returns the plan."""
    int4 = cfg.quant is not None
    plan = {"format": FORMAT, "version": VERSION, "source": str(src.resolve()), "dtype": dtype, "int4_experts": int4}
    plan["dequantized_fp8"] = dequantized is not None
    plan["groups"] = group_names(cfg)
    plan["source_files"] = source_fingerprint(src, reader.ckpt.files.values())
    _write_or_check_plan(dst, plan)
    _copy_small_files(src, dst)
    if dequantized is not None:  # the stored weights are no longer FP8: drop the quantization_config
        (dst / "config.json").write_text(json.dumps(dequantized, indent=2) + "\n")
    return plan


# long: one read-ahead pipeline; its two closures share the buffers, the checkpointer and the progress bar
def _write_groups(
    reader: Reader,
    cfg: KimiConfig,
    src: Path,
    dst: Path,
    todo: list[str],
    sizes: dict[str, int],
    dtype: np.dtype,
    progress: bool,
    on_group_written: Callable[[str], None] | None,
) -> list[str]:
    """Read, save and finalize each group in `todo`, in order; records each written group's bytes in `sizes` and
    returns the groups written."""
    int4 = cfg.quant is not None
    # The exact total needs the abstract model (a trace, ~0.3 s): only for the progress bar.
    total = sum(_group_bytes(cfg, dtype, int4)[g] for g in todo) if progress else None
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="convert", disable=not progress)
    buffers = _Buffers()
    written: list[tuple[str, list[np.ndarray]]] = []

    def saved() -> None:
        ck.wait_until_finished()
        if not written:
            return
        name, owned = written[-1]
        if not ocp.utils.is_checkpoint_finalized(group_dir(dst, name)):
            raise RuntimeError(f"orbax did not finalize {group_dir(dst, name)}")
        done_file(dst, name).touch()
        buffers.give(owned)  # written and finalized: the next read may overwrite them
        owned.clear()
        bar.update(sizes[name])
        if on_group_written is not None:
            on_group_written(name)

    def load(name: str) -> tuple[dict[str, Any], list[np.ndarray]]:
        owned = buffers.taken()
        tree = _contiguous(flatten_quant(read_group(reader, cfg, name, int4, dtype, buffers)), buffers)
        buffers.drop()  # what this group did not reuse is not needed any more
        reader.ckpt.release()
        if reader.problems:
            raise CheckpointError(f"{src}: problem(s) while reading {name}:\n  " + "\n  ".join(reader.problems))
        return tree, owned

    # One reader thread runs a group ahead: group i+1 is read while Orbax writes group i (its threads), and no more
    # than those two groups are in host memory. The buffer hand-over (give, then the next load) never overlaps.
    pool, ck = ThreadPoolExecutor(1, thread_name_prefix="jaxspec-convert-read"), None
    try:
        ahead = pool.submit(load, todo[0]) if todo else None
        ck = _writer()  # (starts JAX's backend: ~0.1 s, while the first group is read)
        for i, name in enumerate(todo):
            tree, owned = ahead.result()
            saved()
            ahead = pool.submit(load, todo[i + 1]) if i + 1 < len(todo) else None
            _remove_partial(group_dir(dst, name))
            sizes[name] = sum(int(np.asarray(v).nbytes) for _, v in flatten(tree))
            ck.save(group_dir(dst, name), args=ocp.args.PyTreeSave(tree))
            written.append((name, owned))
            del tree
        saved()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        bar.close()
        if ck is not None:
            ck.close()
    return [name for name, _ in written]


def _contiguous(tree: Any, buffers: _Buffers) -> Any:
    """`tree` with every non-contiguous array (the [out, in] -> [in, out] views of the name table) copied into a
    pooled page-aligned one: `shard_writer` then writes it with O_DIRECT, where TensorStore's strided encode took
    0.3 s for the 17 MB top group (against 0.13 s for a 205 MB layer of contiguous arrays)."""
    if isinstance(tree, dict):
        return {k: _contiguous(v, buffers) for k, v in tree.items()}
    if isinstance(tree, np.ndarray) and tree.size and not tree.flags.c_contiguous:
        out = buffers.take(tree.shape, tree.dtype)
        np.copyto(out, tree)
        return out
    return tree


class _Buffers:
    """Expert stacks of groups already written, handed to the next group's read: without it every layer's arrays are
    fresh pages the kernel faults in and zeroes (about a tenth of a conversion's CPU time). Used by one thread at a
    time: `load` takes (reader thread), `saved` gives back (main thread) only once that load has finished."""

    def __init__(self) -> None:
        self.free: dict[tuple, list[np.ndarray]] = {}
        self.owned: list[np.ndarray] = []

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        stack = self.free.get((tuple(shape), np.dtype(dtype)))
        out = stack.pop() if stack else aligned_empty(shape, dtype)
        self.owned.append(out)
        return out

    def taken(self) -> list[np.ndarray]:
        """A fresh list that collects what the next group's read takes."""
        self.owned = []
        return self.owned

    def give(self, arrays: list[np.ndarray]) -> None:
        for a in arrays:
            self.free.setdefault((a.shape, a.dtype), []).append(a)

    def drop(self) -> None:
        self.free.clear()


def open_source(
    src: Path, dtype: str = "float32", dequantize_fp8: bool = False
) -> tuple[KimiConfig, Reader, dict[str, Any] | None]:
    """(config, lazy reader, dequantised config.json or None): FP8 block weights are read as stored, or with
    `dequantize_fp8` dequantised to `dtype` (one rounding of the float32 product, as DeepSeek's `weight_dequant`)."""
    raw_path = src / "config.json"
    if not raw_path.is_file():
        raise FileNotFoundError(f"config.json not found in {src}")
    raw = json.loads(raw_path.read_text())
    cfg, ckpt = KimiConfig.from_hf_config(raw), open_checkpoint(src, np.dtype(jnp.dtype(dtype)))
    dequantized = dequantized_config(raw) if dequantize_fp8 and fp8_block(raw) is not None else None
    cfg = cfg.replace(fp8=None) if dequantize_fp8 else cfg
    root = src.resolve()
    outside = sorted({str(f) for f in set(ckpt.files.values()) if not f.resolve().is_relative_to(root)})
    if outside:
        raise CheckpointError(f"{src}: the index points outside the checkpoint directory: {outside}")
    for f in sorted(set(ckpt.files.values())):  # every header, before anything is written
        try:
            with safe_open(f, "numpy"):
                pass
        except Exception as e:  # safetensors raises its own error type, naming no file
            raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from e
    return cfg, Reader(ckpt, model_fp8_blocks(cfg, cfg.quant is not None)), dequantized


def read_group(
    reader: Reader, cfg: KimiConfig, name: str, int4: bool, dtype: np.dtype, buffers: _Buffers | None = None
) -> dict[str, Any]:
    """The parameters of one group as stored: a nested dict of numpy arrays cast to `dtype` (Int4Array for INT4
    experts, Fp8Array for FP8 weights). Float and FP8 routed experts keep the checkpoint's [E, out, in] layout (see
    `jaxspec.io.orbax`), read straight into (reused) `buffers`."""
    dtype, cast = np.dtype(dtype), caster(dtype)
    if name == "top":
        return reader.rows(top_table(cfg), cast)
    layer = int(name.removeprefix("layer_"))
    moe = stack_of(cfg, layer)[0] == "moe_layers"
    if int4 or not moe:
        return read_layer(reader, cfg, layer, moe, int4, dtype)
    out = reader.rows(layer_table(cfg, True), cast, prefix=f"model.layers.{layer}.")
    take = (buffers or _Buffers()).take
    if reader.fp8_blocks:
        for proj, parts in read_fp8_experts(reader, cfg, layer, take).items():
            set_path(out, ("mlp", proj), None if parts is None else Fp8Array(*parts, cfg.fp8.block))
        return out
    for proj, stack in read_float_experts(reader, cfg, layer, dtype, take).items():
        set_path(out, ("mlp", proj), stack)
    return out


def check_names(reader: Reader, cfg: KimiConfig, int4: bool, src: Path) -> int:
    """Check every expected tensor's presence and shape from the headers alone, and flag unexpected ones.

    Raises CheckpointError listing every problem; returns the number of skipped MTP (extra-layer) tensors.
    """
    expected = expected_tensors(cfg, int4)
    problems = []
    for name, shape in expected.items():
        if name not in reader.names:
            problems.append(f"missing tensor {name} (expected shape {list(shape)})")
            continue
        actual = reader.ckpt.shape(reader.names[name])
        if actual != tuple(shape):
            problems.append(f"{name}: expected shape {list(shape)}, got {list(actual)}")
    extra = set(reader.names) - set(expected)
    mtp = sum(1 for n in extra if re.match(r"model\.layers\.(\d+)\.", n) and is_ignorable(n, cfg, reader.names))
    problems += [f"unexpected tensor {n}" for n in sorted(n for n in extra if not is_ignorable(n, cfg, reader.names))]
    if problems:
        raise CheckpointError(f"{src}: {len(problems)} problem(s) with the checkpoint:\n  " + "\n  ".join(problems))
    return mtp


def verify_conversion(src: str | Path, dst: str | Path, *, sample: int = 3) -> list[str]:
    """Re-read a sample of groups from both sides (top, first/middle/last layers) and compare them exactly.

    Raises CheckpointError listing every missing, unexpected, mis-shaped or differing tensor; returns the groups
    compared.
    """
    src, dst = Path(src), Path(dst)
    plan = json.loads((dst / PLAN).read_text())
    cfg, reader, _ = open_source(src, plan["dtype"], plan.get("dequantized_fp8", False))
    int4 = cfg.quant is not None
    n = cfg.num_hidden_layers
    # First, last, first MoE and middle layer, in that priority.
    layers = sorted(list(dict.fromkeys(i for i in (0, n - 1, cfg.first_k_dense_replace, n // 2) if i < n))[:sample])
    groups = ["top"] + [layer_group(i) for i in layers]
    ck, problems = ocp.StandardCheckpointer(), []
    for name in groups:
        ref = dict(flatten(flatten_quant(read_group(reader, cfg, name, int4, np.dtype(jnp.dtype(plan["dtype"]))))))
        got = dict(flatten(ck.restore(group_dir(dst, name))))
        for key in sorted(set(ref) | set(got)):
            label = f"{name}/{'.'.join(key)}"
            if key not in got:
                problems.append(f"missing tensor {label} (expected shape {list(ref[key].shape)})")
            elif key not in ref:
                problems.append(f"unexpected tensor {label} (shape {list(np.shape(got[key]))})")
            elif np.shape(got[key]) != ref[key].shape or np.asarray(got[key]).dtype != ref[key].dtype:
                problems.append(
                    f"{label}: expected {list(ref[key].shape)} {ref[key].dtype}, "
                    f"got {list(np.shape(got[key]))} {np.asarray(got[key]).dtype}"
                )
            elif not np.array_equal(np.asarray(got[key]), ref[key]):
                problems.append(f"{label}: values differ from the source")
    ck.close()
    problems += reader.problems
    if problems:
        raise CheckpointError(f"{dst}: verification found {len(problems)} problem(s):\n  " + "\n  ".join(problems))
    return groups


# ----------------------------------------------------------------------------------------------- helpers
def _group_bytes(cfg: KimiConfig, dtype, int4: bool) -> dict[str, int]:
    """Bytes each group occupies once converted (from the abstract model: nothing allocated)."""
    _, abstract = nnx.split(Target.abstract_model(cfg, dtype, int4))
    out = dict.fromkeys(group_names(cfg), 0)
    counts = {"dense_layers": cfg.first_k_dense_replace}
    counts["moe_layers"] = cfg.num_hidden_layers - counts["dense_layers"]
    per_layer = dict.fromkeys(counts, 0)
    for path, var in nnx.to_flat_state(abstract):
        nbytes = sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(var.get_value()))
        if path[0] in per_layer:
            per_layer[path[0]] += nbytes // max(counts[path[0]], 1)
        else:
            out["top"] += nbytes
    for i in range(cfg.num_hidden_layers):
        out[layer_group(i)] = per_layer[stack_of(cfg, i)[0]]
    return out


def source_fingerprint(src: Path, weight_files) -> dict[str, list]:
    """{file: [size, mtime_ns, sha256 of its safetensors header]} for config.json and every weight file: a resumed
    conversion must read the same files its finished groups were read from (hashing the data would read it all)."""
    out = {}
    for f in sorted({Path(f) for f in weight_files} | {src / "config.json", *src.glob("*.index.json")}):
        st = f.stat()
        with open(f, "rb") as h:
            head = h.read(8)
            if f.suffix == ".safetensors" and len(head) == 8:
                head += h.read(int.from_bytes(head, "little"))
        out[f.relative_to(src).as_posix()] = [st.st_size, st.st_mtime_ns, hashlib.sha256(head).hexdigest()]
    return out


def _writer() -> ocp.AsyncCheckpointer:
    """Orbax's async pytree writer without what costs CPU per byte and buys nothing here: zstd (weights barely
    compress), the defensive copy of every host array (a group's arrays are not touched until its save has
    finished), OCDBT (zarr3 arrays in their own files took ~40% less CPU to write), and the page-cache copy of each
    array's bytes (`shard_writer`)."""
    th = ocp.type_handlers
    registry = th.create_type_handler_registry((np.ndarray, DirectNumpyHandler()), (np.number, th.ScalarHandler()))
    handler = ocp.PyTreeCheckpointHandler(
        use_compression=False, use_zarr3=True, use_ocdbt=False, type_handler_registry=registry
    )
    return ocp.AsyncCheckpointer(handler)


def _write_or_check_plan(dst: Path, plan: dict) -> None:
    path = dst / PLAN
    if path.is_file():
        old = json.loads(path.read_text())
        was, now = old.get("source_files", {}), plan["source_files"]
        changed = sorted(f for f in set(was) | set(now) if was.get(f) != now.get(f))
        if changed and old.get("source") == plan["source"]:
            raise ValueError(
                f"{dst} holds a partial conversion of {plan['source']}, whose files changed since it started "
                f"({', '.join(changed)}); its finished groups may be stale: delete {dst} and convert again"
            )
        if old != plan:
            diff = sorted(k for k in set(old) | set(plan) if old.get(k) != plan.get(k))
            raise ValueError(
                f"{dst} holds a partial conversion with different settings ({', '.join(diff)}); "
                "use another --dst or delete it"
            )
        return
    if dst.exists() and any(dst.iterdir()):
        raise FileExistsError(f"{dst} is not empty and holds no jaxspec conversion; choose an empty --dst")
    dst.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan, indent=2) + "\n")


def _copy_small_files(src: Path, dst: Path) -> None:
    """config.json, tokenizer and other non-weight files (never the weights or their index)."""
    for item in src.iterdir():
        if item.is_file() and not item.name.endswith(WEIGHT_SUFFIXES) and not item.name.endswith(".index.json"):
            shutil.copy2(item, dst / item.name)


def _remove_partial(target: Path) -> None:
    """Drop an unfinished group (and Orbax temp dirs for it) left by an interrupted run."""
    for d in [target, *target.parent.glob(f"{target.name}{ocp.utils.TMP_DIR_SUFFIX}*")]:
        if d.is_dir():
            shutil.rmtree(d)
