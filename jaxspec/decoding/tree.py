"""Tree drafts (topk > 1): build a draft tree, accept a root-to-leaf path of it, compact the accepted path's KV.

Building blocks for the draft-verify loop; pure, static-shape and jittable (B first, every row decides on its own).

Shapes. T is the tree's node count *including the root* (SGLang's `num_draft_tokens`, the verify step's query
tokens: node 0 is the pending token, nodes 1..T-1 the draft tokens). `mask_BTS` is [B, T, T]: query node t sees node
s (S names the same nodes as keys, as the fresh keys of `models/tree_attention.py`). The candidate axis of a growing
draft (`topk + (num_steps - 1) * topk**2` entries) and the accepted path axis (`num_steps + 1` entries, the root
first) have no glossary letter and carry no suffix.

1. Construction (SGLang's scheme, EAGLE-2's "expand then rerank"). `first_expansion` takes the drafter's log-probs at
   the root and keeps its top-`topk` tokens; they are the first frontier. Each `expand` takes the drafter's log-probs
   at the `topk` frontier nodes, adds every frontier node's top-`topk` children as candidates (path score = sum of the
   draft log-probs, i.e. the product of draft probabilities), and makes the `topk` best of those `topk**2` the next
   frontier. `finish` keeps the `num_draft_tokens - 1` best candidates of all steps, in candidate order. A child's score
   is its parent's plus a log-prob <= 0 (clamped so), and ties rank the lower candidate index (the parent) first, so
   the kept set always holds every kept node's parent, and candidate order puts parents before children. topk = 1 is
   exactly the chain: one frontier node, its argmax child each step, all kept.
2. Greedy acceptance (`greedy_accept_tree`): the deepest node whose every ancestor-or-self (root excluded) equals the
   target's argmax at its parent. Siblings are distinct tokens, so at most one child matches and the matching nodes
   form a single path; the bonus token is the target's argmax at its end.
3. Sampling acceptance (`speculative_accept_tree`), lossless: see its docstring for the derivation.
4. Commit (`models.tree_attention.compact_path`, through `Target.compact_cache`): the verify step writes node t's KV
   at cache slot prefix + t (RoPE position prefix + depth); the accepted path's entries move to slots prefix + 0..a,
   so the cache holds exactly the path, each entry at its own position.

How a cycle of the loop uses them (n = the row's processed length, the root is the pending token at position n):
- draft: `first_expansion` on the drafter's logits at the root (from the previous draft-extend). Drafter step s
  (s = 1..num_steps-1) runs the topk frontier nodes of depth s as topk queries per row: tokens
  `frontier_tokens`, hidden inputs = the previous step's h2 gathered by `frontier_parent_slot` (step 1: the root's
  hidden state for every slot), position n + s - 1 for all of them (a chain's d_s). Their KV goes to a scratch
  buffer of (num_steps - 1) * topk entries, not to the drafter cache (topk entries share one position); a query
  sees the drafter cache below position n and the scratch entries `lineage` marks (its ancestors and itself).
  `expand` then takes their logits. topk = 1 makes every piece the chain's.
- verify: `finish(draft, pending, n, num_draft_tokens)`; one target forward over `tokens_BT` at `positions_BT` with
  `mask_BTS` (models/tree_attention.py), writing node t's latent at slot n + t.
- accept: `greedy_accept_tree` on the target's argmax ids, or `speculative_accept_tree` on its warped probs
  (target-only for top-k trees); emitted = the path's tokens after the root, then `next_token`.
- commit: `Target.compact_cache` on the target cache; the drafter cache needs none: draft-extend runs over the
  compacted path (emitted tokens at positions n..n+a, the captured target states gathered by `path`) and writes its
  own KV there.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxspec.decoding.acceptance import residual_distribution


@struct.dataclass
class TreeDraft:
    """A tree being drafted: every candidate so far, in candidate order (step by step, frontier slot, child rank)."""

    tokens: jax.Array  # [B, candidates] int32 candidate tokens
    scores: jax.Array  # [B, candidates] float32 path log-probability under the drafter
    parents: jax.Array  # [B, candidates] int32 candidate index of the parent; -1 = the root
    frontier: jax.Array  # [B, topk] candidate indices of the nodes the next `expand` expands
    frontier_parent_slot: jax.Array  # [B, topk] which slot of the previous frontier each frontier node descends from
    # [B, topk, steps * topk] bool: which frontier slots of steps 1..now (step-major) are this frontier node or its
    # ancestors: the drafter's attention mask over the entries its tree steps wrote (see the module docstring).
    lineage: jax.Array
    expanded: tuple[jax.Array, ...]  # frontiers already expanded, one [B, topk] per `expand` (for `node_values`)
    topk: int = struct.field(pytree_node=False)

    @property
    def frontier_tokens(self) -> jax.Array:
        """[B, topk] int32: the tokens the drafter's next step takes (one query per frontier node)."""
        return jnp.take_along_axis(self.tokens, self.frontier, axis=1)

    @property
    def num_steps(self) -> int:
        return len(self.expanded) + 1


