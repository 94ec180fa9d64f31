"""Measure what a compiled step communicates and holds: collective census, memory, parameter bytes.

Everything here reads the *optimized, SPMD-partitioned* HLO (`jax.jit(f).lower(...).compile().as_text()`), so
shapes are per device and the collectives are the ones XLA will run, including those GSPMD inserted.

Counting conventions (stated once, used everywhere):
- A collective is one of COLLECTIVE_KINDS. Async pairs (`all-reduce-start`/`-done`) count once, at the
  `-done`; collectives wrapped in `async-start(..., calls=%c)` count once, inside `%c`.
- Bytes of a collective are the bytes of its result per device: the reduced array for all-reduce, the
  gathered array for all-gather, the scattered shard for reduce-scatter; tuples (combined collectives) are
  summed. s4/u4 (and other sub-byte types) count their bits, rounded up to whole bytes per array.
- `static` counts text occurrences. `executed` counts runs per program execution: a collective inside a
  while body runs trip-count times (XLA records `"known_trip_count":{"n":"5"}` in the while's backend_config
  for `lax.scan`/`fori_loop` loops), nested loops multiply, and computations reached through
  call/fusion/async wrappers inherit their caller's count. A while without a known trip count (a
  data-dependent `lax.while_loop`) counts its body once, and conditional branches all count as taken;
  `executed_exact` is then False.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import jax

COLLECTIVE_KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "ragged-all-to-all",
    "collective-broadcast",
)

# Bits per element of HLO primitive types (f8*/f6*/f4* variants are matched by prefix below).
_DTYPE_BITS = {
    "pred": 8,
    "s1": 1, "u1": 1, "s2": 2, "u2": 2, "s4": 4, "u4": 4,
    "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32, "u32": 32, "s64": 64, "u64": 64,
    "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128,
    "token": 0, "opaque": 0,
}  # fmt: skip


# ----------------------------------------------------------------------------------------------------------
# Shapes


def dtype_bits(hlo_dtype: str) -> int:
    """Bits per element of an HLO primitive type name (`bf16`, `s4`, `f8e4m3fn`, ...)."""
    if hlo_dtype in _DTYPE_BITS:
        return _DTYPE_BITS[hlo_dtype]
    for prefix, bits in (("f8", 8), ("f6", 6), ("f4", 4)):
        if hlo_dtype.startswith(prefix):
            return bits
    raise ValueError(f"unknown HLO element type {hlo_dtype!r}; add it to sharding.inspect._DTYPE_BITS")


_ARRAY_SHAPE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")


def parse_hlo_shape(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """Flatten an HLO shape (`f32[8,128]{1,0}`, `(s32[], bf16[4,16])`, `token[]`) into (dtype, dims) pairs.

    Layouts, tiling and memory-space annotations are ignored; dynamic dims `<=8` count at their bound.
    """
    shape = re.sub(r"\{[^{}]*(\{[^{}]*\}[^{}]*)*\}", "", _strip_comments(shape))  # layouts, incl. one nesting
    arrays = []
    for dtype, dims in _ARRAY_SHAPE.findall(shape):
        parsed = tuple(int(d.strip().lstrip("<=")) for d in dims.split(",") if d.strip())
        arrays.append((dtype, parsed))
    if not arrays and shape.strip() not in ("()", ""):
        raise ValueError(f"cannot parse HLO shape {shape!r}")
    return arrays


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape: sum over tuple elements of ceil(elements * bits / 8)."""
    return sum(math.ceil(math.prod(dims) * dtype_bits(dt) / 8) for dt, dims in parse_hlo_shape(shape))


# ----------------------------------------------------------------------------------------------------------
# A small HLO text parser: computations, instructions, call graph.


@dataclass
class HloInstruction:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str
    computation: str
    is_root: bool = False

    @property
    def parameter_number(self) -> int | None:
        return int(self.operands[0]) if self.opcode == "parameter" and self.operands else None

    @property
    def tuple_index(self) -> int | None:
        m = re.search(r"^,\s*index=(\d+)", self.attrs)
        return int(m.group(1)) if m else None


@dataclass
class HloComputation:
    name: str
    is_entry: bool
    instructions: dict[str, HloInstruction] = field(default_factory=dict)
    root: str | None = None


@dataclass
class HloModule:
    computations: dict[str, HloComputation]
    entry: str

    def callees(self, instr: HloInstruction) -> list[tuple[str, str]]:
        """(role, computation) pairs an instruction calls: role is the attribute name (body, calls, ...)."""
        out = []
        for key, value in _CALL_ATTR.findall(instr.attrs):
            names = value.strip("{}").split(",") if value.startswith("{") else [value]
            for n in names:
                n = n.strip().lstrip("%")
                if n in self.computations:
                    out.append((key, n))
        return out


