"""The serving scheduler alone, without a device: its plans run on a fake executor (plain Python rows that follow
each plan's parts the way the device does), so admission order, queue limits, cancellation (queued, prefilling,
running), the bucket and program choice and the seeds are checked decision by decision; and the plan round-trips
through bytes. The scheduler and the plan import no jax (checked in a fresh interpreter and by the import contract)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxspec.decoding.draft_shape import DraftShape
from jaxspec.decoding.sampling_params import RowSpec, Sampling
from jaxspec.serving.plan import (
    FORMAT,
    Counters,
    PrefillChunk,
    RowAdmission,
    RowBlocks,
    RowRead,
    RowResult,
    Segment,
    StepPlan,
    StepResult,
)
from jaxspec.serving.scheduler import QueueFull, Request, Scheduler
from tests.serving.support import CHAIN, EOS, VOCAB, FakeExecutor, Shape, make, token
from tests.support import lint_imports

ROOT = Path(__file__).resolve().parents[2]


def expected(prompt, max_new: int, seed: int, stop_ids=()) -> list[int]:
    out = []
    while len(out) < max_new:
        out.append(token(seed, len(out)))
        if out[-1] in (EOS, *stop_ids):
            break
    return out


def step(scheduler: Scheduler, executor: FakeExecutor):
    plan = scheduler.schedule()
    return plan, scheduler.update(executor.run(plan))


def drain(scheduler: Scheduler, executor: FakeExecutor, limit: int = 200) -> list[StepPlan]:
    plans = []
    while scheduler.has_work:
        assert len(plans) < limit, "the scheduler does not finish"
        plans.append(step(scheduler, executor)[0])
    return plans


def test_requests_come_out_as_alone_through_the_fake_executor():
    """Twelve mixed requests through four slots: each one's tokens are what it would get alone, it finishes with the
    right reason, and the reports account for every token and every finish."""
    scheduler, executor = make(), FakeExecutor(Shape())
    requests = [
        Request([1 + i] * (3 + 5 * i % 20), 4 + (3 * i) % 11, RowSpec(seed=i, stop_ids=(i % 5 + 10,) if i % 3 else ()))
        for i in range(12)
    ]
    for r in requests[:8]:
        scheduler.submit(r)
    delivered, finished = 0, []
    while scheduler.has_work:
        plan, report = step(scheduler, executor)
        delivered += sum(d.count for d in report.delivered)
        finished += report.finished
        assert scheduler.occupancy <= 4
        if plan.step == 3:
            for r in requests[8:]:
                scheduler.submit(r)
    for r in requests:
        assert r.tokens == expected(r.prompt, r.max_tokens, r.spec.seed, r.spec.stop_ids), r
        stopped = r.tokens[-1] in (EOS, *r.spec.stop_ids)
        assert r.finish_reason == ("stop" if stopped else "length") and r.slot is None
    assert delivered == sum(len(r.tokens) for r in requests) and sorted(map(id, finished)) == sorted(map(id, requests))
    assert scheduler.slots == [None] * 4 and not scheduler.has_work


def test_admission_takes_the_lowest_free_slots_in_arrival_order():
    scheduler, executor = make(Shape(max_batch=2)), FakeExecutor(Shape(max_batch=2))
    a, b, c, d = (Request([5] * 4, n, RowSpec(seed=9)) for n in (1, 60, 2, 2))
    for r in (a, b, c, d):
        scheduler.submit(r)
    plan, _ = step(scheduler, executor)
    assert [(x.row, x.max_new) for x in plan.admit] == [(0, 1), (1, 60)] and scheduler.queue_depth == 2
    assert [(p.row, p.start) for p in plan.prefill] == [(0, 0), (1, 0)] and plan.segment is None
    assert a.finished and a.tokens == [token(9, 0)]  # its first token was its budget: slot 0 is free again
    plan, _ = step(scheduler, executor)
    assert [(x.row, x.max_new) for x in plan.admit] == [(0, 2)] and b.slot == 1
    assert c.tokens == expected(c.prompt, 2, 9) and c.finish_reason == "length"  # prefill + 1 token of b's segment
    drain(scheduler, executor)
    assert all(r.finished for r in (a, b, c, d))


def test_prefill_runs_one_chunk_per_step_while_the_others_generate():
    scheduler, executor = make(), FakeExecutor(Shape())
    short, long = Request([1] * 3, 20, RowSpec(seed=1)), Request(list(range(1, 21)), 5, RowSpec(seed=2))
    scheduler.submit(short)
    step(scheduler, executor)
    scheduler.submit(long)
    plans = [step(scheduler, executor)[0] for _ in range(3)]
    assert [[(c.row, c.start) for c in p.prefill] for p in plans] == [[(1, 0)], [(1, 8)], [(1, 16)]]
    assert all(p.segment is not None for p in plans)  # the short request keeps generating meanwhile
    assert [[r.row for r in p.read] for p in plans] == [[0], [0], [0, 1]]  # the long one is read once prefilled


def test_queue_limit_and_bad_requests_name_the_field():
    scheduler = make(Shape(max_queue=3))
    for _ in range(3):
        scheduler.submit(Request([1, 2], 3))
    with pytest.raises(QueueFull, match="holds 3 waiting requests"):
        scheduler.submit(Request([1, 2], 3))
    for request, match in [
        (lambda: Request([], 3), "prompt: expected a non-empty list of token ids in \\[0, 50\\)"),
        (lambda: Request([1, VOCAB], 3), "prompt: expected"),
        (lambda: Request([1], 0), "max_tokens: expected an integer >= 1, got 0"),
        (lambda: Request([1], True), "max_tokens"),
        (lambda: Request([1], 3, RowSpec(stop_ids=tuple(range(9)))), "RowSpec.stop_ids: expected at most 8"),
        (lambda: Request([1], 3, RowSpec(stop_ids=(VOCAB,))), "RowSpec.stop_ids: expected token ids in \\[0, 50\\)"),
        (lambda: Request([1], 3, RowSpec(seed=-1)), "RowSpec.seed: expected an integer in \\[0, 4294967295\\]"),
        (lambda: Request([1], 3, RowSpec(min_new=4)), "spec.min_new: expected at most max_tokens 3"),
        (lambda: Request([1] * 30, 100), "exceeds the context of 128 positions"),
    ]:
        with pytest.raises(ValueError, match=match):
            scheduler.submit(request())
    assert scheduler.queue_depth == 3
    # 120 + 3 new tokens + lookahead 4 + 1 = 128 fits; one more token does not. A prompt is also chunk-padded.
    assert scheduler.check(120, 3) is None and "exceeds" in scheduler.check(120, 4)
    assert make(Shape(max_context=64, prefill_chunk=32)).check(33, 1) is not None  # 2 chunks + 1 > 64


@pytest.mark.parametrize("pool_blocks", [64, 20], ids=["whole-context pool", "preemptible pool"])
def test_a_refusal_states_the_rule_applied_and_max_model_len_always_fits(pool_blocks):
    """`check` refuses exactly what does not fit (max_tokens beyond `room`); every prompt + max_tokens up to
    `max_model_len` fits whatever the split; a refusal's message states the chunk rounding that refused it."""
    scheduler = make(Shape(max_context=128, prefill_chunk=32, block=8, pool_blocks=pool_blocks))
    cap = min(128, pool_blocks * 8)
    limit = scheduler.max_model_len
    assert limit == min(cap - 4, (cap - 1) // 32 * 32 + 1)  # lookahead 3 + 1 for drafting; whole chunks + 1
    for prompt_len in range(1, cap + 2):
        room = scheduler.room(prompt_len)
        for max_tokens in range(1, cap + 2 - prompt_len):
            fits = scheduler.check(prompt_len, max_tokens) is None
            assert fits == (max_tokens <= room), (prompt_len, max_tokens)
            assert fits or prompt_len + max_tokens > limit, (prompt_len, max_tokens)
    # a prompt that passes "prompt + max_tokens + drafting <= context" and is refused by the prefill's chunks
    problem = make(Shape(max_context=128, prefill_chunk=32, block=8)).check(97, 1)
    assert problem.startswith("prompt of 97 tokens exceeds the context of 128 positions per slot")
    assert "chunks of 32 positions plus one (97 tokens take 129)" in problem and "up to 97 always fit" in problem


@pytest.mark.parametrize("when", ["queued", "prefilling", "running"])
def test_cancel_frees_the_slot_at_once(when):
    scheduler, executor = make(Shape(max_batch=1)), FakeExecutor(Shape(max_batch=1))
    updates = []
    first = Request(
        [1] * 20, 30, RowSpec(seed=3), on_update=lambda r, new: updates.append((list(new), r.finish_reason))
    )
    after = Request([2] * 3, 4, RowSpec(seed=4))
    scheduler.submit(first)
    if when != "queued":
        step(scheduler, executor)  # admitted, its first chunk of three
    if when == "running":
        while not first.tokens:
            step(scheduler, executor)
    scheduler.submit(after)
    scheduler.cancel(first)
    plan, report = step(scheduler, executor)
    assert first.finish_reason == "cancelled" and first.slot is None and report.finished == (first,)
    assert updates[-1] == ([], "cancelled")
    assert plan.free == (() if when == "queued" else (0,))
    assert [a.row for a in plan.admit] == [0] and after.slot == 0  # the freed slot is taken in the same step
    scheduler.cancel(first)  # again, after it finished: ignored
    drain(scheduler, executor)
    assert first.tokens == expected(first.prompt, 30, 3)[: len(first.tokens)] and len(first.tokens) < 30
    assert after.tokens == expected(after.prompt, 4, 4) and after.finish_reason in ("stop", "length")
    assert [p.free for p in executor.plans].count(()) == len(executor.plans) - (when != "queued")


def test_row_bucket_covers_the_highest_generating_row():
    scheduler, executor = make(), FakeExecutor(Shape())
    rows = [Request([1] * 3, 30, RowSpec(seed=s)) for s in range(3)]
    for r in rows:
        scheduler.submit(r)
    plan, _ = step(scheduler, executor)
    assert plan.segment is None  # nothing generates before its prefill
    assert step(scheduler, executor)[0].segment.rows == 4  # rows 0..2 generate: bucket 4 (buckets 1, 2, 4)
    scheduler.cancel(rows[2])
    assert step(scheduler, executor)[0].segment.rows == 2
    scheduler.cancel(rows[1])
    assert step(scheduler, executor)[0].segment.rows == 1
    scheduler.cancel(rows[0])
    scheduler.submit(Request([1] * 3, 30, RowSpec(seed=5)))
    scheduler.submit(late := Request([1] * 3, 30, RowSpec(seed=6)))
    step(scheduler, executor)
    scheduler.cancel(scheduler.slots[0].request)
    assert late.slot == 1 and step(scheduler, executor)[0].segment.rows == 2  # row 1 alone still needs 2 rows


def reach(r: Request, draft: DraftShape, cycles: int, prefilling: bool) -> int:
    """The positions a segment may touch for one row, as the scheduler's rule states it."""
    ahead = draft.lookahead
    if prefilling:  # its riding-along cycles write the lookahead past its prompt
        return len(r.prompt) + ahead + 1
    end = len(r.prompt) + len(r.tokens) + 1  # + the token a row prefilled in this step has not handed over
    return min(end + (cycles - 1) * (draft.num_steps + 1) + ahead + 1, len(r.prompt) + r.max_tokens + ahead + 1)


@pytest.mark.parametrize("draft", [CHAIN, DraftShape(2, topk=2, num_draft_tokens=6), DraftShape(0)], ids=str)
def test_blocks_cover_what_every_row_can_reach(draft):
    """Before each segment every generating row owns the blocks of what it can reach in it: its end plus its
    cycles' tokens and lookahead (capped by its budget). The fake executor checks every cycle's writes stay inside
    the row's own blocks."""
    shape = Shape(max_batch=2)
    scheduler, executor = make(shape, draft), FakeExecutor(shape, draft.num_steps)
    a, b = Request([1] * 5, 40, RowSpec(seed=5)), Request([1] * 30, 4, RowSpec(seed=2))
    scheduler.submit(a)
    step(scheduler, executor)
    seen: set[str] = set()  # the cases met
    while not a.finished:
        if len(a.tokens) > 6 and b.slot is None and not b.finished and not scheduler.queue_depth:
            scheduler.submit(b)
        plan = scheduler.schedule()
        owned = list(executor.owned)  # each row's blocks once this plan's are in
        for blocks in plan.blocks:
            owned[blocks.row] = len(blocks.blocks)
        held = lambda r, owned=owned: min(owned[r.slot] * shape.block, shape.max_context)  # noqa: E731
        want = reach(a, draft, shape.segment_cycles, False)
        assert held(a) >= want, (held(a), want)
        if b.slot is not None:
            chunk = next((c for c in plan.prefill if c.row == b.slot), None)
            still = chunk is not None and chunk.start + shape.prefill_chunk < len(b.prompt)
            if not still:
                assert held(b) >= reach(b, draft, shape.segment_cycles, False)
            seen.add("prefilling" if still else "both generating")
        seen.add("capped" if want == len(a.prompt) + a.max_tokens + draft.lookahead + 1 else "growing")
        scheduler.update(executor.run(plan))
    assert seen == {"prefilling", "both generating", "capped", "growing"}


def test_program_is_static_greedy_only_while_every_occupied_row_is_greedy():
    scheduler, executor = make(), FakeExecutor(Shape())
    scheduler.submit(Request([1] * 3, 45, RowSpec(seed=5)))  # its tokens reach no stop id before 45
    step(scheduler, executor)
    assert step(scheduler, executor)[0].segment.greedy
    sampled = Request([1] * 20, 5, RowSpec(Sampling(0.7, top_k=5), seed=2))
    scheduler.submit(sampled)
    plan, _ = step(scheduler, executor)
    assert plan.prefill and not plan.segment.greedy  # a sampled row still prefilling already counts
    assert plan.admit[0].spec.sampling == Sampling(0.7, top_k=5)
    drain_until = lambda: sampled.finished
    while not drain_until():
        assert not step(scheduler, executor)[0].segment.greedy
    assert step(scheduler, executor)[0].segment.greedy
    never = make(Shape(greedy_program=False))
    never.submit(Request([1] * 3, 30))
    never.update(FakeExecutor(Shape()).run(never.schedule()))
    assert not never.schedule().segment.greedy
    assert step(scheduler, executor)[0].segment.draft == DraftShape(3) and plan.segment.cycles == 2


@pytest.mark.parametrize("asks", [RowSpec(seed=5, logprobs=True), "echo", RowSpec(seed=5, min_new=2)])
def test_a_greedy_row_that_needs_logits_runs_the_per_row_program(asks):
    """Logprobs, echo and min_tokens need the target's logits (the static-greedy program has an argmax head): the
    admission carries them and every segment while the row is occupied runs the per-row program; the echo read
    asks for the prompt's scores once, at the first read."""
    scheduler, executor = make(), FakeExecutor(Shape())
    r = Request([1] * 3, 6, RowSpec(seed=5), echo=True) if asks == "echo" else Request([1] * 3, 6, asks)
    scheduler.submit(r)
    plan, _ = step(scheduler, executor)
    a = plan.admit[0]
    assert (a.spec.logprobs, a.spec.min_new) == (bool(r.spec.logprobs or r.echo), r.spec.min_new)
    assert [x.prompt for x in plan.read] == [r.echo]
    while not r.finished:
        plan, _ = step(scheduler, executor)
        assert not plan.segment.greedy and not any(x.prompt for x in plan.read)


def test_ignore_eos_is_the_rows_own_flag():
    """ignore_eos goes to the device in the admission (the row generates past the model's eos, its own stop ids still
    end it), and a row that ran to its budget finishes "length" even when its last token is the eos."""
    seed = next(s for s in range(VOCAB) if EOS in [token(s, i) for i in range(4)])
    plain, through = Request([1] * 3, 12, RowSpec(seed=seed)), Request([1] * 3, 12, RowSpec(seed=seed, ignore_eos=True))
    scheduler, executor = make(), FakeExecutor(Shape())
    for r in (plain, through):
        scheduler.submit(r)
    plans = drain(scheduler, executor)
    assert [a.spec.ignore_eos for p in plans for a in p.admit] == [False, True]
    assert plain.tokens == expected([1] * 3, 12, seed) and plain.finish_reason == "stop"
    assert through.tokens == [token(seed, i) for i in range(12)] and through.finish_reason == "length"
    assert EOS in through.tokens[:4]
    ends = next(s for s in range(VOCAB) if token(s, 1) == EOS and EOS not in (token(s, 0),))
    last = Request([1] * 3, 2, RowSpec(seed=ends, ignore_eos=True))
    scheduler.submit(last)
    drain(scheduler, executor)
    assert last.tokens[-1] == EOS and last.finish_reason == "length"
    with pytest.raises(ValueError, match="ignore_eos: expected a bool"):
        Request([1] * 3, 2, RowSpec(ignore_eos=1))


def test_seeds_are_drawn_by_the_scheduler_and_written_into_the_plan():
    drawn = iter([77, 78, 79])
    scheduler = make(seeds=lambda: next(drawn))
    for seed in (None, 5, None):
        scheduler.submit(Request([1] * 3, 4, RowSpec(seed=seed)))
    plan = scheduler.schedule()
    assert [a.spec.seed for a in plan.admit] == [77, 5, 78]
    default = Scheduler(Shape(), DraftShape(3), vocab_size=VOCAB)
    default.submit(Request([1] * 3, 4))
    default.submit(Request([1] * 3, 4))
    seeds = [a.spec.seed for a in default.schedule().admit]
    assert all(0 <= s < 2**32 for s in seeds) and seeds[0] != seeds[1]


def test_abandon_finishes_everything_and_frees_the_rows_next_step():
    scheduler, executor = make(Shape(max_batch=2)), FakeExecutor(Shape(max_batch=2))
    requests = [Request([1] * 3, 30, RowSpec(seed=s)) for s in range(3)]
    for r in requests:
        scheduler.submit(r)
    step(scheduler, executor)
    report = scheduler.abandon("error")
    assert set(map(id, report.finished)) == set(map(id, requests)) and {r.finish_reason for r in requests} == {"error"}
    assert scheduler.slots == [None, None] and scheduler.queue_depth == 0 and scheduler.has_work
    plan, _ = step(scheduler, executor)
    assert plan.free == (0, 1) and not plan.busy and not scheduler.has_work
    kept = Request([1] * 3, 4, RowSpec(seed=1))
    scheduler.submit(running := Request([1] * 3, 30, RowSpec(seed=2)))
    step(scheduler, executor)
    scheduler.submit(kept)
    assert scheduler.abandon("error", queued=False).finished == (running,)  # a failed step: the queue stays
    drain(scheduler, executor)
    assert kept.tokens == expected(kept.prompt, 4, 1) and running.finish_reason == "error"


def test_update_checks_the_result_belongs_to_the_last_plan():
    scheduler = make()
    scheduler.submit(Request([1] * 20, 4))
    plan = scheduler.schedule()
    with pytest.raises(ValueError, match="StepResult.step: expected 1"):
        scheduler.update(StepResult(plan.step + 1))
    with pytest.raises(ValueError, match="row 0 holds no generating request"):
        scheduler.update(StepResult(plan.step, (RowResult(0, (1,), False),)))  # row 0 is still prefilling


def test_plan_and_result_round_trip_through_bytes():
    plan = StepPlan(
        step=12,
        free=(3, 1),
        admit=(
            RowAdmission(1, (5, 6, 7), 9, RowSpec(Sampling(0.1, top_k=40, top_p=0.95), (11, 12), 2**32 - 1)),
            RowAdmission(3, (8,) * 70, 4, RowSpec(seed=0, logprobs=True, min_new=2, ignore_eos=True), cached=64),
        ),
        prefill=(PrefillChunk(1, 0), PrefillChunk(2, 64)),
        segment=Segment(4, DraftShape(4, topk=2, num_draft_tokens=8), False, 4),
        read=(RowRead(0, 17), RowRead(2, 70, prompt=True)),
        blocks=(RowBlocks(1, (4, 2, 9)), RowBlocks(3, ())),
    )
    again = StepPlan.from_bytes(plan.to_bytes())
    assert again == plan and again.admit[0].spec.sampling.temperature == 0.1 and again.segment.draft.tree
    assert StepPlan.from_bytes(StepPlan(1).to_bytes()) == StepPlan(1) and not StepPlan(1).busy
    result = StepResult(
        12,
        (
            RowResult(0, (4, 5), False),
            RowResult(2, (7,), True, ((-0.5, (7, 3), (-0.5, -1.25)),), ((-2.0, (1, 9), (-1.0, -2.0)),)),
        ),
        Counters(9, (3, 2), (2, 1), (1, 2, 6)),
    )
    assert (
        StepResult.from_bytes(result.to_bytes()) == result
        and StepResult.from_bytes(StepResult(2).to_bytes()).rows == ()
    )
    with pytest.raises(ValueError, match=f"StepPlan.from_bytes: expected kind 'StepPlan' in format {FORMAT}"):
        StepPlan.from_bytes(result.to_bytes())
    with pytest.raises(ValueError, match="StepPlan.from_bytes: not a serialised StepPlan"):
        StepPlan.from_bytes(b"\xff")


def test_plan_values_refuse_bad_fields_by_name():
    for build, match in [
        (lambda: RowAdmission(-1, (1,), 1), "RowAdmission.row: expected an integer >= 0, got -1"),
        (lambda: RowAdmission(0, (), 1), "RowAdmission.prompt: expected at least one"),
        (lambda: RowAdmission(0, [1], 1), "RowAdmission.prompt: expected a tuple of token ids"),
        (lambda: RowAdmission(0, (1,), 1, RowSpec()), "RowAdmission.spec: expected a RowSpec with a seed"),
        (lambda: RowAdmission(0, (1,), 1, RowSpec(seed=0, min_new=2)), "RowAdmission.spec.min_new: expected at most"),
        (lambda: RowSpec(seed=2**32), "RowSpec.seed: expected an integer in \\[0, 4294967295\\]"),
        (lambda: RowSpec(stop_ids=tuple(range(9))), "RowSpec.stop_ids: expected at most 8"),
        (lambda: RowSpec(Sampling(), [1]), "RowSpec.stop_ids: expected a tuple of token ids"),
        (lambda: RowSpec(logprobs=1), "RowSpec.logprobs: expected a bool"),
        (lambda: RowSpec(min_new=-1), "RowSpec.min_new: expected an integer >= 0"),
        (lambda: RowSpec(cache_salt=""), "RowSpec.cache_salt: expected None or 1 to 256 characters"),
        (lambda: RowSpec(Sampling(top_k=2**31)), "Sampling.top_k: expected an integer in \\[0, 2147483647\\]"),
        (lambda: Segment(0, DraftShape(1), True, 1), "Segment.rows: expected an integer >= 1"),
        (lambda: Segment(1, 3, True, 1), "Segment.draft: expected a DraftShape"),
        (lambda: StepPlan(1, prefill=(PrefillChunk(0, 0), PrefillChunk(0, 8))), "StepPlan.prefill: expected each row"),
        (lambda: StepPlan(1, free=(2, 2)), "StepPlan.free: expected a tuple of distinct rows"),
        (lambda: RowAdmission(0, (1, 2), 1, cached=2), "RowAdmission.cached: expected an integer in \\[0, 1\\]"),
        (lambda: RowBlocks(0, (0, 1)), "RowBlocks.blocks: expected a tuple of block ids >= 1"),
        (lambda: StepPlan(1, blocks=(RowBlocks(0, ()), RowBlocks(0, (1,)))), "StepPlan.blocks: expected each row"),
        (lambda: StepPlan(1, admit=[RowAdmission(0, (1,), 1)]), "StepPlan.admit: expected a tuple of RowAdmission"),
    ]:
        with pytest.raises(ValueError, match=match):
            build()


def test_scheduler_and_plan_import_no_jax():
    code = "import sys, jaxspec.serving.scheduler, jaxspec.serving.plan; assert 'jax' not in sys.modules, 'jax'"
    code += "; assert 'flax' not in sys.modules, 'flax'; from jaxspec import Sampling"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


def test_the_import_contract_catches_jax_in_the_scheduler(tmp_path):
    """The forbidden contract is not vacuous: with the engine (which imports jax) among its sources, it breaks."""
    text = (ROOT / "pyproject.toml").read_text()
    sources = re.search(r'source_modules = \[\s*"jaxspec\.serving\.scheduler",[^\]]*\]', text)
    assert sources, "the scheduler's contract in pyproject.toml changed: update this test"
    engine = sources[0][:-1].rstrip().rstrip(",") + ', "jaxspec.serving.engine"]'
    (tmp_path / "pyproject.toml").write_text(text.replace(sources[0], engine))
    run = lint_imports(tmp_path / "pyproject.toml")
    assert run.returncode != 0 and "jaxspec.serving.engine" in run.stdout and "BROKEN" in run.stdout, run.stdout[-3000:]


class Recording:
    """A DraftPolicy stand-in that drafts `CHAIN` and records the context it is asked about and told of."""

    predicted, probing = None, False

    def __init__(self, feed=lambda context: True):
        self.chosen, self.observed, self.fed, self.feed = [], [], [], feed
        self.generating, self.counted = [], []  # (generating, fed) asked; (the loop's counters, unfed) told
        self.beside, self.slots = [], None  # the fed rows a new row joins, as asked (and as the slots hold: `slots`)

    def choose(self, rows, generating, context, fed):
        self.chosen.append(context)
        self.generating.append((generating, fed))
        return CHAIN

    def observe(self, segment, counters, seconds, context, unfed):
        self.observed.append(context)
        self.counted.append((counters, unfed))

    def feeds_drafter(self, context, rows=None, fed=None):
        self.fed.append((context, rows))
        self.beside.append(fed if self.slots is None else (fed, sum(s.drafter for s in self.slots if s is not None)))
        return self.feed(context)

    def admitted(self, fed):
        pass


def test_the_policy_is_asked_with_the_longest_generating_rows_live_length():
    """The context the policy chooses and learns by is the longest generating row's prompt and tokens so far (what
    the scheduler knows; a prefilling row's prompt does not count until it generates)."""
    scheduler, executor = make(), FakeExecutor(Shape())
    scheduler.policy = policy = Recording()
    short, long = Request([1] * 5, 20, RowSpec(seed=1)), Request([1] * 30, 20, RowSpec(seed=2))
    scheduler.submit(short)
    step(scheduler, executor)
    scheduler.submit(long)
    want = []
    while scheduler.has_work:
        plan = scheduler.schedule()  # a row whose last prompt chunk is in the plan generates in its segment
        generating = [r for r in (short, long) if r.slot is not None and scheduler.slots[r.slot].next_chunk is None]
        if plan.segment is not None:
            want.append(max(len(r.prompt) + len(r.tokens) for r in generating))
        scheduler.update(executor.run(plan))
    assert policy.chosen == want == policy.observed and max(want) > 30 + 1 and min(want) < 30
    policy.probing = True  # a probe: one cycle
    scheduler.submit(Request([1] * 5, 20, RowSpec(seed=3)))
    assert [step(scheduler, executor)[0].segment for _ in range(2)][1].cycles == 1


def test_the_policy_is_asked_whether_to_feed_a_row_at_the_rows_it_will_be_served_with():
    """A row's feed decision is asked with its prompt's length and the rows it will be served with: those in slots
    and the queue's (itself included), at most the slots; a burst of 6 into 4 free slots asks at 4 rows each time,
    a request alone at 1, one joining 3 generating rows at 4."""
    scheduler, executor = make(), FakeExecutor(Shape())
    scheduler.policy = policy = Recording()
    scheduler.submit(Request([1] * 5, 8, RowSpec(seed=1)))
    step(scheduler, executor)
    assert policy.fed == [(5, 1)]
    drain(scheduler, executor)
    policy.fed.clear()
    burst = [Request([1] * (6 + i), 30, RowSpec(seed=10 + i)) for i in range(6)]
    for r in burst:
        scheduler.submit(r)
    step(scheduler, executor)
    assert policy.fed == [(6 + i, 4) for i in range(4)]
    scheduler.cancel(burst[0])
    policy.fed.clear()
    step(scheduler, executor)
    assert policy.fed == [(10, 4)]  # the fifth, beside 3 rows and before the sixth: the slots hold 4 at most
    assert policy.beside[-1] == 3  # ... all fed the drafter (this policy feeds every row)


def test_the_policy_learns_fed_and_unfed_rows_acceptance_apart():
    """Every other row is fed the drafter at prefill: the policy is asked how many of a segment's generating rows were
    fed, and told what the unfed rows counted (from the rows' own counters: a position is reached where the one
    before it was accepted), which over the run is what the unfed requests' cycles did, the rest of the loop's
    counters the fed ones'."""
    scheduler, executor = make(), FakeExecutor(Shape())
    scheduler.policy = policy = Recording(feed=lambda context: context % 2 == 0)
    policy.slots = scheduler.slots
    requests = [Request([1] * (4 + i), 12, RowSpec(seed=i)) for i in range(6)]  # even seeds: fed
    for r in requests:
        scheduler.submit(r)
    asked = []  # (generating, fed) of each segment: the rows generating before its plan, the even seeds fed
    while scheduler.has_work:
        rows = [s.request.spec.seed for s in scheduler.slots if s is not None and s.next_chunk is None]
        plan, _ = step(scheduler, executor)
        if plan.segment is not None:
            asked.append((len(rows), sum(seed % 2 == 0 for seed in rows)))
    assert policy.generating == asked and any(0 < f < g for g, f in asked)  # segments over fed and unfed rows
    assert all(said == held for said, held in policy.beside) and len({n for n, _ in policy.beside}) > 1  # feed asks
    totals = {True: [0] * 6, False: [0] * 6}  # (reached, accepted) per position, fed and not
    for request in requests:
        cycles, *accepted = executor.ledger[request.spec.seed][CHAIN.label]
        reached = [cycles, *accepted[:-1]]
        fed = request.spec.seed % 2 == 0
        totals[fed] = [t + x for t, x in zip(totals[fed], reached + accepted, strict=True)]
    last, unfed_seen = Counters(0, (0,) * 3, (0,) * 3, (0,) * 4), [0] * 6
    for counters, unfed in policy.counted:
        delta, last = counters.minus(last), counters
        unfed = [0] * 6 if unfed is None else [int(x) for x in (*unfed[0], *unfed[1])]
        assert all(0 <= x <= d for x, d in zip(unfed, (*delta.reached, *delta.accepted), strict=True))  # a part
        unfed_seen = [t + x for t, x in zip(unfed_seen, unfed, strict=True)]
    assert unfed_seen == totals[False] and any(totals[False])
    fed_seen = [a - b for a, b in zip((*last.reached, *last.accepted), unfed_seen, strict=True)]
    assert fed_seen == totals[True] and any(totals[True])
