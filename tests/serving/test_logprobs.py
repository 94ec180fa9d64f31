"""Token logprobs and min_tokens on the device (the serving engine's per-row program): a greedy speculative run
reports what plain decoding reports, both equal one full forward of the final sequence, echo scores the prompt from
its prefill, a sampled run's scores are the target's raw ones (no temperature or top-k), and min_tokens masks the
stop ids in both alike."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxspec.decoding import DraftShape
from jaxspec.decoding.sampling import Sampling
from jaxspec.decoding.sampling_params import MAX_TOP_LOGPROBS, RowSpec
from jaxspec.serving.engine import Engine, Request
from tests.serving.support import ENGINE as CONFIG
from tests.serving.support import TREE_ENGINE as TREE

TOL = 1e-4  # float32 on the bundled pair


@pytest.fixture(scope="module")
def engines(pair):
    """The speculative engine of test_engine (its programs compile once per session) and a plain one."""
    target, drafter, tokenizer = pair
    spec = Engine(target, drafter, CONFIG, stop_ids=tokenizer.stop_ids)
    plain = Engine(target, None, dataclasses.replace(CONFIG, draft=DraftShape(0)), stop_ids=tokenizer.stop_ids)
    return spec, plain


def run(engine: Engine, requests: list[Request]) -> list[Request]:
    for r in requests:
        engine.submit(r)
    engine.run_until_idle()
    assert all(r.finished for r in requests)
    return requests


def forward_scores(target, sequence: list[int]) -> np.ndarray:
    """log-softmax [T, V] of one full forward over `sequence` (no cache): row p scores token p + 1."""
    return np.asarray(jax.nn.log_softmax(target.logits([sequence])[0].astype(np.float32), axis=-1))


def check_against_forward(scores, lp_TV: np.ndarray, tokens: list[int], first: int) -> None:
    """`scores` (TokenLogprobs of tokens[first:]) equal the forward's at positions first-1..: the token's logprob,
    and the top ids / logprobs."""
    assert len(scores) == len(tokens) - first
    for i, (lp, ids, tops) in enumerate(scores):
        p = first + i - 1
        assert abs(lp - lp_TV[p, tokens[p + 1]]) < TOL, (i, lp, lp_TV[p, tokens[p + 1]])
        assert len(ids) == len(tops) == MAX_TOP_LOGPROBS and list(tops) == sorted(tops, reverse=True)
        np.testing.assert_allclose(tops, lp_TV[p, list(ids)], atol=TOL)
        assert tops[0] == pytest.approx(lp_TV[p].max(), abs=TOL)


def test_greedy_speculative_logprobs_equal_plain_decoding_and_one_full_forward(engines, pair, prompts):
    spec, plain = engines
    asks = [(prompts[1], 14), (prompts[4], 9)]  # 43 tokens (3 prefill chunks of 16) and 9 (one)
    got = run(spec, [Request(p, n, RowSpec(logprobs=True), echo=True) for p, n in asks])
    want = run(plain, [Request(p, n, RowSpec(logprobs=True), echo=True) for p, n in asks])
    target = pair[0]
    for g, w in zip(got, want, strict=True):
        assert g.tokens == w.tokens and len(g.token_logprobs) == len(g.tokens)
        for a, b in zip(g.token_logprobs + g.prompt_logprobs, w.token_logprobs + w.prompt_logprobs, strict=True):
            assert abs(a[0] - b[0]) < TOL and a[1] == b[1]
            np.testing.assert_allclose(a[2], b[2], atol=TOL)
        sequence = g.prompt + g.tokens
        lp_TV = forward_scores(target, sequence)
        check_against_forward(g.token_logprobs, lp_TV, sequence, len(g.prompt))
        check_against_forward(g.prompt_logprobs, lp_TV, g.prompt, 1)  # echo: every prompt token but the first
        # greedy: each generated token is the target's best
        assert [t[1][0] for t in g.token_logprobs] == g.tokens


def test_sampled_logprobs_are_the_targets_raw_scores_and_rows_without_them_are_unaffected(engines, pair, prompts):
    spec, _ = engines
    settings = Sampling(0.7, top_k=5)
    scored = Request(prompts[2], 12, RowSpec(settings, seed=3, logprobs=True))
    bare = Request(prompts[2], 12, RowSpec(settings, seed=3))
    run(spec, [scored, bare])
    assert scored.tokens == bare.tokens  # scoring changes nothing of what is generated
    assert bare.token_logprobs == [] and bare.prompt_logprobs is None and scored.prompt_logprobs is None
    sequence = scored.prompt + scored.tokens
    check_against_forward(scored.token_logprobs, forward_scores(pair[0], sequence), sequence, len(scored.prompt))


def test_min_tokens_masks_stop_ids_and_greedy_speculative_equals_plain(engines, prompts, reference):
    """A stop id the greedy output meets at token k cannot end it before min_tokens: spec == plain decoding with the
    same mask, the masked position takes the best token that is not a stop id (the raw scores still rank the stop id
    first), and without min_tokens the request stops there."""
    spec, plain = engines
    ref = reference(prompts[5], 12)
    k = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i])
    stop = (ref[k],)
    assert run(spec, [Request(prompts[5], 12, RowSpec(stop_ids=stop))])[0].tokens == ref[: k + 1]
    asks = lambda: [Request(prompts[5], 12, RowSpec(stop_ids=stop, min_new=k + 3, logprobs=True))]  # noqa: E731
    (got,), (want,) = run(spec, asks()), run(plain, asks())
    assert got.tokens == want.tokens and got.tokens[:k] == ref[:k] and stop[0] not in got.tokens[: k + 3]
    top_ids = got.token_logprobs[k][1]
    assert top_ids[0] == stop[0] and got.tokens[k] == top_ids[1]


@pytest.mark.slow  # test budget (the default suite reached 31 minutes): ~21 s; test_logprobs_loop keeps trees
def test_tree_logprobs_equal_one_full_forward(pair, prompts):
    """A tree draft's scores come from the verify logits of the accepted path's nodes (the engine of
    test_engine_tree, whose programs compile once per session): a greedy and a sampled request."""

    target, drafter, tokenizer = pair
    engine = Engine(target, drafter, TREE, stop_ids=tokenizer.stop_ids)
    asks = [
        Request(prompts[1], 14, RowSpec(logprobs=True)),
        Request(prompts[3], 10, RowSpec(Sampling(0.8), seed=4, logprobs=True)),
    ]
    for r in run(engine, asks):
        sequence = r.prompt + r.tokens
        check_against_forward(r.token_logprobs, forward_scores(target, sequence), sequence, len(r.prompt))