_CALL_ATTR = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation|branch_computations|"
    r"called_computations|select|scatter)=(\{[^}]*\}|%?[\w.\-]+)"
)
_COMP_HEADER = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s+\(.*->.*\{\s*$")
_INSTR_HEAD = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")
TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?')


def _strip_comments(text: str) -> str:
    return re.sub(r"/\*.*?\*/", "", text)


def _balanced(text: str, start: int) -> int:
    """Index just past the parenthesis group opening at text[start] == '('."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced parentheses in HLO line: {text[:200]!r}")


def _parse_instruction(line: str, computation: str) -> HloInstruction | None:
    m = _INSTR_HEAD.match(line)
    if not m:
        return None
    pos = m.end()
    if line.startswith("(", pos):
        end = _balanced(line, pos)
    else:
        end = pos
        while end < len(line) and not line[end].isspace():
            end += 1
    shape = line[pos:end]
    om = re.compile(r"\s*([a-z][\w\-]*)\(").match(line, end)
    if not om:
        return None
    close = _balanced(line, om.end() - 1)
    operand_text = line[om.end() : close - 1]
    operands = []
    depth, cur = 0, ""
    for ch in operand_text + ",":
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        if ch == "," and depth == 0:
            token = cur.strip().split()[-1] if cur.strip() else ""
            if token:
                operands.append(token.lstrip("%"))
            cur = ""
        else:
            cur += ch
    return HloInstruction(
        name=m.group(2),
        shape=shape,
        opcode=om.group(1),
        operands=operands,
        attrs=line[close:],
        computation=computation,
        is_root=bool(m.group(1)),
    )


def parse_hlo(hlo: Any) -> HloModule:
    """Parse optimized HLO text (or a `Compiled`, via `.as_text()`) into computations and instructions."""
    text = _hlo_text(hlo)
    computations: dict[str, HloComputation] = {}
    entry = None
    current: HloComputation | None = None
    for raw in text.splitlines():
        line = _strip_comments(raw)
        if current is None:
            m = _COMP_HEADER.match(line)
            if m:
                current = HloComputation(name=m.group(2), is_entry=bool(m.group(1)))
                computations[current.name] = current
                if current.is_entry:
                    entry = current.name
            continue
        if line.strip() == "}":
            current = None
            continue
        instr = _parse_instruction(line, current.name)
        if instr is not None:
            current.instructions[instr.name] = instr
            if instr.is_root:
                current.root = instr.name
    if entry is None:
        raise ValueError("no ENTRY computation found: pass optimized HLO text (compiled.as_text())")
    return HloModule(computations, entry)


def _hlo_text(hlo: Any) -> str:
    if isinstance(hlo, HloModule):
        raise TypeError("pass HLO text or a Compiled object, not a parsed HloModule")
    if not isinstance(hlo, str):
        if hasattr(hlo, "compile") and not hasattr(hlo, "memory_analysis"):
            raise TypeError(
                f"got {type(hlo).__name__}: the census needs the optimized HLO of a compiled program; "
                "pass lowered.compile() (or its .as_text()), not the lowered StableHLO"
            )
        if not hasattr(hlo, "as_text"):
            raise TypeError(f"expected HLO text or a jax Compiled object, got {type(hlo).__name__}")
        hlo = hlo.as_text()
    if hlo.lstrip().startswith("module"):
        raise ValueError("this is StableHLO/MLIR text; pass the optimized HLO (lowered.compile().as_text())")
    return hlo


# ----------------------------------------------------------------------------------------------------------
# Execution counts


def execution_counts(module: HloModule) -> dict[str, tuple[int, bool]]:
    """Times each computation runs per program execution, and whether that count is exact.

    While bodies run `known_trip_count` times (conditions n + 1); without a known trip count, and for
    conditional branches, the count is 1 and marked inexact. Unreachable computations run 0 times.
    """
    edges: dict[str, list[tuple[str, int, bool]]] = defaultdict(list)
    for comp in module.computations.values():
        for instr in comp.instructions.values():
            if instr.opcode in ("async-done", "async-update"):
                continue  # the async-start already accounts for the wrapped computation
            trip = trip_count(module, comp, instr) if instr.opcode == "while" else None
            for role, callee in module.callees(instr):
                if instr.opcode == "while":
                    n = trip if trip is not None else 1
                    edges[comp.name].append((callee, n + 1 if role == "condition" else n, trip is not None))
                elif instr.opcode == "conditional":
                    edges[comp.name].append((callee, 1, False))
                else:
                    edges[comp.name].append((callee, 1, True))
    order: list[str] = []
    seen: set[str] = set()

    def visit(name: str) -> None:  # post-order DFS; HLO call graphs are acyclic
        seen.add(name)
        for callee, _, _ in edges[name]:
            if callee not in seen:
                visit(callee)
        order.append(name)

    visit(module.entry)
    counts: dict[str, int] = defaultdict(int)
    exact: dict[str, bool] = defaultdict(lambda: True)
    counts[module.entry] = 1
    for name in reversed(order):  # callers before callees
        for callee, factor, is_exact in edges[name]:
            if counts[name]:
                counts[callee] += counts[name] * factor
                exact[callee] = exact[callee] and exact[name] and is_exact
    return {name: (counts.get(name, 0), exact[name]) for name in module.computations}


def trip_count(module: HloModule, comp: HloComputation, instr: HloInstruction) -> int | None:
    """A while loop's trip count: XLA's `known_trip_count` where recorded (CPU, GPU), else read off the loop as
    TPU's HLO leaves it: a condition `counter < constant N` over a tuple element the loop starts at constant 0
    (what `lax.scan` and a static `fori_loop` lower to). None when neither holds (a data-dependent bound)."""
    known = TRIP_COUNT.search(instr.attrs)
    if known:
        return int(known.group(1))
    cond = module.computations.get(dict(module.callees(instr)).get("condition", ""))
    root = cond.instructions.get(cond.root or "") if cond is not None else None
    if root is None or root.opcode != "compare" or "direction=LT" not in root.attrs or len(root.operands) != 2:
        return None
    counter, bound = (cond.instructions.get(name) for name in root.operands)
    if counter is None or bound is None or counter.opcode != "get-tuple-element" or bound.opcode != "constant":
        return None
    start = _tuple_operand(comp, instr.operands[0] if instr.operands else "", counter.tuple_index)
    if start is None or start.opcode != "constant" or start.operands != ["0"]:
        return None
    try:
        return int(bound.operands[0])
    except (IndexError, ValueError):
        return None


def _tuple_operand(comp: HloComputation, name: str, index: int | None) -> HloInstruction | None:
    """Element `index` of the tuple instruction `name` in `comp`, looking through copies."""
    tup = comp.instructions.get(name)
    if tup is None or tup.opcode != "tuple" or index is None or index >= len(tup.operands):
        return None
    element = comp.instructions.get(tup.operands[index])
    while element is not None and element.opcode in ("copy", "bitcast") and element.operands:
        element = comp.instructions.get(element.operands[0])
    return element


# ----------------------------------------------------------------------------------------------------------
# Collective census


def collective_kind(opcode: str) -> str | None:
    """The collective kind an opcode counts as (None for non-collectives and for the `-start` half)."""
    if opcode in COLLECTIVE_KINDS:
        return opcode
    if opcode.endswith("-done") and opcode[: -len("-done")] in COLLECTIVE_KINDS:
        return opcode[: -len("-done")]
    return None


def collective_census(compiled_or_hlo_text: Any) -> dict[str, dict[str, Any]]:
    """Count collectives by kind in optimized HLO, statically and per execution, with per-device bytes.

    Returns {kind: {"static", "executed", "static_bytes", "executed_bytes", "executed_exact"}} for every kind
    in COLLECTIVE_KINDS (zeros when absent). See the module docstring for the counting conventions.
    """
    module = parse_hlo(compiled_or_hlo_text)
    runs = execution_counts(module)
    census = {
        k: {"static": 0, "executed": 0, "static_bytes": 0, "executed_bytes": 0, "executed_exact": True}
        for k in COLLECTIVE_KINDS
    }
    for comp in module.computations.values():
        n, exact = runs[comp.name]
        for instr in comp.instructions.values():
            kind = collective_kind(instr.opcode)
            if kind is None:
                continue
            nbytes = shape_bytes(instr.shape)
            row = census[kind]
            row["static"] += 1
            row["static_bytes"] += nbytes
            row["executed"] += n
            row["executed_bytes"] += n * nbytes
            row["executed_exact"] = row["executed_exact"] and (exact or n == 0)
    return census


# ----------------------------------------------------------------------------------------------------------
# Memory and parameter bytes

_MEMORY_FIELDS = {
    "argument_bytes": "argument_size_in_bytes",
    "output_bytes": "output_size_in_bytes",
    "alias_bytes": "alias_size_in_bytes",
    "temp_bytes": "temp_size_in_bytes",
    "generated_code_bytes": "generated_code_size_in_bytes",
    "host_temp_bytes": "host_temp_size_in_bytes",
}


def memory_report(compiled: Any) -> dict[str, int | None]:
    """Per-device memory of a compiled program from `compiled.memory_analysis()` (XLA's buffer assignment).

    argument/output/alias/temp/generated-code bytes; None for a field the backend does not report.
    `total_bytes` = argument + output - alias + temp: the device memory the step needs at peak by XLA's
    accounting (aliased = donated outputs share their input buffers), None if a term is missing.
    """
    try:
        stats = compiled.memory_analysis()
    except Exception:  # some backends/plugins raise Unimplemented
        stats = None
    if isinstance(stats, (list, tuple)):
        stats = stats[0] if stats else None
    report: dict[str, int | None] = {}
    for key, attr in _MEMORY_FIELDS.items():
        value = getattr(stats, attr, None) if stats is not None else None
        report[key] = int(value) if value is not None else None
    terms = [report[k] for k in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes")]
    if all(t is not None for t in terms):
        arg, out, alias, temp = terms
        report["total_bytes"] = arg + out - alias + temp
    else:
        report["total_bytes"] = None
    return report


def _leaf_bytes(shape: tuple[int, ...], dtype: Any) -> int:
    return math.ceil(math.prod(shape) * jax.dtypes.itemsize_bits(dtype) / 8)


def _array_leaves(tree: Any) -> list[tuple[str, Any]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    out = []
    for path, leaf in flat:
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            raise TypeError(
                f"leaf {jax.tree_util.keystr(path)} is a {type(leaf).__name__}, not an array/ShapeDtypeStruct"
            )
        out.append((jax.tree_util.keystr(path), leaf))
    return out


def param_bytes(tree: Any) -> int:
    """Total (global) bytes of a pytree of arrays or ShapeDtypeStructs; int4/uint4 count 4 bits each."""
    return sum(_leaf_bytes(tuple(leaf.shape), leaf.dtype) for _, leaf in _array_leaves(tree))


def device_param_bytes(tree: Any) -> dict[Any, int]:
    """Bytes each device holds for a pytree of sharded arrays / ShapeDtypeStructs with shardings.

    Uses each leaf's `sharding.devices_indices_map(shape)`, so a replicated leaf counts fully on every device,
    an evenly split leaf 1/n, uneven splits exactly, and a leaf on a device subset only on those devices.
    """
    per_device: dict[Any, int] = defaultdict(int)
    for path, leaf in _array_leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if sharding is None:
            raise ValueError(f"leaf {path} has no sharding; give ShapeDtypeStructs sharding= or pass arrays")
        shape = tuple(leaf.shape)
        for device, index in sharding.devices_indices_map(shape).items():
            dims = tuple(len(range(*sl.indices(n))) for sl, n in zip(index, shape, strict=True))
            per_device[device] += _leaf_bytes(dims, leaf.dtype)
    return dict(per_device)


def per_device_param_bytes(tree: Any) -> int:
    """Bytes held by the most-loaded device (see device_param_bytes)."""
    per_device = device_param_bytes(tree)
    return max(per_device.values()) if per_device else 0


# ----------------------------------------------------------------------------------------------------------
# Report


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)  # unreachable


def format_report(census: dict[str, dict[str, Any]], memory: dict[str, int | None] | None = None) -> str:
    """A readable table of a collective census (and optionally a memory report), per device per step."""
    lines = [f"{'collective':<22}{'static':>8}{'executed':>10}{'bytes/step':>14}  exact"]
    total_n, total_b = 0, 0
    for kind, row in census.items():
        if not row["static"]:
            continue
        total_n += row["executed"]
        total_b += row["executed_bytes"]
        exact = "yes" if row["executed_exact"] else "no (unknown trip count / conditional)"
        nbytes = _fmt_bytes(row["executed_bytes"])
        lines.append(f"{kind:<22}{row['static']:>8}{row['executed']:>10}{nbytes:>14}  {exact}")
    if len(lines) == 1:
        lines.append("(no collectives)")
    lines.append(f"{'total':<22}{'':>8}{total_n:>10}{_fmt_bytes(total_b):>14}")
    if memory is not None:
        lines.append("")
        lines.append("memory per device")
        for key, value in memory.items():
            lines.append(f"  {key:<22}{_fmt_bytes(value):>14}")
    return "\n".join(lines)
