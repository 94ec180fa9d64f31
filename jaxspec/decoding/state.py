"""The loop's static configuration and its state: `LoopConfig`, and `LoopState` with its one constructor, its row
windows and its row writes.

`LoopState` declares its own layout: each field says which axis holds the rows and which the positions (`_axes`),
and everything that cuts the state into rows or positions (`window`, `put`) reads those declarations. The state is
built in one place (`LoopState.empty`), then filled by prompts (`with_prompts`, for `generate`) or by one admitted
request at a time (`admit`, for the serving engine).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec

from jaxspec.decoding.draft_shape import DraftShape
from jaxspec.decoding.sampling import RowSampling, Sampling
from jaxspec.decoding.sampling_params import MAX_STOP_IDS, MAX_TOP_LOGPROBS, RowSpec
from jaxspec.models.cache import Paged
from sharding.multihost import put_global


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """Static settings of one compiled loop (each distinct value compiles its own program)."""

    draft: DraftShape  # what a cycle drafts and verifies (DraftShape(0): plain decoding)
    sampling: Sampling | None  # None: per-row settings from LoopState.settings (the serving engine)
    stop_ids: tuple[int, ...]
    prompt_bucket: int  # padded prompt length (a multiple of prefill_chunk)
    prefill_chunk: int
    # Write each scored position's raw logprobs into LoopState.logprobs for the rows that ask (settings.logprobs_B):
    # needs per-row sampling (the static-greedy program's head is an argmax, with no logits to score).
    logprobs: bool = False
    # Plain cycles (num_steps 0) on a state with a lazy drafter (`LoopState.empty(lazy_drafter=True)`): each keeps the
    # captured target states of its token (LoopState.aux_BSI), so the next drafting program catches the drafter up
    # over them (adaptive serving switches shapes between segments).
    track_drafter: bool = False
    # Static sampling that is coupled (decoding/coupling.py) rather than rejection sampling: the state's keys are then
    # one per row (`LoopState.with_row_seeds`). Per-row states take it from each row's settings (coupled_B).
    coupled: bool = False

    def __post_init__(self):
        if not isinstance(self.draft, DraftShape):
            raise ValueError(f"LoopConfig.draft: expected a DraftShape, got {self.draft!r}")
        if self.coupled and self.sampling is None:
            raise ValueError("LoopConfig.coupled: per-row states take it from each row's settings, got sampling None")
        if self.logprobs and self.sampling is not None:
            raise ValueError("LoopConfig.logprobs: needs per-row sampling (sampling None), got static sampling")

    @property
    def num_steps(self) -> int:
        """J: drafter steps per cycle (a chain's draft tokens; a tree's depth)."""
        return self.draft.num_steps

    @property
    def topk(self) -> int:
        return self.draft.topk

    @property
    def tree(self) -> bool:
        return self.draft.tree

    @property
    def num_draft_tokens(self) -> int:
        """Tokens one verify step takes (the root included)."""
        return self.draft.verify_tokens


# What plain cycles on a state with a lazy drafter neither read nor write: the drafter's current draft, the position
# it has reached and the target states of unfed prompts' last positions (a chain program's catch-up reads them and
# brings the drafter up to date).
DRAFTER_ONLY = ("draft_B", "draft_q_BV", "hidden_BD", "drafted_B", "prompt_aux_BI")


def _axes(row: int | None, position: int | None = None) -> dict[str, Any]:
    """A LoopState field's layout: its row (batch) axis and its position axis (None: it has none)."""
    return {"metadata": {"row_axis": row, "position_axis": position}}


