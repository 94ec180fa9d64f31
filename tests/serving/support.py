"""What several serving test modules share: the fake device the scheduler tests run plans on, the engines' configs
and their warm-up, the server tests' port and health helpers, and the brute-force text a stop string leaves."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import socket
import subprocess
import sys
import time

import httpx

from jaxspec.decoding import DraftShape
from jaxspec.serving.adaptive import Scripted  # noqa: F401 (the tests' scripted policy)
from jaxspec.serving.engine import EngineConfig
from jaxspec.serving.plan import Counters, RowAdmission, RowResult, Segment, StepPlan, StepResult
from jaxspec.serving.scheduler import Scheduler

NUM_STEPS = 3  # the depth both the engine tests and the test server run

VOCAB = 50
EOS = 7


@dataclasses.dataclass(frozen=True)
class Shape:
    """The slot shape the scheduler reads (the engine's config has the same fields)."""

    max_batch: int = 4
    max_context: int = 128
    prefill_chunk: int = 8
    segment_cycles: int = 2
    max_queue: int = 8
    greedy_program: bool = True
    buckets: tuple[int, ...] = (1, 2, 4)
    block: int = 8
    pool_blocks: int = 64  # every slot's full context: no preemption
    prefix_cache: bool = True


def token(seed: int, i: int) -> int:
    """The fake model's i-th generated token for a row seeded `seed` (whatever else is in the batch)."""
    return (seed * 31 + i * 17 + 3) % VOCAB


@dataclasses.dataclass
class FakeRow:
    admission: RowAdmission
    tokens: list[int]  # prompt + generated, as the device's tokens_BS row
    prefilled: int = 0  # prompt positions processed
    done: bool = True  # as the device: a row is done until its last prefill chunk
    cycles: int = 0  # the row's counters since its admission, as the device keeps them
    accepted: list[int] = dataclasses.field(default_factory=list)

    def generated(self) -> int:
        return len(self.tokens) - len(self.admission.prompt)

    def emit(self) -> None:
        a = self.admission
        self.tokens.append(token(a.spec.seed, self.generated()))
        stops = a.spec.stop_ids if a.spec.ignore_eos else (EOS, *a.spec.stop_ids)
        self.done = self.tokens[-1] in stops or self.generated() >= a.max_new


class FakeExecutor:
    """Runs plans as the device does (free, admit, prefill, segment, read), on host rows; each generating row gains
    1 to J+1 tokens per cycle (it accepted the cycle's drafts but one). It checks what the device relies on: chunks
    in order, and blocks that hold every position a generating row writes (the device writes each row's entries into
    its own blocks in place). `ledger[seed]`: what each request's cycles did (per draft shape label, its cycles and
    accepted drafts per position), whichever rows ran it; `depth`: the deepest draft (the rows' counters' length);
    `reached`, `accepted`: the loop's counters over every row, as the device counts them."""

    Row = FakeRow

    def __init__(self, shape: Shape, depth: int = 3):
        self.shape, self.rows, self.plans = shape, [None] * shape.max_batch, []
        self.owned = [0] * shape.max_batch  # each row's blocks (its table's length)
        self.cycle, self.depth = 0, depth
        self.ledger: dict[int, dict[str, list[int]]] = {}
        self.reached, self.accepted = [0] * depth, [0] * depth  # the loop's counters (over every row)

    def run(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        for row in plan.free:
            self.rows[row].done = True
        for b in plan.blocks:
            self.owned[b.row] = len(b.blocks)
        for a in plan.admit:
            self.rows[a.row] = self.Row(a, list(a.prompt), a.cached, accepted=[0] * self.depth)
        for chunk in plan.prefill:
            row = self.rows[chunk.row]
            assert chunk.start == row.prefilled and row.done, "prefill chunks run in order, on a row not generating"
            assert chunk.start >= row.admission.cached, "prefill starts past the cached prefix"
            row.prefilled = min(chunk.start + self.shape.prefill_chunk, len(row.admission.prompt))
            if row.prefilled == len(row.admission.prompt):
                row.emit()  # the prefill's first token
        if plan.segment is not None:
            self._segment(plan.segment)
        out = []
        for read in plan.read:
            row = self.rows[read.row]
            assert read.start <= len(row.tokens)
            scores = () if read.prompt else None  # an echo read's prompt scores (none: the fake scores nothing)
            counts = dict(cycles=row.cycles, accepted=tuple(row.accepted))
            out.append(RowResult(read.row, tuple(row.tokens[read.start :]), row.done, None, scores, **counts))
        counters = Counters(self.cycle, tuple(self.reached), tuple(self.accepted), (0,) * (1 + self.depth))
        counters = counters if plan.busy else None
        return StepResult(plan.step, tuple(out), counters)

    def _segment(self, seg: Segment) -> None:
        assert seg.rows in self.shape.buckets
        ahead = seg.draft.lookahead
        for _ in range(seg.cycles):
            self.cycle += 1
            for i, row in enumerate(self.rows[: seg.rows]):
                if row is None:
                    continue
                # a generating row writes up to lookahead positions past its length: inside its own blocks
                held = min(self.owned[i] * self.shape.block, self.shape.max_context)
                assert row.done or len(row.tokens) + ahead <= held, (i, len(row.tokens), self.owned[i], seg)
                if row.done:
                    continue
                taken = (row.admission.spec.seed + self.cycle) % (seg.draft.num_steps + 1)  # drafts accepted
                self._count(row, seg.draft.label, taken)
                for j in range(seg.draft.num_steps):
                    self.reached[j] += j <= taken
                    self.accepted[j] += j < taken
                for _ in range(1 + taken):
                    if not row.done:
                        row.emit()

    def _count(self, row: FakeRow, label: str, taken: int) -> None:
        row.cycles += 1
        row.accepted[:taken] = [a + 1 for a in row.accepted[:taken]]
        entry = self.ledger.setdefault(row.admission.spec.seed, {})
        counts = entry.setdefault(label, [0] * (1 + self.depth))  # cycles, then accepted per position
        counts[0] += 1
        counts[1 : 1 + taken] = [a + 1 for a in counts[1 : 1 + taken]]


CHAIN = DraftShape(3)


def make(shape: Shape = Shape(), draft: DraftShape = CHAIN, seeds=None) -> Scheduler:
    seeds = seeds or itertools.count(1000).__next__
    return Scheduler(shape, draft, vocab_size=VOCAB, stop_ids=(EOS,), seeds=seeds)


# The engine tests' config (test_engine; varied by test_engine_pool, test_logprobs and test_adaptive).
# 2 slots of 128 positions, prefill chunks of 16 (most prompts take several), short segments. Per-row programs
# only, so as few programs compile as before (the server tests run the static-greedy program).
ENGINE = EngineConfig(
    max_batch=2,
    max_context=128,
    draft=DraftShape(NUM_STEPS),
    prefill_chunk=16,
    segment_cycles=2,
    max_queue=6,
    batch_buckets=(2,),
    greedy_program=False,
)


# The tree engine's (test_engine_tree, test_logprobs): 2 slots of 128 positions, both segment programs (static-greedy
# and per-row).
TREE_ENGINE = EngineConfig(
    max_batch=2,
    max_context=128,
    draft=DraftShape(3, topk=2, num_draft_tokens=6),
    prefill_chunk=16,
    segment_cycles=2,
    max_queue=6,
    batch_buckets=(2,),
)


def warm_engine(pair, config):
    """An `Engine` on the bundled pair with `config`, every program compiled (warm-up)."""
    from jaxspec.serving.engine import Engine

    target, drafter, tokenizer = pair
    engine = Engine(target, drafter, config, stop_ids=tokenizer.stop_ids)
    engine.warmup(lambda _: None)
    return engine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, procs: list, logs: list, timeout: float = 600) -> None:
    """Until `base`/health answers 200; fails (with the log's tail) when a process exits or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while True:
        for i, (p, log) in enumerate(zip(procs, logs, strict=True)):
            assert p.poll() is None, f"process {i} exited ({p.returncode}):\n{log.read_text()[-3000:]}"
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "not ready:\n" + "\n".join(log.read_text()[-3000:] for log in logs)
        time.sleep(0.5)


@contextlib.contextmanager
def running_server(tmp_path_factory, flags: list[str], env: dict[str, str] | None = None):
    """`jaxspec serve FLAGS` (uvicorn in a subprocess on a free port) until it answers /health; yields (process,
    base url, log path) and kills it afterwards if it is still running."""
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    argv = [sys.executable, "-m", "jaxspec", "serve", "--port", str(port), *flags]
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, [proc], [log])
        yield proc, base, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


TEXT_EOS = 0  # the bundled tokenizer's EOS (its one stop id): it ends a choice and adds no text


def expected_text(tokenizer, ids: list[int], stops: list[str]) -> tuple[str, int]:
    """(text, counted tokens) by brute force: the shortest prefix whose text contains a stop string."""
    text_ids = [t for t in ids if t != TEXT_EOS]
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode([t for t in ids[:k] if t != TEXT_EOS])
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return text[: min(hits)], k
    return tokenizer.decode(text_ids), len(ids)


def assert_drafter_cache_kept(executor, before, row: int, upto: int, block: int) -> None:
    """The drafter's pool at row `row`'s positions [0, upto) holds what `before` (its leaves, as numpy) held."""
    import jax
    import numpy as np

    below = [(int(executor.tables[row, p // block]), p % block) for p in range(upto)]
    for now, then in zip(jax.tree.leaves(executor.pool.drafter), jax.tree.leaves(before), strict=True):
        now = np.asarray(now)
        for b, i in below:
            np.testing.assert_array_equal(now[b, i], then[b, i])


def prefill_all(engine, requests) -> None:
    """Submit `requests` and step until every one is admitted and prefilled."""
    for r in requests:
        engine.submit(r)
    while any(r.slot is None or engine.scheduler.slots[r.slot].next_chunk is not None for r in requests):
        engine.step()


def run(engine, requests, script, feed=True):
    engine.scheduler.policy = Scripted(script, feed)
    for r in requests:
        engine.submit(r)
    drafts = []
    while engine.step():
        drafts.append(engine.scheduler._segment_run and engine.scheduler._segment_run.draft)
    return drafts
