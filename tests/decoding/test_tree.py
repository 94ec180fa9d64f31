"""Tree drafts (decoding/tree.py): construction, greedy and lossless sampling acceptance, path compaction.

The drafter and the target are random Markov chains over V tokens, as in test_acceptance.py: the next-token logits
of a node are a row of a [V, V] table picked by the node's own token, so p and q depend on the context.

- Construction is checked against SGLang's scheme written here as plain python loops (`reference_tree`), over
  hypothesis-drawn shapes, with exact ties (tables of small integers) and zero-probability tokens among them.
- Greedy acceptance must emit the target's own greedy continuation and accept the deepest matching path (a python
  depth-first search); topk = 1 must equal the chain's rule in acceptance.py.
- Sampling acceptance: chi-square tests (the standard of test_acceptance.py) that the first and the first two emitted
  tokens are distributed as the warped target, for several tree shapes, drafts near and far from the target, and both
  the target-only rule (deterministic top-k trees) and the drafter-q rule (children sampled without replacement); a
  negative control shows the test rejects a broken residual.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxspec.decoding import tree as tr
from jaxspec.decoding.acceptance import greedy_accept_ids
from jaxspec.decoding.sampling import Sampling, warp
from jaxspec.models.cache import write_cache
from jaxspec.models.tree_attention import compact_path
from tests.decoding.support import chisquare_pvalue

ALPHA = 1e-3  # per statistical assertion, as in test_acceptance.py (whose chi-square helper this file uses)
N = 200_000
V = 6


@partial(jax.jit, static_argnames=("topk", "num_steps", "num_draft_tokens", "sampled"))
def build(table_VV, root_B, prefix_B, key, *, topk, num_steps, num_draft_tokens, sampled=False):
    """A tree from the Markov drafter `table_VV` (log-probs or logits), and the drafter's q at every node."""
    keys = jax.random.split(key, num_steps)
    draft = tr.first_expansion(table_VV[root_B], topk, keys[0] if sampled else None)
    qs = []
    for s in range(1, num_steps):
        qs.append(table_VV[draft.frontier_tokens])
        draft = tr.expand(draft, qs[-1], keys[s] if sampled else None)
    tree = tr.finish(draft, root_B, prefix_B, num_draft_tokens)
    return tree, tr.node_values(draft, tree, table_VV[root_B], qs), draft


def check_lineage(draft: tr.TreeDraft):
    """The drafter's mask over its tree steps' entries: frontier node k of the last step sees entry (step j, slot m)
    iff that frontier node is k or one of its ancestors (walking candidate parents in python)."""
    frontiers = [*map(np.asarray, draft.expanded), np.asarray(draft.frontier)]
    parents, lineage, K = np.asarray(draft.parents), np.asarray(draft.lineage), draft.topk
    for b in range(parents.shape[0]):
        for k, c in enumerate(frontiers[-1][b]):
            want = np.zeros(len(frontiers) * K, bool)
            while c >= 0:
                steps, slots = np.nonzero(np.stack([f[b] for f in frontiers]) == c)
                assert len(steps) == 1, "every ancestor of a frontier node was in exactly one frontier"
                want[steps[0] * K + slots[0]] = True
                c = parents[b, c]
            np.testing.assert_array_equal(lineage[b, k], want)


# ---------------------------------------------------------------------------------------------------------------------
# Construction


def reference_tree(logp_VV: np.ndarray, root: int, topk: int, num_steps: int, num_draft_tokens: int):
    """SGLang's tree selection in python: (tokens, parents, depths, scores) of the kept nodes, the root first.
    Ties rank the lower candidate index first (as torch.topk / lax.top_k on equal values here)."""
    best = lambda scores, k: sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:k]
    cands = [(logp_VV[root, c], c, -1, 1) for c in best(list(logp_VV[root]), topk)]  # (score, token, parent, depth)
    frontier = list(range(topk))
    for step in range(2, num_steps + 1):
        new = []
        for f in frontier:
            score, token = cands[f][0], cands[f][1]
            new += [(np.float32(score + logp_VV[token, c]), c, f, step) for c in best(list(logp_VV[token]), topk)]
        frontier = [len(cands) + i for i in best([c[0] for c in new], topk)]
        cands += new
    kept = sorted(best([c[0] for c in cands], num_draft_tokens - 1))
    node_of = {c: i + 1 for i, c in enumerate(kept)}
    tokens = [root] + [cands[c][1] for c in kept]
    parents = [-1] + [node_of.get(cands[c][2], 0) if cands[c][2] >= 0 else 0 for c in kept]
    assert all(cands[c][2] < 0 or cands[c][2] in node_of for c in kept), "reference: a kept node lost its parent"
    return tokens, parents, [0] + [cands[c][3] for c in kept], [0.0] + [cands[c][0] for c in kept]


