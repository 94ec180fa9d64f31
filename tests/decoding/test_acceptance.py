"""Accept rules and sampling: a greedy scenario table, and chi-square tests that speculative sampling is lossless.

Lossless tests: the target and the drafter are random Markov chains over V tokens (next-token logits = a row of a
[V, V] table, picked by the previous token), so p and q depend on the context exactly as a real model's do. From
root token 0, N sequences (the batch) run two draft-verify cycles; the first two emitted tokens must be distributed
as p(a | 0) p(b | a) of the warped target. A chi-square test on the V*V cells (and on the V cells of the first
token) must not reject at ALPHA, cells the warped target gives probability 0 must stay empty, and the same test must
reject broken rules (negative controls). Accepting with p/q instead of min(1, p/q) is no negative control: with
u ~ U[0, 1) the two are the same rule.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxspec.decoding import acceptance
from jaxspec.decoding.acceptance import greedy_accept, greedy_accept_ids, speculative_accept
from jaxspec.decoding.sampling import Sampling, sample, warp
from tests.decoding.support import chisquare_pvalue

V = 6
N = 200_000
# Per assertion: the probability that a correct rule fails under a fresh seed. There are 14 statistical assertions on
# correct rules, so at most 1.4% for the whole file; the seeds are fixed, so the file itself is deterministic.
ALPHA = 1e-3
# Eager JAX compiles every op on first use; one program per test is faster.
_warp = jax.jit(warp, static_argnums=1)
_speculative_accept = jax.jit(speculative_accept)

# ---------------------------------------------------------------------------------------------------------------------
# Greedy: scenario table (draft tokens, target argmax at the k+1 verified positions, accepted, next token).

GREEDY_CASES = {
    "all accepted -> bonus": ([1, 2, 3], [1, 2, 3, 4], 3, 4),
    "first rejected": ([5, 2, 3], [1, 2, 3, 4], 0, 1),
    "middle rejected": ([1, 5, 3], [1, 2, 3, 4], 1, 2),
    "last rejected": ([1, 2, 5], [1, 2, 3, 4], 2, 3),
    "matches after a mismatch do not count": ([0, 2, 3], [1, 2, 3, 4], 0, 1),
    "k=1 accepted": ([2], [2, 5], 1, 5),
    "k=0 is plain decoding": ([], [5], 0, 5),
}


def _greedy_inputs(draft, target):
    noise_BTV = np.random.default_rng(0).uniform(0, 0.5, (1, len(target), V))  # stays below the argmax's 1
    return np.asarray([draft], np.int32).reshape(1, -1), (np.eye(V)[[target]] + noise_BTV).astype(np.float32)


def _greedy_via_speculative(draft_BJ, logits_BTV):
    """Speculative sampling at temperature 0 (one-hot p, one-hot q): must be exactly the greedy rule."""
    p_BTV = jnp.exp(warp(logits_BTV, Sampling()))
    return speculative_accept(jax.random.key(1), draft_BJ, jax.nn.one_hot(draft_BJ, V), p_BTV)


@pytest.mark.parametrize("rule", [greedy_accept, _greedy_via_speculative], ids=["greedy", "speculative at T=0"])
@pytest.mark.parametrize("case", GREEDY_CASES.values(), ids=GREEDY_CASES.keys())
def test_greedy_scenarios(case, rule):
    draft, target, accepted, next_token = case
    num_accepted_B, next_token_B = jax.jit(rule)(*_greedy_inputs(draft, target))
    assert (int(num_accepted_B[0]), int(next_token_B[0])) == (accepted, next_token)
    assert num_accepted_B.dtype == next_token_B.dtype == jnp.int32


def test_greedy_batch_rows_decide_independently():
    cases = [c for c in GREEDY_CASES.values() if len(c[0]) == 3]
    inputs = [_greedy_inputs(draft, target) for draft, target, _, _ in cases]
    draft_BJ, logits_BTV = np.concatenate([d for d, _ in inputs]), np.concatenate([t for _, t in inputs])
    num_accepted_B, next_token_B = jax.jit(greedy_accept)(draft_BJ, logits_BTV)
    assert num_accepted_B.tolist() == [c[2] for c in cases]
    assert next_token_B.tolist() == [c[3] for c in cases]


def test_shape_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"expected \[B, J\+1, V\] = \[2, 4, V\]"):
        greedy_accept(jnp.zeros((2, 3), jnp.int32), jnp.zeros((2, 3, V)))
    with pytest.raises(ValueError, match="target ids"):
        greedy_accept_ids(jnp.zeros((2, 3), jnp.int32), jnp.zeros((2, 3), jnp.int32))
    with pytest.raises(ValueError, match="q_probs_BJV"):
        speculative_accept(jax.random.key(0), jnp.zeros((2, 3), jnp.int32), jnp.zeros((2, 2, V)), jnp.zeros((2, 4, V)))


# ---------------------------------------------------------------------------------------------------------------------
# Speculative sampling is lossless.


def _cycle(key, ctx_N, target_VV, draft_VV, sampling, depth, draft_mode):
    """One draft-verify cycle from context tokens ctx_N: emitted tokens [N, depth+1] (valid up to accepted_N),
    accepted_N, and which rows drew their rejected draft token again as the correction."""
    keys = jax.random.split(key, depth + 1)
    tok_N, drafts, qs = ctx_N, [], []
    for j in range(depth):
        logits_NV = draft_VV[tok_N]
        if draft_mode == "greedy":
            tok_N = jnp.argmax(logits_NV, -1).astype(jnp.int32)
            q_NV = jax.nn.one_hot(tok_N, V)
        else:
            tok_N, q_NV = sample(keys[j], logits_NV, sampling), jnp.exp(warp(logits_NV, sampling))
            if draft_mode == "q passed unwarped":  # negative control: q not warped like p
                q_NV = jax.nn.softmax(logits_NV)
        drafts.append(tok_N)
        qs.append(q_NV)
    draft_NJ = jnp.stack(drafts, 1) if depth else jnp.zeros((N, 0), jnp.int32)
    q_NJV = jnp.stack(qs, 1) if depth else jnp.zeros((N, 0, V))
    p_NTV = jnp.exp(warp(target_VV[jnp.concatenate([ctx_N[:, None], draft_NJ], 1)], sampling))
    accepted_N, next_N = speculative_accept(keys[depth], draft_NJ, q_NJV, p_NTV)
    emitted_NT = jnp.where(
        jnp.arange(depth + 1) < accepted_N[:, None], jnp.pad(draft_NJ, ((0, 0), (0, 1))), next_N[:, None]
    )
    # A rejected draft token has p(x) < q(x), so the residual gives it probability exactly 0.
    redrawn_N = (accepted_N < depth) & (
        next_N == jnp.take_along_axis(draft_NJ, accepted_N[:, None], 1, mode="clip")[:, 0]
    )
    return emitted_NT, accepted_N, redrawn_N


def _pvalues(sampling, depth, draft_mode="sampled", drafter="noisy"):
    """(first-token p-value, first-two-tokens p-value, rejected drafts redrawn) for one configuration."""
    rng = np.random.default_rng(0)
    target_VV = 1.5 * rng.standard_normal((V, V), np.float32)
    draft_VV = target_VV if drafter == "exact" else target_VV + rng.standard_normal((V, V), np.float32)
    # A fresh closure, so nothing is reused from a trace made before a negative control monkeypatched the rule.
    jitted = jax.jit(lambda key, ctx_N, t_VV, d_VV: _cycle(key, ctx_N, t_VV, d_VV, sampling, depth, draft_mode))
    cycle = lambda seed, ctx_N: map(np.asarray, jitted(jax.random.key(seed), ctx_N, target_VV, draft_VV))
    emitted1_NT, accepted1_N, redrawn_N = cycle(1, np.zeros(N, np.int32))
    # The second cycle, from the last emitted token, only matters where the first emitted a single token.
    emitted2_NT, _, _ = cycle(2, emitted1_NT[:, 0])
    second_N = np.where(accepted1_N > 0, emitted1_NT[:, min(depth, 1)], emitted2_NT[:, 0])
    p_VV = np.exp(np.asarray(_warp(target_VV, sampling), np.float64))  # row a: p(. | a)
    first = chisquare_pvalue(emitted1_NT[:, 0], p_VV[0])
    joint = chisquare_pvalue(emitted1_NT[:, 0] * V + second_N, p_VV[0][:, None] * p_VV)
    return first, joint, int(redrawn_N.sum())


WARPED = Sampling(temperature=0.7, top_k=4, top_p=0.8)
LOSSLESS_CASES = {
    "T=1, k=3": (Sampling(temperature=1.0), 3, "sampled", "noisy"),
    "T=0.7, top-k 4, top-p 0.8, k=3": (WARPED, 3, "sampled", "noisy"),
    "greedy drafter (one-hot q), T=1, k=2": (Sampling(temperature=1.0), 2, "greedy", "noisy"),
    "greedy drafter (one-hot q), warped, k=3": (WARPED, 3, "greedy", "noisy"),
    "drafter == target (p == q), k=2": (Sampling(temperature=1.0), 2, "sampled", "exact"),
    "k=0 is plain sampling": (WARPED, 0, "sampled", "noisy"),
}


@pytest.mark.parametrize("case", LOSSLESS_CASES.values(), ids=LOSSLESS_CASES.keys())
def test_speculative_sampling_is_lossless(case):
    first, joint, redrawn = _pvalues(*case)
    assert first > ALPHA and joint > ALPHA, f"emitted tokens are not the target's: p-values {first:.2e}, {joint:.2e}"
    assert redrawn == 0, f"{redrawn} rejected draft tokens were drawn again as the correction"


def test_lossless_test_catches_resampling_from_p(monkeypatch):
    monkeypatch.setattr(acceptance, "residual_distribution", lambda p_BV, q_BV: p_BV)
    _, joint, redrawn = _pvalues(Sampling(temperature=1.0), 3)
    assert joint < ALPHA and redrawn > 0


def test_lossless_test_catches_q_warped_differently_from_p():
    _, joint, _ = _pvalues(WARPED, 3, "q passed unwarped")
    assert joint < ALPHA


def test_residual_falls_back_to_p_when_p_equals_q():
    p_BV = np.random.default_rng(0).dirichlet(np.ones(V), 3).astype(np.float32)
    assert np.array_equal(acceptance.residual_distribution(p_BV, p_BV), p_BV)
    # and a drafter identical to the target is always accepted, with no NaN anywhere
    p_BTV = np.broadcast_to(p_BV[:, None], (3, 3, V))
    accepted_B, next_B = _speculative_accept(jax.random.key(0), np.zeros((3, 2), np.int32), p_BTV[:, :2], p_BTV)
    assert accepted_B.tolist() == [2, 2, 2] and ((0 <= next_B) & (next_B < V)).all()


def test_point_mass_draft_redraws_from_p_without_x():
    """One-hot q, p(x) = 0.4: accept 40%; a rejection draws from p with x removed, renormalised."""
    p_V, q_V, n = np.asarray([0.4, 0.3, 0.2, 0.1, 0.0, 0.0], np.float32), np.eye(V, dtype=np.float32)[0], 50_000
    accepted_N, next_N = _speculative_accept(
        jax.random.key(3), np.zeros((n, 1), np.int32), np.broadcast_to(q_V, (n, 1, V)), np.broadcast_to(p_V, (n, 2, V))
    )
    rejected = np.asarray(accepted_N) == 0
    assert stats.binomtest(int((~rejected).sum()), n, 0.4).pvalue > ALPHA
    assert chisquare_pvalue(np.asarray(next_N)[rejected], [0.0, 0.5, 1 / 3, 1 / 6, 0.0, 0.0]) > ALPHA


# ---------------------------------------------------------------------------------------------------------------------
# Sampling and warping.


def _kept(logits, sampling) -> list[int]:
    return np.flatnonzero(np.isfinite(_warp(np.asarray(logits, np.float32), sampling))).tolist()


def test_greedy_is_the_argmax_point_mass():
    logits_NV = np.random.default_rng(0).standard_normal((4, 5, V), np.float32)
    assert np.array_equal(np.exp(_warp(logits_NV, Sampling())), np.eye(V)[logits_NV.argmax(-1)])
    greedy = jax.jit(sample, static_argnums=2)
    for seed in range(3):
        assert np.array_equal(greedy(jax.random.key(seed), logits_NV, Sampling()), logits_NV.argmax(-1))


def test_top_k_keeps_exactly_k():
    # Ties at the cut: a threshold on the k-th logit would keep all three 2.0s; rank keeps the lower ids.
    assert _kept([2.0, 2.0, 1.0, 2.0, 0.0, -1.0], Sampling(temperature=1.0, top_k=2)) == [0, 1]
    logits_NV = np.random.default_rng(0).standard_normal((3, 50), np.float32)
    keep_NV = np.isfinite(_warp(logits_NV, Sampling(temperature=0.5, top_k=7)))
    assert np.array_equal(keep_NV, logits_NV >= np.sort(logits_NV, -1)[:, -7:-6])
    assert _kept([0.0] * V, Sampling(temperature=1.0, top_k=V + 5)) == list(range(V))


TOP_P_PROBS = [0.05, 0.5, 0.15, 0.3]  # sorted: 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)


@pytest.mark.parametrize(
    "top_p, top_k, kept",
    [(0.4, 0, [1]), (0.7, 0, [1, 3]), (0.9, 0, [1, 2, 3]), (0.97, 0, [0, 1, 2, 3]), (1.0, 0, [0, 1, 2, 3]),
     # top-p sees the top-k renormalised distribution: 0.5 / 0.8 >= 0.6 keeps one token (0.5 alone would not)
     (0.6, 2, [1])],
)  # fmt: skip
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p, top_k, kept):
    logits = np.log(TOP_P_PROBS)
    sampling = Sampling(temperature=1.0, top_k=top_k, top_p=top_p)
    assert _kept(logits, sampling) == kept
    probs_V = np.exp(_warp(logits.astype(np.float32), sampling))
    np.testing.assert_allclose(
        probs_V[kept], np.asarray(TOP_P_PROBS)[kept] / np.sum(np.asarray(TOP_P_PROBS)[kept]), rtol=1e-5
    )


def test_temperature_scales_logits():
    logits_V = np.random.default_rng(0).standard_normal(V, np.float32)
    expected_V = 2 * logits_V - np.log(np.exp(2 * logits_V).sum())
    np.testing.assert_allclose(_warp(logits_V, Sampling(temperature=0.5)), expected_V, rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs, field",
    [({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"), ({"top_p": 0.0}, "top_p"),
     ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k"), ({"top_k": 2.5}, "top_k"),
     # bounds of the device's types: an int32 top_k, a top_p float32 flushes to 0, an infinite temperature
     ({"top_k": 2**31}, "top_k"), ({"top_p": 1e-39}, "top_p"), ({"temperature": float("inf")}, "temperature")],
)  # fmt: skip
def test_bad_sampling_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"Sampling.{field}: expected .*, got {list(kwargs.values())[0]}"):
        Sampling(**kwargs)
