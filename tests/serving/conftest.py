"""Shared by the serving tests: the bundled pair (loaded once) and single-request `jaxspec.generate` references."""

import functools

import pytest

from jaxspec import bundled, generate

NUM_STEPS = 3  # the depth both the engine tests and the test server run


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
    def run(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
        out = generate(
            target, drafter, [list(prompt)], max_new_tokens=max_tokens, num_steps=NUM_STEPS, tokenizer=tokenizer
        )
        return out.tokens[0]

    return lambda prompt, max_tokens: run(tuple(prompt), max_tokens)