def walk_mask(parents: list[int]) -> np.ndarray:
    T = len(parents)
    mask = np.eye(T, dtype=bool)
    for t in range(T):
        s = parents[t]
        while s >= 0:
            mask[t, s] = True
            s = parents[s]
    return mask


@st.composite
def tree_shapes(draw):
    topk = draw(st.integers(1, 3))
    num_steps = draw(st.integers(1, 4))
    vocab = draw(st.integers(topk, 7))
    capacity = topk + (num_steps - 1) * topk * topk
    num_draft_tokens = draw(st.integers(1, capacity + 1))
    kind = draw(st.sampled_from(["normal", "ties", "zeros"]))
    return topk, num_steps, vocab, num_draft_tokens, kind, draw(st.integers(0, 2**16))


def check_construction(topk, num_steps, vocab, num_draft_tokens, kind, seed):
    rng = np.random.default_rng(seed)
    if kind == "ties":  # small integers: many exactly equal log-probs and path scores
        logits = rng.integers(0, 3, (vocab, vocab)).astype(np.float32)
    else:
        logits = rng.standard_normal((vocab, vocab)).astype(np.float32)
    if kind == "zeros":  # zero-probability tokens (a warped drafter): -inf log-probs, kept when topk exceeds the rest
        logits[rng.random((vocab, vocab)) < 0.4] = -np.inf
        logits[np.arange(vocab), rng.integers(0, vocab, vocab)] = 0.0
    logp = np.minimum(np.asarray(jax.nn.log_softmax(logits, axis=-1)), 0.0)
    roots, prefix = np.asarray([0, vocab - 1], np.int32), np.asarray([3, 11], np.int32)
    tree, _, draft = build(
        logits, roots, prefix, jax.random.key(0), topk=topk, num_steps=num_steps, num_draft_tokens=num_draft_tokens
    )
    check_lineage(draft)
    for b, root in enumerate(roots):
        tokens, parents, depths, scores = reference_tree(logp, int(root), topk, num_steps, num_draft_tokens)
        assert tree.tokens_BT[b].tolist() == tokens
        assert tree.parent_BT[b].tolist() == parents
        assert tree.depth_BT[b].tolist() == depths
        assert (tree.positions_BT[b] == prefix[b] + np.asarray(depths)).all()
        np.testing.assert_array_equal(np.asarray(tree.score_BT[b]), np.asarray(scores, np.float32))
        np.testing.assert_array_equal(np.asarray(tree.mask_BTS[b]), walk_mask(parents))
        # Siblings are distinct tokens (greedy acceptance relies on it).
        for t in range(len(tokens)):
            children = [tokens[c] for c in range(len(tokens)) if parents[c] == t]
            assert len(set(children)) == len(children)