@struct.dataclass
class Tree:
    """A finished draft tree of T nodes (node 0 the root); parents come before their children."""

    tokens_BT: jax.Array  # int32; node 0 is the root (the pending token)
    parent_BT: jax.Array  # int32 parent node; -1 for the root
    depth_BT: jax.Array  # int32; 0 for the root
    mask_BTS: jax.Array  # bool [B, T, T]: node s is an ancestor of node t, or t itself
    positions_BT: jax.Array  # int32 RoPE positions: prefix length + depth
    score_BT: jax.Array  # float32 draft path log-probability; 0 for the root
    source_BT: jax.Array  # int32 candidate index in the TreeDraft; -1 for the root
    max_depth: int = struct.field(pytree_node=False)  # num_steps: the deepest a node can be
    max_children: int = struct.field(pytree_node=False)  # topk: the most children a node can have


def _log_probs(logp: jax.Array) -> jax.Array:
    """Normalised log-probabilities, clamped to <= 0 so that no child outranks its parent through rounding."""
    return jnp.minimum(jax.nn.log_softmax(logp.astype(jnp.float32), axis=-1), 0.0)


# Maps the drafter's vocabulary indices to the token ids the tree holds (a drafter with its own smaller vocabulary
# maps to target ids, `Drafter.to_target_ids`); None: the indices are the ids.
TokenMap = Callable[[jax.Array], jax.Array] | None


def _top_children(
    logp: jax.Array, topk: int, key: jax.Array | None, to_ids: TokenMap = None
) -> tuple[jax.Array, jax.Array]:
    """(log-probs, tokens) of `topk` children per distribution [..., V]: the top-k, or with `key` a sample without
    replacement in draw order (Gumbel top-k) for a tree verified with the drafter's distribution."""
    if topk > logp.shape[-1]:
        raise ValueError(f"topk: expected at most the vocabulary size {logp.shape[-1]}, got {topk}")
    logp = _log_probs(logp)
    ranked = logp if key is None else logp + jax.random.gumbel(key, logp.shape)
    _, index = jax.lax.top_k(ranked, topk)
    tokens = index if to_ids is None else to_ids(index)
    return jnp.take_along_axis(logp, index, axis=-1), tokens.astype(jnp.int32)


def first_expansion(
    root_logp_BV: jax.Array, topk: int, key: jax.Array | None = None, *, to_ids: TokenMap = None
) -> TreeDraft:
    """Draft step 1: the root's top-`topk` tokens (log-probs or logits [B, V] of the drafter at the root)."""
    if topk < 1:
        raise ValueError(f"topk: expected >= 1 (1 = a chain), got {topk}")
    scores, tokens = _top_children(root_logp_BV, topk, key, to_ids)
    B = tokens.shape[0]
    slots = jnp.broadcast_to(jnp.arange(topk, dtype=jnp.int32), (B, topk))
    lineage = jnp.broadcast_to(jnp.eye(topk, dtype=bool), (B, topk, topk))
    return TreeDraft(
        tokens, scores, jnp.full((B, topk), -1, jnp.int32), slots, jnp.zeros_like(slots), lineage, (), topk
    )


