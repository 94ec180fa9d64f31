"""Adaptive speculation on the engine: segments that switch between plain decoding and a chain on one loop state give
the greedy tokens of a fixed shape, keep the drafter current through plain segments (so sampling stays lossless:
each cycle drafts from the drafter's distribution at the row's true prefix), and compile nothing after warm-up."""

import dataclasses
import re

import jax
import numpy as np
import pytest

from jaxspec.decoding import DraftShape
from jaxspec.decoding.sampling import Sampling
from jaxspec.decoding.sampling_params import RowSpec
from jaxspec.serving.adaptive import (
    CONTEXT_RANGE,
    EXPLORE_SHARE,
    FEED,
    FEED_EVERY,
    FIRST,
    LOSING,
    UNKNOWN_ACCEPTANCE,
    DraftPolicy,
    context_range,
)
from jaxspec.serving.engine import Request
from jaxspec.serving.executor import Executor
from jaxspec.serving.plan import Counters, PrefillChunk, RowAdmission, RowBlocks, Segment, StepPlan
from jaxspec.serving.startup import Programs
from tests.serving.support import ENGINE as ENGINE_CONFIG
from tests.serving.support import NUM_STEPS, Scripted, assert_drafter_cache_kept, prefill_all, run, warm_engine

PLAIN, CHAIN = DraftShape(0), DraftShape(NUM_STEPS)
# test_engine's shape (so its chain, admit and prefill programs compile once for both modules) with plain decoding as
# a second shape; the static-greedy programs switch in a slow test of their own.
CONFIG = dataclasses.replace(ENGINE_CONFIG, adaptive=True)


@pytest.fixture(scope="module")
def engine(pair):
    return warm_engine(pair, CONFIG)


@pytest.fixture(scope="module")
def greedy_engine(pair):
    return warm_engine(pair, dataclasses.replace(CONFIG, greedy_program=True))


SCRIPTS = [(PLAIN, CHAIN), (CHAIN, CHAIN, PLAIN), (PLAIN, PLAIN, CHAIN)]


@pytest.mark.parametrize("script", SCRIPTS)
def test_switching_shapes_gives_the_greedy_tokens_of_a_fixed_shape(engine, prompts, reference, script):
    """Greedy rows, alone and alongside a sampled row: the tokens are the single-request greedy reference whatever
    shape each segment ran; and no program compiles after warm-up."""
    switching_gives_the_reference(engine, prompts, reference, script)


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_switching_with_the_static_greedy_program(greedy_engine, prompts, reference, script):
    """The same with the static-greedy program for all-greedy batches (it leaves a placeholder draft distribution,
    which the per-row segment after it replaces, whichever shape ran)."""
    switching_gives_the_reference(greedy_engine, prompts, reference, script)


@pytest.mark.slow
def test_a_per_row_segment_after_greedy_ones_repairs_their_draft_distribution(greedy_engine, prompts):
    """The static-greedy program leaves a placeholder in a greedy row's draft distribution; the per-row program run
    after it (`fix`) first makes it the point mass on the row's draft, as the per-row program would have left it."""
    engine, x = greedy_engine, greedy_engine.executor
    request = Request(prompts[0], 40)
    engine.scheduler.policy = Scripted((CHAIN,), True)
    engine.submit(request)
    while len(request.tokens) < 8:  # chain segments in the static-greedy program
        engine.step()
    row, per_row = request.slot, x.programs[CHAIN][1]
    q_of = lambda: np.asarray(jax.device_get(x.state.draft_q_BV))[row]  # noqa: E731
    point = np.eye(q_of().shape[-1], dtype=q_of().dtype)[int(jax.device_get(x.state.draft_B)[row])]
    x._run_program((), per_row, (2, None, True), False, 0)  # no cycles, no repair
    assert not np.array_equal(q_of(), point)
    x._run_program((), per_row, (2, None, True), True, 0)  # no cycles, the repair
    np.testing.assert_array_equal(q_of(), point)
    while not request.finished:
        engine.step()


def switching_gives_the_reference(engine, prompts, reference, script):
    alone = [Request(prompts[0], 20), Request(prompts[2], 16)]
    mixed = [Request(prompts[4], 18), Request(prompts[7], 12, RowSpec(Sampling(0.9, top_k=30), seed=3))]
    expected = [reference(r.prompt, r.max_tokens) for r in alone + mixed[:1]]  # generate's programs compile here
    traces = engine.executor.loop.traces
    drafts = run(engine, alone, script)
    assert {PLAIN, CHAIN} <= set(drafts)
    run(engine, mixed, script)
    assert [r.tokens for r in alone + mixed[:1]] == expected
    assert engine.executor.loop.traces == traces


def test_sampled_rows_are_reproducible_under_a_switching_script(engine, prompts):
    """Each row's draws come from its own key, advanced once per cycle whatever the shape: the same seed and the same
    script give the same tokens, next to another request or alone."""
    script = (CHAIN, PLAIN, PLAIN)
    first = Request(prompts[3], 16, RowSpec(Sampling(1.0, top_p=0.9), seed=21))
    run(engine, [first, Request(prompts[1], 10)], script)
    again = Request(prompts[3], 16, RowSpec(Sampling(1.0, top_p=0.9), seed=21))
    run(engine, [again], script)
    assert again.tokens == first.tokens and len(first.tokens) > 1


@pytest.mark.parametrize("script", SCRIPTS[:2])
def test_coupled_rows_give_plain_sampling_whatever_the_script(engine, prompts, reference, coupled_reference, script):
    """A coupled row's tokens are plain coupled sampling's with its seed (`jaxspec.generate(..., sampling=
    "coupled")`) whatever shape each segment ran, next to a rejection-sampled row and a greedy one (which gives the
    greedy reference)."""
    specs = [RowSpec(Sampling(1.0), seed=4, coupled=True), RowSpec(Sampling(0.7, top_k=20), seed=9, coupled=True)]
    coupled = [Request(prompts[3], 16, specs[0]), Request(prompts[6], 12, specs[1])]
    others = [Request(prompts[1], 10, RowSpec(Sampling(0.9), seed=3)), Request(prompts[0], 8)]
    run(engine, [coupled[0], others[0], coupled[1], others[1]], script)
    assert [r.tokens for r in coupled] == [coupled_reference(r.prompt, r.max_tokens, r.spec) for r in coupled]
    assert others[1].tokens == reference(prompts[0], 8) and others[0].finish_reason in ("stop", "length")


