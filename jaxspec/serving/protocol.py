"""The request bodies the HTTP API takes (OpenAI's and vLLM's field names), validated with pydantic.

Unknown fields are a 400 naming them. OpenAI fields this server does not implement are accepted only at their
neutral value (`UNSUPPORTED`); any other value is a 400 that names the field and says why. Every value a client can
send is bounded here to what the engine holds (top_k an int32, top_p a normal float32, a seed a uint32, text that is
valid Unicode: a lone surrogate cannot be encoded), so no field value reaches the engine to fail there.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from jaxspec.decoding.sampling_params import (
    MAX_CACHE_SALT,
    MAX_SEED,
    MAX_STOP_IDS,
    MAX_TOP_K,
    MAX_TOP_LOGPROBS,
    MIN_TOP_P,
    RowSpec,
    Sampling,
)

MAX_STOP_STRINGS = 4  # as OpenAI
MAX_STOP_CHARS = 256  # per stop string (the text a stream holds back is as long as the longest)
MAX_USER_CHARS = 256  # OpenAI's `user` (an end-user id; unused here but bounded)


def unicode_text(text: str, where: str = "") -> str:
    """`text` if it can be encoded (a lone surrogate, sent as a JSON escape such as "\\ud800", cannot), else
    ValueError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{where}expected valid Unicode text, got a lone surrogate at character {e.start}") from None
    return text


Text = Annotated[str, AfterValidator(unicode_text)]

# field -> (its neutral values, why another value is refused)
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "echo": ((None, False), "echo is supported on /v1/completions only"),
    "presence_penalty": ((None, 0), "penalties are not supported"),
    "frequency_penalty": ((None, 0), "penalties are not supported"),
    "repetition_penalty": ((None, 1), "penalties are not supported"),
    "logit_bias": ((None, {}), "logit_bias is not supported"),
    "best_of": ((None, 1), "best_of is not supported (use n)"),
    "suffix": ((None, ""), "suffix (insertion) is not supported"),
    "tools": ((None, []), "tool calling is not supported"),
    "tool_choice": ((None, "none"), "tool calling is not supported"),
    "functions": ((None, []), "function calling is not supported"),
    "function_call": ((None, "none"), "function calling is not supported"),
    "response_format": ((None, {"type": "text"}), "structured output (response_format) is not supported"),
}


