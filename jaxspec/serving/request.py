"""A generation request as the scheduler serves it (its output fields filled in as tokens arrive), and what one
engine step did to the requests (`StepReport`, from which the engine keeps its metrics). Plain Python (no jax)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from jaxspec.decoding.sampling_params import RowSpec
from jaxspec.serving.plan import TokenLogprob
from jaxspec.serving.speculation import Speculation

log = logging.getLogger("jaxspec.serving")


class QueueFull(RuntimeError):
    """The bounded admission queue is full (the HTTP layer answers 429)."""


@dataclasses.dataclass(eq=False)
class Request:
    """One generation request. The scheduler fills in the output fields and calls `on_update(request, new_tokens)`
    from the engine's thread whenever tokens arrive and once more when the request finishes (finish_reason set)."""

    prompt: list[int]
    max_tokens: int
    # its settings (seed None: the scheduler draws one and keeps it here; min_new counts from its first token)
    spec: RowSpec = RowSpec()
    on_update: Callable[[Request, list[int]], None] | None = None
    echo: bool = False  # score the prompt's tokens 1.. too (`prompt_logprobs`, set before the first tokens arrive)
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
    # what speculation did for it so far (set at its first admission; replaced, never changed in place, so another
    # thread reads one consistent value)
    speculation: Speculation | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def validate(self, vocab: int) -> None:
        """Raise ValueError naming the first field that a model of `vocab` token ids cannot serve."""
        if not self.prompt or min(self.prompt) < 0 or max(self.prompt) >= vocab:
            raise ValueError(f"prompt: expected a non-empty list of token ids in [0, {vocab})")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: expected an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.spec, RowSpec):
            raise ValueError(f"spec: expected a RowSpec, got {self.spec!r}")
        self.spec.check_vocab(vocab)
        if self.spec.min_new > self.max_tokens:
            raise ValueError(f"spec.min_new: expected at most max_tokens {self.max_tokens}, got {self.spec.min_new}")

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
