"""The step plan: everything the device does in one engine step, as one plain value, and the result it hands back.

The scheduler (`scheduler.py`) decides a `StepPlan`, the executor (`executor.py`) runs it and returns a `StepResult`,
and the scheduler's `update` delivers that result to the requests. Both values are plain Python (no jax) and
serialise (`to_bytes` / `from_bytes`, JSON), because the plan is what crosses processes: process 0 decides, and every
process runs the same plans in the same order. The executor runs a plan's parts in this order:

1. `free`: rows whose request was cancelled or preempted are marked done (a row whose request finished is done
   already);
2. `blocks`: each `RowBlocks` replaces one row's block table (its blocks of the cache pool, in position order; a row
   that left gets none: every position of it then maps to the null block);
3. `admit`: each `RowAdmission` writes one row's prompt, budget and settings (a `RowSpec`: sampling, stop ids,
   seed, logprobs, min_new, ignore_eos);
4. `prefill`: one `PrefillChunk` (row, start) for each row still prefilling, in the order given (a row that reuses a
   cached prefix starts past it); with a segment, inside the segment's program, before its cycles;
5. `segment`: `cycles` cycles of the draft-verify loop over rows [0, rows) and positions [0, positions) (compiled
   buckets), drafting `draft` (a `DraftShape`), as the static-greedy program (`greedy`) or the per-row one; None when
   no row is generating;
6. `read`: for each `RowRead` (row, start), the row's tokens from `start` to its end and whether it is done (and
   their logprobs, for a row admitted with `logprobs`; with `RowRead.prompt`, its prompt's too).

"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jaxspec.decoding.draft_shape import DraftShape
from jaxspec.decoding.sampling_params import RowSpec

FORMAT = 4  # the serialised form's version (`to_bytes` writes it, `from_bytes` checks it)


def _int(owner: str, name: str, value: Any, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{owner}.{name}: expected an integer {bound}, got {value!r}")


def _ids(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, tuple) or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in value):
        raise ValueError(f"{owner}.{name}: expected a tuple of token ids >= 0, got {value!r}")


@dataclasses.dataclass(frozen=True)
class RowAdmission:
    """One request written into a free row: its prompt, budget (new tokens) and settings (`RowSpec`, with its seed)."""

    row: int
    prompt: tuple[int, ...]
    max_new: int
    spec: RowSpec = RowSpec(seed=0)  # its seed drawn by the scheduler when the request has none
    cached: int = 0  # prompt positions reused from the prefix cache (a multiple of the prefill chunk), not prefilled
    first: int | None = None  # a resumed (preempted) request: its last token, the row's first instead of a draw

    def __post_init__(self):
        _int("RowAdmission", "row", self.row, 0)
        _ids("RowAdmission", "prompt", self.prompt)
        if not self.prompt:
            raise ValueError("RowAdmission.prompt: expected at least one token id")
        _int("RowAdmission", "max_new", self.max_new, 1)
        if not isinstance(self.spec, RowSpec) or self.spec.seed is None:
            raise ValueError(f"RowAdmission.spec: expected a RowSpec with a seed, got {self.spec!r}")
        if self.spec.min_new > self.max_new:
            raise ValueError(f"RowAdmission.spec.min_new: expected at most max_new {self.max_new}, got {self.spec}")
        _int("RowAdmission", "cached", self.cached, 0, len(self.prompt) - 1)
        if self.first is not None:
            _ids("RowAdmission", "first", (self.first,))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"prompt": list(self.prompt), "spec": self.spec.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RowAdmission:
        return cls(d["row"], tuple(d["prompt"]), d["max_new"], RowSpec.from_dict(d["spec"]), d["cached"], d["first"])


@dataclasses.dataclass(frozen=True)
class RowPosition:
    """A row and a position in it (what a prefill chunk and a read each name)."""

    row: int
    start: int

    def __post_init__(self):
        _int(type(self).__name__, "row", self.row, 0)
        _int(type(self).__name__, "start", self.start, 0)


@dataclasses.dataclass(frozen=True)
class PrefillChunk(RowPosition):
    """One prefill chunk of a row's prompt, from position `start` (a multiple of the prefill chunk). `drafter`: the
    drafter runs over the chunk too (False: not at all, for an adaptive engine's row admitted where speculation does
    not pay: a chain that later runs on the row drafts from its prompt's last position on; a fixed-shape engine always
    runs it)."""

    drafter: bool = True

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.drafter, bool):
            raise ValueError(f"PrefillChunk.drafter: expected a bool, got {self.drafter!r}")


@dataclasses.dataclass(frozen=True)
class Segment:
    """`cycles` cycles of the loop over rows [0, rows) (a compiled batch bucket), each row reading and writing its
    own cache blocks in place."""

    rows: int
    draft: DraftShape
    greedy: bool  # the static-greedy program (every occupied row is greedy); False: the per-row program
    cycles: int

    def __post_init__(self):
        for name in ("rows", "cycles"):
            _int("Segment", name, getattr(self, name), 1)
        if not isinstance(self.draft, DraftShape):
            raise ValueError(f"Segment.draft: expected a DraftShape, got {self.draft!r}")
        if not isinstance(self.greedy, bool):
            raise ValueError(f"Segment.greedy: expected a bool, got {self.greedy!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"draft": self.draft.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Segment:
        return cls(d["rows"], DraftShape.from_dict(d["draft"]), d["greedy"], d["cycles"])


@dataclasses.dataclass(frozen=True)
class RowRead(RowPosition):
    """Read back a generating row's tokens from position `start` (what its request has not been handed yet); for a
    row that wants logprobs, their logprobs too, and with `prompt` its prompt's (echo: tokens 1.. of the prompt)."""

    prompt: bool = False


