"""A generation request as the scheduler serves it (its output fields filled in as tokens arrive), and what one
engine step did to the requests (`StepReport`, from which the engine keeps its metrics). Plain Python (no jax)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from jaxspec.decoding.sampling_params import Sampling
from jaxspec.serving.plan import MAX_STOP_IDS, TokenLogprob

log = logging.getLogger("jaxspec.serving")


class QueueFull(RuntimeError):
    """The bounded admission queue is full (the HTTP layer answers 429)."""


@dataclasses.dataclass(eq=False)
class Request:
    """One generation request. The scheduler fills in the output fields and calls `on_update(request, new_tokens)`
    from the engine's thread whenever tokens arrive and once more when the request finishes (finish_reason set)."""

    prompt: list[int]
    max_tokens: int
    sampling: Sampling = Sampling()
    seed: int | None = None  # None: a random seed
    stop_ids: tuple[int, ...] = ()  # extra stop token ids (the model's eos always stops)
    on_update: Callable[[Request, list[int]], None] | None = None
    logprobs: bool = False  # score each generated token (`token_logprobs`)
    echo: bool = False  # score the prompt's tokens 1.. too (`prompt_logprobs`, set before the first tokens arrive)
    min_tokens: int = 0  # stop ids (eos and the request's) cannot end it before this many tokens
    ignore_eos: bool = False  # the model's stop ids do not end it (its own `stop_ids` still do)
    # filled in by the scheduler
    tokens: list[int] = dataclasses.field(default_factory=list)
    token_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)  # one per token (with logprobs)
    prompt_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop", "length", "cancelled", "error"
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None
    slot: int | None = None
    cached_tokens: int = 0  # prompt tokens whose cache came from the prefix cache

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def validate(self, vocab: int) -> None:
        """Raise ValueError naming the first field that a model of `vocab` token ids cannot serve."""
        if not self.prompt or min(self.prompt) < 0 or max(self.prompt) >= vocab:
            raise ValueError(f"prompt: expected a non-empty list of token ids in [0, {vocab})")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: expected an integer >= 1, got {self.max_tokens!r}")
        if len(self.stop_ids) > MAX_STOP_IDS or any(not 0 <= t < vocab for t in self.stop_ids):
            raise ValueError(f"stop ids: expected at most {MAX_STOP_IDS} token ids in [0, {vocab})")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens: expected an integer in [0, max_tokens], got {self.min_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos: expected a bool, got {self.ignore_eos!r}")
        seed = self.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32):
            raise ValueError(f"seed: expected an integer in [0, 2**32), got {seed!r}")

    def notify(self, new: list[int]) -> None:
        """`on_update(self, new)`, if set."""
        if self.on_update is None:
            return
        try:
            self.on_update(self, new)
        except Exception:  # a consumer that went away must not stop the engine (or the other requests)
            log.exception("on_update of a request failed; ignoring")


@dataclasses.dataclass(frozen=True)
class Delivery:
    """`count` tokens handed to `request` at time `at`; `since`: when its previous tokens came (None: its first)."""

    request: Request
    count: int
    since: float | None
    at: float


@dataclasses.dataclass(frozen=True)
class StepReport:
    """What one step did to the requests: tokens delivered, and requests finished (cancellations included)."""

    delivered: tuple[Delivery, ...] = ()
    finished: tuple[Request, ...] = ()