def test_a_chain_segment_after_plain_ones_catches_the_drafter_up(engine, pair, prompts):
    """Plain segments leave the drafter behind (their target states kept); the next chain segment first runs the
    drafter over them: its cache over every processed position then equals what a fresh prefill of the same tokens
    writes, so the chain drafts from the drafter's distribution at the row's true prefix (what lossless speculative
    sampling needs)."""
    request = Request(prompts[3], 24, RowSpec(Sampling(0.9), seed=8))
    engine.scheduler.policy = Scripted((CHAIN, PLAIN, PLAIN, CHAIN))
    engine.submit(request)
    drafts = []
    while drafts[-2:] != [PLAIN, CHAIN]:
        engine.step()
        drafts.append(engine.scheduler._segment_run and engine.scheduler._segment_run.draft)
        state, row = engine.executor.state, request.slot
        if drafts[-1] == PLAIN:
            assert int(state.drafted_B[row]) < int(state.length_B[row])  # behind, as plain segments leave it
    assert not request.finished and int(state.drafted_B[row]) == int(state.length_B[row])
    length = int(state.length_B[row])
    history = [int(t) for t in np.asarray(state.tokens_BS[row, : length + 1])]  # + the pending token
    target, drafter, _ = pair
    c = CONFIG  # the engine's shape: the fresh executor reuses its compiled prefill
    blocks = c.max_context // c.block  # the fresh row holds a whole row of blocks
    one_chain = dataclasses.replace(c, adaptive=False, kv_cache_tokens=blocks * c.block)  # its prefill, one row's pool
    fresh = Executor.of(target, drafter, one_chain, stop_ids=engine.stop_ids)
    chunks = tuple(PrefillChunk(0, start) for start in range(0, len(history), 16))
    for i, chunk in enumerate(chunks):
        admit = (RowAdmission(0, tuple(history), 2, RowSpec(Sampling(0.9), seed=8)),) if i == 0 else ()
        table = (RowBlocks(0, tuple(range(1, blocks + 1))),) if i == 0 else ()
        fresh.run(StepPlan(i + 1, admit=admit, prefill=(chunk,), blocks=table))
    ours, theirs = (row_draft_cache(e, r) for e, r in ((engine.executor, row), (fresh, 0)))
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_allclose(
            np.asarray(a[:length], np.float32), np.asarray(b[:length], np.float32), atol=2e-4, rtol=2e-3
        )
    engine.scheduler.policy = Scripted((CHAIN,))
    engine.run_until_idle()
    assert request.finish_reason in ("stop", "length")


def test_rows_not_fed_the_drafter_give_the_greedy_tokens_and_draw_drafts_from_q(engine, prompts, reference):
    """Rows admitted where speculation does not pay (`DraftPolicy.feeds_drafter` False) cost the drafter nothing at
    prefill: no chunk writes its cache (its entries up to the prompt's end keep what the pool held there), and the
    drafter waits at the prompt's last position, through plain segments too. The first chain segment drafts from
    there: the drafter is then current, the first draft and its distribution q come from the drafter (the draft has
    positive mass under q: lossless speculative sampling needs nothing more), and chains on such rows give the greedy
    reference, alone and next to a fed row."""
    requests = [Request(prompts[5], 24), Request(prompts[6], 24, RowSpec(Sampling(0.8), seed=4))]
    expected = reference(requests[0].prompt, 24)
    engine.scheduler.policy = Scripted((PLAIN,), feed=False)
    x = engine.executor
    before = jax.tree.map(np.asarray, x.pool.drafter)
    prefill_all(engine, requests)
    engine.step()  # a plain segment over both
    for r in requests:
        row, n = r.slot, len(r.prompt)
        assert int(x.state.drafted_B[row]) == n - 1 < int(x.state.length_B[row])  # waits at the prompt's end
        assert_drafter_cache_kept(x, before, row, n, CONFIG.block)  # no chunk wrote it, not even the last position
    engine.scheduler.policy = Scripted((CHAIN, PLAIN), feed=False)
    engine.step()  # the chain's catch-up drafts from the prompt's last position on
    assert not any(r.finished for r in requests)
    for r in requests:
        assert int(x.state.drafted_B[r.slot]) == int(x.state.length_B[r.slot])
    row = requests[1].slot
    q = np.asarray(x.state.draft_q_BV[row])
    assert q.sum() == pytest.approx(1.0, abs=1e-4) and q[int(x.state.draft_B[row])] > 0
    engine.scheduler.policy.feed = True
    fed = Request(prompts[0], 12)
    engine.submit(fed)
    engine.run_until_idle()
    assert requests[0].tokens == expected and fed.tokens == reference(fed.prompt, 12)
    assert all(r.finish_reason in ("stop", "length") for r in requests)


@pytest.mark.slow  # test budget (the default suite reached 31 minutes): ~19 s
def test_programs_do_not_copy_the_kept_target_states(engine):
    """The target states plain cycles keep (`aux_BSI`, [B, S, 3 x hidden]: 352 MB for Kimi at 8 slots x 1024
    positions) stay in place: a chain segment's program, which only reads them after prefill chunks that do not
    touch them, and a plain segment's, which writes them into the whole buffer, compile without a copy of it (XLA
    copied it twice per chain segment when they went through the chunks' loop and the window's put), nor a slice of
    the window's rows (XLA:CPU copied that out for the chain's catch-up). One row of the two, as a bucket smaller
    than the slots."""
    x, c = engine.executor, engine.config
    shape = ",".join(map(str, x.state.aux_BSI.shape))
    window_shape = ",".join(map(str, (1, *x.state.aux_BSI.shape[1:])))
    runs = np.zeros((c.max_batch, 3), np.int32), np.int32(0), np.bool_(False), np.int32(c.segment_cycles)
    for draft in (CHAIN, PLAIN):
        window = (1, c.max_context, not draft.plain)
        args = x.loop, x.per_row, x.programs[draft][0], window, x._params(), x.state, x.pool, x._tables
        hlo = x._program.lower(*args, *runs).compile().as_text()  # as the executor compiles it
        copies = re.findall(rf"\w+\[{shape}\]\S* copy\(", hlo)
        assert not copies, f"the {draft.label} segment's program copies aux_BSI: {copies}"
        slices = re.findall(rf"\w+\[{window_shape}\]\S* (?:dynamic-)?slice\(", hlo)
        assert not slices, f"the {draft.label} segment's program slices its rows of aux_BSI: {slices}"