@dataclasses.dataclass(frozen=True)
class RowBlocks:
    """Row `row`'s block table from now on: the pool blocks holding its positions [0, len(blocks) * block_size)."""

    row: int
    blocks: tuple[int, ...]

    def __post_init__(self):
        _int("RowBlocks", "row", self.row, 0)
        ok = isinstance(self.blocks, tuple) and all(type(b) is int and b >= 1 for b in self.blocks)
        if not ok:
            raise ValueError(f"RowBlocks.blocks: expected a tuple of block ids >= 1, got {self.blocks!r}")


def _unique_rows(name: str, parts: tuple) -> None:
    rows = [p.row for p in parts]
    if len(set(rows)) != len(rows):
        raise ValueError(f"StepPlan.{name}: expected each row at most once, got rows {rows}")


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """Everything the device does in one engine step (see the module docstring for the order of its parts)."""

    step: int  # the scheduler's step number (consecutive from 1): what a log and a multi-process fan-out key on
    free: tuple[int, ...] = ()
    admit: tuple[RowAdmission, ...] = ()
    prefill: tuple[PrefillChunk, ...] = ()
    segment: Segment | None = None
    read: tuple[RowRead, ...] = ()
    blocks: tuple[RowBlocks, ...] = ()

    def __post_init__(self):
        _int("StepPlan", "step", self.step, 0)
        parts = (("admit", RowAdmission), ("prefill", PrefillChunk), ("read", RowRead), ("blocks", RowBlocks))
        for name, kind in parts:
            parts = getattr(self, name)
            if not isinstance(parts, tuple) or any(not isinstance(p, kind) for p in parts):
                raise ValueError(f"StepPlan.{name}: expected a tuple of {kind.__name__}, got {parts!r}")
            _unique_rows(name, parts)
        if not isinstance(self.free, tuple) or len(set(self.free)) != len(self.free):
            raise ValueError(f"StepPlan.free: expected a tuple of distinct rows, got {self.free!r}")
        for row in self.free:
            _int("StepPlan", "free", row, 0)
        if self.segment is not None and not isinstance(self.segment, Segment):
            raise ValueError(f"StepPlan.segment: expected a Segment or None, got {self.segment!r}")

    @property
    def busy(self) -> bool:
        """The step runs the model (a prefill chunk or a segment), not only bookkeeping."""
        return bool(self.prefill) or self.segment is not None

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "free": list(self.free),
            "admit": [a.to_dict() for a in self.admit],
            "prefill": [dataclasses.asdict(c) for c in self.prefill],
            "segment": self.segment.to_dict() if self.segment is not None else None,
            "read": [dataclasses.asdict(r) for r in self.read],
            "blocks": [[b.row, list(b.blocks)] for b in self.blocks],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepPlan:
        return cls(
            d["step"],
            tuple(d["free"]),
            tuple(RowAdmission.from_dict(a) for a in d["admit"]),
            tuple(PrefillChunk(**c) for c in d["prefill"]),
            Segment.from_dict(d["segment"]) if d["segment"] is not None else None,
            tuple(RowRead(**r) for r in d["read"]),
            tuple(RowBlocks(row, tuple(blocks)) for row, blocks in d["blocks"]),
        )

    def to_bytes(self) -> bytes:
        return _dump("StepPlan", self.to_dict())

    @classmethod
    def from_bytes(cls, data: bytes) -> StepPlan:
        return cls.from_dict(_load("StepPlan", data))


