"""The cache pool's bookkeeping, in plain Python (no jax; an import contract says so): fixed-size blocks of cache
positions with reference counts, and the prefix index over full blocks.

The executor holds the pool's arrays (block 0 is the null block: every table entry a row does not own points there,
so what a row writes past its blocks lands there and is never read); the scheduler hands out blocks 1..num_blocks
through a `BlockPool` and puts each row's block table into the plan.

Prefix caching (vLLM's automatic prefix caching, with EAGLE's shift): a full block of a prompt is keyed by a hash
chain, its parent block's key, its tokens and the token AFTER it. The target's cache entry at position p depends on
tokens 0..p, but the drafter's depends on token p + 1 too (it pairs the target state of p with the next token), so a
block's drafter entries are reusable only when the next token matches as well (sglang-jax keys EAGLE on bigrams for
the same reason). A request's `cache_salt` starts its chain (vLLM's semantics): rows with different salts never share
a block, so a prefix hit (`cached_tokens`, time to first token) tells a client nothing about other salts' prompts. A
block registered by a row the drafter was not fed (`PrefillChunk.drafter`: adaptive serving where speculation does
not pay) holds the target's entries only: a row that is fed the drafter does not reuse it, and
registering the same key with the drafter's entries replaces it. A block is registered once its prefill chunk is
planned and is never written again: every write of a row lies at or past its prompt's last position (prefill chunks
start past the reused prefix; a cycle writes from the row's length on; a tree's compaction moves entries past the
length only). Blocks no row references stay cached and are evicted least-recently-used when a row needs a block and
none is free.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence


def chain_keys(tokens: Sequence[int], block_size: int, count: int, salt: str | None = None) -> list[bytes]:
    """The keys of the first `count` full blocks of `tokens` (each needs the token after it: `tokens` has at least
    count * block_size + 1 of them). A `salt` (a request's cache_salt) starts the chain: keys of different salts
    never match, so their requests share no block (None: the unsalted chain)."""
    if len(tokens) < count * block_size + 1:
        raise ValueError(f"tokens: {count} blocks of {block_size} need {count * block_size + 1}, got {len(tokens)}")
    keys, parent = [], b"" if salt is None else hashlib.blake2b(b"salt:" + salt.encode(), digest_size=16).digest()
    for k in range(count):
        block = tokens[k * block_size : (k + 1) * block_size + 1]  # the block and the token after it
        parent = hashlib.blake2b(parent + b"".join(t.to_bytes(4, "little") for t in block), digest_size=16).digest()
        keys.append(parent)
    return keys


class BlockPool:
    """Blocks 1..num_blocks of `block_size` positions: free, held by rows (reference counted), or cached (registered
    under a key; an unreferenced cached block waits in LRU order until it is taken again or evicted)."""

    def __init__(self, num_blocks: int, block_size: int):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"BlockPool.{name}: expected an integer >= 1, got {value!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: list[int] = list(range(num_blocks, 0, -1))  # popped from the end: lowest first
        self._refs: dict[int, int] = {}  # held blocks -> how many rows hold them
        self._index: dict[bytes, int] = {}  # key -> cached block
        self._key_of: dict[int, bytes] = {}  # cached block -> its key
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # unreferenced cached, oldest first
        self._target_only: set[int] = set()  # cached blocks without the drafter's entries

    @property
    def available(self) -> int:
        """Blocks a row can take now: the free ones and the unreferenced cached ones (evicted when taken)."""
        return len(self._free) + len(self._lru)

    @property
    def used(self) -> int:
        """Blocks some row holds."""
        return len(self._refs)

    @property
    def cached(self) -> int:
        """Blocks registered in the prefix index (held or not)."""
        return len(self._index)

    def lookup(self, keys: Sequence[bytes], drafter: bool = False) -> list[int]:
        """The cached blocks of the longest prefix of `keys` (no reference taken); with `drafter`, of blocks that
        hold the drafter's entries too."""
        blocks = []
        for key in keys:
            block = self._index.get(key)
            if block is None or (drafter and block in self._target_only):
                break
            blocks.append(block)
        return blocks

    def take(self, cached: Sequence[int], fresh: int) -> list[int] | None:
        """All or nothing: reference the `cached` blocks (a `lookup`'s) and allocate `fresh` more (free ones first,
        then evicting the least recently used cached ones); returns the blocks in that order, or None when the pool
        cannot give them all (nothing taken)."""
        idle = sum(b in self._lru for b in cached)
        if fresh > self.available - idle:
            return None
        for block in cached:
            self._lru.pop(block, None)
            self._refs[block] = self._refs.get(block, 0) + 1
        return [*cached, *(self._allocate() for _ in range(fresh))]

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block, last first (so a chain's tail is evicted before its head)."""
        for block in reversed(blocks):
            refs = self._refs.get(block, 0)
            if refs < 1:
                raise ValueError(f"BlockPool.release: block {block} is not held")
            if refs > 1:
                self._refs[block] = refs - 1
                continue
            del self._refs[block]
            if block in self._key_of:
                self._lru[block] = None
            else:
                self._free.append(block)

    def register(self, block: int, key: bytes, drafter: bool = True) -> None:
        """`block` (held) holds the full block keyed `key` from now on (the target's entries, and with `drafter` the
        drafter's); a key already cached keeps its block, unless that one lacks the drafter's entries and this one
        has them."""
        if block not in self._refs:
            raise ValueError(f"BlockPool.register: block {block} is not held")
        cached = self._index.get(key)
        if block in self._key_of or (cached is not None and not (drafter and cached in self._target_only)):
            return
        if cached is not None:
            self._forget(cached)
        self._index[key], self._key_of[block] = block, key
        if not drafter:
            self._target_only.add(block)

    def _forget(self, block: int) -> None:
        """`block` is no longer cached: free when no row holds it."""
        del self._index[self._key_of.pop(block)]
        self._target_only.discard(block)
        if block in self._lru:  # no row holds it
            del self._lru[block]
            self._free.append(block)

    def clear(self) -> None:
        """Forget every cached block (the pool's arrays were reset); held blocks stay held."""
        for block in self._lru:
            self._free.append(block)
        self._lru.clear()
        self._index.clear()
        self._key_of.clear()
        self._target_only.clear()

    def _allocate(self) -> int:
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._lru.popitem(last=False)
            del self._index[self._key_of.pop(block)]
            self._target_only.discard(block)
        self._refs[block] = 1
        return block


class BlockTables:
    """Each row's blocks over one `BlockPool`: what a row takes at admission (its cached prefix, then fresh blocks),
    grows by while it generates, registers as its prompt's blocks fill, and gives back when it leaves. `changes()`
    hands out the rows whose table changed since the last call (what the next plan carries). With `caching` off, no
    block is looked up or registered."""

    def __init__(self, pool: BlockPool, *, prefill_chunk: int, caching: bool = True):
        if prefill_chunk % pool.block_size:
            raise ValueError(f"block_size: {pool.block_size} must divide the prefill chunk ({prefill_chunk})")
        self.pool, self.prefill_chunk, self.caching = pool, prefill_chunk, caching
        self.blocks: dict[int, list[int]] = {}  # row -> its blocks, position order
        self._keys: dict[int, list[bytes]] = {}  # row -> keys of its prompt's full blocks (next token in the prompt)
        self._registered: dict[int, int] = {}  # row -> its blocks registered (or reused) so far
        self._drafter: dict[int, bool] = {}  # row -> its prefill writes the drafter's entries
        self._changed: dict[int, None] = {}
        self.queries = self.hits = 0  # prompt tokens looked up, and found cached

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.pool.block_size)

    def admit(
        self,
        row: int,
        prompt: Sequence[int],
        need: int,
        lookup: bool = True,
        drafter: bool = True,
        salt: str | None = None,
    ) -> int | None:
        """Give `row` blocks for `need` positions, its longest cached prefix first (with `lookup`; with `drafter`,
        the row's prefill writes the drafter's entries, and it reuses only blocks that hold them; `salt`: only
        blocks of rows with the same salt); returns how many prompt positions it reuses (a multiple of the prefill
        chunk, at most len(prompt) - 1: the last prompt position is always prefilled, for the first token), or None
        when the pool cannot hold it yet."""
        bs = self.pool.block_size
        keys = chain_keys(prompt, bs, (len(prompt) - 1) // bs, salt) if self.caching else []
        hit = self.pool.lookup(keys, drafter) if lookup else []
        per_chunk = self.prefill_chunk // bs
        hit = hit[: len(hit) // per_chunk * per_chunk]  # prefill restarts on a chunk edge, as the cold run chunks
        blocks = self.pool.take(hit, max(self.blocks_for(need) - len(hit), 0))
        if blocks is None:
            return None
        self.blocks[row], self._keys[row], self._registered[row] = blocks, keys, len(hit)
        self._drafter[row] = drafter
        self._changed[row] = None
        if lookup and self.caching:
            self.queries += len(prompt)
            self.hits += len(hit) * bs
        return len(hit) * bs

    def grow(self, row: int, need: int) -> bool:
        """Give `row` blocks for `need` positions; False (nothing taken) when the pool cannot."""
        more = self.blocks_for(need) - len(self.blocks[row])
        if more <= 0:
            return True
        fresh = self.pool.take((), more)
        if fresh is None:
            return False
        self.blocks[row].extend(fresh)
        self._changed[row] = None
        return True

    def prefilled(self, row: int, end: int) -> None:
        """Positions [0, end) of `row`'s prompt are planned into the cache: register its full blocks there."""
        keys, done = self._keys[row], self._registered[row]
        full = min(end // self.pool.block_size, len(keys))
        for k in range(done, full):
            self.pool.register(self.blocks[row][k], keys[k], self._drafter[row])
        self._registered[row] = max(done, full)

    def release(self, row: int) -> None:
        """`row` left: its blocks go back to the pool (cached ones stay cached) and its table empties."""
        self.pool.release(self.blocks.pop(row))
        del self._keys[row], self._registered[row], self._drafter[row]
        self._changed[row] = None

    def changes(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """(row, blocks) for each row whose table changed since the last call (no blocks: the row left)."""
        changed, self._changed = self._changed, {}
        return tuple((row, tuple(self.blocks.get(row, ()))) for row in sorted(changed))