def row_draft_cache(executor: Executor, row: int):
    """Row `row`'s drafter cache, read from the executor's pool through its block table."""
    tables = np.asarray(executor.tables[row])
    return jax.tree.map(lambda pool: np.asarray(pool)[tables].reshape(-1, *pool.shape[2:]), executor.pool.drafter)


# ---------------------------------------------------------------------- the policy alone (plain Python)
def segment(draft: DraftShape, rows: int = 2, cycles: int = 4) -> Segment:
    return Segment(rows, draft, False, cycles)


class Loop:
    """Counters as the executor's loop state keeps them (running totals, sized by the deepest draft)."""

    def __init__(self):
        self.counters = Counters(0, (0, 0, 0), (0, 0, 0), (0, 0, 0, 0))

    def run(
        self,
        policy,
        draft: DraftShape,
        seconds_per_cycle: float,
        accepted: int,
        *,
        rows=2,
        context=0,
        cycles=4,
        unfed=0,
        unfed_accepted=0,
    ):
        """One segment of `cycles` cycles over `rows` rows, each accepting `accepted` drafts of a chain, the longest
        `context` positions long; `unfed` of them (none unless given) were not fed the drafter at prefill and accept
        `unfed_accepted` each."""
        c, k = self.counters, draft.num_steps
        j, t = np.arange(len(c.reached)), np.arange(len(c.accept_hist))

        def counts(a: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # of n row-cycles accepting a drafts
            a = min(a, k)
            return n * ((j < k) & (j <= a)), n * (j < a), n * (t == a)

        fed, own = counts(accepted, cycles * (rows - unfed)), counts(unfed_accepted, cycles * unfed)
        was = c.reached, c.accepted, c.accept_hist
        now = [tuple(int(x) for x in np.add(w, f + o)) for w, f, o in zip(was, fed, own, strict=True)]
        self.counters = Counters(c.cycles + cycles, *now)
        observed = (own[0].tolist(), own[1].tolist()) if unfed else None
        policy.observe(segment(draft, rows, cycles), self.counters, cycles * seconds_per_cycle, context, observed)


@pytest.mark.parametrize(
    ("accepted", "chain_cost", "best"),
    [(3, 2.0, CHAIN), (0, 2.0, PLAIN), (1, 3.0, PLAIN), (2, 2.0, CHAIN), (0, 3.0, PLAIN), (3, 8.0, PLAIN)],
)
def test_the_policy_times_each_shape_first_then_runs_the_predicted_fastest(accepted, chain_cost, best):
    """Each shape runs once, then each again up to FIRST times (interleaved) unless predicted below LOSING x the
    best; then the shape of highest n E / T: a chain accepting a drafts per cycle yields a + 1 tokens per cycle at
    `chain_cost` times a plain cycle."""
    policy, loop = DraftPolicy((PLAIN, CHAIN), cycles=4), Loop()
    chain, plain = (1 + accepted) / chain_cost, 1.0  # tokens per plain cycle's time
    learning = [s for s, r in ((PLAIN, plain), (CHAIN, chain)) if r >= LOSING * max(chain, plain)]
    for expected in [PLAIN, CHAIN] + learning * (FIRST - 1):
        shape = policy.choose(2, 2)
        assert shape == expected and not policy.probing  # not timed yet: a whole segment
        loop.run(policy, shape, 0.01 * (chain_cost if shape.num_steps else 1), accepted)
    assert policy.choose(2, 2) == best
    tokens, cost = (1 + accepted, chain_cost) if best.num_steps else (1, 1)
    assert policy.predicted == pytest.approx(2 * tokens / (0.01 * cost))
    assert policy.choose(1, 1) == PLAIN  # another bucket: timed on its own


@pytest.mark.parametrize(
    ("acceptance", "chain_cost", "first"), [(0.9, 2.0, CHAIN), (0.2, 2.0, PLAIN), (0.9, 4.5, PLAIN)]
)
def test_a_calibrated_policy_with_a_recorded_acceptance_runs_the_predicted_best_from_the_first_segment(
    acceptance, chain_cost, first
):
    """Cycle times timed at warm-up (`calibrate`) and tune.json's acceptance (`prior`): the first segment already runs
    the shape of highest n E / T, with no learning segments (a chain chosen on the prior alone: a probe of one cycle,
    the traffic's first measure of the drafter); online counters then outweigh the prior (a chain that accepts nothing
    on the traffic is dropped after its probe and at most one segment)."""
    policy, loop = DraftPolicy((PLAIN, CHAIN), cycles=4), Loop()
    policy.calibrate(PLAIN, 2, 0.01)
    policy.calibrate(CHAIN, 2, 0.01 * chain_cost)
    policy.prior([acceptance] * NUM_STEPS)
    e = 1 + sum(acceptance ** (j + 1) for j in range(NUM_STEPS))
    assert first == (CHAIN if e / chain_cost > 1 else PLAIN)
    assert policy.choose(2, 2) == first and policy.probing == (first == CHAIN)
    if first == CHAIN:  # the traffic disagrees with the prior: plain within two segments, the first a probe
        chosen = []
        for _ in range(4):
            shape, cycles = policy.choose(2, 2), 1 if policy.probing else 4
            chosen.append((shape, cycles))
            loop.run(policy, shape, 0.01 * (chain_cost if shape.num_steps else 1), accepted=0, cycles=cycles)
        assert chosen[0] == (CHAIN, 1) and chosen[2:] == [(PLAIN, 4)] * 2, chosen  # (the prior: 16 row-cycles)


def test_a_shape_timed_at_warm_up_alone_moves_with_the_shapes_timed_online():
    """Warm-up rows are short, the traffic's longer: a plain cycle timed online at 1.5x its warm-up time scales the
    chain's warm-up time (not timed online yet) by 1.5x too, at that bucket only, so the chain does not look faster
    than it is against plain decoding's online time (the ratio the warm-up measured stays: a tie stays a tie); the
    chain's own online times then take over."""
    policy, loop = DraftPolicy((PLAIN, CHAIN), cycles=4), Loop()
    for rows in (1, 2):
        policy.calibrate(PLAIN, rows, 0.01)
        policy.calibrate(CHAIN, rows, 0.02)
    policy.prior([1.0] * NUM_STEPS)  # E = 4: the chain 2x plain at warm-up's times
    loop.run(policy, PLAIN, 0.02, 0)  # online, 2 rows: [0.01 (warm-up), 0.02] -> 0.015 per cycle
    assert policy.cycle_seconds[PLAIN, 2, 0] == pytest.approx(0.015)
    assert policy.cycle_seconds[CHAIN, 2, 0] == pytest.approx(0.03)
    assert policy.cycle_seconds[CHAIN, 1, 0] == pytest.approx(0.02)  # another bucket: as it was timed
    assert policy.predict(CHAIN, 2, 2) == pytest.approx(2 * policy.predict(PLAIN, 2, 2))
    loop.run(policy, CHAIN, 0.05, NUM_STEPS)  # its own online time: [0.02, 0.05] -> 0.035
    assert policy.cycle_seconds[CHAIN, 2, 0] == pytest.approx(0.035)
    loop.run(policy, PLAIN, 0.02, 0)  # no longer rescaled
    assert policy.cycle_seconds[CHAIN, 2, 0] == pytest.approx(0.035)


@pytest.mark.parametrize("chain_cost", [1.5, 2.5])
def test_a_calibrated_policy_without_a_recorded_acceptance_predicts_each_draft_half_accepted(chain_cost):
    """Times known, acceptance not: each draft position is predicted accepted UNKNOWN_ACCEPTANCE of the time. Where
    that predicts the chain to win, it runs first, as a probe of one cycle (its acceptance measured; its time, mostly
    what a segment pays once, not taken for a cycle's); where it predicts the chain to lose, plain decoding runs and
    the chain's probe waits until the time spent without it reaches its segment's time / x / EXPLORE_SHARE, as any
    losing candidate's exploring does (x = its predicted throughput / plain decoding's). Then the measured best."""
    policy, loop = DraftPolicy((PLAIN, CHAIN), cycles=4), Loop()
    policy.calibrate(PLAIN, 2, 0.01)
    policy.calibrate(CHAIN, 2, 0.01 * chain_cost)
    x = (1 + sum(UNKNOWN_ACCEPTANCE ** (j + 1) for j in range(NUM_STEPS))) / chain_cost
    assert policy.predict(CHAIN, 2, 2) == pytest.approx(x * policy.predict(PLAIN, 2, 2))
    plain_segments = 0
    while policy.choose(2, 2) == PLAIN:
        assert not policy.probing and plain_segments < 1000
        loop.run(policy, PLAIN, 0.01, accepted=0)
        plain_segments += 1
    assert policy.probing  # the chain's first segment, whenever it comes: one cycle
    wait = 4 * 0.01 * chain_cost / x / EXPLORE_SHARE  # seconds without the chain before it is explored
    assert plain_segments == 0 if x > 1 else (plain_segments - 1) * 0.04 < wait <= plain_segments * 0.04
    loop.run(policy, CHAIN, 0.5, accepted=0, cycles=1)
    assert policy.choose(2, 2) == PLAIN and not policy.probing
    assert policy.cycle_seconds[CHAIN, 2, 0] == 0.01 * chain_cost
    with pytest.raises(ValueError, match="DraftPolicy.calibrate"):
        policy.calibrate(DraftShape(NUM_STEPS + 1), 2, 0.01)


def test_the_warm_up_times_every_shape_at_every_batch_bucket(pair):
    """An adaptive engine's policy starts with a cycle time for every (shape, batch bucket), measured over live rows
    after the programs compiled, and with none of the warm-up's dummy counters (a chain's acceptance unmeasured)."""
    engine = warm_engine(pair, CONFIG)  # a fresh engine (its programs are the module's, compiled once)
    policy = engine.scheduler.policy
    assert set(policy.cycle_seconds) == {(s, b, 0) for s in (PLAIN, CHAIN) for b in CONFIG.buckets}
    assert all(t > 0 for t in policy.cycle_seconds.values())
    assert np.isnan(policy.acceptance()).all() and np.isnan(policy.acceptance(fed=False)).all()
    assert policy.choose(2, 2) == max((PLAIN, CHAIN), key=lambda s: policy.predict(s, 2, 2))


@pytest.mark.slow  # test budget (the default suite reached 28 minutes): ~52 s of its own compiles; the placement
# of its rounds is checked in the default suite (test_a_warm_up_round_puts_its_two_chunk_dummies_beside_...)
def test_the_warm_up_runs_every_segment_program_over_live_rows(pair):
    """Once compiled, every (batch bucket, draft shape, program) runs cycles over a live row, each chain runs its
    catch-up (a row the drafter is behind on: one not fed at prefill), and each runs a prefill chunk fed the drafter
    and one not beside a live row: the compile runs' rows are done, and on XLA:CPU a loop body's first run took 15-30
    ms more than its next, which a fresh server's first requests paid (Engine._first_runs). Segments of 8 cycles: the
    warm-up's first dummy request is done after its first (so no compile run finds it live, as with the bundled pair
    at the defaults). And no queue (--max-queue 0): the warm-up's requests fill a bucket's slots at once whatever the
    bound (it raised QueueFull). One bucket of 3 rows: both of a round's two-chunk dummies fit beside a short one."""
    from jaxspec.serving.engine import Engine

    # greedy_engine's programs
    config = dataclasses.replace(
        CONFIG, greedy_program=True, segment_cycles=8, max_queue=0, max_batch=3, batch_buckets=(3,)
    )
    target, drafter, tokenizer = pair
    engine = Engine(target, drafter, config, stop_ids=tokenizer.stop_ids)
    ran, caught_up, chunks, run = set(), set(), set(), engine.executor.run

    def recording(plan: StepPlan):
        before = engine.executor.state
        cycles = np.asarray(before.row_cycles_B)
        behind = ~np.asarray(before.done_B) & (np.asarray(before.drafted_B) < np.asarray(before.length_B))
        unfed = np.zeros(len(cycles), bool)
        unfed[[c.row for c in plan.prefill if not c.drafter]] = True
        result = run(plan)
        if plan.segment is not None:
            rows = slice(0, plan.segment.rows)
            live = np.asarray(engine.executor.state.row_cycles_B)[rows] > cycles[rows]
            key = (plan.segment.rows, plan.segment.draft, plan.segment.greedy)
            ran.update([key] if live.any() else [])
            chain = not plan.segment.draft.plain
            caught_up.update([key] if chain and (live & (behind | unfed)[rows]).any() else [])
            chunks.update((*key, c.drafter) for c in plan.prefill if live.any())
        return result

    engine.executor.run = recording
    engine.warmup(lambda _: None)
    programs = Programs.of(config).programs
    assert ran == {(b, s, g) for b in config.buckets for s in config.shapes for g in programs}
    assert caught_up == {(b, s, g) for b in config.buckets for s in config.shapes if not s.plain for g in programs}
    fed = (False, True)
    assert chunks == {(b, s, g, f) for b in config.buckets for s in config.shapes for g in programs for f in fed}


@pytest.mark.parametrize(("rows", "slots", "late"), [(1, 4, 2), (2, 4, 2), (4, 4, 2), (1, 2, 2), (2, 2, 1), (3, 8, 1)])
def test_a_warm_up_round_puts_its_two_chunk_dummies_beside_the_bucket_s_rows(rows, slots, late):
    """`engine._round`: in slot order, the last short dummy takes slot rows - 1 (its segments run at the bucket of
    `rows`), the two-chunk ones take the slots under it first, then above it, as many as `slots` hold, each salted
    apart (no cached first chunk)."""
    from jaxspec.serving.engine import _round

    spec = RowSpec(ignore_eos=True)
    requests = _round(rows, slots, 5, spec, (17, 18)[:late], "warm-up 0")
    short = [len(r.prompt) == 3 for r in requests]
    assert len(requests) <= slots and short.count(False) == min(late, slots - 1)  # all beside one short one
    assert max(i for i, s in enumerate(short) if s) == rows - 1
    assert all(r.max_tokens == (5 if s else 1) for r, s in zip(requests, short, strict=True))
    salts = [r.spec.cache_salt for r, s in zip(requests, short, strict=True) if not s]
    assert len(set(salts)) == len(salts) and None not in salts


@pytest.mark.parametrize(("accepted", "chain_cost"), [(0, 3.0), (0, 1.5), (1, 2.5)])
def test_the_policy_re_measures_the_other_shape_for_a_small_share_of_the_time(accepted, chain_cost):
    """With the chain losing (x = its predicted throughput / plain decoding's), it runs again once the time spent
    without it reaches its segment's time / x / EXPLORE_SHARE; then, still losing, plain decoding again: exploring
    takes about EXPLORE_SHARE x x of the time, and costs at most EXPLORE_SHARE / 4 of the throughput."""
    policy, loop = DraftPolicy((PLAIN, CHAIN), cycles=4), Loop()
    x = (1 + accepted) / chain_cost
    chosen = []
    for _ in range(3000):
        shape = policy.choose(2, 2)
        chosen.append(shape)
        loop.run(policy, shape, 0.01 * (chain_cost if shape.num_steps else 1), accepted)
    explored = chosen.count(CHAIN) - (FIRST if x >= LOSING else 1)
    plain_time, explored_time = chosen.count(PLAIN) * 0.04, explored * 0.04 * chain_cost
    assert 0 < explored and explored_time <= EXPLORE_SHARE * x * 1.1 * plain_time
    lost = explored_time * (1 - x) / (plain_time + explored_time)
    assert lost <= EXPLORE_SHARE / 4


@pytest.mark.parametrize(("accepted", "chain_cost"), [(0, 2.0), (1, 2.2), (0, 1.1), (1, 1.8), (3, 2.0)])
def test_rows_are_fed_the_drafter_where_a_chain_measured_on_the_traffic_pays(accepted, chain_cost):
    """No row is fed the drafter at prefill before a chain has counted acceptance online (not even every
    FEED_EVERY-th: no chain would serve it); then unless the chain is predicted below FEED x plain decoding at every
    bucket where both are timed (then every FEED_EVERY-th admission all the same; one bucket where it is not below:
    fed again)."""
    policy, loop = DraftPolicy((PLAIN, CHAIN), cycles=4), Loop()
    assert not policy.feeds_drafter()
    loop.run(policy, PLAIN, 0.01, accepted)
    for _ in range(2 * FEED_EVERY):
        assert not policy.feeds_drafter()
        policy.admitted(False)
    policy.admitted(True)  # (the count restarts: as if the chain's first measure came with a fed row)
    loop.run(policy, CHAIN, 0.01 * chain_cost, accepted)
    pays = (1 + accepted) / chain_cost >= FEED
    asked = [policy.feeds_drafter() for _ in range(2 * FEED_EVERY)]  # asking admits nothing: no answer changes
    assert asked == [pays] * len(asked)
    fed = []
    for _ in range(2 * FEED_EVERY):
        fed.append(policy.feeds_drafter())
        policy.admitted(fed[-1])
    assert fed == [True] * len(fed) if pays else fed == ([False] * (FEED_EVERY - 1) + [True]) * 2
    loop.run(policy, PLAIN, 0.01, accepted, rows=1)
    loop.run(policy, CHAIN, 0.0095 / FEED, accepted, rows=1)  # a bucket where the chain is 5% over FEED x plain
    assert policy.feeds_drafter()
    assert DraftPolicy((CHAIN,), cycles=4).feeds_drafter() and DraftPolicy((PLAIN,), cycles=4).feeds_drafter()


def test_the_acceptance_kept_between_segments_follows_the_counters_and_is_not_the_callers():
    """The policy works a range's a_j out once per change of its counters (`observe`, `prior`): what it answers moves
    with every drafting segment, and an answer the caller writes to changes nothing it answers next."""
    policy, loop = DraftPolicy((PLAIN, CHAIN), cycles=4), Loop()
    policy.prior([0.9] * NUM_STEPS)
    first = policy.acceptance(100)
    np.testing.assert_allclose(first, [0.9] * NUM_STEPS)
    first[:] = 0.0
    np.testing.assert_allclose(policy.acceptance(100), [0.9] * NUM_STEPS)
    loop.run(policy, CHAIN, 0.02, 0)  # a chain that accepts nothing
    after = policy.acceptance(100)
    assert after[0] < 0.9 and policy.predict(CHAIN, 2, 2, 100) == pytest.approx(
        2 * (1 + after[0] + after[0] * after[1] + after[0] * after[1] * after[2]) / 0.02
    )
    policy.prior([0.5] * NUM_STEPS)
    assert policy.acceptance(100)[0] < after[0]


@pytest.mark.parametrize(
    ("prompt", "every"),
    [(1, FEED_EVERY), (CONTEXT_RANGE, FEED_EVERY), (CONTEXT_RANGE + 1, 2 * FEED_EVERY),
     (3 * CONTEXT_RANGE, 2 * FEED_EVERY), (4 * CONTEXT_RANGE + 1, 4 * FEED_EVERY)],
)  # fmt: skip
def test_longer_prompts_are_fed_all_the_same_less_often(prompt, every):
    """Where no chain pays, the admission fed all the same is every FEED_EVERY-th for a prompt in the first context
    range and twice as far apart in each next one (feeding a prompt 4x longer costs ~4x as much)."""
    policy, loop = DraftPolicy((PLAIN, CHAIN), cycles=4), Loop()
    loop.run(policy, PLAIN, 0.01, 0)
    policy.admitted(True)
    loop.run(policy, CHAIN, 0.02, 0)
    fed = []
    for _ in range(2 * every):
        fed.append(policy.feeds_drafter(prompt))
        policy.admitted(fed[-1])
    assert fed == ([False] * (every - 1) + [True]) * 2


def test_a_recorded_acceptance_chooses_shapes_but_feeds_no_row():
    """With tune.json's acceptance (`prior`) and warm-up times, the first segment runs the chain the prior predicts
    fastest, but rows are fed only once a chain has measured the drafter on this traffic (a recorded acceptance is of
    other prompts: on HumanEval the bundled drafter accepts half what the held-out prompts give), and not every
    FEED_EVERY-th admission either before then."""
    policy, loop = DraftPolicy((PLAIN, CHAIN), cycles=4), Loop()
    policy.calibrate(PLAIN, 2, 0.01)
    policy.calibrate(CHAIN, 2, 0.02)
    policy.prior([0.95] * NUM_STEPS)
    assert policy.choose(2, 2) == CHAIN
    fed = []
    for _ in range(FEED_EVERY):
        fed.append(policy.feeds_drafter(rows=2))
        policy.admitted(fed[-1])
    assert fed == [False] * FEED_EVERY
    loop.run(policy, CHAIN, 0.02, NUM_STEPS)
    assert policy.feeds_drafter(rows=2)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, None])
