"""HLO checks the tests make on compiled programs: while loops and their trip counts, and all-gathers that gather a
weight (weights must stay sharded). Built on `sharding.inspect`'s parser; the library itself needs neither."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import jax

from sharding.inspect import (
    HloInstruction,
    HloModule,
    collective_kind,
    execution_counts,
    parse_hlo,
    parse_hlo_shape,
    trip_count,
)

# Ops whose result is (a view of) operand 0's data: followed when tracing an all-gather's operand back.
_VIEW_OPS = frozenset(
    {"bitcast", "copy", "reshape", "transpose", "convert", "bitcast-convert", "dynamic-slice", "slice"}
    | {"dynamic-reshape", "copy-start", "copy-done"}
)


def while_loops(hlo: Any) -> list[dict[str, Any]]:
    """Every while loop: its computation, body, condition and recorded trip count (None when unknown)."""
    module = parse_hlo(hlo)
    out = []
    for comp in module.computations.values():
        for instr in comp.instructions.values():
            if instr.opcode == "while":
                roles = dict(module.callees(instr))
                trip = trip_count(module, comp, instr)
                out.append(
                    {
                        "computation": comp.name,
                        "name": instr.name,
                        "body": roles.get("body"),
                        "condition": roles.get("condition"),
                        "trip_count": trip,
                    }
                )
    return out


def _callers(module: HloModule) -> dict[str, list[HloInstruction]]:
    callers: dict[str, list[HloInstruction]] = defaultdict(list)
    for comp in module.computations.values():
        for instr in comp.instructions.values():
            for _, callee in module.callees(instr):
                callers[callee].append(instr)
    return callers


def _trace_entry_params(
    module: HloModule, callers: dict[str, list[HloInstruction]], comp_name: str, instr_name: str
) -> set[int]:
    """Entry parameter numbers whose data `instr_name` is a pure view of (through copies, converts, slices,
    bitcasts, tuples, loop-carried values, fusions/calls made only of such ops). Empty when real compute
    (an add, a dot, a collective, ...) lies on the path."""
    found: set[int] = set()
    seen: set[tuple[str, str, tuple[int, ...]]] = set()
    stack: list[tuple[str, str, tuple[int, ...]]] = [(comp_name, instr_name, ())]
    while stack:
        key = stack.pop()
        if key in seen:
            continue
        seen.add(key)
        cname, iname, index = key
        comp = module.computations[cname]
        instr = comp.instructions.get(iname)
        if instr is None:
            continue
        op = instr.opcode
        if op == "parameter":
            if comp.is_entry:
                found.add(instr.parameter_number or 0)
                continue
            k = instr.parameter_number or 0
            for call in callers[cname]:
                callees = module.callees(call)
                if call.opcode == "while":
                    slot = 0  # body/condition parameter 0 is the loop tuple
                elif call.opcode == "conditional":
                    slot = 1 + [c for r, c in callees if r != "to_apply"].index(cname)
                elif call.opcode == "call" or any(
                    c == cname and r in ("calls", "called_computations") for r, c in callees
                ):
                    slot = k  # fusion / async-start / call / custom-call: parameter k is operand k
                else:
                    continue  # reductions (to_apply of reduce, all-reduce, ...) are not data paths
                if slot < len(call.operands):
                    stack.append((call.computation, call.operands[slot], index))
        elif op == "get-tuple-element":
            stack.append((cname, instr.operands[0], (instr.tuple_index or 0, *index)))
        elif op == "tuple":
            if index and index[0] >= len(instr.operands):
                continue
            targets = [instr.operands[index[0]]] if index else instr.operands
            for t in targets:
                stack.append((cname, t, index[1:]))
        elif op == "optimization-barrier":
            stack.append((cname, instr.operands[0], index))
        elif op in ("fusion", "call", "while"):
            roles = dict(module.callees(instr))
            callee = roles.get("body") if op == "while" else roles.get("calls") or roles.get("to_apply")
            if callee and module.computations[callee].root:
                stack.append((callee, module.computations[callee].root, index))
        elif op in _VIEW_OPS and instr.operands:
            stack.append((cname, instr.operands[0], index if op != "copy-start" else ()))
    return found


def all_gathers(compiled_or_hlo_text: Any) -> list[dict[str, Any]]:
    """Every all-gather: where it is, its gathered (result) and operand shapes, executions per step, and the
    entry parameters its operand is a pure view of (see _trace_entry_params)."""
    return _all_gathers(parse_hlo(compiled_or_hlo_text))


def _all_gathers(module: HloModule) -> list[dict[str, Any]]:
    runs = execution_counts(module)
    callers = _callers(module)
    out = []
    for comp in module.computations.values():
        for instr in comp.instructions.values():
            if collective_kind(instr.opcode) != "all-gather":
                continue
            source = instr
            if instr.opcode.endswith("-done"):  # the data operands are on the -start
                source = comp.instructions.get(instr.operands[0], instr)
            params: set[int] = set()
            for operand in source.operands:  # several when XLA combined all-gathers
                params |= _trace_entry_params(module, callers, comp.name, operand)
            out.append(
                {
                    "computation": comp.name,
                    "name": instr.name,
                    "shape": _plain_shape(instr.shape),
                    "operand_shape": _plain_shape(
                        ", ".join(comp.instructions[o].shape for o in source.operands if o in comp.instructions)
                    ),
                    "executed": runs[comp.name][0],
                    "entry_params": sorted(params),
                }
            )
    return out


def _plain_shape(shape: str) -> str:
    """An HLO shape without layouts: 'f32[8,16]' or, for several arrays, '(f32[8], bf16[2,2])'."""
    arrays = [f"{dt}[{','.join(map(str, dims))}]" for dt, dims in parse_hlo_shape(shape)]
    return arrays[0] if len(arrays) == 1 else f"({', '.join(arrays)})"


def _squeeze(dims: Iterable[int]) -> tuple[int, ...]:
    return tuple(d for d in dims if d != 1)


def find_weight_all_gathers(compiled_or_hlo_text: Any, weights: Any) -> list[dict[str, Any]]:
    """All-gathers that gather a weight. Empty list means none was found; used to assert weights stay sharded.

    `weights`: a pytree of arrays / ShapeDtypeStructs (global shapes, with shardings if known) or a list of
    shape tuples. An all-gather is reported when either
      (a) its gathered shape equals a weight's global shape, or that shape without leading (stacked-layer)
          dims, ignoring size-1 dims, for weights with at least 2 non-unit dims; or
      (b) its operand is a pure view (copy/convert/slice/bitcast/loop-carried, see _trace_entry_params) of
          an entry parameter whose per-device shape equals a weight's per-device shard shape (needs
          shardings).
    Dtypes are ignored (the CPU backend gathers s4 weights as s8). Limits: a gather of weights transformed by
    real compute first (e.g. dequantised with a multiply) is caught only by (a); an activation whose shape
    happens to equal a weight's is a false positive. Each hit carries `reason` and the all-gather record.
    """
    global_shapes: list[tuple[int, ...]] = []
    shard_shapes: set[tuple[int, ...]] = set()
    for leaf in _weight_leaves(weights):
        if isinstance(leaf, tuple):
            global_shapes.append(tuple(leaf))
            continue
        shape = tuple(leaf.shape)
        global_shapes.append(shape)
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None:
            shard_shapes.add(_squeeze(sharding.shard_shape(shape)))
    full = set()
    for shape in global_shapes:
        for k in range(len(shape)):
            s = _squeeze(shape[k:])
            if len(s) >= 2:
                full.add(s)
    module = parse_hlo(compiled_or_hlo_text)
    entry = module.computations[module.entry]
    param_dims = {
        i.parameter_number: _squeeze(parse_hlo_shape(i.shape)[0][1])
        for i in entry.instructions.values()
        if i.opcode == "parameter" and parse_hlo_shape(i.shape)
    }
    hits = []
    for ag in _all_gathers(module):
        reasons = []
        if any(_squeeze(dims) in full for _, dims in parse_hlo_shape(ag["shape"])):
            reasons.append("gathered shape equals a weight's (per-layer) global shape")
        for p in ag["entry_params"]:
            if param_dims.get(p) in shard_shapes:
                reasons.append(f"operand is a view of entry parameter {p}, shaped like a weight shard")
        if reasons:
            hits.append({**ag, "reason": "; ".join(reasons)})
    return hits


def _weight_leaves(weights: Any) -> list[Any]:
    def is_leaf(x: Any) -> bool:
        return hasattr(x, "shape") or (isinstance(x, tuple) and all(isinstance(d, int) for d in x))

    leaves = jax.tree.leaves(weights, is_leaf=is_leaf)
    for leaf in leaves:
        if not is_leaf(leaf):
            raise TypeError(f"weights must be arrays, ShapeDtypeStructs or shape tuples; got {leaf!r}")
    return leaves
