"""The OpenAI-compatible HTTP API over an `Engine`: /v1/completions, /v1/chat/completions (both with `stream`),
/v1/models (and /v1/models/{id}), /tokenize and /detokenize (vLLM's shapes), /version, /health and /metrics; HEAD
wherever GET works. The request bodies are in `protocol.py`; each choice's output (text, echo, logprobs) and the
usage are accounted in `choices.py`, the text of a choice is built in `text.py`.

Errors use OpenAI's body, `{"error": {"message", "type", "param", "code"}}`: 400 for malformed JSON, unknown fields,
out-of-range parameters, text that is not valid Unicode, fields this server does not implement (named) and prompts
that do not fit the context (the message states the rule); 404 for another model name (checked before tokenizing);
429 when the admission queue is full; 401, 413 and 408 from `access.py` (API keys, body size, body-read time).
Tokenizing runs on a worker thread (`_Encoder`), and user text is encoded as text (only the chat template's markers
are special tokens; `allow_special` opts completions prompts in). Text stop sequences (`stop`) are matched here on the
decoded text (the engine stops on token ids): the text is cut before the match and the request's slot is freed at
once. A client that disconnects cancels its requests, which frees their slots.

One HTTP request becomes one engine request per choice: a list of prompts gives one choice per prompt, `n` gives n
choices per prompt (index = prompt * n + j), each with its own seed derived from the request's `seed`
(`derive_seed`). `ignore_eos` is the row's own flag on the device: the model's eos does not stop it (the request's
`stop_token_ids` still do), as vLLM applies it.
Logprobs (`logprobs`, chat's `top_logprobs`) and `echo` come from the engine's scores (`logprobs.py` gives them
OpenAI's shapes); `max_tokens: 0` with `echo` runs one token and drops it, returning only the scored prompt.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.metadata
import logging
import time
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from jaxspec.decoding.sampling_params import SAMPLING_DEFAULT, SAMPLING_MODES, derive_seed
from jaxspec.serving.access import TENANT, AccessConfig, Guard, cache_partition
from jaxspec.serving.choices import Choice, Run, completion, sse
from jaxspec.serving.engine import Engine, QueueFull
from jaxspec.serving.protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    FieldError,
    GenerateParams,
    Message,
    TokenizeRequest,
)
from jaxspec.serving.text import ChoiceText
from jaxspec.tokenizer import ChatTemplateError

log = logging.getLogger("jaxspec.serving")
GET = ["GET", "HEAD"]


def _error(status: int, message: str, kind: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


class _Disconnected(Exception):
    """The client of a non-streaming request went away."""


class _BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


def create_app(
    engine: Engine,
    tokenizer,
    model_name: str,
    *,
    chat_format: str = "auto",
    access: AccessConfig | None = None,
    allow_special: bool = False,
    sampling: str = SAMPLING_DEFAULT,
) -> FastAPI:
    """The app around a warmed-up `engine` (started and stopped with the app's lifespan).

    chat_format: "kimi" (the tokenizer's built-in chat template), "plain" (`role: content` lines, for vocabularies
    without chat tokens, such as the bundled pair's) or "auto" (kimi when the vocabulary has its tokens).
    access: API keys, the prefix cache's partition by key, and the body limits (`access.py`). allow_special: a
    completions prompt's special-token text becomes those tokens (off: it is plain text, as chat messages always are).
    sampling: how sampled choices are verified unless a request says ("coupled", "rejection", or "auto": coupled
    for requests with a seed, so a seed reproduces its text whatever the load; `SAMPLING_MODES`).
    """
    if sampling not in SAMPLING_MODES:
        raise ValueError(f"sampling: expected one of {', '.join(SAMPLING_MODES)}, got {sampling!r}")
    text = _Encoder(tokenizer, _resolve_chat_format(tokenizer, chat_format), allow_special)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        log.info(
            "engine started: %d slots, draft %s, chat format %s",
            engine.config.max_batch,
            engine.config.draft.label,
            text.chat_format,
        )
        yield
        # uvicorn has drained the open connections (in-flight requests finished) before it gets here on SIGTERM.
        engine.stop()
        text.pool.shutdown()
        log.info("engine stopped")

    app = FastAPI(title="jaxspec", lifespan=lifespan)
    app.state.engine, app.state.chat_format, app.state.sampling = engine, text.chat_format, sampling
    app.add_middleware(Guard, config=access or AccessConfig())
    _add_error_handlers(app)
    _add_info_routes(app, engine, text, model_name)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(body.model, model_name)  # before any tokenizing
        prompts = await text.run(lambda: [text.prompt(p) if isinstance(p, str) else p for p in body.prompts()])
        return await _serve(engine, tokenizer, model_name, body, prompts, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        _check_model(body.model, model_name)
        messages = _messages(body.messages)
        prompt = await text.run(text.chat, messages)
        return await _serve(engine, tokenizer, model_name, body, [prompt], request, chat=True)

    return app


class _Encoder:
    """The tokenizer's work for the routes, run on one worker thread (`run`): never on the event loop, where a long
    prompt would stall every other client; one thread, as a `tokenizers` encoder's special-token switch is not
    thread-safe. User text is encoded as text: only the chat template's markers (and with `allow_special` a
    completions prompt's special-token text) become special tokens."""

    def __init__(self, tokenizer, chat_format: str, allow_special: bool):
        self.tokenizer, self.chat_format, self.allow_special = tokenizer, chat_format, allow_special
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxspec-tokenize")

    async def run(self, fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, allow_special=self.allow_special)

    def chat(self, messages: list[dict[str, str]]) -> list[int]:
        if self.chat_format == "kimi":
            return self.tokenizer.encode_chat(messages)
        plain = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        return self.tokenizer.encode(plain, allow_special=False)


def _add_info_routes(app: FastAPI, engine: Engine, text: _Encoder, model_name: str) -> None:
    """/health, /metrics, /version, /v1/models[/{id}] (GET and HEAD), /tokenize and /detokenize (vLLM's shapes)."""
    card = {"id": model_name, "object": "model", "created": 0, "owned_by": "jaxspec"}
    # as vLLM: a prompt's tokens + max_tokens up to this always fit (the prefill's chunks and drafting counted)
    card["max_model_len"] = limit = engine.max_model_len
    tokenizer = text.tokenizer

    @app.api_route("/health", methods=GET)
    async def health():
        return {"status": "ok"}

    @app.api_route("/metrics", methods=GET)
    async def metrics():
        return Response(engine.metrics.render() if engine.metrics else b"", media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/version", methods=GET)
    async def version():
        return {"version": importlib.metadata.version("jaxspec")}

    @app.api_route("/v1/models", methods=GET)
    async def models():
        return {"object": "list", "data": [card]}

    @app.api_route("/v1/models/{model_id:path}", methods=GET)
    async def model(model_id: str):
        _check_model(model_id, model_name)
        return card

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        _check_model(body.model, model_name)
        if (body.prompt is None) == (body.messages is None):
            raise _BadRequest("tokenize: expected exactly one of prompt and messages", "prompt")
        if body.prompt is not None:
            tokens = await text.run(text.prompt, body.prompt)
        else:
            tokens = await text.run(text.chat, _messages(body.messages))
        strs = await text.run(lambda: [tokenizer.decode([t]) for t in tokens]) if body.return_token_strs else None
        return {"count": len(tokens), "max_model_len": limit, "tokens": tokens, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        _check_model(body.model, model_name)
        _check_ids(body.tokens, engine.target.vocab_size, "tokens")
        return {"prompt": await text.run(tokenizer.decode, body.tokens)}


def _check_model(requested: str | None, model_name: str) -> None:
    """404 (OpenAI's model_not_found) for a model this server does not serve; None (optional fields) passes."""
    if requested is not None and requested != model_name:
        raise _BadRequest(
            f"model {requested!r} does not exist; this server serves {model_name!r}",
            "model",
            "model_not_found",
            status=404,
        )


def _check_ids(ids: list[int], vocab: int, param: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise _BadRequest(f"{param}: token ids must be in [0, {vocab}); got {bad[:5]}", param)


def _messages(messages: list[Message]) -> list[dict[str, str]]:
    """The messages as {role, content} text (`developer` is OpenAI's newer name for `system`)."""
    try:
        texts = [m.text(f"messages.{i}") for i, m in enumerate(messages)]
    except FieldError as e:
        raise _BadRequest(str(e), e.param) from None
    roles = ["system" if m.role == "developer" else m.role for m in messages]
    return [{"role": r, "content": t} for r, t in zip(roles, texts, strict=True)]


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


def _choices(
    engine: Engine, tokenizer, body: GenerateParams, prompts: list[list[int]], chat: bool, salt: str | None, sampling
) -> list[Choice]:
    """One choice per prompt and sample (index = prompt * n + j), each checked against the engine's context; `salt`
    partitions their prefix cache; `sampling` is the server's mode (`create_app`)."""
    cfg, vocab = engine.config, engine.target.vocab_size
    refused = body.refusal() or _logprob_refusal(body, chat)
    if refused:
        raise _BadRequest(refused[1], refused[0])
    if body.n > cfg.max_batch:
        raise _BadRequest(f"n: expected at most {cfg.max_batch} (the server's slots), got {body.n}", "n")
    if len(prompts) * body.n > cfg.max_batch + cfg.max_queue:
        raise _BadRequest(
            f"prompt: {len(prompts)} prompts x n = {body.n} exceed the server's {cfg.max_batch} slots + "
            f"{cfg.max_queue} queue places",
            "prompt",
        )
    _check_ids(body.stop_token_ids, vocab, "stop_token_ids")
    budget = body.budget if chat else body.max_tokens
    budget_param = "max_completion_tokens" if chat and body.max_completion_tokens is not None else "max_tokens"
    stop_ids = set(engine.stop_ids) | set(body.stop_token_ids)
    choices = []
    for i, prompt in enumerate(prompts):
        where = "messages" if chat else "prompt" if len(prompts) == 1 else f"prompt.{i}"
        if not prompt:
            raise _BadRequest(f"{where}: expected a non-empty prompt", where)
        _check_ids(prompt, vocab, where)
        room = engine.room(len(prompt))  # the most new tokens that fit
        max_tokens = budget if budget is not None else max(room, 1) if chat else min(16, max(room, 1))
        if body.min_tokens > max_tokens:
            raise _BadRequest(
                f"min_tokens: expected at most the budget of {max_tokens}, got {body.min_tokens}", "min_tokens"
            )
        problem = engine.check(len(prompt), max_tokens)
        if problem:
            param = budget_param if room > 0 else where
            raise _BadRequest(f"{param}: {problem}", param, "context_length_exceeded")
        for j in range(body.n):
            seed = None if body.seed is None else derive_seed(body.seed, j)
            text = ChoiceText(tokenizer, stop_ids, body.stop)
            spec = body.row_spec(seed, max(max_tokens, 1), salt, sampling)  # max_tokens 0 (echo): one token
            choices.append(Choice(len(choices), list(prompt), max_tokens, spec, text))
    return choices


def _logprob_refusal(body: GenerateParams, chat: bool) -> tuple[str, str] | None:
    """(field, message) for a logprobs / echo combination that means nothing, else None."""
    if chat and body.top_logprobs and not body.logprobs:
        return "top_logprobs", "top_logprobs: needs logprobs true"
    if not chat and body.max_tokens == 0 and not body.echo:
        return "max_tokens", "max_tokens: 0 generates nothing; it is accepted only with echo (to score the prompt)"
    return None


async def _serve(engine, tokenizer, model_name, body: GenerateParams, prompts: list[list[int]], http: Request, chat):
    salt = cache_partition(http.scope.get("state", {}).get(TENANT), body.cache_salt)
    choices = _choices(engine, tokenizer, body, prompts, chat, salt, http.app.state.sampling)
    run = Run(engine, tokenizer, body, choices, chat)
    try:
        run.start()
    except QueueFull as e:
        raise _BadRequest(str(e), status=429, code="queue_full") from None
    except ValueError as e:
        raise _BadRequest(str(e), "prompt") from None
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())

    async def next_update():
        if body.stream:  # StreamingResponse itself cancels the stream when the client goes away
            return await run.updates.get()
        while True:
            try:
                return await asyncio.wait_for(run.updates.get(), timeout=0.5)
            except TimeoutError:
                if await http.is_disconnected():
                    raise _Disconnected from None

    usage = lambda: run.usage(prompts)
    header = dict(id=rid, created=created, model=model_name)
    if body.stream:
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        events = run.events(next_update)
        sse_events = sse(events, header, chat, run, usage if include_usage else None)
        return StreamingResponse(sse_events, media_type="text/event-stream")
    try:
        async for _, _, reason in run.events(next_update):
            if reason == "error":
                return _error(500, "the engine failed while running this request", "server_error")
    except _Disconnected:
        return Response(status_code=499)  # nobody reads it; the requests are cancelled and their slots freed
    return completion(header, chat, run, usage())