def test_a_row_is_fed_where_a_chain_pays_at_the_bucket_that_will_serve_it(rows):
    """A chain that pays over 1 row and loses over 8 (its cycle costs 2x plain's over 1 row, 6x over 8; 3 tokens per
    cycle): a row admitted to be served alone is fed the drafter, one joining 7 others is not (nor 2 or 3 rows, whose
    nearest timed bucket above is 8; 9: the largest timed); not asked for a bucket (None): fed where one pays."""
    policy, loop = DraftPolicy((PLAIN, CHAIN), cycles=4), Loop()
    for bucket, cost in ((1, 2.0), (8, 6.0)):
        policy.calibrate(PLAIN, bucket, 0.01)
        policy.calibrate(CHAIN, bucket, 0.01 * cost)
    loop.run(policy, CHAIN, 0.02, 2, rows=1)  # measured online: 2 of 3 drafts accepted
    assert policy.feeds_drafter(rows=rows) == (rows in (1, None))


def fresh_policy(rows: int = 2) -> DraftPolicy:
    """A fresh server's policy: warm-up times (a chain cycle 2x a plain one) and a recorded acceptance of 0.9 at every
    position (a fed row's: the chain predicted at 1.72x plain decoding)."""
    policy = DraftPolicy((PLAIN, CHAIN), cycles=4)
    policy.calibrate(PLAIN, rows, 0.01)
    policy.calibrate(CHAIN, rows, 0.02)
    policy.prior([0.9] * NUM_STEPS)
    return policy