@settings(max_examples=4, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(shape=tree_shapes())
def test_construction_equals_sglang_scheme(shape):
    check_construction(*shape)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(shape=tree_shapes())
def test_construction_equals_sglang_scheme_sweep(shape):
    check_construction(*shape)


def test_topk_1_is_the_chain():
    """topk = 1: the tree is the drafter's greedy chain (tril mask, consecutive positions) and greedy acceptance is
    acceptance.py's chain rule."""
    rng = np.random.default_rng(5)
    draft_VV, B = rng.standard_normal((V, V)).astype(np.float32), 64
    roots, prefix = rng.integers(0, V, B).astype(np.int32), rng.integers(0, 9, B).astype(np.int32)
    tree, _, _ = build(draft_VV, roots, prefix, jax.random.key(0), topk=1, num_steps=4, num_draft_tokens=5)
    for b, root in enumerate(roots):
        chain = [int(root)]
        for _ in range(4):
            chain.append(int(draft_VV[chain[-1]].argmax()))
        assert tree.tokens_BT[b].tolist() == chain
    assert (tree.parent_BT == np.arange(5) - 1).all() and (tree.depth_BT == np.arange(5)).all()
    assert (tree.positions_BT == prefix[:, None] + np.arange(5)).all()
    assert (tree.mask_BTS == np.tril(np.ones((5, 5), bool))).all()

    # Targets that agree with the chain to a random depth, then differ.
    target_BT = np.array(jnp.roll(tree.tokens_BT, -1, axis=1))
    wrong = rng.integers(0, 6, B)
    for b in range(B):
        if wrong[b] < 5:
            target_BT[b, wrong[b]] = (target_BT[b, wrong[b]] + 1) % V
    path, accepted_B, next_B = jax.jit(tr.greedy_accept_tree)(tree, target_BT)
    want_accepted, want_next = greedy_accept_ids(np.asarray(tree.tokens_BT)[:, 1:], target_BT)
    assert accepted_B.tolist() == want_accepted.tolist() and next_B.tolist() == want_next.tolist()
    assert sorted(set(accepted_B.tolist())) == [0, 1, 2, 3, 4]
    assert (np.asarray(path) == np.minimum(np.arange(5), np.asarray(accepted_B)[:, None])).all()


def test_bad_tree_settings_name_the_field():
    shape = jax.eval_shape  # the checks run at trace time: nothing is compiled
    logits = jax.ShapeDtypeStruct((2, V), jnp.float32)
    zeros = lambda *shape_, dtype=jnp.float32: jax.ShapeDtypeStruct(shape_, dtype)
    with pytest.raises(ValueError, match="topk: expected >= 1"):
        shape(lambda x: tr.first_expansion(x, 0), logits)
    with pytest.raises(ValueError, match="topk: expected at most the vocabulary size 6"):
        shape(lambda x: tr.first_expansion(x, 7), logits)
    draft = shape(lambda x: tr.first_expansion(x, 2), logits)
    with pytest.raises(ValueError, match=r"frontier_logp_BKV: expected \[B, topk, V\] = \[2, 2, V\]"):
        shape(tr.expand, draft, zeros(2, 3, V))
    ids = zeros(2, dtype=jnp.int32)
    with pytest.raises(ValueError, match=r"num_draft_tokens: expected 1..3 .* got 4"):
        shape(lambda d, r, n: tr.finish(d, r, n, 4), draft, ids, ids)
    tree = shape(lambda d, r, n: tr.finish(d, r, n, 3), draft, ids, ids)
    with pytest.raises(ValueError, match="target_BT"):
        shape(tr.greedy_accept_tree, tree, zeros(2, 4, dtype=jnp.int32))
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="p_probs_BTV"):
        shape(tr.speculative_accept_tree, key, tree, zeros(2, 2, V))
    with pytest.raises(ValueError, match="q_probs_BTV"):
        shape(tr.speculative_accept_tree, key, tree, zeros(2, 3, V), zeros(2, 3, V + 1))


# ---------------------------------------------------------------------------------------------------------------------
# Greedy acceptance and the commit


def deepest_match(tokens, parents, target_at) -> int:
    """Python depth-first search: the depth of the deepest node whose path matches the target's argmax."""
    children = {t: [c for c in range(len(tokens)) if parents[c] == t] for t in range(len(tokens))}

    def depth(t):
        return max([1 + depth(c) for c in children[t] if tokens[c] == target_at[t]], default=0)

    return depth(0)


@partial(jax.jit, static_argnames=("topk", "num_steps", "num_draft_tokens"))
def greedy_cycle(draft_VV, target_VV, root_B, prefix_B, cache, *, topk, num_steps, num_draft_tokens):
    """One greedy cycle on a token "cache" [1, B, S, 1] (what a latent cache would hold, as token ids): verify
    writes node t at slot prefix + t, the accepted path is compacted, the bonus becomes the next root."""
    tree, _, _ = build(
        draft_VV, root_B, prefix_B, jax.random.key(0), topk=topk, num_steps=num_steps, num_draft_tokens=num_draft_tokens
    )
    target_BT = jnp.argmax(target_VV[tree.tokens_BT], axis=-1)
    cache = write_cache(
        cache, 0, tree.tokens_BT[..., None].astype(cache.dtype), prefix_B[:, None] + jnp.arange(num_draft_tokens)
    )
    path, accepted_B, next_B = tr.greedy_accept_tree(tree, target_BT)
    cache = compact_path(cache, prefix_B, path, accepted_B, batch_axis=1)
    return tree, target_BT, path, accepted_B, next_B, cache


