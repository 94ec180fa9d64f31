"""The draft vocabulary against a brute-force count, and the deterministic batch order the trainer resumes on."""

from collections import Counter

import numpy as np
import pytest

from jaxspec.training.trainer import batch_indices
from jaxspec.training.vocab import build_draft_vocab, draft_to_target_ids


def brute_force(ids, mask, U, V):
    counts = Counter(int(t) for t, m in zip(ids.ravel(), mask.ravel(), strict=True) if m)
    ranked = sorted(range(V), key=lambda t: (-counts.get(t, 0), t))  # most frequent, then lower id
    used = sorted(ranked[:U])
    return np.array([u - i for i, u in enumerate(used)]), np.isin(np.arange(V), used)


@pytest.mark.parametrize(
    "shape,U,V,skew",
    [((6, 40), 10, 64, 1.5), ((3, 20), 50, 64, 3.0), ((4, 16), 64, 64, 1.0), ((1, 1), 1, 8, 1.0)],
    ids=["typical", "fewer-distinct-than-U", "full-vocab", "single-token"],
)
def test_matches_brute_force(shape, U, V, skew):
    rng = np.random.default_rng(0)
    ids = np.minimum(rng.zipf(skew + 0.01, shape) - 1, V - 1) if skew > 1 else rng.integers(0, V, shape)
    mask = rng.random(shape) < 0.7
    mask.flat[0] = True
    d2t, t2d = build_draft_vocab(ids, mask, U, V)
    want_d2t, want_t2d = brute_force(ids, mask, U, V)
    assert d2t.dtype == np.int64 and d2t.shape == (U,) and t2d.dtype == bool and t2d.shape == (V,)
    np.testing.assert_array_equal(d2t, want_d2t)
    np.testing.assert_array_equal(t2d, want_t2d)
    np.testing.assert_array_equal(draft_to_target_ids(d2t), np.flatnonzero(t2d))


def test_ties_lower_id_and_masked_tokens_ignored():
    ids = np.array([[5, 5, 3, 3, 9, 9, 9, 7, 7, 7]])
    mask = np.array([[1, 1, 1, 1, 1, 1, 1, 0, 0, 0]], bool)  # 7 is frequent but never a loss token
    d2t, t2d = build_draft_vocab(ids, mask, 2, 10)
    np.testing.assert_array_equal(np.flatnonzero(t2d), [3, 9])  # 9 (3x), then 3 before 5 (tie: lower id)
    np.testing.assert_array_equal(d2t, [3, 8])
    # Fewer distinct tokens than U: the lowest unused ids fill the rest.
    _, t2d = build_draft_vocab(ids, mask, 5, 10)
    np.testing.assert_array_equal(np.flatnonzero(t2d), [0, 1, 3, 5, 9])


@pytest.mark.parametrize(
    "args,match",
    [
        ((np.zeros((2, 3), int), np.ones((2, 2), bool), 2, 8), r"loss_mask: expected the token ids' shape \(2, 3\)"),
        ((np.full((1, 2), 9), np.ones((1, 2), bool), 2, 8), r"token ids must be in \[0, vocab_size=8\)"),
        ((np.zeros((1, 2), int), np.ones((1, 2), bool), 9, 8), r"draft_vocab_size: expected an integer in \[1, "),
        ((np.zeros((1, 2), int), np.ones((1, 2), bool), 0, 8), r"draft_vocab_size"),
    ],
)
def test_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        build_draft_vocab(*args)


def test_batch_order_is_a_function_of_seed_and_step():
    n, b = 10, 4
    seen = np.concatenate([batch_indices(3, s, b, n) for s in range(5)])  # 20 rows = 2 epochs
    assert sorted(seen[:10]) == list(range(n)) and sorted(seen[10:]) == list(range(n))  # each epoch a permutation
    np.testing.assert_array_equal(batch_indices(3, 2, b, n), batch_indices(3, 2, b, n))
    assert not np.array_equal(seen[:10], np.concatenate([batch_indices(4, s, b, n) for s in range(3)])[:10])
