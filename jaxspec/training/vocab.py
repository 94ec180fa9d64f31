"""The EAGLE-3 draft vocabulary: the `draft_vocab_size` most frequent target tokens of the training targets.

The rule: count the target tokens over the loss-masked positions, keep the U most
frequent (ties: the lower id first), sort them by id (`used`); then `d2t[i] = used[i] - i` (int64 offsets, draft id
i is target id i + d2t[i]) and `t2d[t] = t in used`. When fewer than U distinct tokens occur, the lowest unused ids
fill the rest, so the vocabulary is always exactly U long (an lm_head row per draft id).
"""

from __future__ import annotations

import numpy as np


def token_counts(token_ids, loss_mask, vocab_size: int) -> np.ndarray:
    """How often each target id occurs at loss-masked positions: int64 [V]."""
    ids, mask = np.asarray(token_ids), np.asarray(loss_mask)
    if ids.shape != mask.shape:
        raise ValueError(f"loss_mask: expected the token ids' shape {ids.shape}, got {mask.shape}")
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"token_ids: expected integers, got {ids.dtype}")
    picked = ids[mask.astype(bool)].astype(np.int64)
    if picked.size and (picked.min() < 0 or picked.max() >= vocab_size):
        raise ValueError(f"token ids must be in [0, vocab_size={vocab_size}); got [{picked.min()}, {picked.max()}]")
    return np.bincount(picked, minlength=vocab_size)


def build_draft_vocab(token_ids, loss_mask, draft_vocab_size: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(d2t int64 [U], t2d bool [V]) from token ids and their loss mask (any matching shapes, e.g. [B, T])."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int | np.integer) or vocab_size < 1:
        raise ValueError(f"vocab_size: expected a positive integer, got {vocab_size!r}")
    U = draft_vocab_size
    if isinstance(U, bool) or not isinstance(U, int | np.integer) or not 0 < U <= vocab_size:
        raise ValueError(f"draft_vocab_size: expected an integer in [1, vocab_size={vocab_size}], got {U!r}")
    counts = token_counts(token_ids, loss_mask, vocab_size)
    # lexsort: the last key is primary. Most frequent first, then the lower id; unused ids (count 0) come last in
    # id order, so they fill a short vocabulary with the lowest unused ids.
    order = np.lexsort((np.arange(vocab_size), -counts))
    used = np.sort(order[:U]).astype(np.int64)
    t2d = np.zeros(vocab_size, bool)
    t2d[used] = True
    return used - np.arange(U, dtype=np.int64), t2d


def draft_to_target_ids(d2t: np.ndarray) -> np.ndarray:
    """The target id of every draft id: `arange(U) + d2t`, int64 [U]."""
    d2t = np.asarray(d2t, np.int64)
    return np.arange(d2t.shape[0], dtype=np.int64) + d2t