def test_rows_not_fed_the_drafter_count_their_acceptance_apart_and_weigh_in_by_their_share():
    """Chains on rows not fed the drafter at prefill accept nothing, three segments: the unfed rows' a_j fall, the
    fed rows' stay the recorded ones; a segment of unfed rows runs plain decoding, one of fed rows the chain, one of
    each the chain (E averaged over the rows: (3.44 + 1.58) / 2 per cycle of 2x a plain one's)."""
    policy, loop = fresh_policy(), Loop()
    for _ in range(3):
        loop.run(policy, CHAIN, 0.02, NUM_STEPS, unfed=2, unfed_accepted=0)
    np.testing.assert_allclose(policy.acceptance(), [0.9] * NUM_STEPS)
    assert policy.acceptance(fed=False)[0] < 0.4
    assert policy.choose(2, 2, fed=0) == PLAIN
    assert policy.choose(2, 2, fed=2) == CHAIN
    assert policy.choose(2, 2, fed=1) == CHAIN
    assert policy.predict(CHAIN, 2, 2, fed=1) == pytest.approx(
        (policy.predict(CHAIN, 2, 2, fed=0) + policy.predict(CHAIN, 2, 2, fed=2)) / 2
    )
    unfed = policy.acceptance(fed=False)
    loop.run(policy, CHAIN, 0.02, 1, unfed=1, unfed_accepted=0)  # one row fed (it accepts 1 draft), one not (none)
    a = policy.acceptance()
    assert a[0] > 0.9 > a[1]
    assert a[2] == pytest.approx(min(0.9 * a[0] / 0.9, 1))  # never reached: the prior, scaled as a_1 moved from 0.9
    assert policy.acceptance(fed=False)[0] < unfed[0]


