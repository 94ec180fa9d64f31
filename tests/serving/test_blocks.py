"""The cache pool's bookkeeping without a device: the block allocator (reference counts, LRU eviction of cached
blocks), the hash chains that key full blocks on their tokens AND the token after them (EAGLE's drafter entry at
position p pairs with token p + 1), and the scheduler's use of them through a fake executor that keeps what each
pool position holds: a prefix hit reads exactly what a cold prefill would have written there, no block a row shares
is ever rewritten, every position a row keeps is in a block it owns, and requests that together need more than the
pool all complete with their own tokens (preempted and resumed by recompute)."""

from __future__ import annotations

import dataclasses

import pytest

from jaxspec.decoding.draft_shape import DraftShape
from jaxspec.decoding.sampling_params import RowSpec
from jaxspec.serving.blocks import BlockPool, BlockTables, chain_keys
from jaxspec.serving.request import Request
from tests.serving.support import EOS, FakeExecutor, FakeRow, Scripted, Shape, make, token


def test_allocator_counts_references_and_evicts_the_least_recently_used_cached_block():
    pool = BlockPool(4, 2)
    a = pool.take((), 2)
    assert a == [1, 2] and pool.available == 2 and pool.used == 2
    assert pool.take((), 3) is None and pool.available == 2  # all or nothing
    keys = chain_keys([5, 6, 7, 8, 9], 2, 2)
    pool.register(1, keys[0])
    pool.register(2, keys[1])
    assert pool.lookup(keys) == [1, 2] and pool.lookup(chain_keys([5, 6, 7, 8, 0], 2, 2)) == [1]
    b = pool.take(pool.lookup(keys), 1)  # shares both cached blocks
    assert b == [1, 2, 3] and pool.used == 3
    pool.release(a)
    assert pool.used == 3 and pool.available == 1  # still held by b
    pool.release(b)  # tail first: block 2 becomes the least recently used, then 1
    assert pool.used == 0 and pool.available == 4 and pool.cached == 2
    assert pool.take((), 2) == [3, 4]  # free blocks go first
    assert pool.take((), 1) == [2] and pool.lookup(keys) == [1]  # then the LRU cached block, evicted
    with pytest.raises(ValueError, match="BlockPool.release: block 1 is not held"):
        pool.release([1])
    with pytest.raises(ValueError, match="BlockPool.num_blocks"):
        BlockPool(0, 2)


def test_blocks_without_the_drafters_entries_serve_only_rows_the_drafter_is_not_fed():
    """A block registered by a row the drafter was not fed holds the target's entries only: a fed row's lookup stops
    there (and prefills it itself), a row not fed reuses it, and the fed row's block replaces it under the key."""
    tables = BlockTables(BlockPool(16, 4), prefill_chunk=4)
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks with their next token
    assert tables.admit(0, prompt, 16, drafter=False) == 0
    tables.prefilled(0, 12)
    target_only = tables.blocks[0][:3]
    assert tables.admit(1, prompt, 16, drafter=False) == 12 and tables.blocks[1][:3] == target_only
    assert tables.admit(2, prompt, 16) == 0  # fed: the target-only blocks are no prefix for it
    tables.prefilled(2, 12)
    full = tables.blocks[2][:3]
    assert set(full).isdisjoint(target_only)
    assert tables.admit(3, prompt, 16) == 12 and tables.blocks[3][:3] == full
    assert tables.admit(4, prompt, 16, drafter=False) == 12 and tables.blocks[4][:3] == full
    for row in (0, 1):
        tables.release(row)  # the replaced blocks are free again, not cached
    assert tables.pool.cached == 3 and tables.pool.available == 16 - tables.pool.used


def test_a_blocks_key_covers_its_chain_and_the_token_after_it():
    ids = list(range(1, 20))
    keys = chain_keys(ids, 4, 4)
    assert chain_keys(ids[:17], 4, 4) == keys and chain_keys(ids, 4, 2) == keys[:2]
    other_next = ids[:8] + [99] + ids[9:]
    assert chain_keys(other_next, 4, 4)[:1] == keys[:1] and chain_keys(other_next, 4, 4)[1] != keys[1]
    with pytest.raises(ValueError, match="tokens: 4 blocks of 4 need 17"):
        chain_keys(ids[:16], 4, 4)


