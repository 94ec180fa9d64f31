"""`Sampling`: how tokens are chosen (temperature, top-k, top-p), as one frozen value.

Plain Python (no jax), so the serving scheduler can hold a request's settings and write them into a step plan;
`decoding/sampling.py` holds the jittable functions that apply them (and re-exports this class).
"""

from __future__ import annotations

import dataclasses
import numbers

MAX_STOP_IDS = 8  # per-request stop token ids (besides the model's own): the width of the loop state's stop_ids
MAX_TOP_LOGPROBS = 20  # top alternatives kept per position when logprobs are asked for (OpenAI's limit)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How tokens are chosen: temperature 0 is greedy; top_k = 0 and top_p = 1 turn those filters off.

    Frozen and hashable, so it is a static argument of a jitted function (each setting compiles its own program).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        # `not x >= 0` also rejects NaN.
        if not self.temperature >= 0:
            raise ValueError(f"Sampling.temperature: expected >= 0 (0 = greedy), got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral) or self.top_k < 0:
            raise ValueError(f"Sampling.top_k: expected an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"Sampling.top_p: expected a value in (0, 1] (1 = off), got {self.top_p}")

    @property
    def greedy(self) -> bool:
        """Temperature 0: argmax decoding (top-k / top-p are then irrelevant)."""
        return self.temperature == 0