def test_a_recorded_acceptance_s_deeper_positions_follow_the_traffic_s_first():
    """A recorded acceptance is of other prompts (tune.json's, of the held-out files: 0.93, 0.91, 0.95, 0.87; on
    HumanEval fed rows measured a_1 near 0.7): where the traffic's chains accept no draft, two segments bring a_1
    down, and the positions they never reach are scaled with it, so the chain (at 2x a plain cycle) is predicted to
    lose and the policy goes plain. Kept at the recorded 0.9, they predicted the chain at 1.2x plain decoding."""
    policy, loop = fresh_policy(), Loop()
    for _ in range(2):
        loop.run(policy, CHAIN, 0.02, 0)
    a = policy.acceptance()
    assert 0.3 < a[0] < 0.6
    np.testing.assert_allclose(a[1:], 0.9 * a[0] / 0.9)
    assert policy.predict(CHAIN, 2, 2) < policy.predict(PLAIN, 2, 2)
    assert policy.choose(2, 2) == PLAIN


def test_a_recorded_acceptance_shorter_than_the_chain_leaves_the_deeper_positions_unknown():
    """A tune.json of a shallower chain records fewer positions than the chain drafts: where neither it nor the
    traffic has counted anything, a_j stays unknown (NaN: predicted UNKNOWN_ACCEPTANCE), not 0."""
    policy, loop = fresh_policy(), Loop()
    policy.prior([0.9, 0.9])
    loop.run(policy, CHAIN, 0.02, 1)  # every row-cycle reaches the first two positions, accepts the first
    a = policy.acceptance()
    assert a[0] > 0.9 > a[1] > 0 and np.isnan(a[2:]).all(), a