def test_tables_reuse_whole_prefill_chunks_and_register_blocks_once_prefilled():
    tables = BlockTables(BlockPool(32, 4), prefill_chunk=8)
    prompt = list(range(1, 30))  # 29 tokens: blocks 0..6 have their next token in the prompt
    assert tables.admit(0, prompt, 40) == 0 and len(tables.blocks[0]) == 10
    tables.prefilled(0, 16)
    assert tables.pool.cached == 4
    tables.prefilled(0, 32)
    assert tables.pool.cached == 7
    assert tables.admit(1, prompt, 40) == 24  # 7 blocks cached, reused by whole chunks of 2 blocks
    assert tables.blocks[1][:6] == tables.blocks[0][:6] and tables.queries == 58 and tables.hits == 24
    assert tables.admit(2, prompt[:17], 20) == 16 and tables.admit(3, prompt[:16], 20) == 8
    assert tables.admit(4, prompt, 40, lookup=False) == 0
    assert [r for r, _ in tables.changes()] == [0, 1, 2, 3, 4] and tables.changes() == ()
    for row in range(5):
        tables.release(row)
    assert tables.pool.used == 0 and tables.changes() == tuple((r, ()) for r in range(5))
    with pytest.raises(ValueError, match="block_size: 4 must divide the prefill chunk"):
        BlockTables(BlockPool(4, 4), prefill_chunk=6)


def test_rows_with_different_cache_salts_share_no_block():
    """vLLM's cache_salt: the salt starts the chain, so the same prompt under another salt (or none) finds nothing
    cached, and under the same salt finds what that salt cached."""
    ids = list(range(1, 20))
    plain, a, b = chain_keys(ids, 4, 4), chain_keys(ids, 4, 4, "a"), chain_keys(ids, 4, 4, "b")
    assert not {*plain} & {*a} and not {*a} & {*b} and chain_keys(ids, 4, 4, "a") == a
    tables = BlockTables(BlockPool(64, 4), prefill_chunk=8)
    prompt = list(range(1, 30))
    assert tables.admit(0, prompt, 40, salt="a") == 0
    tables.prefilled(0, 32)
    assert tables.admit(1, prompt, 40, salt="b") == 0 and tables.admit(2, prompt, 40) == 0
    assert tables.admit(3, prompt, 40, salt="a") == 24


# ---------------------------------------------------------------------- the scheduler on a pool-keeping fake device
@dataclasses.dataclass
class PoolRow(FakeRow):
    """A fake row whose next token depends on its position (what a resumed request needs: its row prompt is its
    prompt and the tokens it already had)."""

    def generated(self) -> int:
        return len(self.tokens) - len(self.admission.prompt)

    def emit(self) -> None:
        a = self.admission
        self.tokens.append(token(a.spec.seed, len(self.tokens)))
        self.done = self.tokens[-1] in (EOS, *a.spec.stop_ids) or self.generated() >= a.max_new


def expected(prompt, max_new: int, seed: int) -> list[int]:
    out = []
    while len(out) < max_new and not (out and out[-1] == EOS):
        out.append(token(seed, len(prompt) + len(out)))
    return out


