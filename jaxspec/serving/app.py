"""The OpenAI-compatible HTTP API over an `Engine`: /v1/completions, /v1/chat/completions (both with `stream`),
/v1/models, /health and /metrics.

Errors use OpenAI's body, `{"error": {"message", "type", "param", "code"}}`: 400 for malformed JSON, unknown fields,
out-of-range parameters and prompts that do not fit the context; 404 for another model name; 429 when the admission
queue is full. Text stop sequences (`stop`) are matched here on the decoded text (the engine stops on token ids):
the text is cut before the match and the request's slot is freed at once. A client that disconnects cancels its
request, which frees its slot.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException

from jaxspec.decoding.sampling import Sampling
from jaxspec.serving.engine import MAX_STOP_IDS, Engine, QueueFull
from jaxspec.serving.engine import Request as EngineRequest
from jaxspec.tokenizer import ChatTemplateError

log = logging.getLogger("jaxspec.serving")
MAX_STOP_STRINGS = 4  # as OpenAI


class _Params(BaseModel):
    """Fields both endpoints take. Unknown fields are rejected; OpenAI fields this server does not implement are
    accepted only at their neutral value (n = 1, no logprobs, no penalties)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # extension (as vLLM): 0 = off
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = Field(None, validate_default=True)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=MAX_STOP_IDS)  # extension (as vLLM)
    stream: bool = False
    stream_options: dict[Literal["include_usage"], bool] | None = None
    n: Literal[1] = 1
    user: str | None = None
    logprobs: Literal[None, False] = None
    presence_penalty: Literal[0, 0.0] = 0.0
    frequency_penalty: Literal[0, 0.0] = 0.0

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise ValueError(f"expected at most {MAX_STOP_STRINGS} non-empty strings")
        return stops


class CompletionRequest(_Params):
    prompt: str | list[int] = Field(min_length=1)
    echo: Literal[False] = False


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatRequest(_Params):
    messages: list[Message] = Field(min_length=1)