@struct.dataclass
class LoopState:
    """Everything the loop carries between cycles (a pytree; B = padded batch, S = token buffer length)."""

    tokens_BS: jax.Array = struct.field(**_axes(0, 1))  # int32 prompt + generated; the pending token at length_B
    prompt_len_B: jax.Array = struct.field(**_axes(0))  # int32
    length_B: jax.Array = struct.field(**_axes(0))  # int32: positions the target has processed (and cached)
    end_B: jax.Array = struct.field(**_axes(0))  # int32: exclusive end of the generated tokens (length + 1 running)
    max_new_B: jax.Array = struct.field(**_axes(0))  # int32: generation budget per sequence
    done_B: jax.Array = struct.field(**_axes(0))  # bool: stopped, out of budget, a padding row or a free slot
    # The target's latent KV cache: dense [L, B, S, Y], or `Paged` (the serving pool, read and written in place)
    target_cache: Any = struct.field(**_axes(1, 2))
    # The drafter's cache (arrays [B, S, ...], or `Paged`: the serving pool), or None when J = 0
    draft_cache: Any = struct.field(**_axes(0, 1))
    draft_B: jax.Array = struct.field(**_axes(0))  # int32 (target ids): the next cycle's first draft token (chains)
    # Chains: float32 [B, V], the draft distribution of draft_B over the target vocabulary ([B, 1] when unused).
    # Trees: float32 [B, U], the drafter's logits at the next root (its children are that cycle's first expansion).
    draft_q_BV: jax.Array = struct.field(**_axes(0))
    hidden_BD: jax.Array = struct.field(**_axes(0))  # drafter h2 at the last processed position
    key: jax.Array = struct.field(**_axes(0))  # one key (static sampling) or one per row [B] (per-row sampling)
    cycles: jax.Array = struct.field(**_axes(None))  # int32 scalar
    # The counters are sized by the deepest draft the state was built for; a shallower program counts its positions.
    reached_J: jax.Array = struct.field(**_axes(None))  # int32 [J]: how often draft position j+1 was verified
    accepted_J: jax.Array = struct.field(**_axes(None))  # int32 [J]: how often it was accepted
    accept_hist_T: jax.Array = struct.field(**_axes(None))  # int32 [J+1]: cycles that accepted exactly t drafts
    # The same per row, since the row's admission (the serving executor reads them back with each row's tokens, so a
    # request's response can say what speculation did for it): the cycles the row took part in, and per draft
    # position how often it accepted that position's draft (a chain's or a tree path's; a cycle that accepted t
    # drafts counts positions 1..t).
    row_cycles_B: jax.Array = struct.field(**_axes(0))  # int32 [B]
    row_accepted_BJ: jax.Array = struct.field(**_axes(0))  # int32 [B, J]
    # Per-row states (LoopConfig.sampling None: the serving engine): each row's request settings (a `RowSpec` per
    # row); `key` is then one key per row (from the spec's seed), so a row's random draws depend only on its own seed
    # and history.
    settings: RowSettings | None = struct.field(default=None, **_axes(0))
    # Per-row states: rows whose first token is given (at prompt_len_B in tokens_BS: a preempted request resumed by
    # recomputing its tokens but the last) instead of drawn by the prefill (bool).
    first_given_B: jax.Array | None = struct.field(default=None, **_axes(0))
    # Logprobs (a state built with `logprobs`): at each position p the target's raw scores of token p + 1 (so token
    # i's are at i - 1; programs with LoopConfig.logprobs write them for the rows whose settings ask).
    logprobs: Logprobs | None = struct.field(default=None, **_axes(0, 1))
    # Lazy drafter (a state built with `lazy_drafter`, for plain and drafting programs on one state): the captured
    # target states at each position [B, S, X*D] that plain cycles keep, and how far the drafter has run (int32 [B]: its
    # cache, draft_B, draft_q_BV and hidden_BD are current when drafted_B == length_B; a drafting program first catches
    # up). A row not fed the drafter at prefill (`SpecLoop.prefill_slot`'s `feed` False) leaves it at its last prompt
    # position, whose captured target states [B, X*D] the prefill keeps in prompt_aux_BI: the first drafting program
    # drafts its first draft there, as the prefill would have (the drafter costs an unfed prompt nothing until then).
    aux_BSI: jax.Array | None = struct.field(default=None, **_axes(0, 1))
    drafted_B: jax.Array | None = struct.field(default=None, **_axes(0))
    prompt_aux_BI: jax.Array | None = struct.field(default=None, **_axes(0))

    # ------------------------------------------------------------------ the one constructor
    @classmethod
    def empty(
        cls,
        target,
        drafter,
        draft: DraftShape,
        batch: int,
        context: int,
        *,
        per_row: bool = False,
        greedy: bool = False,
        seed: int = 0,
        logprobs: bool = False,
        lazy_drafter: bool = False,
        caches: bool = True,
    ) -> LoopState:
        """A state of `batch` rows and `context` positions with every row done (free), replicated on the target's
        mesh. `per_row`: per-row sampling (greedy), stop ids (none) and keys (split from seed `seed`, until a
        request is admitted there); else one key from `seed`. `greedy`: every program run on this state is greedy,
        so a chain keeps no draft distribution. `logprobs` (per-row only): the logprob buffers (`Logprobs`, 164
        bytes per position and row). The drafter's cache exists when the draft uses the drafter; `lazy_drafter`:
        the fields that let plain cycles and unfed prompts leave the drafter behind (aux_BSI, drafted_B,
        prompt_aux_BI). Without `caches` neither cache is made (None): the serving executor keeps them in its pool
        of blocks."""
        use_drafter = drafter is not None and not draft.plain
        D = drafter.config.hidden_size if use_drafter else 1
        V = 1
        if use_drafter and draft.tree:  # the next root's draft logits
            V = drafter.config.draft_vocab_size
        elif use_drafter and not greedy:  # a sampled chain's draft distribution over the target vocabulary
            V = target.vocab_size
        hidden_dtype = drafter.dtype if use_drafter else jnp.float32
        J = draft.num_steps
        if logprobs and not per_row:
            raise ValueError("LoopState.empty: logprobs needs per_row (rows ask for them one by one)")
        rows = cls._rows(target.mesh, batch, context, D, V, J, hidden_dtype, per_row, seed, logprobs)
        draft_cache = drafter.init_cache(batch, context) if use_drafter and caches else None
        target_cache = target.init_cache(batch, context) if caches else None
        lazy = {}
        if lazy_drafter and use_drafter:
            width = len(drafter.capture_layers) * drafter.config.target_hidden_size

            def make():
                aux = jnp.zeros((batch, context, width), target.dtype)
                last = jnp.zeros((batch, width), target.dtype)
                return dict(aux_BSI=aux, drafted_B=jnp.zeros((batch,), jnp.int32), prompt_aux_BI=last)

            # made by a program (not device_put), so a mesh spanning processes gets its shards on every process
            lazy = jax.jit(make, out_shardings=NamedSharding(target.mesh, PartitionSpec()))()
        return cls(target_cache=target_cache, draft_cache=draft_cache, **rows, **lazy)

    @staticmethod
    def _rows(mesh, B: int, S: int, D: int, V: int, J: int, hidden_dtype, per_row: bool, seed: int, lp: bool) -> dict:
        """Every field but the caches, made on the devices in one program (replicated: the loop's bookkeeping runs
        replicated, and a program that makes its own arrays places them on every process's devices alike)."""

        def make(seed):
            z = lambda dtype=jnp.int32: jnp.zeros((B,), dtype)
            key = jax.random.key(seed)
            fields = dict(
                tokens_BS=jnp.zeros((B, S), jnp.int32),
                prompt_len_B=z() + 1,
                length_B=z(),
                end_B=z() + 1,
                max_new_B=z() + 1,
                done_B=jnp.ones((B,), bool),
                draft_B=z(),
                draft_q_BV=jnp.zeros((B, V), jnp.float32),
                hidden_BD=jnp.zeros((B, D), hidden_dtype),
                key=jax.random.split(key, B) if per_row else key,
                cycles=jnp.zeros((), jnp.int32),
                reached_J=jnp.zeros((J,), jnp.int32),
                accepted_J=jnp.zeros((J,), jnp.int32),
                accept_hist_T=jnp.zeros((J + 1,), jnp.int32),
                row_cycles_B=z(),
                row_accepted_BJ=jnp.zeros((B, J), jnp.int32),
            )
            if per_row:
                fields["settings"] = RowSettings.empty(B)
                fields["first_given_B"] = jnp.zeros((B,), bool)
            if lp:
                N = MAX_TOP_LOGPROBS
                fields["logprobs"] = Logprobs(
                    jnp.zeros((B, S), jnp.float32), jnp.zeros((B, S, N), jnp.int32), jnp.zeros((B, S, N), jnp.float32)
                )
            return fields

        replicated = NamedSharding(mesh, PartitionSpec())
        return jax.jit(make, out_shardings=replicated)(put_global(np.uint32(seed), replicated))

    def with_prompts(self, prompts: list[list[int]], max_new_tokens: int) -> LoopState:
        """Rows 0..len(prompts)-1 hold `prompts` (padded into the token buffer) with a budget of `max_new_tokens`;
        the other rows stay done (padding). For `generate`: the prefill then runs every row at once."""
        B, S = self.tokens_BS.shape
        tokens = np.zeros((B, S), np.int32)
        prompt_len = np.ones((B,), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
            prompt_len[i] = len(p)
        rep = self.tokens_BS.sharding
        host = (tokens, prompt_len, np.int32(max_new_tokens), np.int32(len(prompts)))
        return _fill(self, *put_global(host, rep))

    def with_row_seeds(self, seeds: list[int]) -> LoopState:
        """One key per row, row b's `jax.random.key(seeds[b])`, for static settings that sample coupled
        (`LoopConfig.coupled`): the rows' draws are then folded from their own keys and positions, as a per-row
        state's are, and carried unchanged."""
        host = put_global(np.asarray(seeds, np.uint32), self.tokens_BS.sharding.update(spec=PartitionSpec()))
        return self.replace(key=_row_keys(host))

    # ------------------------------------------------------------------ rows (traceable)
    def admit(self, row, init: RowInit) -> LoopState:
        """Write one admitted request into row `row`: prompt, budget, settings, key (from its seed), its counters at
        zero. The row stays done (cycles skip it) until its last prefill chunk; its length is the prompt length, so
        the positions that riding-along cycles overwrite lie past the prompt (and are rewritten before they are
        read)."""
        set_ = lambda x, v: x.at[row].set(v)
        return self.replace(
            tokens_BS=set_(self.tokens_BS, init.tokens_S),
            prompt_len_B=set_(self.prompt_len_B, init.prompt_len),
            length_B=set_(self.length_B, init.prompt_len),
            end_B=set_(self.end_B, init.prompt_len + 1),
            max_new_B=set_(self.max_new_B, init.max_new),
            done_B=set_(self.done_B, True),
            key=set_(self.key, jax.random.key(init.seed)),
            settings=jax.tree.map(set_, self.settings, init.settings),
            first_given_B=set_(self.first_given_B, init.first >= 0),
            row_cycles_B=set_(self.row_cycles_B, 0),
            row_accepted_BJ=set_(self.row_accepted_BJ, 0),
        )

    def set_aside(self, *names: str) -> tuple[LoopState, dict[str, Any]]:
        """This state with the fields `names` None, and their values (`replace(**aside)` puts them back): a program
        that neither reads nor writes a large field (the lazy drafter's `aux_BSI` for prefill chunks; `DRAFTER_ONLY`
        and `aux_BSI` for plain cycles, which write `aux_BSI` in place) keeps it out of its windows and puts."""
        return self.replace(**dict.fromkeys(names)), {name: getattr(self, name) for name in names}

    def greedy_q_repaired(self) -> LoopState:
        """Each greedy row's draft distribution as the per-row program would have left it (a point mass on its draft
        token; the static-greedy program keeps a placeholder there): before a per-row chain segment that follows
        greedy ones (traceable; a per-row state)."""
        q_BV = self.draft_q_BV
        point_BV = jax.nn.one_hot(self.draft_B, q_BV.shape[1], dtype=q_BV.dtype)
        greedy_B = self.settings.sampling.temperature_B == 0
        return self.replace(draft_q_BV=jnp.where(greedy_B[:, None], point_BV, q_BV))

    def free(self, row) -> LoopState:
        """Row `row` is done (its request left): cycles skip it."""
        return self.replace(done_B=self.done_B.at[row].set(True))

    def window(self, rows: int, positions: int | None = None, start=0) -> LoopState:
        """The state of rows [start, start + rows) and positions [0, positions) (all, when None); the counters are
        kept. `rows` and `positions` are static, `start` may be traced. A paged cache keeps its whole pool: the
        window is of its tables."""
        paged = {name: c.window(rows, positions, start) for name, c in self._paged().items()}
        if paged:
            return self.replace(**dict.fromkeys(paged)).window(rows, positions, start).replace(**paged)

        def take(axes, x):
            row, position = axes
            if position is not None and positions is not None:
                x = jax.lax.slice_in_dim(x, 0, positions, axis=position)
            if row is None or x.ndim == 0:  # not per row (the counters; a static program's one key)
                return x
            return jax.lax.dynamic_slice_in_dim(x, start, rows, axis=row)

        return self._map(take)

    def put(self, part: LoopState, start=0) -> LoopState:
        """Write `part`, a `window` of this state (rows from `start`, positions from 0), back in; the counters are
        `part`'s. A paged cache's pool is `part`'s (written in place), its tables this state's."""
        paged = {}
        for name, cache in part._paged().items():
            mine = getattr(self, name)
            paged[name] = mine._replace(pool=cache.pool) if isinstance(mine, Paged) else cache
        if paged:
            none = dict.fromkeys(paged)
            return self.replace(**none).put(part.replace(**none), start).replace(**paged)

        def write(axes, x, y):
            row, _ = axes
            if row is None or x.ndim == 0:
                return y
            at = [0] * x.ndim
            at[row] = start
            # jax >= 0.11 refuses an update sharded otherwise than its operand, where 0.10 let it pass.
            return jax.lax.dynamic_update_slice(x, sharded_like(y, x), tuple(at))

        return self._map(write, part)

    def _paged(self) -> dict[str, Paged]:
        """The caches held as pools (`Paged`), by field name."""
        return {n: getattr(self, n) for n in ("target_cache", "draft_cache") if isinstance(getattr(self, n), Paged)}

    def _map(self, fn, *others: LoopState) -> LoopState:
        """`fn((row_axis, position_axis), leaf, *other_leaves)` over every field's leaves."""
        new = {}
        for f in dataclasses.fields(self):
            axes = (f.metadata["row_axis"], f.metadata["position_axis"])
            leaves = (getattr(self, f.name), *(getattr(o, f.name) for o in others))
            new[f.name] = jax.tree.map(lambda *xs, axes=axes: fn(axes, *xs), *leaves)
        return self.replace(**new)


def sharded_like(y: jax.Array, x: jax.Array) -> jax.Array:
    """`y` in `x`'s sharding, where `x` has one on a mesh and `y`'s differs (else `y` as it is)."""
    want = jax.typeof(x).sharding
    mesh = getattr(want, "mesh", None)
    if mesh is None or mesh.empty or jax.typeof(y).sharding == want:
        return y
    return jax.sharding.reshard(y, want)


@struct.dataclass
class Logprobs:
    """Scores per position p of the token at p + 1, from the target's raw logits (log-softmax, no warping, as
    vLLM's raw_logprobs): its logprob [B, S] and the top MAX_TOP_LOGPROBS ids and logprobs [B, S, N], best first."""

    token_BS: jax.Array  # float32
    top_ids_BSN: jax.Array  # int32
    top_BSN: jax.Array  # float32


@struct.dataclass
class RowSettings:
    """A `RowSpec` per row as arrays [B] (`LoopState.settings`), so rows with different settings share one program;
    one row of it (scalars) is what `LoopState.admit` writes. The spec's seed is not here: it becomes the row's key."""

    sampling: RowSampling  # float32 / int32 / float32
    stop_ids: Any  # int32 [B, MAX_STOP_IDS]: the row's own stop ids, -1 = none
    logprobs_B: Any  # bool: the row's tokens are scored (into a state built with `logprobs`)
    # The stop ids (the config's and the row's) are masked out of the target's distribution while a row has generated
    # fewer than min_new_B tokens (int32; min_tokens as vLLM applies it).
    min_new_B: Any
    ignore_eos_B: Any  # bool: the config's stop ids do not stop the row (its own still do; ignore_eos as vLLM)
    coupled_B: Any  # bool: the row samples coupled (decoding/coupling.py), not by rejection sampling

    @classmethod
    def empty(cls, B: int) -> RowSettings:
        """Settings of B free rows (greedy, no stop ids), as device arrays (traceable)."""
        zeros = lambda dtype: jnp.zeros((B,), dtype)
        sampling = RowSampling(zeros(jnp.float32), zeros(jnp.int32), zeros(jnp.float32) + 1)
        stop_ids = jnp.full((B, MAX_STOP_IDS), -1, jnp.int32)
        return cls(sampling, stop_ids, zeros(bool), zeros(jnp.int32), zeros(bool), zeros(bool))

    @classmethod
    def of(cls, spec: RowSpec) -> RowSettings:
        """One row's settings (host scalars): what `LoopState.admit` writes."""
        s = spec.sampling
        stop = np.full((MAX_STOP_IDS,), -1, np.int32)
        stop[: len(spec.stop_ids)] = spec.stop_ids
        sampling = RowSampling(np.float32(s.temperature), np.int32(s.top_k), np.float32(s.top_p))
        flags = np.bool_(spec.logprobs), np.int32(spec.min_new), np.bool_(spec.ignore_eos)
        return cls(sampling, stop, *flags, np.bool_(spec.coupled))


@struct.dataclass
class RowInit:
    """One admitted request as the row values `LoopState.admit` writes (host arrays; a pytree)."""

    tokens_S: Any  # int32 [S]: the prompt, zero-padded to the state's positions
    prompt_len: Any  # int32
    max_new: Any  # int32
    seed: Any  # uint32: the row's key is jax.random.key(seed)
    settings: RowSettings  # the rest of its RowSpec
    first: Any = -1  # int32: the row's first token, given (a resumed request's last token); -1: the prefill draws it

    @classmethod
    def of(cls, prompt, max_new: int, spec: RowSpec, context: int, first: int | None = None) -> RowInit:
        """A request's row for a state of `context` positions (validated by the caller: it fits; its spec has a
        seed); `first`: its first token, given rather than drawn."""
        if spec.seed is None:
            raise ValueError("RowInit.of: spec.seed: expected a seed (the scheduler draws one), got None")
        tokens = np.zeros((context,), np.int32)
        tokens[: len(prompt)] = prompt
        if first is not None:
            tokens[len(prompt)] = first
        given = np.int32(-1 if first is None else first)
        row = np.int32(len(prompt)), np.int32(max_new), np.uint32(spec.seed)
        return cls(tokens, *row, RowSettings.of(spec), given)


@jax.jit
def _row_keys(seeds_B: jax.Array) -> jax.Array:
    return jax.vmap(jax.random.key)(seeds_B)


@jax.jit
def _fill(state: LoopState, tokens_BS, prompt_len_B, max_new, count) -> LoopState:
    """`with_prompts` on the devices (the host arrays placed like the state's fields)."""
    pad_B = jnp.arange(state.done_B.shape[0]) >= count
    return state.replace(
        tokens_BS=tokens_BS,
        prompt_len_B=prompt_len_B,
        length_B=prompt_len_B,
        end_B=prompt_len_B + 1,
        max_new_B=jnp.full_like(state.max_new_B, max_new),
        done_B=pad_B,
    )