class PoolExecutor(FakeExecutor):
    """The fake device with a pool: position p of a row holds (token p, token p + 1), the target's entry and the
    drafter's, written through the row's block table when the device writes it."""

    def __init__(self, shape: Shape):
        super().__init__(shape)
        self.tables: dict[int, tuple[int, ...]] = {}
        self.pool: dict[tuple[int, int], tuple[int, int]] = {}

    Row = PoolRow

    def run(self, plan):
        for b in plan.blocks:
            self.tables[b.row] = b.blocks
        for a in plan.admit:  # what a row reuses is what its own prefill would have written there
            assert a.cached % self.shape.prefill_chunk == 0
            for p in range(a.cached):
                assert self.pool[self._at(a.row, p)] == (a.prompt[p], a.prompt[p + 1]), (a.row, p)
        before = {i: len(r.tokens) for i, r in enumerate(self.rows) if r is not None}
        result = super().run(plan)
        for c in plan.prefill:  # prompt positions, the last paired with the first token
            row = self.rows[c.row]
            for p in range(c.start, min(c.start + self.shape.prefill_chunk, len(row.admission.prompt))):
                self.write(c.row, p, row.tokens)
        for i, row in enumerate(self.rows):  # a segment's tokens: each new token q completes position q - 1
            if row is not None and plan.segment is not None:
                for q in range(max(before.get(i, 0), len(row.admission.prompt) + 1), len(row.tokens)):
                    self.write(i, q - 1, row.tokens)
        assert len(set().union(*self.tables.values())) <= self.shape.pool_blocks
        return result

    def _at(self, row: int, p: int) -> tuple[int, int]:
        blocks, bs = self.tables[row], self.shape.block
        assert p // bs < len(blocks), f"row {row} keeps position {p} without a block"
        return blocks[p // bs], p % bs

    def write(self, row: int, p: int, tokens: list[int]) -> None:
        at, value = self._at(row, p), (tokens[p], tokens[p + 1])
        if self.pool.get(at, value) != value:
            sharing = [r for r, t in self.tables.items() if r != row and at[0] in t]
            assert not sharing, f"row {row} rewrites position {p} in block {at[0]}, shared with rows {sharing}"
        self.pool[at] = value


def serve(shape: Shape, batches: list[list[Request]], served: tuple | None = None) -> tuple:
    """Each batch of requests submitted once the previous one is done, on a new scheduler and fake executor or on
    `served` ones; returns them (scheduler, executor)."""
    scheduler, executor = served or (make(shape), PoolExecutor(shape))
    for batch in batches:
        for r in batch:
            scheduler.submit(r)
        steps = 0
        while scheduler.has_work:
            plan = scheduler.schedule()
            scheduler.update(executor.run(plan))
            steps += 1
            assert steps < 500, "the scheduler does not finish"
        for r in batch:
            assert r.tokens == expected(r.prompt, r.max_tokens, r.spec.seed), r
            assert r.finish_reason in ("stop", "length"), r
    return scheduler, executor


SYSTEM = [(3 * i) % 40 + 10 for i in range(41)]  # a shared system prompt of 41 tokens (VOCAB 50; no EOS)


def test_chat_requests_share_the_system_prompt_up_to_the_block_whose_next_token_differs():
    """Blocks of 8, chunks of 8: the first request caches blocks 0..4 (positions 0..39, each with its next token);
    the others reuse all 40 positions (token 40 is the system prompt's last), and so does the system prompt alone
    (its last position, 40, is prefilled); a prompt of the first 40 tokens reuses 32 (its last position, 39, is
    always prefilled), and so does one with a different 41st token (block 4's drafter entry pairs with token 40)."""
    first = Request(SYSTEM + [11, 12, 13], 6, RowSpec(seed=1))
    later = [Request(SYSTEM + [20 + i] * (i + 1), 6, RowSpec(seed=2 + i)) for i in range(3)]
    alone, edge = Request(SYSTEM, 4, RowSpec(seed=8)), Request(SYSTEM[:40], 4, RowSpec(seed=9))
    other = Request(SYSTEM[:40] + [44, 45], 4, RowSpec(seed=10))
    scheduler, _ = serve(Shape(), [[first], later + [alone, edge, other]])
    assert first.cached_tokens == 0 and [r.cached_tokens for r in later + [alone]] == [40, 40, 40, 40]
    assert edge.cached_tokens == 32 and other.cached_tokens == 32
    tables = scheduler.tables
    assert tables.queries == sum(len(r.prompt) for r in [first, *later, alone, edge, other]) and tables.hits == 224


def test_prompts_ending_inside_a_block_on_its_edge_and_one_a_prefix_of_another():
    base = list(range(10, 42))  # 32 tokens: 4 blocks
    inside, edge, exact = (
        Request(base[:21], 5, RowSpec(seed=1)),
        Request(base[:24], 5, RowSpec(seed=2)),
        Request(base, 5, RowSpec(seed=3)),
    )
    again = [
        Request(base[:21], 5, RowSpec(seed=4)),
        Request(base[:24], 5, RowSpec(seed=5)),
        Request(base, 5, RowSpec(seed=6)),
    ]
    longer = Request(base + [7, 8], 5, RowSpec(seed=7))
    serve(Shape(), [[inside, edge, exact], again + [longer]])
    # the full prompt's last block (positions 24..31) was never cached: its next token lies past that prompt
    assert [r.cached_tokens for r in again] == [16, 16, 24] and longer.cached_tokens == 24


def test_concurrent_requests_share_the_blocks_of_a_running_one():
    """A request admitted while another with the same prefix generates takes that one's blocks (held by both)."""
    scheduler, executor = make(), PoolExecutor(Shape())
    a, b = Request(SYSTEM + [1], 30, RowSpec(seed=1)), Request(SYSTEM + [2], 5, RowSpec(seed=2))
    scheduler.submit(a)
    while not a.tokens:
        scheduler.update(executor.run(scheduler.schedule()))
    scheduler.submit(b)
    scheduler.update(executor.run(scheduler.schedule()))
    assert b.cached_tokens == 40 and scheduler.tables.blocks[1][:5] == scheduler.tables.blocks[0][:5]
    while scheduler.has_work:
        scheduler.update(executor.run(scheduler.schedule()))
    assert a.tokens == expected(a.prompt, 30, 1) and b.tokens == expected(b.prompt, 5, 2)


def test_requests_needing_more_than_the_pool_complete_through_preemption():
    """A pool of 24 blocks (192 positions) for four slots of 128: eight requests that each reach up to 100
    positions preempt one another (the newest first) and are resumed by recompute; each gets its own tokens."""
    shape = Shape(pool_blocks=24)
    requests = [Request([10 + i] * (20 + 5 * i), 40 + 5 * (i % 3), RowSpec(seed=i)) for i in range(8)]
    scheduler, _ = serve(shape, [requests])
    assert scheduler.preemptions > 0 and scheduler.tables.pool.used == 0
    assert scheduler.check(60, 60) is None and "cache pool" in make(Shape(pool_blocks=12)).check(60, 60)


def test_eviction_under_pool_pressure_keeps_the_recently_used_prefixes():
    shape = Shape(max_batch=1, pool_blocks=16)
    prompts = [[20 + i] * 33 for i in range(4)]  # each caches 4 blocks
    served = serve(shape, [[Request(p, 4, RowSpec(seed=1))] for p in prompts])
    pool = served[0].tables.pool
    # the fourth prompt's blocks evicted the least recently used: the first prompt's tail two, its head still cached
    cached = [len(pool.lookup(chain_keys(p, shape.block, 4))) for p in prompts]
    assert cached == [2, 4, 4, 4] and pool.cached == 14 and pool.used == 0
    last, first = Request(prompts[-1], 4, RowSpec(seed=2)), Request(prompts[0], 4, RowSpec(seed=3))
    serve(shape, [[last], [first]], served)
    # the oldest prefix lost blocks to the newer ones (its tail first: what is left of it is still a prefix)
    assert last.cached_tokens == 32 and first.cached_tokens < 32


def test_without_the_prefix_cache_nothing_is_looked_up_or_cached():
    a, b = Request(SYSTEM + [1], 4, RowSpec(seed=1)), Request(SYSTEM + [2], 4, RowSpec(seed=2))
    scheduler, _ = serve(Shape(prefix_cache=False), [[a], [b]])
    assert b.cached_tokens == 0 and scheduler.tables.pool.cached == 0 and scheduler.tables.queries == 0


def test_each_request_counts_the_cycles_it_ran_through_preemption_and_shape_changes():
    """Eight requests that preempt one another (resumed by recompute), segments cycling through chain k=3, plain and
    chain k=1: each request's speculation is what the fake device's cycles did for it (its ledger, whichever rows ran
    them), and accounts for its tokens: the first, then per cycle its accepted drafts and one more (the last cycle
    may have accepted past the budget)."""
    shape = Shape(pool_blocks=24)
    requests = [Request([10 + i] * (20 + 5 * i), 40 + 5 * (i % 3), RowSpec(seed=i)) for i in range(8)]
    scheduler, executor = make(shape), PoolExecutor(shape)
    scheduler.policy = Scripted([DraftShape(3), DraftShape(0), DraftShape(1)])
    serve(shape, [requests], (scheduler, executor))
    assert scheduler.preemptions > 0
    names = {"k=3": "chain k=3", "k=0": "plain", "k=1": "chain k=1"}
    for r in requests:
        ledger, spec = executor.ledger.get(r.spec.seed, {}), r.speculation  # none: its first token ended it
        assert dict(spec.shapes) == {names[label]: counts[0] for label, counts in ledger.items()}, r.spec.seed
        assert list(spec.accepted) == [sum(c[1 + j] for c in ledger.values()) for j in range(3)]
        assert spec.steps == sum(c[0] for label, c in ledger.items() if label != "k=0")
        assert spec.drafted == sum(c[0] * int(label[2:]) for label, c in ledger.items())
        cycles = sum(c[0] for c in ledger.values())
        assert 0 <= 1 + cycles + sum(spec.accepted) - len(r.tokens) <= 3, (r.spec.seed, spec)
    assert {name for r in requests for name, _ in r.speculation.shapes} == set(names.values())
