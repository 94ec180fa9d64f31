"""Token logprobs in OpenAI's response shapes, from the engine's scores (`plan.TokenLogprob`: a token's logprob and
the top MAX_TOP_LOGPROBS ids and logprobs at its position, from the target's raw logits).

- completions (`logprobs: N`): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, where each
  top_logprobs entry maps the N best tokens' text to their logprob, the chosen token included (so N or N + 1
  entries, as OpenAI and vLLM give); with `echo` the prompt's tokens come first, the first one unscored (None);
- chat (`logprobs: true`, `top_logprobs: N`): `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`.
A token's text is its own decoding (a piece of a multi-byte character decodes to U+FFFD, as in vLLM).
"""

from __future__ import annotations

from typing import Any

from jaxspec.serving.plan import TokenLogprob


def completion_logprobs(
    tokenizer, tokens: list[int], scores: list[TokenLogprob | None], top: int, offset: int = 0
) -> dict[str, list]:
    """The completions `logprobs` object of `tokens` (their `scores`, None: unscored), text offsets from `offset`."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, score in zip(tokens, scores, strict=True):
        text = tokenizer.decode([token])
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if score is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        logprob, ids, logprobs = score
        best = {tokenizer.decode([i]): lp for i, lp in zip(ids[:top], logprobs[:top], strict=True)}
        best.setdefault(text, logprob)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(best)
    return out


def chat_logprobs(tokenizer, tokens: list[int], scores: list[TokenLogprob], top: int) -> dict[str, Any]:
    """The chat `logprobs` object of `tokens` with their `scores` and `top` alternatives each."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = [
        entry(t, lp) | {"top_logprobs": [entry(i, x) for i, x in zip(ids[:top], lps[:top], strict=True)]}
        for t, (lp, ids, lps) in zip(tokens, scores, strict=True)
    ]
    return {"content": content}