class FieldError(ValueError):
    """A field's value this server cannot serve; `param` names it as OpenAI's error body does."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class GenerateParams(BaseModel):
    """Fields both endpoints take."""

    model_config = ConfigDict(extra="forbid")

    SERVED: ClassVar[frozenset[str]] = frozenset()  # UNSUPPORTED fields this endpoint serves

    model: Text
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, ge=MIN_TOP_P, le=1.0, allow_inf_nan=False)  # (0 would keep no token)
    top_k: int = Field(0, ge=0, le=MAX_TOP_K)  # extension (as vLLM): 0 = off
    seed: int | None = Field(None, ge=0, le=MAX_SEED)  # a uint32: a larger seed is refused, not wrapped
    stop: str | list[str] | None = Field(None, validate_default=True)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=MAX_STOP_IDS)  # extension (as vLLM)
    ignore_eos: bool = False  # extension (as vLLM): generate past the model's eos (request stop ids still stop)
    stream: bool = False
    stream_options: dict[Literal["include_usage"], bool] | None = None
    n: int = Field(1, ge=1)  # at most the engine's slots (checked with the engine)
    min_tokens: int = Field(
        0, ge=0
    )  # as vLLM: stop ids cannot end a choice before this many tokens (at most the budget)
    user: Text | None = Field(None, max_length=MAX_USER_CHARS)
    # extension (as vLLM): requests with different salts never share prefix-cache blocks (no salt: the shared cache)
    cache_salt: Text | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT)
    # extension: how a sampled choice is verified: "coupled", its text depends on its seed alone (never on the draft
    # shape, the batch or the load), or "rejection", lossless rejection sampling (more tokens accepted); None: the
    # server's --sampling
    sampling: Literal["coupled", "rejection"] | None = None
    # Declared so that a neutral value passes and any other is refused by name (`refusal`).
    echo: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    logit_bias: Any = None
    best_of: Any = None
    suffix: Any = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [unicode_text(s) for s in ([v] if isinstance(v, str) else (v or []))]
        if len(stops) > MAX_STOP_STRINGS or any(not 0 < len(s) <= MAX_STOP_CHARS for s in stops):
            raise ValueError(f"expected at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS}")
        return stops

    @property
    def top_logprobs_count(self) -> int | None:
        """Alternatives per token, or None when no logprobs are asked for (each endpoint says how it asks)."""
        return None

    def row_spec(
        self, seed: int | None, budget: int, cache_salt: str | None = None, server_sampling: str = "rejection"
    ) -> RowSpec:
        """One choice's settings: its `seed` (None: the engine draws one), its `budget` of tokens (min_tokens is
        capped by it), its prefix cache's salt (the request's, or one the server derives from it) and whether it
        samples coupled: the request's `sampling`, else the server's ("auto": coupled when the request has a seed)."""
        sampling = Sampling(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)
        scored = self.top_logprobs_count is not None
        stop_ids = tuple(self.stop_token_ids)
        min_new = min(self.min_tokens, budget)
        mode = self.sampling or server_sampling
        coupled = mode == "coupled" or (mode == "auto" and self.seed is not None)
        return RowSpec(sampling, stop_ids, seed, scored, min_new, self.ignore_eos, cache_salt, coupled)

    def refusal(self) -> tuple[str, str] | None:
        """(field, message) for the first field set to a value this server does not implement, else None."""
        for name, (neutral, why) in UNSUPPORTED.items():
            if name in self.SERVED:
                continue
            value = getattr(self, name, None)
            # bool is kept apart from int: `logprobs: 0` asks for the sampled token's logprob, `false` for none
            if not any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutral):
                return name, f"{name}: {why}; expected it unset or {neutral[-1]!r}, got {value!r}"
        return None


class CompletionRequest(GenerateParams):
    SERVED: ClassVar[frozenset[str]] = frozenset({"echo"})

    # One prompt (text or token ids) or a list of them: one choice per prompt (times n), in order.
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0 with echo: score the prompt, generate nothing (checked in app)
    echo: bool = False  # the prompt before the text (and its tokens' logprobs first, with logprobs)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # each token's, and the N best alternatives

    @field_validator("prompt")
    @classmethod
    def _some_prompt(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("expected a prompt: a string, token ids, or a non-empty list of them")
        for text in [v] if isinstance(v, str) else v:
            if isinstance(text, str):
                unicode_text(text)
        return v

    @property
    def top_logprobs_count(self) -> int | None:
        """Alternatives per token, or None when no logprobs are asked for."""
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list (a bare string or token-id list is one prompt)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]]
    name: Text | None = None

    @field_validator("content")
    @classmethod
    def _text(cls, v):
        return unicode_text(v) if isinstance(v, str) else v

    def text(self, where: str) -> str:
        """The content as text; content parts must be `{"type": "text", "text": ...}` (`where` names the message
        in errors)."""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for i, part in enumerate(self.content):
            kind = part.get("type")
            if kind != "text" or not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                raise FieldError(
                    f"{where}.content.{i}",
                    f"{where}.content.{i}: only text parts ({{'type': 'text', 'text': ...}}) are supported, "
                    f"got a part of type {kind!r}" + (" with extra keys" if kind == "text" else ""),
                )
            try:
                texts.append(unicode_text(part["text"], f"{where}.content.{i}.text: "))
            except ValueError as e:
                raise FieldError(f"{where}.content.{i}.text", str(e)) from None
        return "".join(texts)


class ChatRequest(GenerateParams):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's current name; wins over max_tokens
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    parallel_tool_calls: bool | None = None  # meaningful only with tools
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @property
    def top_logprobs_count(self) -> int | None:
        """Alternatives per token, or None when no logprobs are asked for."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize body: a `prompt` (as /v1/completions encodes it) or chat `messages` (as /v1/chat/completions
    renders them)."""

    model_config = ConfigDict(extra="forbid")
    model: Text | None = None
    prompt: Text | None = None
    messages: list[Message] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Text | None = None
    tokens: list[int]
