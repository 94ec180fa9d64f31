"""Shared by the serving tests: the bundled pair (loaded once) and single-request `jaxspec.generate` references."""

import functools

import pytest

from jaxspec import bundled, generate
from tests.serving.support import NUM_STEPS

REF_TOKENS = 24  # references are generated once per prompt with this budget (greedy output for a smaller budget is
# its prefix), so few programs compile; tests ask for at most this many tokens


@pytest.fixture(scope="session")
def pair():
    return bundled.load_pair()


@pytest.fixture(scope="session")
def prompts(pair):
    """Held-out prompts as token ids, cut to mixed lengths (some span several prefill chunks)."""
    tokenizer = pair[2]
    ids = [tokenizer.encode(p) for p in bundled.prompts()]
    lengths = [5, 43, 17, 30, 9, 60, 24, 12]
    return [ids[i % len(ids)][: lengths[i % len(lengths)]] for i in range(8)]


@pytest.fixture(scope="session")
def reference(pair):
    """reference(prompt_ids, max_tokens) -> greedy tokens of a single-request `jaxspec.generate` call."""
    target, drafter, tokenizer = pair

    @functools.cache
    def run(prompt: tuple[int, ...]) -> list[int]:
        out = generate(
            target, drafter, [list(prompt)], max_new_tokens=REF_TOKENS, num_steps=NUM_STEPS, tokenizer=tokenizer
        )
        return out.tokens[0]

    def reference(prompt, max_tokens: int) -> list[int]:
        assert max_tokens <= REF_TOKENS, f"reference: raise REF_TOKENS to {max_tokens}"
        return run(tuple(prompt))[:max_tokens]

    return reference


@pytest.fixture(scope="session")
def coupled_reference(pair):
    """coupled_reference(prompt_ids, max_tokens, spec) -> the tokens plain decoding samples for the prompt with the
    spec's sampling settings and seed, coupled (`jaxspec.generate(..., sampling="coupled")`): what a coupled request
    must give whatever its draft shapes."""
    target, _, tokenizer = pair

    @functools.cache
    def run(prompt: tuple[int, ...], sampling, seed: int) -> list[int]:
        settings = dict(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
        out = generate(
            target, None, [list(prompt)], max_new_tokens=REF_TOKENS, num_steps=0, tokenizer=tokenizer, seed=seed,
            sampling="coupled", **settings,
        )  # fmt: skip
        return out.tokens[0]

    def reference(prompt, max_tokens: int, spec) -> list[int]:
        assert max_tokens <= REF_TOKENS, f"coupled_reference: raise REF_TOKENS to {max_tokens}"
        assert spec.coupled and spec.seed is not None
        return run(tuple(prompt), spec.sampling, spec.seed)[:max_tokens]

    return reference