def greedy_rollout(target_VV, root, n) -> list[int]:
    out = [root]
    for _ in range(n):
        out.append(int(np.argmax(target_VV[out[-1]])))
    return out


@pytest.mark.parametrize(
    ("topk", "num_steps", "num_draft_tokens"), [(3, 3, 10), pytest.param(2, 4, 9, marks=pytest.mark.slow)]
)
def test_greedy_tree_decoding_equals_greedy_decoding(topk, num_steps, num_draft_tokens):
    """Cycles of tree draft -> verify -> greedy accept -> compact reproduce the target's greedy sequence in the cache,
    on ragged rows, and each cycle accepts the deepest matching path of its tree."""
    rng = np.random.default_rng(topk * 10 + num_steps)
    vocab, B, S, cycles = 12, 16, 64, 4
    target_VV = rng.standard_normal((vocab, vocab)).astype(np.float32)
    draft_VV = target_VV + 0.8 * rng.standard_normal((vocab, vocab)).astype(np.float32)  # often right, not always
    prefix_B = rng.integers(0, 8, B).astype(np.int32)
    root_B = rng.integers(0, vocab, B).astype(np.int32)
    cache = np.full((1, B, S, 1), -1.0, np.float32)
    cache[0, np.arange(B), prefix_B, 0] = root_B  # the pending token's slot, as the rollout's first entry
    start_B, accepted_total = prefix_B.copy(), []
    for _ in range(cycles):
        tree, target_BT, path, accepted_B, next_B, cache = greedy_cycle(
            draft_VV,
            target_VV,
            root_B,
            prefix_B,
            cache,
            topk=topk,
            num_steps=num_steps,
            num_draft_tokens=num_draft_tokens,
        )
        tokens, parents, target_BT = map(np.asarray, (tree.tokens_BT, tree.parent_BT, target_BT))
        for b in range(B):
            assert int(accepted_B[b]) == deepest_match(tokens[b].tolist(), parents[b].tolist(), target_BT[b])
        accepted_total += np.asarray(accepted_B).tolist()
        prefix_B = prefix_B + np.asarray(accepted_B) + 1
        root_B = np.asarray(next_B)
        cache = np.asarray(cache).copy()
        cache[0, np.arange(B), prefix_B, 0] = root_B
    assert np.mean(accepted_total) > 1.0, "the drafter should be right often enough to exercise deep paths"
    for b in range(B):
        got = np.asarray(cache)[0, b, start_B[b] : prefix_B[b] + 1, 0].astype(int).tolist()
        assert got == greedy_rollout(target_VV, int(got[0]), len(got) - 1)


@pytest.mark.parametrize("layout", ["target [L,B,S,K]", "drafter [B,S,O,Z]"])
def test_compact_path_moves_exactly_the_path(layout):
    rng = np.random.default_rng(9)
    B, S, T = 3, 20, 7
    prefix_B, accepted_B = np.asarray([2, 9, 0], np.int32), np.asarray([3, 0, 2], np.int32)
    path = np.asarray([[0, 2, 4, 6], [0, 0, 0, 0], [0, 1, 5, 5]], np.int32)  # padded past each row's depth
    shape, batch_axis = ((2, B, S, 5), 1) if layout.startswith("target") else ((B, S, 2, 3), 0)
    cache = rng.standard_normal(shape).astype(np.float32)
    out = np.asarray(jax.jit(partial(compact_path, batch_axis=batch_axis))(cache, prefix_B, path, accepted_B))
    want = cache.copy()
    for b in range(B):
        for j in range(accepted_B[b] + 1):
            src, dst = prefix_B[b] + path[b, j], prefix_B[b] + j
            if batch_axis:
                want[:, b, dst] = cache[:, b, src]
            else:
                want[b, dst] = cache[b, src]
    assert T > path.max()
    np.testing.assert_array_equal(out, want)