# One token's scores: (its logprob, the top ids best first, their logprobs), from the target's raw logits.
TokenLogprob = tuple[float, tuple[int, ...], tuple[float, ...]]


@dataclasses.dataclass(frozen=True)
class RowResult:
    """A read row after the step: the tokens it gained from the read's start, and whether it is done; for a row that
    wants logprobs, each token's (`logprobs`) and, when the read asked, the prompt's tokens 1.. (`prompt_logprobs`).
    `cycles` and `accepted`: the row's own counters since its admission (`LoopState.row_cycles_B`, `row_accepted_BJ`):
    the cycles it took part in, and per draft position how many of them accepted that position's draft."""

    row: int
    tokens: tuple[int, ...]
    done: bool
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    cycles: int = 0
    accepted: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RowResult:
        def scores(x):
            return None if x is None else tuple((lp, tuple(ids), tuple(lps)) for lp, ids, lps in x)

        lps = scores(d.get("logprobs")), scores(d.get("prompt_logprobs"))
        return cls(d["row"], tuple(d["tokens"]), d["done"], *lps, d["cycles"], tuple(d["accepted"]))


@dataclasses.dataclass(frozen=True)
class Counters:
    """The loop's running totals (not per row: the loop state counts over all rows): cycles run, and per draft depth
    how often it was verified (`reached`) and accepted; `accept_hist[n]`: row-cycles that accepted n drafts."""

    cycles: int
    reached: tuple[int, ...]
    accepted: tuple[int, ...]
    accept_hist: tuple[int, ...]

    def minus(self, earlier: Counters) -> Counters:
        """What was counted since `earlier`."""
        sub = lambda a, b: tuple(x - y for x, y in zip(a, b, strict=True))
        return Counters(
            self.cycles - earlier.cycles,
            sub(self.reached, earlier.reached),
            sub(self.accepted, earlier.accepted),
            sub(self.accept_hist, earlier.accept_hist),
        )


_COUNTS = ("reached", "accepted", "accept_hist")


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What the executor hands back for one plan: one `RowResult` per `RowRead`, in the plan's order, the loop's
    counters after the step (None when the step ran nothing), and the wall seconds its segment took (None: none ran,
    or its program ran prefill chunks too)."""

    step: int
    rows: tuple[RowResult, ...] = ()
    counters: Counters | None = None
    segment_seconds: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepResult:
        rows = tuple(RowResult.from_dict(r) for r in d["rows"])
        c = d["counters"]
        counters = None if c is None else Counters(c["cycles"], *(tuple(c[k]) for k in _COUNTS))
        return cls(d["step"], rows, counters, d.get("segment_seconds"))

    def to_bytes(self) -> bytes:
        return _dump("StepResult", self.to_dict())

    @classmethod
    def from_bytes(cls, data: bytes) -> StepResult:
        return cls.from_dict(_load("StepResult", data))


def _dump(kind: str, d: dict[str, Any]) -> bytes:
    return json.dumps({"format": FORMAT, "kind": kind, **d}, separators=(",", ":")).encode()


def _load(kind: str, data: bytes) -> dict[str, Any]:
    try:
        d = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{kind}.from_bytes: not a serialised {kind} ({e})") from None
    if not isinstance(d, dict) or d.get("kind") != kind or d.get("format") != FORMAT:
        got = (d.get("kind"), d.get("format")) if isinstance(d, dict) else type(d).__name__
        raise ValueError(f"{kind}.from_bytes: expected kind {kind!r} in format {FORMAT}, got {got}")
    return d