def expand(
    draft: TreeDraft, frontier_logp_BKV: jax.Array, key: jax.Array | None = None, *, to_ids: TokenMap = None
) -> TreeDraft:
    """One more draft step: the drafter's log-probs (or logits) at each frontier node [B, topk, V] add topk children
    per frontier node as candidates; the topk best-scoring of them become the next frontier."""
    B, k = draft.frontier.shape
    if frontier_logp_BKV.shape[:2] != (B, k):
        raise ValueError(f"frontier_logp_BKV: expected [B, topk, V] = [{B}, {k}, V], got {frontier_logp_BKV.shape}")
    child_logp, child_tokens = _top_children(frontier_logp_BKV, k, key, to_ids)  # [B, topk, topk]
    frontier_scores = jnp.take_along_axis(draft.scores, draft.frontier, axis=1)
    scores = (frontier_scores[:, :, None] + child_logp).reshape(B, k * k)
    parents = jnp.broadcast_to(draft.frontier[:, :, None], (B, k, k)).reshape(B, k * k)
    _, best = jax.lax.top_k(scores, k)  # ties rank the lower index first
    offset, parent_slot = draft.tokens.shape[1], (best // k).astype(jnp.int32)
    inherited = jnp.take_along_axis(draft.lineage, parent_slot[:, :, None], axis=1)
    own = jnp.broadcast_to(jnp.eye(k, dtype=bool), (B, k, k))
    return TreeDraft(
        tokens=jnp.concatenate([draft.tokens, child_tokens.reshape(B, k * k)], axis=1),
        scores=jnp.concatenate([draft.scores, scores], axis=1),
        parents=jnp.concatenate([draft.parents, parents], axis=1),
        frontier=(offset + best).astype(jnp.int32),
        frontier_parent_slot=parent_slot,
        lineage=jnp.concatenate([inherited, own], axis=2),
        expanded=(*draft.expanded, draft.frontier),
        topk=k,
    )


def _candidate_depths(topk: int, num_candidates: int) -> np.ndarray:
    """Depth of each candidate index (static: step 1 holds topk candidates, each later step topk**2)."""
    steps = 1 + (num_candidates - topk) // (topk * topk)
    return np.concatenate([np.ones(topk, np.int32)] + [np.full(topk * topk, s + 1, np.int32) for s in range(1, steps)])


def finish(draft: TreeDraft, root_B: jax.Array, prefix_len_B: jax.Array, num_draft_tokens: int) -> Tree:
    """Keep the `num_draft_tokens - 1` best candidates under the root token `root_B`; the tree's positions start at
    each row's prefix length (the root's position)."""
    B, num_cands = draft.tokens.shape
    if not 1 <= num_draft_tokens <= num_cands + 1:
        raise ValueError(
            f"num_draft_tokens: expected 1..{num_cands + 1} (the root plus at most topk + (num_steps - 1) * topk**2 = "
            f"{num_cands} candidates for topk={draft.topk}, num_steps={draft.num_steps}), got {num_draft_tokens}"
        )
    if num_draft_tokens > 1:
        _, best = jax.lax.top_k(draft.scores, num_draft_tokens - 1)
        kept = jnp.sort(best, axis=1).astype(jnp.int32)  # candidate order: parents before children
    else:  # the root alone: plain decoding through the same machinery
        kept = jnp.zeros((B, 0), jnp.int32)
    parent_cand = jnp.take_along_axis(draft.parents, kept, axis=1)
    # A kept node's parent is kept (see the module docstring): its place in `kept` is the one index that matches.
    place_BTS = kept[:, None, :] == parent_cand[:, :, None]
    parent_node = 1 + jnp.sum(place_BTS * jnp.arange(kept.shape[1], dtype=jnp.int32), axis=-1)
    root_col = lambda v, x: jnp.concatenate([jnp.full((B, 1), v, x.dtype), x], axis=1)
    parent_BT = root_col(-1, jnp.where(parent_cand < 0, 0, parent_node).astype(jnp.int32))
    depth_BT = root_col(0, jnp.asarray(_candidate_depths(draft.topk, num_cands))[kept])
    return Tree(
        tokens_BT=root_col(0, jnp.take_along_axis(draft.tokens, kept, axis=1)).at[:, 0].set(root_B),
        parent_BT=parent_BT,
        depth_BT=depth_BT,
        mask_BTS=ancestor_mask(parent_BT, draft.num_steps),
        positions_BT=(prefix_len_B[:, None] + depth_BT).astype(jnp.int32),
        score_BT=root_col(0.0, jnp.take_along_axis(draft.scores, kept, axis=1)),
        source_BT=root_col(-1, kept),
        max_depth=draft.num_steps,
        max_children=draft.topk,
    )


def ancestor_mask(parent_BT: jax.Array, max_depth: int) -> jax.Array:
    """[B, T, T] bool: node s is node t or one of its ancestors (parent -1 = the root; depth at most max_depth)."""
    T = parent_BT.shape[1]
    up_BT = jnp.where(parent_BT < 0, jnp.arange(T), parent_BT)  # the root is its own parent: the walk stops there
    node_BT = jnp.broadcast_to(jnp.arange(T, dtype=parent_BT.dtype), parent_BT.shape)
    mask_BTS = jax.nn.one_hot(node_BT, T, dtype=bool)
    for _ in range(max_depth):
        node_BT = jnp.take_along_axis(up_BT, node_BT, axis=1)
        mask_BTS |= jax.nn.one_hot(node_BT, T, dtype=bool)
    return mask_BTS


def node_values(draft: TreeDraft, tree: Tree, root_value_B_: jax.Array, step_values: list[jax.Array]) -> jax.Array:
    """Per-node values [B, T, ...] of something known per expanded node, e.g. the drafter's distribution q there.

    `root_value_B_` [B, ...] is the root's, `step_values[i]` [B, topk, ...] the frontier's at the i-th `expand`
    (the same order as `draft.expanded`). Nodes that were never expanded (the leaves) get zeros.
    """
    if len(step_values) != len(draft.expanded):
        raise ValueError(f"step_values: expected one per expand ({len(draft.expanded)}), got {len(step_values)}")
    B, T = tree.tokens_BT.shape
    trailing = root_value_B_.shape[1:]
    out = jnp.zeros((B, T, *trailing), root_value_B_.dtype).at[:, 0].set(root_value_B_)
    for frontier_BK, value_BK_ in zip(draft.expanded, step_values, strict=True):
        hit_BTK = tree.source_BT[:, :, None] == frontier_BK[:, None, :]
        hit = hit_BTK.reshape(*hit_BTK.shape, *(1,) * len(trailing))
        out = out + jnp.sum(jnp.where(hit, value_BK_[:, None].astype(out.dtype), 0), axis=2)
    return out


def path_nodes(tree: Tree, last_B: jax.Array) -> jax.Array:
    """[B, max_depth + 1] int32: the nodes from the root to `last_B` by depth, padded with `last_B` past its depth."""
    on_path_BS = jnp.take_along_axis(tree.mask_BTS, last_B[:, None, None], axis=1)[:, 0]
    depths = jnp.arange(tree.max_depth + 1, dtype=jnp.int32)
    at_depth = on_path_BS[:, None, :] & (tree.depth_BT[:, None, :] == depths[:, None])  # [B, path, S]
    return jnp.where(at_depth.any(-1), jnp.argmax(at_depth, axis=-1), last_B[:, None]).astype(jnp.int32)


def greedy_accept_tree(tree: Tree, target_BT: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Greedy acceptance: (path [B, max_depth + 1], num_accepted_B, next_token_B).

    `target_BT` is the target's argmax at every node. path[:, :num_accepted + 1] are the accepted nodes, root first;
    next_token is the target's argmax at the last of them (the bonus, or the correction after a mismatch).
    """
    if target_BT.shape != tree.tokens_BT.shape:
        raise ValueError(f"target_BT: expected the tree's [B, T] = {tree.tokens_BT.shape}, got {target_BT.shape}")
    at_parent_BT = jnp.take_along_axis(target_BT, jnp.maximum(tree.parent_BT, 0), axis=1)
    match_BT = (tree.tokens_BT == at_parent_BT).at[:, 0].set(True)
    good_BT = ~jnp.any(tree.mask_BTS & ~match_BT[:, None, :], axis=-1)  # every ancestor-or-self matches
    last_B = jnp.argmax(jnp.where(good_BT, tree.depth_BT, -1), axis=1).astype(jnp.int32)
    num_accepted_B = jnp.take_along_axis(tree.depth_BT, last_B[:, None], axis=1)[:, 0]
    next_B = jnp.take_along_axis(target_BT, last_B[:, None], axis=1)[:, 0]
    return path_nodes(tree, last_B), num_accepted_B, next_B.astype(jnp.int32)


def speculative_accept_tree(
    key: jax.Array, tree: Tree, p_probs_BTV: jax.Array, q_probs_BTV: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Lossless sampling acceptance over a tree: (path [B, max_depth + 1], num_accepted_B, next_token_B).

    Multi-candidate speculative sampling (SpecInfer's recursive rejection sampling, as in EAGLE-2). Walk from the
    root; at node c with the target's distribution p = p_probs_BTV[c], set r = p and try c's children x_1..x_k in
    node order, child i "drawn from" q_i:
        accept x_i with probability min(1, r(x_i) / q_i(x_i)); on rejection r <- normalize(max(0, r - q_i)).
    On acceptance descend into x_i; if every child is rejected (or c is a leaf), the next token is drawn from r and
    the walk ends. `key` is one key, or one per row [B].

    Why the emitted token at c is distributed as p. Let r_i be the residual before child i and suppose x_i ~ q_i given
    everything before it (x_1..x_{i-1} and the coin flips). The token that step i emits (x_i, or whatever the steps
    after it emit from r_{i+1}) has probability
        q_i(x) min(1, r_i(x)/q_i(x)) + P(reject) r_{i+1}(x) = min(q_i(x), r_i(x)) + max(0, r_i(x) - q_i(x)) = r_i(x),
    given that the steps after it emit r_{i+1}; the last fallback does (it samples r_{k+1}), so by induction down to
    i = 1 the token is distributed as r_1 = p. Given the accepted x_i, the walk continues at x_i with the target's
    distribution for the extended context, so the emitted sequence is distributed as the target's, token by token.

    What it needs from the draft distribution:
    - `q_probs_BTV` None: the children are deterministic given the context (the top-k expansion of `expand`
      without a key, any pruning rule, any drafter), so q_i is the point mass on x_i. The rule becomes "accept x_i
      with probability r(x_i); on rejection zero x_i in r and renormalise" (SGLang's target-only tree sampling):
      nothing of the drafter's distribution is needed, only that the tree does not depend on this step's random draws.
      Equivalently, draw x ~ p and descend while x is a child.
    - `q_probs_BTV` [B, T, V]: the drafter's distribution at each node (from `node_values`), whose children were
      sampled from it WITHOUT replacement in node order (`expand` with a key), so q_i is q with x_1..x_{i-1} removed
      and renormalised (children beyond q's support, which `expand` adds when topk exceeds it, are skipped: such a
      child has q_i = 0 and cannot be a draw from it). Which nodes are expanded may depend on the children's
      scores, but no sampled child may be dropped because of its own value (keep every candidate: num_draft_tokens
      = 1 + all candidates), or x_i ~ q_i no longer holds. Both p and q must be warped by the same `Sampling`.
    """
    B, T = tree.tokens_BT.shape
    if p_probs_BTV.shape[:2] != (B, T):
        raise ValueError(f"p_probs_BTV: expected [B, T, V] = [{B}, {T}, V] for the tree, got {p_probs_BTV.shape}")
    if q_probs_BTV is not None and q_probs_BTV.shape != p_probs_BTV.shape:
        raise ValueError(f"q_probs_BTV: expected p's shape {p_probs_BTV.shape}, got {q_probs_BTV.shape}")
    levels, k = tree.max_depth + 1, tree.max_children
    # All randomness is drawn here, outside the per-row walk: random ops inside a vmapped loop compile slowly.
    if key.ndim == 0:
        u_key, draw_key = jax.random.split(key)
        u_BLK = jax.random.uniform(u_key, (B, levels, k))
        draw = lambda logits_BV: jax.random.categorical(draw_key, logits_BV, axis=-1)
    else:  # one key per row [B]: a row's draws depend only on its own key
        u_key_B, draw_key_B = jnp.swapaxes(jax.vmap(lambda kb: jax.random.split(kb))(key), 0, 1)
        u_BLK = jax.vmap(lambda kb: jax.random.uniform(kb, (levels, k)))(u_key_B)
        draw = lambda logits_BV: jax.vmap(jax.random.categorical)(draw_key_B, logits_BV)
    walk = lambda u, tok, par, p, q: _walk_row(u, tok, par, p, q)
    last_B, residual_BV = jax.vmap(walk)(u_BLK, tree.tokens_BT, tree.parent_BT, p_probs_BTV, q_probs_BTV)
    num_accepted_B = jnp.take_along_axis(tree.depth_BT, last_B[:, None], axis=1)[:, 0]
    return path_nodes(tree, last_B), num_accepted_B, draw(jnp.log(residual_BV)).astype(jnp.int32)


def _walk_row(u_LK, tokens_T, parent_T, p_TV, q_TV):
    """One row of `speculative_accept_tree` with its uniforms [levels, max_children]: (last accepted node, the
    residual distribution the next token is drawn from)."""
    V = p_TV.shape[-1]
    p_TV = p_TV.astype(jnp.float32)

    def level(d, carry):
        node, done, final_V = carry
        child_T = parent_T == node
        rank_T = jnp.cumsum(child_T) - 1

        def sibling(i, c):
            r_V, left_V, accepted = c  # left_V: q minus the children tried so far (unused without q)
            is_i_T = child_T & (rank_T == i)
            t = jnp.argmax(is_i_T).astype(jnp.int32)
            x = tokens_T[t]
            if q_TV is None:
                q_V = jax.nn.one_hot(x, V, dtype=jnp.float32)
            else:
                q_V = left_V / jnp.maximum(left_V.sum(), jnp.finfo(jnp.float32).tiny)
                left_V = jnp.where(is_i_T.any(), left_V.at[x].set(0.0), left_V)
            # A child q gives no mass (more children than q's support) cannot be a draw from q: it is skipped.
            trying = is_i_T.any() & (accepted < 0) & (q_V[x] > 0)
            accept = trying & (u_LK[d, i] * q_V[x] < r_V[x])  # u < r/q without the division
            residual_V = residual_distribution(r_V, q_V)
            r_V = jnp.where(trying & ~accept, residual_V / residual_V.sum(), r_V)
            return r_V, left_V, jnp.where(accept, t, accepted)

        left_V = jnp.zeros(()) if q_TV is None else q_TV[node].astype(jnp.float32)
        r_V, _, accepted = jax.lax.fori_loop(0, u_LK.shape[1], sibling, (p_TV[node], left_V, jnp.int32(-1)))
        stop = ~done & (accepted < 0)
        return jnp.where(done | stop, node, accepted), done | stop, jnp.where(stop, r_V, final_V)

    init = (jnp.int32(0), jnp.bool_(False), p_TV[0])
    last, _, final_V = jax.lax.fori_loop(0, u_LK.shape[0], level, init)
    return last, final_V