@pytest.mark.parametrize("fed_accepted", [NUM_STEPS, 0])
def test_a_fresh_server_s_unfed_first_rows_do_not_keep_the_next_rows_unfed(fed_accepted):
    """A fresh server's first row is not fed (nothing measured on the traffic); its chain accepts nothing without the
    drafter's entries for its prompt, and it goes plain. Where the drafter's acceptance on fed rows is the recorded
    one, that would keep every next row unfed (their chains measuring the same) and plain: instead, until a chain has
    measured a fed row, one row is fed where a fed row's chain is predicted to pay (one: the recorded acceptance can
    be of other prompts), and then none but the FEED_EVERY-th; once fed rows' acceptance is measured, it decides: the
    chain accepting every draft on them feeds every row, accepting none feeds none but the FEED_EVERY-th."""
    policy, loop = fresh_policy(rows=1), Loop()
    assert not policy.feeds_drafter(rows=1)
    policy.admitted(False)
    for _ in range(3):
        loop.run(policy, CHAIN, 0.02, NUM_STEPS, rows=1, unfed=1, unfed_accepted=0)
    assert policy.choose(1, 1, fed=0) == PLAIN
    fed = []
    for _ in range(FEED_EVERY + 1):
        fed.append(policy.feeds_drafter(rows=1))
        policy.admitted(fed[-1])
    assert fed == [True] + [False] * (FEED_EVERY - 1) + [True]
    assert policy.choose(1, 1, fed=1) == CHAIN
    for _ in range(6):
        loop.run(policy, CHAIN, 0.02, fed_accepted, rows=1)
    fed = []
    for _ in range(FEED_EVERY):
        fed.append(policy.feeds_drafter(rows=1))
        policy.admitted(fed[-1])
    assert fed == ([True] * FEED_EVERY if fed_accepted else [False] * (FEED_EVERY - 1) + [True])


@pytest.mark.parametrize("beside", range(8))
def test_until_a_fed_row_is_measured_a_row_is_fed_only_where_a_chain_would_run_over_the_rows_it_joins(beside):
    """A fresh server's 8 first rows, not fed, run a chain that accepts nothing on them, and go plain. A row admitted
    then, to measure a fed row's acceptance, joins 7 others: with the recorded acceptance (E 3.44 at 2x a plain
    cycle, an unfed row's 1.02) a chain would run over them only where 3 of them or more are fed too (a segment's E
    is its rows' mean), so it is fed where the policy would choose the chain over that mix, else not (a fed row that
    no chain serves costs its drafter's prefill for nothing), and the FEED_EVERY-th admission no more; asked alone (a
    bucket of 1, or with the others not said) it is fed."""
    policy, loop = fresh_policy(rows=8), Loop()
    for _ in range(3):
        loop.run(policy, CHAIN, 0.02, 0, rows=8, unfed=8, unfed_accepted=0)
    assert policy.choose(8, 8, fed=0) == PLAIN
    runs = policy.choose(8, 8, fed=beside + 1) == CHAIN
    assert runs == (beside >= 3), "E over 8 rows: (f 3.44 + (8 - f) 1.02) / 8 >= 2 from f = 4 fed rows"
    assert policy.feeds_drafter(rows=8, fed=beside) == runs
    assert policy.feeds_drafter(rows=1, fed=0) and policy.feeds_drafter(rows=8)
    for _ in range(FEED_EVERY - 1):
        policy.admitted(False)
    assert policy.feeds_drafter(rows=8, fed=beside) == runs


SHORT, LONG = 100, 16 * CONTEXT_RANGE  # live lengths in the first context range and two ranges further


def test_context_ranges_are_the_first_range_then_each_4x_longer():
    ranges = [context_range(n) for n in (0, 1, CONTEXT_RANGE, CONTEXT_RANGE + 1, 4 * CONTEXT_RANGE, LONG, LONG + 1)]
    assert ranges == [0, 0, 0, 1, 1, 2, 3]


def test_a_long_context_that_stops_paying_goes_plain_while_short_ones_keep_speculating():
    """Short and long rows take turns: every cycle costs twice as much at the long context, and there the drafter
    accepts nothing (short: every draft). Cycle times and acceptance kept per context range: within two long
    segments the long rows run plain decoding while the short ones still run the chain (one acceptance and one time
    for both would run one shape for both; with the long range's a_2.. at the short range's, five)."""
    policy, loop = DraftPolicy((PLAIN, CHAIN), cycles=4), Loop()
    for rows in (1, 2):
        policy.calibrate(PLAIN, rows, 0.01)
        policy.calibrate(CHAIN, rows, 0.02)
    policy.prior([0.9] * NUM_STEPS)
    chosen = {SHORT: [], LONG: []}
    for _ in range(40):
        for context, accepted, cost in ((SHORT, NUM_STEPS, 1.0), (LONG, 0, 2.0)):
            shape = policy.choose(2, 2, context)
            chosen[context].append(shape)
            loop.run(policy, shape, cost * (0.02 if shape.num_steps else 0.01), accepted, context=context)
    assert chosen[SHORT].count(PLAIN) <= 2 and chosen[SHORT][-1] == CHAIN, chosen[SHORT]
    assert chosen[LONG][:10].count(CHAIN) <= 2 and chosen[LONG][10:].count(CHAIN) <= 1, chosen[LONG]
    assert policy.acceptance(LONG)[0] < 0.6 < 0.9 < policy.acceptance(SHORT)[0]