def build_two_rows(logits: np.ndarray):
    """The two-row tree (roots 1 and 4, topk 2, 3 steps, 7 draft tokens) shared by the tests below (one compile)."""
    return build(
        logits,
        np.asarray([1, 4], np.int32),
        np.zeros(2, np.int32),
        jax.random.key(0),
        topk=2,
        num_steps=3,
        num_draft_tokens=7,
    )


def test_node_values_follow_the_expanded_nodes():
    """node_values puts each expanded node's value (here: the drafter's logits row of its token) on that node."""
    logits = np.random.default_rng(4).standard_normal((V, V)).astype(np.float32)
    tree, values, _ = build_two_rows(logits)
    tokens, parents, depth, values = map(np.asarray, (tree.tokens_BT, tree.parent_BT, tree.depth_BT, values))
    for b in range(2):
        for t in range(7):
            row = logits[tokens[b, t]]
            if t == 0 or (parents[b] == t).any():  # the root and every node with children were expanded
                np.testing.assert_array_equal(values[b, t], row)
            elif depth[b, t] == tree.max_depth:  # the last step's nodes never are
                assert not values[b, t].any()
            else:  # a frontier node whose children were all pruned, or a node never in the frontier
                assert np.array_equal(values[b, t], row) or not values[b, t].any()


# ---------------------------------------------------------------------------------------------------------------------
# Sampling acceptance is lossless

WARPED = Sampling(temperature=0.7, top_k=4, top_p=0.8)


def sampling_cycle(key, root_N, target_VV, draft_VV, sampling, topk, num_steps, num_draft_tokens, mode):
    """One tree cycle from root tokens: (accepted path tokens [N, num_steps + 1], accepted_N, next_N).

    mode "top": deterministic top-k tree on the raw drafter, target-only rule (no q). mode "sampled": children drawn
    without replacement from the warped drafter q, which the rule then uses."""
    build_key, accept_key = jax.random.split(key)
    sampled = mode == "sampled"
    table_VV = warp(draft_VV, sampling) if sampled else draft_VV
    zeros_N = jnp.zeros_like(root_N)
    tree, logq_NTV, _ = build(table_VV, root_N, zeros_N, build_key, topk=topk, num_steps=num_steps,
                           num_draft_tokens=num_draft_tokens, sampled=sampled)  # fmt: skip
    p_NTV = jnp.exp(warp(target_VV[tree.tokens_BT], sampling))
    q_NTV = jnp.exp(logq_NTV) if sampled else None  # leaves read exp(0): they have no children to try
    path, accepted_N, next_N = tr.speculative_accept_tree(accept_key, tree, p_NTV, q_NTV)
    return jnp.take_along_axis(tree.tokens_BT, path, axis=1), accepted_N, next_N


def tree_pvalues(sampling, topk, num_steps, num_draft_tokens, mode, drafter):
    """(first-token p-value, first-two-tokens p-value, mean accepted) from root 0, over N rows."""
    rng = np.random.default_rng(0)
    target_VV = 1.5 * rng.standard_normal((V, V)).astype(np.float32)
    noise_VV = rng.standard_normal((V, V)).astype(np.float32)
    draft_VV = {"exact": target_VV, "noisy": target_VV + noise_VV, "unrelated": 1.5 * noise_VV, "anti": -target_VV}
    draft_VV = draft_VV[drafter]
    # A fresh closure, so nothing is reused from a trace made before a negative control monkeypatched the rule.
    static = (sampling, topk, num_steps, num_draft_tokens, mode)
    jitted = jax.jit(lambda key, root_N, t_VV, d_VV: sampling_cycle(key, root_N, t_VV, d_VV, *static))
    cycle = lambda seed, root_N: map(np.asarray, jitted(jax.random.key(seed), root_N, target_VV, draft_VV))
    first_of = lambda path_NJ, accepted_N, next_N: np.where(accepted_N >= 1, path_NJ[:, 1], next_N)
    path1_NJ, accepted1_N, next1_N = cycle(1, np.zeros(N, np.int32))
    first_N = first_of(path1_NJ, accepted1_N, next1_N)
    # Where the first cycle emitted a single token, the second comes from a cycle rooted at it.
    second_N = np.where(accepted1_N >= 2, path1_NJ[:, min(2, num_steps)], np.where(accepted1_N == 1, next1_N, 0))
    second_N = np.where(accepted1_N == 0, first_of(*cycle(2, first_N)), second_N)
    p_VV = np.exp(np.asarray(jax.jit(warp, static_argnums=1)(target_VV, sampling), np.float64))
    first = chisquare_pvalue(first_N, p_VV[0])
    joint = chisquare_pvalue(first_N * V + second_N, p_VV[0][:, None] * p_VV)
    return first, joint, float(accepted1_N.mean())


