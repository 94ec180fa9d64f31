"""The draft-verify loop as one compiled program: prefill, then a `lax.while_loop` over cycles.

Per cycle, with a static draft depth J (= k, `num_steps`):
1. draft: the first draft token comes from the previous draft-extend; J-1 more drafter steps propose the rest;
2. verify: the target scores [pending, d_1..d_J] at positions n..n+J in one forward (writing their latent KV);
3. accept: greedy prefix match, or lossless speculative sampling; the target's token after the accepted prefix is
   the new pending token (the "bonus");
4. commit: each sequence advances by accepted+1 (cache entries past the new length are dead and get overwritten);
5. draft-extend: the drafter runs over the accepted tokens with their captured target states (fixing its own KV
   cache) and proposes the next cycle's first draft token;
6. per-position reached/accepted counters, stop on stop ids / max tokens.
J = 0 is plain autoregressive decoding through the same machinery (no drafter calls), so baselines compare like for
like. With `topk` > 1 a cycle drafts a tree instead of a chain (`_tree_cycle`, building blocks in tree.py): J drafter
steps over the top-`topk` frontier, the `num_draft_tokens` best nodes verified in one target forward under the tree's
ancestor mask, the longest accepted root-to-leaf path committed (its cache entries compacted to consecutive slots).
Batches are ragged: every sequence has its own length and position; padding rows are born done.

Token bookkeeping: `tokens_BS[b, :length_B[b]]` are processed by the target (its cache holds those positions) and
`tokens_BS[b, length_B[b]]` is the pending token, already emitted but not yet fed back. Generated tokens are
`tokens_BS[b, prompt_len_B[b]:end_B[b]]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxspec.decoding import coupling as coupled
from jaxspec.decoding import tree
from jaxspec.decoding.acceptance import greedy_accept_ids, speculative_accept
from jaxspec.decoding.coupling import Coupling
from jaxspec.decoding.sampling import RowSampling, Sampling, sample, sample_rows, warp, warp_rows
from jaxspec.decoding.sampling_params import MAX_TOP_LOGPROBS
from jaxspec.decoding.state import Logprobs, LoopConfig, LoopState, sharded_like
from jaxspec.models.eagle3 import concat_captured
from jaxspec.runtime import Drafter, Target


class SpecLoop:
    """Compiled prefill and cycle loop for one (target, drafter) pair; counts its traces (= compiles).

    The loop composes the phase functions below (`target_forward`, `draft_step`, `draft_extend`, `accept_commit`,
    `count_acceptance`); `jaxspec.profiling.timing` times the same functions one by one."""

    def __init__(self, target: Target, drafter: Drafter | None = None):
        self.target, self.drafter = target, drafter
        self.traces = 0
        self.prefill = jax.jit(self._prefill_impl, static_argnums=0, donate_argnums=3)
        self.run = jax.jit(self._run_impl, static_argnums=0, donate_argnums=3)
        self.prefill_slot = jax.jit(self._prefill_slot_impl, static_argnums=0, donate_argnums=3)

    def _uses_drafter(self, cfg: LoopConfig) -> bool:
        return self.drafter is not None and (cfg.num_steps > 0 or cfg.track_drafter)

    def _target_step(self, tparams, tokens_BT, pos_BT, cache, cfg: LoopConfig):
        """Target forward; returns (ids [B,T] if greedy else logits [B,T,V], cache, captured [X,B,T,D])."""
        capture = self.drafter.capture_layers if self._uses_drafter(cfg) else ()
        return target_forward(self.target, tparams, tokens_BT, pos_BT, cache, capture=capture, greedy=_greedy(cfg))

    # ------------------------------------------------------------------ prefill
    def _prefill_impl(self, cfg: LoopConfig, tparams, dparams, state: LoopState) -> LoopState:
        """Process every row's prompt in chunks (`LoopState.with_prompts`); emit each row's first token and the
        drafter's first draft. Padding rows (done) stay done."""
        self.traces += 1
        chunk = cfg.prefill_chunk

        def body(s, c):
            return as_carry(self._prefill_chunk(cfg, tparams, dparams, s, c * chunk), s), None

        state, _ = jax.lax.scan(body, state, jnp.arange(cfg.prompt_bucket // chunk, dtype=jnp.int32))
        return state.replace(done_B=state.done_B | self._ends_at_first(cfg, state))

    def _prefill_slot_impl(
        self, cfg: LoopConfig, tparams, dparams, state: LoopState, slot, start, feed=None
    ) -> LoopState:
        """One prefill chunk (positions start..start+chunk) of row `slot` of a per-row state (LoopConfig.sampling
        None), for the serving engine: every other row keeps its state. The row must be admitted (`LoopState.admit`)
        and done (so cycles skip it) while its chunks run in order; the chunk holding its last prompt position sets
        its first token and draft, and makes it active unless that token ends it. `feed` (a traced bool; None:
        True): the drafter runs over the chunk; else not at all, and the row's first draft waits for a drafting
        program (`_prompt_extend`)."""
        self.traces += 1
        row = self._prefill_chunk(cfg, tparams, dparams, state.window(1, start=slot), start, feed)
        last_chunk = row.prompt_len_B - 1 < start + cfg.prefill_chunk
        row = row.replace(done_B=jnp.where(last_chunk, self._ends_at_first(cfg, row), True))
        return state.put(row, start=slot)

    def _ends_at_first(self, cfg: LoopConfig, s: LoopState) -> jax.Array:
        """Rows [B] whose first generated token ends them (a stop id, or a budget of one token)."""
        first_B = jnp.take_along_axis(s.tokens_BS, s.prompt_len_B[:, None], axis=1)[:, 0]
        return _is_stop(first_B, cfg, s) | (s.max_new_B <= 1)

    def _prefill_chunk(self, cfg: LoopConfig, tparams, dparams, s: LoopState, start, feed=None) -> LoopState:
        """Prompt positions start..start+chunk of every row into the caches. A row whose last prompt position falls
        in this chunk gets its first generated token, its first draft (and q) and the drafter's hidden state."""
        tokens_BS, prompt_len_B, sampling = s.tokens_BS, s.prompt_len_B, _sampling(cfg, s)
        B, S = tokens_BS.shape
        chunk = cfg.prefill_chunk
        last_B = prompt_len_B - 1
        pos_BT = jnp.broadcast_to(start + jnp.arange(chunk, dtype=jnp.int32), (B, chunk))
        chunk_BT = jax.lax.dynamic_slice_in_dim(tokens_BS, start, chunk, axis=1)
        out, tcache, captured = self._target_step(tparams, chunk_BT, pos_BT, s.target_cache, cfg)
        # The first generated token comes from the last prompt position, if it falls in this chunk.
        key, (k1, k2) = _draws(s.key, 2, FIRST, prompt_len_B)
        if key.ndim:  # the first draft, keyed as a cycle or a catch-up ending at the prompt's end keys its draft
            _, (k2,) = _draws(key, 1, EXTEND, prompt_len_B)
        in_chunk_B = (last_B >= start) & (last_B < start + chunk)
        row_B = jnp.clip(last_B - start, 0, chunk - 1)
        out_B = jnp.take_along_axis(out, row_B.reshape((B, 1) + (1,) * (out.ndim - 2)), axis=1)[:, 0]
        masked_BV = mask_stops(cfg, s, out_B[:, None], jnp.zeros((B, 1), jnp.int32))[:, 0]
        first_B = _choose_target(k1, masked_BV, sampling, _coupling(cfg, s), prompt_len_B)
        if s.first_given_B is not None:  # a resumed row's first token is the one it had (at its prompt's end)
            given_B = jnp.take_along_axis(tokens_BS, prompt_len_B[:, None], axis=1)[:, 0]
            first_B = jnp.where(s.first_given_B, given_B, first_B)
        at_first_BS = in_chunk_B[:, None] & (jnp.arange(S) == prompt_len_B[:, None])
        s = s.replace(tokens_BS=jnp.where(at_first_BS, first_B[:, None], tokens_BS), target_cache=tcache, key=key)
        # Position p scores (and the drafter pairs the target state of p with) token p+1: the first token for the last.
        next_BT = jax.lax.dynamic_slice_in_dim(s.tokens_BS, start + 1, chunk, axis=1)
        s = write_logprobs(cfg, s, out, next_BT, jnp.full((B,), start), jnp.ones((B,), bool))
        if not self._uses_drafter(cfg):
            return s
        chunk = next_BT, concat_captured(captured), pos_BT, row_B
        if cfg.tree:  # the next root's logits: the first cycle expands its top-k
            extend = lambda *x: extend_logits(self.drafter, dparams, *x)
            dq_BV, h2_BD, dcache = _prompt_extend(extend, s.draft_cache, chunk, feed)
            d_B = s.draft_B
        else:
            c = _coupling(cfg, s)
            extend = lambda *x: draft_extend(self.drafter, dparams, *x, k2, sampling, c)
            d_B, dq_BV, h2_BD, dcache = _prompt_extend(extend, s.draft_cache, chunk, feed)
        fed_B = in_chunk_B if feed is None else in_chunk_B & feed
        if s.drafted_B is not None:  # the drafter has run over the prompt, or else waits at its last position
            unfed_B = in_chunk_B & ~fed_B
            last_aux_BI = replicate(_at_rows(chunk[1], row_B), self.target.mesh).astype(s.prompt_aux_BI.dtype)
            s = s.replace(
                drafted_B=jnp.where(in_chunk_B, jnp.where(fed_B, prompt_len_B, last_B), s.drafted_B),
                prompt_aux_BI=jnp.where(unfed_B[:, None], last_aux_BI, s.prompt_aux_BI),
            )
        return s.replace(
            draft_cache=dcache,
            draft_B=jnp.where(fed_B, d_B, s.draft_B),
            draft_q_BV=jnp.where(fed_B[:, None], dq_BV, s.draft_q_BV),
            hidden_BD=jnp.where(fed_B[:, None], h2_BD.astype(s.hidden_BD.dtype), s.hidden_BD),
        )

    # ------------------------------------------------------------------ the cycle loop
    def _run_impl(self, cfg: LoopConfig, tparams, dparams, state: LoopState, max_cycles):
        """Run cycles until every sequence is done or `max_cycles` more cycles ran (for streaming)."""
        self.traces += 1
        if cfg.num_steps and state.drafted_B is not None:
            state = self._catch_up(cfg, dparams, state)
        limit = state.cycles + max_cycles

        def cond(s: LoopState):
            return jnp.any(~s.done_B) & (s.cycles < limit)

        return jax.lax.while_loop(cond, lambda s: as_carry(self._cycle(cfg, tparams, dparams, s), s), state)

    def _catch_up(self, cfg: LoopConfig, dparams, s: LoopState) -> LoopState:
        """A lazy drafter behind its rows (plain cycles ran, or the row's prompt was not fed it): draft-extend over
        the positions [drafted_B, length_B) with the target states plain cycles kept (at an unfed prompt's last
        position, the ones its prefill kept), num_steps + 1 positions per step (the slots a cycle's own
        draft-extend writes), until every running row's draft, q and hidden state are current at its length (a
        tree's: its next root's logits, in draft_q_BV, and hidden state)."""
        W, sampling = cfg.num_steps + 1, _sampling(cfg, s)
        S = s.tokens_BS.shape[1]
        behind = lambda s: ~s.done_B & (s.drafted_B < s.length_B)

        def step(s: LoopState) -> LoopState:
            go_B = behind(s)
            start_B = jnp.where(go_B, s.drafted_B, s.length_B)  # other rows write only past their length (dead)
            pos_BT = start_B[:, None] + jnp.arange(W, dtype=jnp.int32)
            tokens_BT = jnp.take_along_axis(s.tokens_BS, jnp.minimum(pos_BT + 1, S - 1), axis=1)
            rows_B1 = jnp.arange(pos_BT.shape[0])[:, None]  # the first rows of `aux_BSI` (serving: the whole buffer)
            aux_BTI = s.aux_BSI[rows_B1, jnp.minimum(pos_BT, S - 1)]
            at_prompt_BT = pos_BT == s.prompt_len_B[:, None] - 1  # an unfed prompt's last position: its own states
            aux_BTI = jnp.where(at_prompt_BT[:, :, None], s.prompt_aux_BI[:, None].astype(aux_BTI.dtype), aux_BTI)
            last_B = jnp.clip(s.length_B - 1 - start_B, 0, W - 1)
            key, d_B = s.key, s.draft_B
            if cfg.tree:  # a tree drafts deterministically from the root's logits: no draw
                q_BV, h2_BD, dcache = extend_logits(
                    self.drafter, dparams, tokens_BT, aux_BTI, pos_BT, s.draft_cache, last_B
                )
            else:
                key, (extend_key,) = _draws(s.key, 1, EXTEND, s.length_B)
                d_B, q_BV, h2_BD, dcache = draft_extend(
                    self.drafter, dparams, tokens_BT, aux_BTI, pos_BT, s.draft_cache, last_B, extend_key, sampling,
                    _coupling(cfg, s),
                )  # fmt: skip
            done_B = go_B & (s.length_B - start_B <= W)  # caught up in this step
            return s.replace(
                draft_cache=dcache,
                draft_B=jnp.where(done_B, d_B, s.draft_B),
                draft_q_BV=jnp.where(done_B[:, None], q_BV, s.draft_q_BV),
                hidden_BD=jnp.where(done_B[:, None], h2_BD.astype(s.hidden_BD.dtype), s.hidden_BD),
                drafted_B=jnp.where(go_B, jnp.minimum(start_B + W, s.length_B), s.drafted_B),
                key=key,
            )

        return jax.lax.while_loop(lambda s: jnp.any(behind(s)), lambda s: as_carry(step(s), s), s)

    def _keep_aux(self, aux_BSI, captured, n_B):
        """A plain cycle's captured target states [X, B, 1, D] written at each row's position n_B of `aux_BSI` (its
        first B rows: the serving executor passes the whole buffer to a window of its first rows)."""
        aux_BI = replicate(concat_captured(captured), self.target.mesh)[:, 0].astype(aux_BSI.dtype)
        rows_B = jnp.arange(n_B.shape[0])
        return aux_BSI.at[rows_B, n_B].set(aux_BI, mode="drop")  # a scatter XLA runs in place (no copy per cycle)

    def _cycle(self, cfg: LoopConfig, tparams, dparams, s: LoopState) -> LoopState:
        if cfg.tree:
            return self._tree_cycle(cfg, tparams, dparams, s)
        J, sampling = cfg.num_steps, _sampling(cfg, s)
        n_B = s.length_B
        key, (draft_key, accept_key, extend_key) = _draws(s.key, 3, CYCLE, n_B)
        pending_B = jnp.take_along_axis(s.tokens_BS, n_B[:, None], axis=1)[:, 0]

        # 1. draft J tokens (the first came from the last draft-extend)
        draft_BJ, qs, dcache = self._draft_chain(dparams, s, draft_key, n_B, J, (sampling, _coupling(cfg, s)))

        # 2. verify [pending, d_1..d_J] at positions n..n+J
        verify_BT = jnp.concatenate([pending_B[:, None], draft_BJ], axis=1)
        pos_BT = n_B[:, None] + jnp.arange(J + 1, dtype=jnp.int32)
        out, tcache, captured = self._target_step(tparams, verify_BT, pos_BT, s.target_cache, cfg)

        # 3-4. accept and commit
        accepted_B, emitted_BT, active_B, committed = accept_commit(cfg, s, draft_BJ, qs, out, accept_key)

        # 5. draft-extend over [d_1..d_a, bonus] with the target states of positions n..n+a
        draft_B, q_BV, hidden_BD, lazy = s.draft_B, s.draft_q_BV, s.hidden_BD, {}
        if J == 0 and self._uses_drafter(cfg):  # a lazy drafter: keep the target states of position n
            lazy = dict(aux_BSI=self._keep_aux(s.aux_BSI, captured, n_B))
        elif J:
            aux_BTI = concat_captured(captured)
            if key.ndim:  # a row's next first draft is keyed as a prefill or a catch-up ending there keys it
                _, (extend_key,) = _draws(key, 1, EXTEND, committed.length_B)
            new_draft_B, new_q_BV, h2_BD, dcache = draft_extend(
                self.drafter, dparams, emitted_BT, aux_BTI, pos_BT, dcache, accepted_B, extend_key, sampling,
                _coupling(cfg, s),
            )  # fmt: skip
            draft_B = jnp.where(active_B, new_draft_B, s.draft_B)
            q_BV = jnp.where(active_B[:, None], new_q_BV, s.draft_q_BV)
            hidden_BD = jnp.where(active_B[:, None], h2_BD.astype(s.hidden_BD.dtype), s.hidden_BD)
            if s.drafted_B is not None:  # the drafter is current again
                lazy = dict(drafted_B=jnp.where(active_B, committed.length_B, s.drafted_B))

        # 6. statistics over the sequences that were active this cycle
        return committed.replace(
            target_cache=tcache,
            draft_cache=dcache,
            draft_B=draft_B,
            draft_q_BV=q_BV,
            hidden_BD=hidden_BD,
            key=key,
            **count_acceptance(J, s, accepted_B, active_B),
            **lazy,
        )

    def _draft_chain(self, dparams, s: LoopState, key, n_B, J: int, how):
        """Step 1 of a chain cycle: d_1 (the last draft-extend's) and J - 1 drafter steps, d_j at drafter position
        n + j - 1 (the target position of its predecessor), each from the previous step's h2. The steps are one
        `lax.scan`, not J - 1 copies: the program holds one drafter step and one sampler whatever J is (a copy per
        step made the per-row k = 4 program 1.8x the kernels, compile time and memory maps of the static-greedy one).
        Returns (drafts [B, J], their distributions (J of [B, V]: see `choose_draft`), the drafter cache). `how`:
        (sampling, coupling)."""
        B = s.tokens_BS.shape[0]
        sampling, c = how
        if J == 0:
            return jnp.zeros((B, 0), jnp.int32), [], s.draft_cache
        if J == 1:
            return s.draft_B[:, None], [s.draft_q_BV], s.draft_cache

        def step(carry, xs):
            token_B, hidden_BD, cache = carry
            j, k = xs
            token_B, q_BV, h2_BD, cache = draft_step(
                self.drafter, dparams, token_B, hidden_BD, (n_B + j - 1)[:, None], cache, k, sampling, c
            )
            return as_carry((token_B, h2_BD.astype(hidden_BD.dtype), cache), carry), (token_B, q_BV)

        steps = (jnp.arange(1, J, dtype=jnp.int32), _split(key, J - 1))
        (_, _, cache), (tokens_NB, q_NBV) = jax.lax.scan(step, (s.draft_B, s.hidden_BD, s.draft_cache), steps)
        draft_BJ = jnp.concatenate([s.draft_B[:, None], tokens_NB.T], axis=1)
        return draft_BJ, [s.draft_q_BV, *q_NBV], cache

    def _tree_cycle(self, cfg: LoopConfig, tparams, dparams, s: LoopState) -> LoopState:
        """A cycle with a draft tree (tree.py's module docstring): draft, verify under the tree mask, accept a path,
        compact it in the target cache, draft-extend over it."""
        J, sampling, mesh = cfg.num_steps, _sampling(cfg, s), self.target.mesh
        n_B = s.length_B
        key, (accept_key,) = _draws(s.key, 1, CYCLE, n_B)
        pending_B = jnp.take_along_axis(s.tokens_BS, n_B[:, None], axis=1)[:, 0]

        # 1. draft the tree (deterministic top-k expansion: acceptance needs nothing of the draft distribution)
        tilt = _tree_tilt(self.drafter, _coupling(cfg, s), sampling, n_B)
        draft = draft_tree(self.drafter, dparams, s.draft_q_BV, s.hidden_BD, n_B, s.draft_cache, J, cfg.topk, tilt)
        nodes = tree.finish(draft, pending_B, n_B, cfg.num_draft_tokens)

        # 2. verify every node in one forward under the tree's ancestor mask (node t at slot n + t)
        capture = self.drafter.capture_layers
        out, tcache, captured = target_forward(
            self.target,
            tparams,
            nodes.tokens_BT,
            nodes.positions_BT,
            s.target_cache,
            capture=capture,
            greedy=_greedy(cfg),
            tree_mask_BTS=nodes.mask_BTS,
        )

        # 3-4. accept the longest matching path (greedy), or walk the tree sampling from the target (lossless)
        if sampling.greedy:
            path, accepted_B, next_B = tree.greedy_accept_tree(nodes, out)
        else:
            generated_BT = (s.end_B - s.prompt_len_B)[:, None] + nodes.depth_BT
            logp_BTV = _warp(mask_stops(cfg, s, out, generated_BT), sampling)
            walk = lambda: tree.speculative_accept_tree(accept_key, nodes, jnp.exp(logp_BTV))
            path, accepted_B, next_B = _accept(_coupling(cfg, s), logp_BTV, n_B[:, None] + nodes.depth_BT, walk, nodes)
        path_BJ = jnp.take_along_axis(nodes.tokens_BT, path[:, 1:], axis=1)
        emitted_BT, active_B, committed = commit(cfg, s, path_BJ, accepted_B, next_B)
        path_out = jnp.take_along_axis(out, path[:, :, None], axis=1) if cfg.logprobs else out  # the path's logits
        committed = write_logprobs(cfg, committed, path_out, emitted_BT, n_B, active_B)
        tcache = self.target.compact_cache(tcache, n_B, path, jnp.where(active_B, accepted_B, 0))

        # 5. draft-extend over the path's tokens with its nodes' target states (positions n..n+J)
        path_XBTD = jnp.take_along_axis(replicate(captured, mesh), path[None, :, :, None], axis=2)
        pos_BT = n_B[:, None] + jnp.arange(J + 1, dtype=jnp.int32)
        root_BU, h2_BD, dcache = extend_logits(
            self.drafter, dparams, emitted_BT, concat_captured(path_XBTD), pos_BT, s.draft_cache, accepted_B
        )
        lazy = {}
        if s.drafted_B is not None:  # the drafter is current again
            lazy = dict(drafted_B=jnp.where(active_B, committed.length_B, s.drafted_B))
        return committed.replace(
            target_cache=tcache,
            draft_cache=dcache,
            draft_q_BV=jnp.where(active_B[:, None], root_BU, s.draft_q_BV),
            hidden_BD=jnp.where(active_B[:, None], h2_BD.astype(s.hidden_BD.dtype), s.hidden_BD),
            key=key,
            **count_acceptance(J, s, accepted_B, active_B),
            **lazy,
        )


# ---------------------------------------------------------------------- the phases of a cycle (traced)
def as_carry(new: LoopState, old: LoopState) -> LoopState:
    """`new` in `old`'s shardings, leaf by leaf. jax >= 0.11 requires a loop's carry to keep its shardings (0.10
    resharded silently where they differed): the drafter's steps return its cache split as `Drafter.cache_specs`
    says, which a caller's state may hold otherwise (the serving pool's window holds it unsplit). A no-op where
    they agree."""
    return jax.tree.map(sharded_like, new, old)


def replicate(x: jax.Array, mesh: Mesh) -> jax.Array:
    """`x` on every device of `mesh` (token choices and bookkeeping run replicated)."""
    return jax.sharding.reshard(x, NamedSharding(mesh, PartitionSpec()))


def target_forward(
    target: Target,
    tparams,
    tokens_BT,
    pos_BT,
    cache,
    *,
    capture: tuple[int, ...] = (),
    greedy: bool,
    tree_mask_BTS=None,
):
    """Verify (also prefill and plain decode): the target over T tokens (a draft tree's nodes with `tree_mask_BTS`).
    Returns (ids [B,T] if `greedy` else logits [B,T,V], replicated; the updated cache; the captured states [X,B,T,D]
    of `capture`)."""
    head = "argmax" if greedy else "logits"
    out, cache, captured = target.apply(
        tparams, tokens_BT, pos_BT, cache, capture=capture, head=head, tree_mask_BTS=tree_mask_BTS
    )
    return replicate(out, target.mesh), cache, captured


def choose_draft(drafter: Drafter, key, logits_BU, sampling: Sampling | RowSampling, coupling=None, at_B=None):
    """Draft token (target ids) [B] and its distribution over the target vocabulary [B, V] (sampling only; [B, 1]
    zeros when greedy). Rows that sample coupled (`coupling`, a `Coupling` or None) propose with the target's noise
    at index `at_B` (coupling.py); the others draw with `key`."""
    target = drafter.target
    logits_BU = replicate(logits_BU, target.mesh)
    draft_U = _sample(key, logits_BU, sampling)
    if sampling.greedy:
        return drafter.to_target_ids(draft_U), jnp.zeros((draft_U.shape[0], 1), jnp.float32)
    logq_BU = _warp(logits_BU, sampling)
    vocab, U = target.vocab_size, logq_BU.shape[-1]
    where_U = None if drafter.d2t is None else drafter.to_target_ids(jnp.arange(U, dtype=jnp.int32))
    if coupling is not None:
        propose = lambda: coupled.draft_tokens(coupling.key_B, logq_BU, at_B, vocab, where_U)
        draft_U = coupled.select(coupling, propose, lambda: draft_U)
    ids_B, q_BU = drafter.to_target_ids(draft_U), jnp.exp(logq_BU)
    if where_U is None:
        return ids_B, q_BU
    return ids_B, jnp.zeros((q_BU.shape[0], vocab), jnp.float32).at[:, where_U].set(q_BU)


def draft_step(drafter: Drafter, dparams, token_B, hidden_BD, pos_BT, cache, key, sampling, coupling=None):
    """Draft: one drafter step from the previous step's h2 at position `pos_BT` [B, 1]. Returns (draft token [B],
    its distribution (see `choose_draft`), this step's h2 [B, D] (replicated), the updated drafter cache). The
    drafter at position p proposes the token at index p + 2 (its input is the token at p + 1)."""
    logits, h2, cache = drafter.apply(dparams, token_B[:, None], hidden_BD[:, None], pos_BT, cache, first_step=False)
    token_B, q_BV = choose_draft(drafter, key, logits[:, 0], sampling, coupling, pos_BT[:, 0] + 2)
    return token_B, q_BV, replicate(h2, drafter.target.mesh)[:, 0], cache


def _prompt_extend(extend, cache, chunk, feed):
    """The drafter's `extend(tokens, aux, pos, cache, row) -> (..., cache)` over a prefill chunk (tokens, target
    states, positions [B, T, ..], each row's last prompt position in it): over every position, or with `feed` False
    (adaptive serving admits rows that way where speculation does not pay) not at all: the prefill keeps the target
    states of the prompt's last position instead (`LoopState.prompt_aux_BI`), and the first drafting program's
    catch-up drafts from there as this would have (over the same cache entries, its draw keyed at the same
    position), so an unfed prompt costs the drafter nothing unless a chain runs on its row. Only the drafter's cache
    below the prompt's end holds no entries of this prompt, which costs acceptance, never correctness. `feed` None:
    every position (a fixed shape always feeds the drafter)."""
    tokens_BT, aux_BTI, pos_BT, row_B = chunk
    whole = lambda: extend(tokens_BT, aux_BTI, pos_BT, cache, row_B)
    if feed is None:
        return whole()

    def unfed():  # whole's outputs' types (a block table can come back typed as sharded over the rows), unused
        *outs, written = jax.eval_shape(whole)
        zeros = (jnp.zeros(x.shape, x.dtype, out_sharding=x.sharding) for x in outs)
        return (*zeros, jax.tree.map(lambda x, t: jax.sharding.reshard(x, t.sharding), cache, written))

    return jax.lax.cond(feed, whole, unfed)


def _at_rows(x_BT, row_B):
    """x_BT[b, row_B[b]] for each b (x [B, T, ...] -> [B, ...])."""
    return jnp.take_along_axis(x_BT, row_B.reshape((-1, 1) + (1,) * (x_BT.ndim - 2)), axis=1)[:, 0]


def draft_extend(drafter: Drafter, dparams, tokens_BT, aux_BTI, pos_BT, cache, row_B, key, sampling, coupling=None):
    """Draft-extend (and the prefill's draft): the drafter's first step over T tokens with the captured target states
    `aux_BTI`, writing its cache; at each sequence's row `row_B` the next draft token and distribution (see
    `choose_draft`) and its h2 [B, D]. Returns (draft [B], q, h2 [B, D], the updated drafter cache)."""
    logits_BU, h2_BD, cache = extend_logits(drafter, dparams, tokens_BT, aux_BTI, pos_BT, cache, row_B)
    at_B = jnp.take_along_axis(pos_BT, row_B[:, None], axis=1)[:, 0] + 2
    draft_B, q_BV = choose_draft(drafter, key, logits_BU, sampling, coupling, at_B)
    return draft_B, q_BV, h2_BD, cache


def extend_logits(drafter: Drafter, dparams, tokens_BT, aux_BTI, pos_BT, cache, row_B):
    """`draft_extend` up to the draft logits: (fp32 logits [B, U] and h2 [B, D] at row `row_B`, replicated; the
    updated drafter cache)."""
    logits, h2, cache = drafter.apply(dparams, tokens_BT, aux_BTI, pos_BT, cache, first_step=True, at_B=row_B)
    mesh = drafter.target.mesh
    return replicate(logits, mesh)[:, 0], replicate(h2, mesh)[:, 0], cache


def draft_tree(drafter: Drafter, dparams, root_logits_BU, hidden_BD, n_B, cache, num_steps: int, topk: int, tilt=None):
    """Draft a tree (tree.py): the root's top-`topk` children, then `num_steps` - 1 drafter steps, each over the
    `topk` frontier nodes of its depth (at position n + depth - 1, their parents' h2 as input, seeing the cache below
    n and their ancestors' scratch entries), each expanding the frontier. `tilt(logits, depth)`: what the children at
    `depth` are ranked by instead of the drafter's logits (`_tree_tilt`). Returns the `tree.TreeDraft`."""
    mesh = drafter.target.mesh
    to_ids = drafter.to_target_ids if drafter.d2t is not None else None
    tilt = tilt or (lambda logits, depth: logits)
    draft = tree.first_expansion(tilt(replicate(root_logits_BU, mesh), 1), topk, to_ids=to_ids)
    B, D = hidden_BD.shape
    entries = (num_steps - 1) * topk
    scratch = drafter.init_scratch(B, max(entries, 1))
    hidden_BKD = jnp.broadcast_to(hidden_BD[:, None], (B, topk, D))  # depth-1 nodes: the root's h2
    for step in range(1, num_steps):
        pos_BK = jnp.broadcast_to((n_B + step - 1)[:, None], (B, topk))
        mask_BKM = jnp.pad(draft.lineage, ((0, 0), (0, 0), (0, entries - draft.lineage.shape[-1])))
        logits_BKU, h2_BKD, scratch = drafter.apply_tree(
            dparams, draft.frontier_tokens, hidden_BKD, pos_BK, cache, scratch, (step - 1) * topk, mask_BKM, n_B
        )
        draft = tree.expand(draft, tilt(replicate(logits_BKU, mesh), step + 1), to_ids=to_ids)
        parent_BK1 = draft.frontier_parent_slot[:, :, None]
        hidden_BKD = jnp.take_along_axis(replicate(h2_BKD, mesh), parent_BK1, axis=1)
    return draft


def accept_commit(cfg: LoopConfig, s: LoopState, draft_BJ, qs, out, accept_key):
    """Steps 3-4 of a cycle: accept a prefix of the drafts against the target's output `out` (ids if greedy, else
    logits; `qs` the drafts' distributions when sampling) and commit it. Returns (accepted_B, emitted_BT, active_B,
    `s` with tokens/end/length/done updated)."""
    J, sampling = cfg.num_steps, _sampling(cfg, s)
    B = s.tokens_BS.shape[0]
    # 3. accept
    if sampling.greedy:
        accepted_B, next_B = greedy_accept_ids(draft_BJ, out)
    else:
        generated_BT = (s.end_B - s.prompt_len_B)[:, None] + jnp.arange(J + 1, dtype=jnp.int32)
        logp_BTV = _warp(mask_stops(cfg, s, out, generated_BT), sampling)
        q_BJV = jnp.stack(qs[:J], axis=1) if J else jnp.zeros((B, 0, logp_BTV.shape[-1]), jnp.float32)
        reject = lambda: _speculative_accept(accept_key, draft_BJ, q_BJV, jnp.exp(logp_BTV))
        at_BT = s.length_B[:, None] + jnp.arange(J + 1, dtype=jnp.int32)
        accepted_B, next_B = _accept(_coupling(cfg, s), logp_BTV, at_BT, reject, draft_BJ)
    emitted_BT, active_B, committed = commit(cfg, s, draft_BJ, accepted_B, next_B)
    committed = write_logprobs(cfg, committed, out, emitted_BT, s.length_B, active_B)
    return accepted_B, emitted_BT, active_B, committed


def commit(cfg: LoopConfig, s: LoopState, draft_BJ, accepted_B, next_B):
    """Step 4: emit d_1..d_a then `next_B` (the bonus, or the correction), cut at the first stop id and at the budget.
    Returns (emitted_BT [B, J+1], active_B, `s` with tokens/end/length/done updated)."""
    J = cfg.num_steps
    n_B = s.length_B
    idx_T = jnp.arange(J + 1, dtype=jnp.int32)
    emitted_BT = jnp.where(idx_T < accepted_B[:, None], jnp.pad(draft_BJ, ((0, 0), (0, 1))), next_B[:, None])
    stop_BT = _is_stop(emitted_BT, cfg, s) & (idx_T <= accepted_B[:, None])
    first_stop_B = jnp.where(stop_BT.any(1), jnp.argmax(stop_BT, axis=1), J + 1)
    budget_B = s.max_new_B - (s.end_B - s.prompt_len_B)
    keep_B = jnp.minimum(jnp.minimum(accepted_B + 1, first_stop_B + 1), budget_B)
    write = lambda row, new, start: jax.lax.dynamic_update_slice_in_dim(row, new, start, axis=0)
    active_B = ~s.done_B
    tokens_BS = jnp.where(active_B[:, None], jax.vmap(write)(s.tokens_BS, emitted_BT, n_B + 1), s.tokens_BS)
    end_B = jnp.where(active_B, s.end_B + keep_B, s.end_B)
    length_B = jnp.where(active_B, n_B + accepted_B + 1, n_B)
    done_B = s.done_B | (first_stop_B <= accepted_B) | (end_B - s.prompt_len_B >= s.max_new_B)
    committed = s.replace(tokens_BS=tokens_BS, end_B=end_B, length_B=length_B, done_B=done_B)
    return emitted_BT, active_B, committed


def mask_stops(cfg: LoopConfig, s: LoopState, logits_BTV, generated_BT):
    """min_tokens: the target's logits [B, T, V] with every stop id (the config's and the row's) at -inf where the
    token chosen there would be the row's generated token number `generated_BT` (0-based) < its min_new_B; the
    speculative accept then runs against this masked distribution, as plain decoding samples from it. A static or
    greedy program (no per-row settings, or ids for `logits_BTV`) is returned unchanged."""
    row = s.settings
    if row is None or _greedy(cfg):
        return logits_BTV
    B, V = logits_BTV.shape[0], logits_BTV.shape[-1]
    early_BT = generated_BT < row.min_new_B[:, None]

    def mask(logits_BTV):
        stop_BV = jnp.zeros((B, V), bool).at[:, jnp.asarray(cfg.stop_ids or (V,))].set(True, mode="drop")
        stop_BV = stop_BV & ~row.ignore_eos_B[:, None]  # those rows are not stopped by the config's ids
        row_ids = jnp.where(row.stop_ids >= 0, row.stop_ids, V)  # -1 (none) out of range: dropped
        stop_BV = stop_BV.at[jnp.arange(B)[:, None], row_ids].set(True, mode="drop")
        return jnp.where(early_BT[:, :, None] & stop_BV[:, None, :], -jnp.inf, logits_BTV)

    # Skipped at run time while no row is below its min_tokens (the common case: the mask touches [B, T, V]).
    return jax.lax.cond(jnp.any(early_BT), mask, lambda x: x, logits_BTV)


def score_tokens(logits_BTV, tokens_BT) -> Logprobs:
    """The raw log-softmax of `logits_BTV` [B, T, V] at each position: the logprob of `tokens_BT` and the top
    MAX_TOP_LOGPROBS ids and logprobs, best first."""
    lp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    token_BT = jnp.take_along_axis(lp_BTV, tokens_BT[..., None], axis=-1)[..., 0]
    top_BTN, ids_BTN = jax.lax.top_k(lp_BTV, MAX_TOP_LOGPROBS)
    return Logprobs(token_BT, ids_BTN.astype(jnp.int32), top_BTN)


def write_logprobs(cfg: LoopConfig, s: LoopState, logits_BTV, tokens_BT, start_B, rows_B) -> LoopState:
    """With `cfg.logprobs`: the scores of `tokens_BT` under `logits_BTV` (the target at positions start_B..) written
    at positions start_B.. of the rows `rows_B` that want logprobs; skipped at run time (lax.cond) when none does."""
    if not cfg.logprobs:
        return s
    want_B = rows_B & s.settings.logprobs_B
    write_row = lambda row, new, start: jax.lax.dynamic_update_slice_in_dim(row, new, start, axis=0)  # noqa: E731

    def write(buffers: Logprobs) -> Logprobs:
        def put(x, new):
            keep = want_B.reshape((-1,) + (1,) * (x.ndim - 1))
            return jnp.where(keep, jax.vmap(write_row)(x, new, start_B), x)

        return jax.tree.map(put, buffers, score_tokens(logits_BTV, tokens_BT))

    return s.replace(logprobs=jax.lax.cond(jnp.any(want_B), write, lambda b: b, s.logprobs))


def count_acceptance(J: int, s: LoopState, accepted_B, active_B) -> dict[str, jax.Array]:
    """Step 6: per-position reached/accepted counters and the accepted-length histogram, over active rows, and each
    active row's own cycles and accepted positions (the LoopState fields they replace). The counters may be deeper
    than J (a state built for a deeper draft): positions past J are not verified by this cycle, so they count
    nothing."""
    idx_J = jnp.arange(s.reached_J.shape[0], dtype=jnp.int32)
    rows = lambda m: m & active_B[:, None]
    count = lambda m: jnp.sum(rows(m), axis=0, dtype=jnp.int32)
    drafted_J = idx_J < J
    return {
        "cycles": s.cycles + 1,
        "reached_J": s.reached_J + count((accepted_B[:, None] >= idx_J) & drafted_J),
        "accepted_J": s.accepted_J + count(accepted_B[:, None] > idx_J),
        "accept_hist_T": s.accept_hist_T + count(accepted_B[:, None] == jnp.arange(s.accept_hist_T.shape[0])),
        "row_cycles_B": s.row_cycles_B + active_B.astype(jnp.int32),
        "row_accepted_BJ": s.row_accepted_BJ + rows(accepted_B[:, None] > idx_J).astype(jnp.int32),
    }


def _choose_target(key, out_BV, sampling: Sampling | RowSampling, coupling: Coupling | None, at_B):
    """A token from the target's output at one position (ids if greedy, else logits): the token at index `at_B`."""
    if sampling.greedy:
        return out_BV
    drawn = lambda: _sample(key, out_BV, sampling)
    if coupling is None:
        return drawn()
    own = lambda: coupled.target_tokens(coupling.key_B, _warp(out_BV, sampling)[:, None], at_B[:, None])[:, 0]
    return coupled.select(coupling, own, drawn)


def _tree_tilt(drafter: Drafter, coupling: Coupling | None, sampling, n_B):
    """For a tree's coupled rows that sample (not greedy ones): rank the children at depth d (the tokens at index
    n + d) by the drafter's warped log-probabilities plus the target's noise there, so a node's best child is the
    coupled proposal (`coupling.draft_tokens`) and the next are the likeliest other matches; None: no such rows."""
    if coupling is None:
        return None
    vocab = drafter.target.vocab_size
    rows_B = sampling.temperature_B > 0 if isinstance(sampling, RowSampling) else None
    if coupling.rows_B is not None:
        rows_B = coupling.rows_B & rows_B
    sampled = Coupling(coupling.key_B, rows_B)

    def tilt(logits_B_U, depth: int):
        def noisy():
            g_BV = coupled.noise(coupling.key_B, (n_B + depth)[:, None], vocab)[:, 0]
            if drafter.d2t is not None:
                g_BV = g_BV[:, drafter.to_target_ids(jnp.arange(logits_B_U.shape[-1], dtype=jnp.int32))]
            g = g_BV.reshape(g_BV.shape[:1] + (1,) * (logits_B_U.ndim - 2) + g_BV.shape[1:])
            return _warp(logits_B_U, sampling) + g

        return coupled.select(sampled, noisy, lambda: logits_B_U.astype(jnp.float32))

    return tilt


def _accept(coupling: Coupling | None, logp_BTV, at_BT, reject, draft):
    """Step 3 when sampling: `reject()` (lossless rejection sampling's accept), or in coupled rows the target's own
    tokens at the verified indices (positions at_BT score the tokens at at_BT + 1) matched as greedy matches argmax
    ids, against the chain `draft` [B, J] or the `tree.Tree` `draft`."""
    if coupling is None:
        return reject()

    def match():
        ids_BT = coupled.target_tokens(coupling.key_B, logp_BTV, at_BT + 1)
        if isinstance(draft, tree.Tree):
            return tree.greedy_accept_tree(draft, ids_BT)
        return greedy_accept_ids(draft, ids_BT)

    return coupled.select(coupling, match, reject)


# ---------------------------------------------------------------------- static or per-row sampling (traced helpers)
def _greedy(cfg: LoopConfig) -> bool:
    """The whole program is greedy (static settings at temperature 0): the target's head is then a sharded argmax."""
    return cfg.sampling is not None and cfg.sampling.greedy


def _sampling(cfg: LoopConfig, s: LoopState) -> Sampling | RowSampling:
    return cfg.sampling if cfg.sampling is not None else s.settings.sampling


def _coupling(cfg: LoopConfig, s: LoopState) -> Coupling | None:
    """The rows that sample coupled (coupling.py): every row under static settings with `cfg.coupled` (its state
    has per-row keys), a per-row state's rows whose settings say so; None when none can (greedy, or rejection)."""
    if _greedy(cfg):
        return None
    if cfg.sampling is not None:
        return Coupling(s.key, None) if cfg.coupled else None
    return Coupling(s.key, s.settings.coupled_B)


# What a per-row draw is for (`_draws`): each purpose folds its own keys from the row's key.
FIRST, CYCLE, EXTEND = 0, 1, 2


def _draws(key: jax.Array, n: int, purpose: int, at_B: jax.Array) -> tuple[jax.Array, list[jax.Array]]:
    """(the key to carry, n keys for the draws). One key (static sampling): split, the first carried on. Per-row keys
    [B] (the serving engine's): row b's keys are folded from its own key, `purpose` and the position `at_B[b]` the
    draws are for, and its key is carried unchanged. So a row's draws depend on its seed and the positions alone, not
    on how its prefill chunks, cycles, segments, draft shapes or a preemption fell: a row resumed by recomputing its
    tokens, or one that reused a cached prefix, draws what it would have drawn."""
    if key.ndim == 0:
        first, *keys = jax.random.split(key, n + 1)
        return first, keys
    fold = lambda k, at: jax.random.split(jax.random.fold_in(jax.random.fold_in(k, purpose), at), n)
    return key, list(jnp.swapaxes(jax.vmap(fold)(key, at_B), 0, 1))


def _split(key: jax.Array, n: int) -> jax.Array:
    """n keys from `key`: [n] from one key, [n, B] from per-row keys [B] (each row split on its own)."""
    if key.ndim == 0:
        return jax.random.split(key, n)
    return jnp.swapaxes(jax.vmap(lambda k: jax.random.split(k, n))(key), 0, 1)


def _warp(logits: jax.Array, sampling: Sampling | RowSampling) -> jax.Array:
    return warp_rows(logits, sampling) if isinstance(sampling, RowSampling) else warp(logits, sampling)


def _sample(key: jax.Array, logits: jax.Array, sampling: Sampling | RowSampling) -> jax.Array:
    if isinstance(sampling, RowSampling):
        return sample_rows(key, logits, sampling)
    if key.ndim:  # static settings on per-row keys (coupled: `LoopConfig.coupled`)
        return jax.vmap(lambda k, x: sample(k, x, sampling))(key, logits)
    return sample(key, logits, sampling)


def _speculative_accept(key, draft_BJ, q_BJV, p_BTV):
    """`speculative_accept`, each row with its own key when `key` is per-row [B]."""
    if key.ndim == 0:
        return speculative_accept(key, draft_BJ, q_BJV, p_BTV)
    one = lambda k, d, q, p: speculative_accept(k, d[None], q[None], p[None])
    accepted_B1, next_B1 = jax.vmap(one)(key, draft_BJ, q_BJV, p_BTV)
    return accepted_B1[:, 0], next_B1[:, 0]


def _is_stop(tokens_B_: jax.Array, cfg: LoopConfig, s: LoopState) -> jax.Array:
    """Which tokens [B, ...] stop their row: the config's stop ids (except in ignore_eos rows), plus each row's own
    (`s.settings.stop_ids` [B, n], -1 padded) in a per-row state."""
    stop = jnp.isin(tokens_B_, jnp.asarray(cfg.stop_ids or (-1,)))
    if s.settings is None:
        return stop
    ignore_eos_B, stop_ids = s.settings.ignore_eos_B, s.settings.stop_ids
    stop = stop & ~ignore_eos_B.reshape(ignore_eos_B.shape + (1,) * (tokens_B_.ndim - 1))
    row_ids = stop_ids.reshape(stop_ids.shape[:1] + (1,) * (tokens_B_.ndim - 1) + stop_ids.shape[1:])
    return stop | jnp.any((tokens_B_[..., None] == row_ids) & (row_ids >= 0), axis=-1)