def _error(status: int, message: str, kind: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


class _Disconnected(Exception):
    """The client of a non-streaming request went away."""


class _BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


def create_app(engine: Engine, tokenizer, model_name: str, *, chat_format: str = "auto") -> FastAPI:
    """The app around a warmed-up `engine` (started and stopped with the app's lifespan).

    chat_format: "kimi" (the tokenizer's built-in chat template), "plain" (`role: content` lines, for vocabularies
    without chat tokens, such as the bundled pair's) or "auto" (kimi when the vocabulary has its tokens).
    """
    chat_format = _resolve_chat_format(tokenizer, chat_format)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        log.info(
            "engine started: %d slots, k = %d, chat format %s",
            engine.config.max_batch,
            engine.config.num_steps,
            chat_format,
        )
        yield
        # uvicorn has drained the open connections (in-flight requests finished) before it gets here on SIGTERM.
        engine.stop()
        log.info("engine stopped")

    app = FastAPI(title="jaxspec", lifespan=lifespan)
    app.state.engine, app.state.chat_format = engine, chat_format

    _add_error_handlers(app)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "jaxspec"}]}

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render() if engine.metrics else b"", media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        if isinstance(body.prompt, str):
            prompt = tokenizer.encode(body.prompt)
        else:
            prompt = body.prompt
        return await _serve(engine, tokenizer, model_name, body, prompt, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        messages = [m.model_dump(exclude_none=True, exclude={"name"}) for m in body.messages]
        prompt = tokenizer.encode(_render_chat(tokenizer, messages, chat_format))
        return await _serve(engine, tokenizer, model_name, body, prompt, request, chat=True)

    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as an OpenAI-style body: bad input 400, overload 429, anything unexpected 500 (logged)."""

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return _error(400, f"malformed JSON body: {first.get('msg')}", "invalid_request_error")
        msg = "; ".join(f"{'.'.join(str(x) for x in e['loc'] if x != 'body')}: {e['msg']}" for e in exc.errors())
        return _error(400, msg, "invalid_request_error", ".".join(loc) or None)

    @app.exception_handler(HTTPException)
    async def http_error(_request, exc: HTTPException):
        return _error(exc.status_code, str(exc.detail), "invalid_request_error")

    @app.exception_handler(Exception)
    async def unexpected(_request, exc: Exception):
        log.exception("unexpected error", exc_info=exc)
        return _error(500, f"internal error: {type(exc).__name__}", "server_error")

    @app.exception_handler(_BadRequest)
    async def bad_request(_request, exc: _BadRequest):
        kind = "rate_limit_error" if exc.status == 429 else "invalid_request_error"
        return _error(exc.status, str(exc), kind, exc.param, exc.code)


def _resolve_chat_format(tokenizer, chat_format: str) -> str:
    if chat_format not in ("auto", "kimi", "plain"):
        raise ValueError(f"chat_format: expected 'auto', 'kimi' or 'plain', got {chat_format!r}")
    if chat_format == "plain":
        return chat_format
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])
        return "kimi"
    except ChatTemplateError as e:
        if chat_format == "kimi":
            raise
        log.warning("chat: %s; /v1/chat/completions renders messages as plain 'role: content' lines", e)
        return "plain"


def _render_chat(tokenizer, messages: list[dict[str, str]], chat_format: str) -> str:
    if chat_format == "kimi":
        return tokenizer.apply_chat_template(messages)
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


def _engine_request(engine: Engine, body: _Params, prompt: list[int], chat: bool) -> EngineRequest:
    vocab = engine.target.vocab_size
    bad = [t for t in (*prompt, *body.stop_token_ids) if not 0 <= t < vocab]
    if bad:
        raise _BadRequest(f"token ids must be in [0, {vocab}); got {bad[:5]}", "prompt")
    cfg = engine.config
    room = cfg.max_context - len(prompt) - cfg.lookahead - 1
    max_tokens = body.max_tokens if body.max_tokens is not None else (max(room, 1) if chat else min(16, max(room, 1)))
    problem = engine.check(len(prompt), max_tokens)
    if problem:
        raise _BadRequest(problem, "max_tokens" if room > 0 else "prompt", "context_length_exceeded")
    sampling = Sampling(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p)
    seed = None if body.seed is None else body.seed % 2**32
    return EngineRequest(list(prompt), max_tokens, sampling, seed, tuple(body.stop_token_ids))


class _Output:
    """The text of a request as its tokens arrive: stop ids left out, cut at a stop string, deltas held back while
    they could still be the start of a stop string or of a multi-byte character."""

    def __init__(self, tokenizer, stop_ids: set[int], stops: list[str]):
        self.tokenizer, self.stop_ids, self.stops = tokenizer, stop_ids, stops
        self.tokens: list[int] = []
        self.sent = 0  # characters handed out
        self.text = ""
        self.stopped = False  # a stop string matched

    def push(self, new: list[int], final: bool) -> str:
        self.tokens.extend(new)
        ids = self.tokens[:-1] if self.tokens and self.tokens[-1] in self.stop_ids else self.tokens
        text = self.tokenizer.decode(ids)
        hits = [at for at in (text.find(s) for s in self.stops) if at >= 0]
        if hits:
            text, self.stopped = text[: min(hits)], True
        hold = 0
        if not self.stopped and not final:
            hold = max([len(s) - 1 for s in self.stops] + [0])
            if text.endswith("\ufffd"):
                hold = max(hold, 1)
        self.text = text
        end = max(len(text) - hold, self.sent)
        delta, self.sent = text[self.sent : end], end
        return delta


def _submit(engine: Engine, model_name: str, body: _Params, prompt, chat: bool) -> tuple[EngineRequest, asyncio.Queue]:
    """Queue the request with the engine; its updates arrive on the returned asyncio queue (from the engine thread)."""
    if body.model != model_name:
        raise _BadRequest(
            f"model {body.model!r} does not exist; this server serves {model_name!r}",
            "model",
            "model_not_found",
            status=404,
        )
    request = _engine_request(engine, body, prompt, chat)
    loop = asyncio.get_running_loop()
    updates: asyncio.Queue = asyncio.Queue()
    request.on_update = lambda r, new: loop.call_soon_threadsafe(updates.put_nowait, (new, r.finish_reason))
    try:
        engine.submit(request)
    except QueueFull as e:
        raise _BadRequest(str(e), status=429, code="queue_full") from None
    except ValueError as e:
        raise _BadRequest(str(e), "prompt") from None
    return request, updates


async def _serve(engine, tokenizer, model_name, body: _Params, prompt, http: Request, chat: bool):
    request, updates = _submit(engine, model_name, body, prompt, chat)
    output = _Output(tokenizer, set(engine.stop_ids) | set(body.stop_token_ids), body.stop)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())

    async def next_update():
        if body.stream:  # StreamingResponse itself cancels the stream when the client goes away
            return await updates.get()
        while True:
            try:
                return await asyncio.wait_for(updates.get(), timeout=0.5)
            except TimeoutError:
                if await http.is_disconnected():
                    raise _Disconnected from None

    async def deltas() -> AsyncIterator[tuple[str, str | None]]:
        """(text delta, finish reason or None) until the request finishes; cancels it if abandoned."""
        try:
            while True:
                new, reason = await next_update()
                delta = output.push(new, reason is not None)
                if output.stopped and reason is None:
                    engine.cancel(request, "stop")  # frees the slot; the engine's final update follows
                    continue
                yield delta, ("stop" if output.stopped else reason) if reason is not None else None
                if reason is not None:
                    return
        finally:
            if not request.finished:
                engine.cancel(request)

    usage = lambda: {  # noqa: E731
        "prompt_tokens": len(prompt),
        "completion_tokens": len(request.tokens),
        "total_tokens": len(prompt) + len(request.tokens),
    }
    if body.stream:
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        return StreamingResponse(
            _sse(deltas(), rid, created, model_name, chat, usage, include_usage), media_type="text/event-stream"
        )
    reason = None
    try:
        async for _, finish in deltas():
            reason = finish
    except _Disconnected:
        return Response(status_code=499)  # nobody reads it; the request is cancelled and its slot freed
    if reason == "error":
        return _error(500, "the engine failed while running this request", "server_error")
    return _completion(rid, created, model_name, chat, output.text, reason, usage())


def _completion(rid: str, created: int, model_name: str, chat: bool, text: str, reason, usage) -> dict[str, Any]:
    """The non-streaming response body (OpenAI's completion or chat.completion object)."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    kind = "chat.completion" if chat else "text_completion"
    return {"id": rid, "object": kind, "created": created, "model": model_name, "choices": [choice], "usage": usage}


async def _sse(deltas, rid, created, model_name, chat, usage, include_usage) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format; `usage` rides on the final chunk (and, with
    stream_options.include_usage, also on an extra chunk with no choices, as OpenAI sends it)."""
    kind = "chat.completion.chunk" if chat else "text_completion"

    def event(choices, **extra) -> str:
        chunk = {"id": rid, "object": kind, "created": created, "model": model_name, "choices": choices, **extra}
        return f"data: {json.dumps(chunk)}\n\n"

    def choice(text: str | None, reason: str | None, first: bool = False) -> dict[str, Any]:
        if chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            return {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
        return {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}

    if chat:
        yield event([choice(None, None, first=True)])
    async for text, reason in deltas:
        if reason is None:
            if text:
                yield event([choice(text, None)])
            continue
        if reason == "error":
            yield f"data: {json.dumps({'error': {'message': 'the engine failed', 'type': 'server_error'}})}\n\n"
            return
        if text:
            yield event([choice(text, None)])
        yield event([choice(None, reason)], usage=usage())
        if include_usage:
            yield event([], usage=usage())
    yield "data: [DONE]\n\n"