T1 = Sampling(temperature=1.0)
# (sampling, topk, num_steps, num_draft_tokens, mode, drafter). Drafters: "noisy" (target + noise), "unrelated" (an
# independent table), "anti" (minus the target: it proposes the target's least likely tokens first), "exact".
# "sampled" trees keep every candidate (the rule's requirement): topk + (num_steps - 1) * topk**2 + 1 nodes.
LOSSLESS_CASES = {
    "top-k tree 3x2, 8 of 12 candidates, unrelated draft, warped": (WARPED, 3, 2, 8, "top", "unrelated"),
    "sampled tree 2x3 (11 nodes) with drafter q, anti draft, T=1": (T1, 2, 3, 11, "sampled", "anti"),
}
SLOW_LOSSLESS_CASES = {
    "top-k tree 2x3, 6 of 10 candidates, noisy draft, T=1": (T1, 2, 3, 6, "top", "noisy"),
    "top-k star 4x1 (5 nodes), anti draft, T=1": (T1, 4, 1, 5, "top", "anti"),
    "top-k chain 1x4, exact draft, warped": (WARPED, 1, 4, 5, "top", "exact"),
    "top-k tree 3x3, 9 of 21 candidates, noisy, warped": (WARPED, 3, 3, 10, "top", "noisy"),
    "sampled tree 3x2 (13 nodes) with drafter q, unrelated, warped": (WARPED, 3, 2, 13, "sampled", "unrelated"),
    "sampled tree 2x2 (7 nodes), exact draft (p == q), T=1": (T1, 2, 2, 7, "sampled", "exact"),
    "sampled chain 1x3 with drafter q, noisy, warped": (WARPED, 1, 3, 4, "sampled", "noisy"),
}


@pytest.mark.parametrize("case", LOSSLESS_CASES.values(), ids=LOSSLESS_CASES.keys())
def test_tree_sampling_is_lossless(case):
    first, joint, accepted = tree_pvalues(*case)
    assert first > ALPHA and joint > ALPHA, f"emitted tokens are not the target's: p-values {first:.2e}, {joint:.2e}"
    assert accepted > 0.1, f"the case must exercise accepted paths (mean accepted {accepted:.2f})"


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_LOSSLESS_CASES.values(), ids=SLOW_LOSSLESS_CASES.keys())
def test_tree_sampling_is_lossless_sweep(case):
    test_tree_sampling_is_lossless(case)


@pytest.mark.parametrize("mode", ["sampled", pytest.param("top", marks=pytest.mark.slow)])
def test_lossless_test_catches_resampling_from_p(monkeypatch, mode):
    """Negative control: after a rejection, drawing from the unchanged residual (not max(0, r - q)) is biased."""
    monkeypatch.setattr(tr, "residual_distribution", lambda r_V, q_V: r_V)
    _, joint, _ = tree_pvalues(T1, 2, 2, 7, mode, "noisy")
    assert joint < ALPHA


def test_per_row_keys_make_rows_independent():
    """With one key per row [B] (the serving engine's), a row's result depends only on its own key and inputs:
    swapping the two rows (keys with them) swaps the results."""
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((V, V)).astype(np.float32)  # the same build as the node_values test (one compile)
    tree, _, _ = build_two_rows(logits)
    p_BTV = jax.nn.softmax(jnp.asarray(rng.standard_normal((2, 7, V)), jnp.float32))
    keys = jax.random.split(jax.random.key(3), 2)
    accept = jax.jit(tr.speculative_accept_tree)
    swap = np.asarray([1, 0])
    batch = accept(keys, tree, p_BTV)
    swapped = accept(*jax.tree.map(lambda a: a[swap], (keys, tree, p_BTV)))
    assert all(np.array_equal(np.asarray(x)[swap], y) for x, y in zip(batch, swapped, strict=True))
