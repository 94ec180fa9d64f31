"""The output of one HTTP request's choices: each choice's text, echo and logprobs as its engine updates arrive, the
usage of the whole request, and the response in OpenAI's shapes (one body, or server-sent events for a stream).

`Run` holds the engine requests of one HTTP request (one per choice) and the queue their updates arrive on from the
engine's thread; `completion` and `sse` turn its choices into OpenAI's text_completion / chat.completion objects.
Each choice carries what speculation did for it (`metrics.speculative_decoding`, speculation.py: on the choice, and
its final chunk when streamed), and the response's root carries the whole request's, where vLLM puts it and aiperf
reads it (once per response: on the last chunk of a stream).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from jaxspec.decoding.sampling_params import RowSpec
from jaxspec.serving.engine import Engine, QueueFull
from jaxspec.serving.engine import Request as EngineRequest
from jaxspec.serving.logprobs import chat_logprobs, completion_logprobs
from jaxspec.serving.protocol import GenerateParams
from jaxspec.serving.speculation import Speculation
from jaxspec.serving.text import ChoiceText


@dataclasses.dataclass(eq=False)
class Choice:
    index: int
    prompt: list[int]
    max_tokens: int
    spec: RowSpec  # its settings (seed None: the engine draws one)
    text: ChoiceText
    request: EngineRequest | None = None  # the engine request running now
    reason: str | None = None  # finish reason, once finished
    # logprobs: the scores of every token taken (text.tokens is a prefix of those), how many of the running engine
    # request's were taken, the echoed prompt's scores (its first token None), and what a stream has sent
    scores: list = dataclasses.field(default_factory=list)
    taken: int = 0
    prefix: str | None = None  # the echoed prompt's text, once echoed
    prompt_scores: list = dataclasses.field(default_factory=list)
    sent: int = -1  # tokens whose scores a stream sent; -1: not even the echoed prompt's
    offset: int = 0  # text offset of the next token a stream sends
    speculation: Speculation | None = None  # as of the update that finished it (the engine's thread keeps counting)


class Run:
    """The engine requests of one HTTP request and their updates (an asyncio queue fed from the engine thread)."""

    def __init__(self, engine: Engine, tokenizer, body: GenerateParams, choices: list[Choice], chat: bool):
        self.engine, self.tokenizer, self.body, self.choices, self.chat = engine, tokenizer, body, choices, chat
        self.top = body.top_logprobs_count  # None: no logprobs
        self.echo = not chat and bool(body.echo)
        self.updates: asyncio.Queue = asyncio.Queue()
        self._loop = asyncio.get_running_loop()

    def start(self) -> None:
        """Submit every choice; on QueueFull or ValueError (raised), cancel those already submitted."""
        try:
            for c in self.choices:
                self._submit(c)
        except (QueueFull, ValueError):
            self.cancel()
            raise

    def _submit(self, c: Choice) -> None:
        r = EngineRequest(list(c.prompt), max(c.max_tokens, 1), c.spec, echo=self.echo and self.top is not None)
        put = self.updates.put_nowait
        r.on_update = lambda r, new, i=c.index: self._loop.call_soon_threadsafe(
            put, (i, r, new, r.finish_reason, r.speculation)
        )
        self.engine.submit(r)
        c.request, c.taken = r, 0

    def cancel(self) -> None:
        for c in self.choices:
            if c.request is not None and not c.request.finished:
                self.engine.cancel(c.request)

    def apply(self, c: Choice, r: EngineRequest, new: list[int], reason: str | None, spec=None) -> str | None:
        """Take one engine update of choice `c` (with its request's speculation then, `spec`); the text delta to
        send, or None for a stale update."""
        if r is not c.request or c.reason is not None:
            return None  # from a part that a stop string ended, or after the choice finished
        c.speculation = spec
        if self.top is not None:
            c.scores.extend(r.token_logprobs[c.taken : c.taken + len(new)])
            c.taken += len(new)
        delta = self._echo(c, r)
        if c.max_tokens == 0:  # echo only: the prompt (and its scores), nothing generated
            self.engine.cancel(r, "length")
            c.reason = "length"
            return delta
        delta += c.text.push(new)
        if c.text.stopped:
            self.engine.cancel(r, "stop")  # frees the slot at once
            c.reason = "stop"
        elif reason is not None:
            delta += c.text.finish()
            c.reason = reason
        return delta

    def _echo(self, c: Choice, r: EngineRequest) -> str:
        """With echo, the prompt's text (and scores) at the choice's first update; else ''."""
        if not self.echo or c.prefix is not None:
            return ""
        c.prefix = self.tokenizer.decode(c.prompt)
        if self.top is not None:
            c.prompt_scores = [None, *(r.prompt_logprobs or [])]
        return c.prefix

    def logprobs(self, c: Choice, stream: bool = False) -> dict[str, Any] | None:
        """The `logprobs` object of choice `c`: all its tokens (the echoed prompt's first), or with `stream` those
        not sent yet. None without logprobs."""
        if self.top is None:
            return None
        end = len(c.text.tokens)
        tokens, scores = c.text.tokens[max(c.sent, 0) : end], c.scores[max(c.sent, 0) : end]
        if c.sent < 0 and c.prefix is not None:
            tokens, scores = c.prompt + tokens, c.prompt_scores + scores
        if stream:
            c.sent = max(c.sent, end)
            if not tokens:
                return None
        if self.chat:
            return chat_logprobs(self.tokenizer, tokens, scores, self.top)
        out = completion_logprobs(self.tokenizer, tokens, scores, self.top, c.offset if stream else 0)
        if stream:
            c.offset += sum(len(t) for t in out["tokens"])
        return out

    async def events(self, next_update: Callable) -> AsyncIterator[tuple[int, str, str | None]]:
        """(choice index, text delta, finish reason or None) until every choice has finished; cancels what is left
        if abandoned."""
        try:
            left = len(self.choices)
            while left:
                i, r, new, reason, spec = await next_update()
                c = self.choices[i]
                delta = self.apply(c, r, new, reason, spec)
                if delta is None or not (delta or c.reason):
                    continue
                yield i, delta, c.reason
                left -= c.reason is not None
                if c.reason == "error":
                    return
        finally:
            self.cancel()

    def metrics(self, c: Choice | None = None) -> dict[str, Any]:
        """The `metrics` object of choice `c` (None: of the whole request, every choice's counts together)."""
        depth = self.engine.config.draft.num_steps
        of = lambda c: c.speculation or Speculation(depth)  # noqa: E731 (a choice never admitted: nothing)
        spec = of(c) if c is not None else Speculation.total(of(c) for c in self.choices)
        return {"speculative_decoding": spec.to_dict()}

    def usage(self, prompts: list[list[int]]) -> dict[str, Any]:
        """Token counts, each prompt once whatever n is (as OpenAI), with its tokens reused from the prefix cache
        (`prompt_tokens_details.cached_tokens`, as its first choice reused them)."""
        done = sum(len(c.text.tokens) for c in self.choices)
        prompt = sum(len(p) for p in prompts)
        firsts = self.choices[:: len(self.choices) // len(prompts)]
        cached = sum(c.request.cached_tokens for c in firsts if c.request is not None)
        counts = {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}
        return counts | {"prompt_tokens_details": {"cached_tokens": cached}}


def completion(header: dict, chat: bool, run: Run, usage: dict) -> dict[str, Any]:
    """The non-streaming response body (OpenAI's text_completion or chat.completion object)."""
    out = []
    for c in run.choices:
        body: dict[str, Any] = {"index": c.index, "finish_reason": c.reason, "logprobs": run.logprobs(c)}
        if chat:
            body["message"] = {"role": "assistant", "content": c.text.text}
        else:
            body["text"] = (c.prefix or "") + c.text.text
        out.append(body | {"metrics": run.metrics(c)})
    kind = "chat.completion" if chat else "text_completion"
    return {**header, "object": kind, "choices": out, "usage": usage, "metrics": run.metrics()}


async def sse(events, header: dict, chat: bool, run: Run, usage: Callable | None) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format; a chunk carries the logprobs of the tokens it completes, and a
    choice's final chunk its `metrics`. With stream_options.include_usage (`usage` given), the usage comes on one
    extra chunk with no choices after the last choice has finished, and nowhere else (as OpenAI); the request's
    `metrics` come on that chunk (as vLLM's), else on the last choice's final chunk: on one chunk only, as aiperf
    counts them once per request."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    left = len(run.choices)

    def event(choices, **extra) -> str:
        return f"data: {json.dumps({**header, 'object': kind, 'choices': choices, **extra})}\n\n"

    def choice(i: int, text: str | None, reason: str | None, first: bool = False) -> dict[str, Any]:
        logprobs = None if first else run.logprobs(run.choices[i], stream=True)
        metrics = {"metrics": run.metrics(run.choices[i])} if reason is not None else {}
        if chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            return {"index": i, "delta": delta, "finish_reason": reason, "logprobs": logprobs, **metrics}
        return {"index": i, "text": text or "", "finish_reason": reason, "logprobs": logprobs, **metrics}

    if chat:
        for i in range(len(run.choices)):
            yield event([choice(i, None, None, first=True)])
    async for i, text, reason in events:
        if reason == "error":
            yield f"data: {json.dumps({'error': {'message': 'the engine failed', 'type': 'server_error'}})}\n\n"
            return
        if text:
            yield event([choice(i, text, None)])
        if reason is not None:
            left -= 1
            root = {"metrics": run.metrics()} if not left and usage is None else {}
            yield event([choice(i, None, reason)], **root)
    if usage is not None:
        yield event([], usage=usage(), metrics=run.metrics())
    yield "data: [DONE]\n\n"
