"""`Sampling`: how tokens are chosen (temperature, top-k, top-p), as one frozen value.

Plain Python (no jax), so the serving scheduler can hold a request's settings and write them into a step plan;
`decoding/sampling.py` holds the jittable functions that apply them (and re-exports this class).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import numbers

MAX_STOP_IDS = 8  # per-request stop token ids (besides the model's own): the width of the loop state's stop_ids
MAX_TOP_LOGPROBS = 20  # top alternatives kept per position when logprobs are asked for (OpenAI's limit)
# Bounds the device's types hold: top_k is an int32, top_p a float32 whose subnormals XLA flushes to 0 (top_p 0 keeps
# no token at all: every draw would be token 0), a seed a uint32.
MAX_TOP_K = 2**31 - 1
MIN_TOP_P = 2.0**-126  # float32's smallest normal number
MAX_SEED = 2**32 - 1
MAX_CACHE_SALT = 256  # characters of a request's cache_salt
# How a server verifies sampled requests unless one says (`jaxspec serve --sampling`): "auto" samples a request that
# has a seed coupled (decoding/coupling.py: its text is then its seed's alone, whatever the load or the draft shape)
# and the rest by rejection sampling, which accepts more drafted tokens (docs/serving.md has the measurements).
SAMPLING_MODES = ("auto", "coupled", "rejection")
VERIFY_MODES = ("rejection", "coupled")  # `generate(sampling=...)`: the modes a single call chooses between
SAMPLING_DEFAULT = "auto"


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How tokens are chosen: temperature 0 is greedy; top_k = 0 and top_p = 1 turn those filters off.

    Frozen and hashable, so it is a static argument of a jitted function (each setting compiles its own program).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not 0 <= self.temperature < math.inf:  # also refuses NaN
            raise ValueError(f"Sampling.temperature: expected >= 0 (0 = greedy) and finite, got {self.temperature}")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 0 <= k <= MAX_TOP_K:
            raise ValueError(f"Sampling.top_k: expected an integer in [0, {MAX_TOP_K}] (0 = off), got {k!r}")
        if not MIN_TOP_P <= self.top_p <= 1:
            raise ValueError(
                f"Sampling.top_p: expected a value in (0, 1] (1 = off) and at least float32's smallest normal "
                f"number {MIN_TOP_P}, got {self.top_p}"
            )

    @property
    def greedy(self) -> bool:
        """Temperature 0: argmax decoding (top-k / top-p are then irrelevant)."""
        return self.temperature == 0


def _int(name: str, value: object, low: int, high: int | None = None) -> None:
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= low
    if not ok or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"RowSpec.{name}: expected an integer {bound}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class RowSpec:
    """A request's per-row settings, as one frozen value from the HTTP layer to the loop state's row: how tokens are
    chosen, its own stop ids (besides the model's), its seed, whether its tokens are scored, how many tokens it
    generates before a stop id may end it, and whether the model's stop ids end it.

    Validated here, once; serialised here (`to_dict` / `from_dict`: it crosses processes inside the step plan). On
    the device it is one row of `decoding.state.RowSettings` (the seed becomes the row's key).
    """

    sampling: Sampling = Sampling()
    stop_ids: tuple[int, ...] = ()  # token ids, at most MAX_STOP_IDS
    seed: int | None = None  # the row's random key is jax.random.key(seed); None: the scheduler draws one
    logprobs: bool = False  # score the row's tokens (and, for an echo, its prompt's)
    min_new: int = 0  # stop ids are masked until the row has generated this many tokens (min_tokens, as vLLM)
    ignore_eos: bool = False  # the model's stop ids do not stop the row (its own stop ids still do)
    # Rows with different salts never share prefix-cache blocks (vLLM's cache_salt); None: the unsalted cache. The
    # scheduler's business only: it is not written into the loop state.
    cache_salt: str | None = None
    # Coupled sampling (decoding/coupling.py): the row's text depends on its seed alone, never on what was drafted
    # (the price is acceptance); False: lossless rejection sampling. Greedy rows are the same either way.
    coupled: bool = False

    def __post_init__(self):
        if not isinstance(self.sampling, Sampling):
            raise ValueError(f"RowSpec.sampling: expected a Sampling, got {self.sampling!r}")
        ids = self.stop_ids
        if not isinstance(ids, tuple) or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
            raise ValueError(f"RowSpec.stop_ids: expected a tuple of token ids >= 0, got {ids!r}")
        if len(ids) > MAX_STOP_IDS:
            raise ValueError(f"RowSpec.stop_ids: expected at most {MAX_STOP_IDS}, got {len(ids)}")
        if self.seed is not None:
            _int("seed", self.seed, 0, MAX_SEED)
        salt = self.cache_salt
        if salt is not None and (not isinstance(salt, str) or not 0 < len(salt) <= MAX_CACHE_SALT):
            raise ValueError(f"RowSpec.cache_salt: expected None or 1 to {MAX_CACHE_SALT} characters, got {salt!r}")
        _int("min_new", self.min_new, 0)
        for name in ("logprobs", "ignore_eos", "coupled"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"RowSpec.{name}: expected a bool, got {getattr(self, name)!r}")

    def check_vocab(self, vocab: int) -> None:
        """Raise ValueError when a stop id lies outside a vocabulary of `vocab` ids."""
        if any(t >= vocab for t in self.stop_ids):
            raise ValueError(f"RowSpec.stop_ids: expected token ids in [0, {vocab}), got {list(self.stop_ids)}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"stop_ids": list(self.stop_ids)}

    @classmethod
    def from_dict(cls, d: dict) -> RowSpec:
        return cls(**(d | {"sampling": Sampling(**d["sampling"]), "stop_ids": tuple(d["stop_ids"])}))


def derive_seed(seed: int, *path: int) -> int:
    """The 32-bit engine seed at `path` below a request's `seed` (a uint32: the protocol refuses larger ones rather
    than wrap them) for choice j (or `generate`'s row j); the all-zero path is the seed itself, so choice 0 of n
    samples what the same request with n = 1 does."""
    if not any(path):
        return seed
    digest = hashlib.blake2b("/".join(map(str, (seed, *path))).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")