def test_a_long_prompt_is_not_fed_the_drafter_where_chains_do_not_pay_at_long_contexts():
    """Whether a row is fed the drafter at prefill is decided in its prompt's context range: the chain accepts every
    draft at short contexts and nothing at long ones (where its cycle also costs 2x): a short prompt is fed, a long
    one is not (but for every admission the cadence for its range feeds all the same)."""
    policy, loop = DraftPolicy((PLAIN, CHAIN), cycles=4), Loop()
    for shape, accepted, context, seconds_per_cycle in [(CHAIN, 0, LONG, 0.04)] * 10 + [(PLAIN, 0, LONG, 0.02)] * 2:
        loop.run(policy, shape, seconds_per_cycle, accepted, context=context)
    for shape, seconds_per_cycle in [(CHAIN, 0.02)] * 10 + [(PLAIN, 0.01)] * 2:
        loop.run(policy, shape, seconds_per_cycle, NUM_STEPS, context=SHORT)
    assert policy.feeds_drafter(SHORT) and policy.feeds_drafter(SHORT + CONTEXT_RANGE)  # the nearest range: short
    every = FEED_EVERY * 2 ** context_range(LONG)
    fed = []
    for _ in range(every):
        fed.append(policy.feeds_drafter(LONG))
        policy.admitted(fed[-1])
    assert fed == [False] * (every - 1) + [True]


def test_a_context_range_not_measured_yet_is_predicted_from_the_nearest_one():
    """A new range costs no learning segments: each shape's T there is its T at the nearest measured range, scaled
    by how much the shapes measured in both changed (here plain decoding, 3x); its acceptance is the overall one."""
    policy, loop = DraftPolicy((PLAIN, CHAIN), cycles=4), Loop()
    policy.calibrate(PLAIN, 2, 0.01)
    policy.calibrate(CHAIN, 2, 0.02)
    policy.prior([0.7] * NUM_STEPS)
    e = 1 + sum(0.7 ** (j + 1) for j in range(NUM_STEPS))
    assert policy.predict(CHAIN, 2, 2, LONG) == pytest.approx(2 * e / 0.02)  # nothing measured there: as short
    assert policy.choose(2, 2, LONG) == CHAIN  # E / 2 > 1: no learning segment
    loop.run(policy, PLAIN, 0.03, 0, context=LONG)  # plain decoding timed at the long context: 3x
    assert policy.predict(CHAIN, 2, 2, LONG) == pytest.approx(2 * e / 0.06)
    assert policy.predict(CHAIN, 2, 2, SHORT) == pytest.approx(2 * e / 0.02)
    assert policy.predict(CHAIN, 2, 2, 4 * LONG) == pytest.approx(2 * e / 0.06)  # the nearest range: LONG's


def test_a_range_whose_first_draft_is_accepted_less_predicts_its_deeper_drafts_accepted_less_alike():
    """At a long context the chain reaches its deeper positions seldom (a_1 is low there), so their own counters stay
    few: the range's a_1 against the overall a_1 scales the overall a_j it takes as their prior. A short range that
    accepts every draft, then a long one that accepts none: the long range's a_2.. fall with its a_1, and the chain
    is predicted there as it measures (below plain decoding), where the unscaled prior kept a_2.. at 1."""
    policy, loop = DraftPolicy((PLAIN, CHAIN), cycles=4), Loop()
    for _ in range(10):
        loop.run(policy, CHAIN, 0.02, NUM_STEPS, context=SHORT)
    loop.run(policy, PLAIN, 0.01, 0, context=SHORT)
    assert policy.acceptance(SHORT) == pytest.approx([1.0] * NUM_STEPS)
    for _ in range(2):
        loop.run(policy, CHAIN, 0.02, 0, context=LONG)
    a = policy.acceptance(LONG)
    overall = policy.acceptance()
    assert a[0] < 0.6 * overall[0]
    np.testing.assert_allclose(a[1:], overall[1:] * a[0] / overall[0])  # never reached there: the scaled prior
    assert policy.predict(CHAIN, 2, 2, LONG) < policy.predict(PLAIN, 2, 2, LONG)


TREE = DraftShape(NUM_STEPS, topk=2, num_draft_tokens=6)


@pytest.mark.parametrize(("accepted", "tree_cost", "best"), [(3, 3.0, TREE), (1, 3.0, PLAIN), (2, 2.5, TREE)])
def test_a_tree_is_a_candidate_beside_plain_decoding_with_its_own_acceptance(accepted, tree_cost, best):
    """With a tree compiled (`--num-steps auto --topk N`) the candidates are plain decoding and the tree (a chain
    keeps another draft state: not beside a tree). Without a recorded acceptance the tree is predicted as a chain is
    (UNKNOWN_ACCEPTANCE per depth); once a segment measured its own a_j per depth, the cost model's n E / T: a tree
    accepting `accepted` nodes per cycle yields accepted + 1 tokens per cycle at `tree_cost` times a plain cycle."""
    with pytest.raises(ValueError, match="DraftPolicy.shapes"):
        DraftPolicy((PLAIN, CHAIN, TREE), cycles=4)
    policy, loop = DraftPolicy((PLAIN, TREE), cycles=4), Loop()
    policy.calibrate(PLAIN, 2, 0.01)
    policy.calibrate(TREE, 2, 0.01 * tree_cost)
    unknown = 1 + sum(UNKNOWN_ACCEPTANCE ** (j + 1) for j in range(TREE.num_steps))
    assert policy.choose(2, 2) == (TREE if unknown > tree_cost else PLAIN)
    loop.run(policy, TREE, 0.01 * tree_cost, accepted)  # the tree's first segment (first, or when explored)
    assert policy.choose(2, 2) == best
    tokens, cost = (1 + accepted, tree_cost) if best.tree else (1, 1)
    assert policy.predicted == pytest.approx(2 * tokens / (0.01 * cost))
