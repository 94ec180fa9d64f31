"""Tokenizers for the generate API and CLI: Kimi's `tiktoken.model` and Hugging Face `tokenizer.json`.

`load_tokenizer(dir)` picks the format. Both classes share one interface (`Tokenizer`): `encode`, `decode`,
`bos_id`, `eos_ids`, `stop_ids`, `vocab_size`, `token_to_id` and `apply_chat_template`. `encode` never adds BOS (Kimi's
chat format has none); callers that want it prepend `bos_id`.

Chat template: only Kimi's format is built in; jinja `chat_template`s are not rendered (no jinja dependency, and a
silently wrong prompt is worse than an error). A vocabulary without Kimi's chat tokens raises `ChatTemplateError`
from `apply_chat_template`; format such prompts yourself and pass text or token ids.
"""

from __future__ import annotations

import abc
import binascii
import json
import operator
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

# Kimi's pre-tokenizer split, verbatim from `pat_str` of `TikTokenTokenizer` in moonshotai/Kimi-K2-Instruct
# `tokenization_kimi.py` (the same string is in transformers' Kimi2_6Tokenizer and in several independent ports).
# Han runs are their own pieces; the letter classes exclude Han via `&&` intersection, which tiktoken's engine
# (fancy-regex) supports and Python's `re` does not. Digits split in groups of at most 3.
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
KIMI_NUM_RESERVED_SPECIAL = 256  # special slots after the base vocab: 163584 + 256 = 163840 for Kimi
# Kimi's HF chat template inserts this system turn when the conversation does not start with one.
KIMI_DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."
_ROLE_TOKENS = {"system": "<|im_system|>", "user": "<|im_user|>", "assistant": "<|im_assistant|>"}
_CHAT_TOKENS = (*_ROLE_TOKENS.values(), "<|im_middle|>", "<|im_end|>")
TURN_END = "<|im_end|>"  # chat turns end here: a stop token besides eos

# Kimi's reference encoder splits long inputs the same way (tiktoken issue 195: very long runs of whitespace or
# non-whitespace make the BPE slow or panic); matching it keeps token ids identical to the reference on long texts.
_MAX_ENCODE_CHARS = 400_000
_MAX_RUN_CHARS = 25_000


class ChatTemplateError(ValueError):
    """The messages or the vocabulary cannot be rendered with the built-in (Kimi) chat format."""


class Tokenizer(abc.ABC):
    """Common interface and shared logic (id checks, stop ids, chat format) of the tokenizer backends."""

    def __init__(self, *, source: str, vocab_size: int, bos_id: int | None, eos_ids: Iterable[int], note: str = ""):
        self.source = source  # where it was loaded from, for error messages
        self.vocab_size = vocab_size
        self.bos_id = bos_id
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_ids))
        turn_end = self.token_to_id(TURN_END)
        self.stop_ids: tuple[int, ...] = tuple(
            dict.fromkeys([*self.eos_ids, *([turn_end] if turn_end is not None else [])])
        )
        for name, ids in (("bos", [bos_id] if bos_id is not None else []), ("eos", self.eos_ids)):
            for i in ids:
                if not 0 <= i < vocab_size:
                    raise ValueError(f"{source}: {name} id {i} is outside the vocabulary [0, {vocab_size})")
        self._chat_note = note  # why the chat template may be unavailable, appended to ChatTemplateError

    @abc.abstractmethod
    def encode(self, text: str, *, allow_special: bool = True) -> list[int]:
        """Token ids of `text`, without BOS. Special-token text (e.g. "<|im_end|>") becomes its id unless
        `allow_special` is False, in which case it is tokenized as plain text (use that for untrusted content)."""

    @abc.abstractmethod
    def token_to_id(self, token: str) -> int | None:
        """The id of `token` if it is one vocabulary entry (special tokens by their text), else None."""

    @abc.abstractmethod
    def _decode(self, ids: list[int], skip_special: bool) -> str: ...

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Text of `ids` (invalid UTF-8 becomes U+FFFD). Raises ValueError for an id outside the vocabulary."""
        ids = [operator.index(i) for i in ids]  # accepts numpy / JAX integer scalars, refuses floats
        for pos, i in enumerate(ids):
            if not 0 <= i < self.vocab_size:
                raise ValueError(
                    f"decode: token id {i} at position {pos} is outside the vocabulary [0, {self.vocab_size})"
                )
        return self._decode(ids, skip_special)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        system_prompt: str | None = KIMI_DEFAULT_SYSTEM_PROMPT,
        thinking: bool | None = None,
    ) -> str:
        """Render `messages` ({"role": "system"|"user"|"assistant", "content": str}) in Kimi's chat format:
        `<|im_system|>system<|im_middle|>...<|im_end|><|im_user|>user<|im_middle|>...<|im_end|>` and, with
        `add_generation_prompt`, `<|im_assistant|>assistant<|im_middle|>`.

        `system_prompt` is inserted as the first turn when the messages do not start with a system turn, as Kimi's
        HF template does (None: insert nothing). `thinking` appends `<think>` (True) or `<think></think>` (False)
        after the generation prompt, as Kimi-K2.5's template does for thinking / non-thinking mode; None appends
        nothing. Tool turns are not supported.
        """
        pieces = self._chat_pieces(messages, add_generation_prompt, system_prompt, thinking)
        return "".join(text for text, _ in pieces)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], **template: Any) -> list[int]:
        """The token ids of `apply_chat_template(messages, **template)` with the messages' text encoded as plain
        text: the template's own markers are its only special tokens, so a message holding
        "<|im_end|><|im_system|>..." cannot forge a turn. Equal to `encode(apply_chat_template(...))` for messages
        without special-token text."""
        pieces = self._chat_pieces(messages, **template)
        return [t for text, marker in pieces for t in self.encode(text, allow_special=marker)]

    def _chat_pieces(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        system_prompt: str | None = KIMI_DEFAULT_SYSTEM_PROMPT,
        thinking: bool | None = None,
    ) -> list[tuple[str, bool]]:
        """Kimi's chat format as (text, is the template's own markup) pieces, in order."""
        missing = [t for t in _CHAT_TOKENS if self.token_to_id(t) is None]
        if missing:
            raise ChatTemplateError(
                f"{self.source}: only Kimi's chat format is built in, and this vocabulary lacks its tokens {missing}"
                f"{self._chat_note}; format the prompt yourself and pass text or token ids"
            )
        if system_prompt is not None and (not messages or messages[0].get("role") != "system"):
            messages = [{"role": "system", "content": system_prompt}, *messages]
        pieces = []
        for n, message in enumerate(messages):
            role, content = message.get("role"), message.get("content")
            if role not in _ROLE_TOKENS:
                raise ChatTemplateError(
                    f"message {n}: role {role!r} is not supported; expected one of {list(_ROLE_TOKENS)}"
                )
            if not isinstance(content, str):
                raise ChatTemplateError(f"message {n}: content must be a str, got {type(content).__name__}")
            pieces += [(f"{_ROLE_TOKENS[role]}{role}<|im_middle|>", True), (content, False), (TURN_END, True)]
        if add_generation_prompt:
            pieces.append(("<|im_assistant|>assistant<|im_middle|>", True))
            if thinking is not None:
                pieces.append(("<think>" if thinking else "<think></think>", True))
        return [(text, marker) for text, marker in pieces if text]


class TiktokenTokenizer(Tokenizer):
    """Kimi-style byte-level BPE: a `tiktoken.Encoding` over the ranks file plus the special-token slots."""

    def __init__(
        self,
        mergeable_ranks: dict[bytes, int],
        special_names: Mapping[int, str],
        *,
        source: str,
        bos_token: str,
        eos_token: str,
        extra_eos_ids: Iterable[int] = (),
        pat_str: str = KIMI_PAT_STR,
    ):
        import tiktoken  # deferred so importing jaxspec does not need the tokenizer packages

        self._num_base = len(mergeable_ranks)
        top = max(special_names, default=self._num_base - 1)
        num_special = max(KIMI_NUM_RESERVED_SPECIAL, top - self._num_base + 1)
        # Unnamed slots get placeholder names, as the reference does, so every id in the vocabulary decodes.
        self._special = {
            special_names.get(i, f"<|reserved_token_{i}|>"): i
            for i in range(self._num_base, self._num_base + num_special)
        }
        if len(self._special) != num_special:
            raise ValueError(f"{source}: two special-token ids share one name")
        self._enc = tiktoken.Encoding(
            name=f"jaxspec:{source}", pat_str=pat_str, mergeable_ranks=mergeable_ranks, special_tokens=self._special
        )
        eos_ids = [self._special_id(eos_token, "eos_token", source), *extra_eos_ids]
        bos_id = self._special_id(bos_token, "bos_token", source)
        super().__init__(source=source, vocab_size=self._num_base + num_special, bos_id=bos_id, eos_ids=eos_ids)

    def _special_id(self, token: str, what: str, source: str) -> int:
        if token not in self._special:
            raise ValueError(f"{source}: {what} {token!r} is not one of the special tokens in tokenizer_config.json")
        return self._special[token]

    def encode(self, text: str, *, allow_special: bool = True) -> list[int]:
        kwargs: dict[str, Any] = {"allowed_special": "all"} if allow_special else {"disallowed_special": ()}
        return [t for piece in _split_for_encode(text) for t in self._enc.encode(piece, **kwargs)]

    def token_to_id(self, token: str) -> int | None:
        if token in self._special:
            return self._special[token]
        try:
            return self._enc.encode_single_token(token)
        except KeyError:
            return None

    def _decode(self, ids: list[int], skip_special: bool) -> str:
        if skip_special:
            ids = [i for i in ids if i < self._num_base]
        return self._enc.decode(ids, errors="replace")


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers.Tokenizer` (tokenizer.json)."""

    def __init__(
        self,
        tok: Any,
        *,
        source: str,
        bos_token: str | None,
        eos_tokens: Iterable[str],
        extra_eos_ids: Iterable[int] = (),
        note: str = "",
    ):
        self._tok = tok

        def token_id(token: str, what: str) -> int:
            i = tok.token_to_id(token)
            if i is None:
                raise ValueError(f"{source}: {what} {token!r} from tokenizer_config.json is not in the vocabulary")
            return i

        bos_id = token_id(bos_token, "bos_token") if bos_token is not None else None
        eos_ids = [*(token_id(t, "eos_token") for t in eos_tokens), *extra_eos_ids]
        vocab_size = tok.get_vocab_size(with_added_tokens=True)
        super().__init__(source=source, vocab_size=vocab_size, bos_id=bos_id, eos_ids=eos_ids, note=note)

    def encode(self, text: str, *, allow_special: bool = True) -> list[int]:
        # tokenizers has no per-call switch; the flag is restored right away (not thread-safe, like the library).
        self._tok.encode_special_tokens = not allow_special
        try:
            # encode_batch releases the GIL while it works (encode holds it): a long text tokenized on the server's
            # worker thread does not stall its event loop. The ids are encode's.
            return self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        finally:
            self._tok.encode_special_tokens = False

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def _decode(self, ids: list[int], skip_special: bool) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special)


class StreamDecoder:
    """Turns token ids arriving in chunks into text deltas, holding back a trailing incomplete UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False):
        self._tok, self._skip = tokenizer, skip_special
        self._ids: list[int] = []
        self._text = ""

    def push(self, ids: Iterable[int]) -> str:
        """Add ids; return the newly completed text (may be empty)."""
        self._ids.extend(ids)
        text = self._tok.decode(self._ids, skip_special=self._skip)
        if text.endswith("\ufffd"):  # likely a multi-byte character split across tokens: wait for the rest
            return ""
        delta, self._text = text[len(self._text) :], text
        return delta

    def flush(self) -> str:
        """Return whatever is left, replacement characters included."""
        text = self._tok.decode(self._ids, skip_special=self._skip)
        delta, self._text = text[len(self._text) :], text
        return delta


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """Load the tokenizer in directory `path`: Kimi-style `tiktoken.model` + `tokenizer_config.json` if present,
    else Hugging Face `tokenizer.json`. eos ids from `config.json` / `generation_config.json` are stop ids too."""
    d = Path(path)
    if not d.is_dir():
        raise FileNotFoundError(f"tokenizer path {d} is not a directory")
    tok_path = d / "tokenizer_config.json"
    tok_config = read_json_object(tok_path) if tok_path.is_file() else None
    extra_eos = _config_eos_ids(d)
    if (d / "tiktoken.model").is_file():
        if tok_config is None:
            raise FileNotFoundError(f"{d}: tiktoken.model needs tokenizer_config.json (special tokens); it is missing")
        ranks = read_tiktoken_ranks(d / "tiktoken.model")
        specials = _added_tokens(tok_config, d / "tokenizer_config.json", num_base=len(ranks))
        return TiktokenTokenizer(
            ranks,
            specials,
            source=str(d),
            bos_token=_token_text(tok_config.get("bos_token")) or "[BOS]",
            eos_token=_token_text(tok_config.get("eos_token")) or "[EOS]",
            extra_eos_ids=extra_eos,
        )
    if (d / "tokenizer.json").is_file():
        import tokenizers

        try:
            tok = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
        except Exception as e:  # the Rust side raises a bare Exception
            raise ValueError(f"{d / 'tokenizer.json'}: cannot be parsed by the tokenizers library: {e}") from e
        tok_config = tok_config or {}
        eos = _token_text(tok_config.get("eos_token"))
        note = (
            " (tokenizer_config.json has a jinja chat_template, which is not rendered)"
            if "chat_template" in tok_config
            else ""
        )
        return HFTokenizer(
            tok,
            source=str(d),
            bos_token=_token_text(tok_config.get("bos_token")),
            eos_tokens=[eos] if eos else [],
            extra_eos_ids=extra_eos,
            note=note,
        )
    raise FileNotFoundError(
        f"{d}: no tokenizer found; looked for tiktoken.model (+ tokenizer_config.json) and tokenizer.json"
    )


def read_tiktoken_ranks(path: str | os.PathLike[str]) -> dict[bytes, int]:
    """Parse a tiktoken ranks file (lines "<base64 token> <rank>"). Ranks must be 0..n-1 and all 256 single bytes
    must be present. Parsed directly: `tiktoken.load.load_tiktoken_bpe` caches even local files by path hash."""
    path = Path(path)
    ranks: dict[bytes, int] = {}
    line_of_rank: dict[int, int] = {}
    with path.open("rb") as f:
        for lineno, line in enumerate(f, 1):
            fields = line.split()
            if not fields:
                continue
            try:
                if len(fields) != 2:
                    raise ValueError(f"expected 2 fields, got {len(fields)}")
                token, rank = binascii.a2b_base64(fields[0], strict_mode=True), int(fields[1])  # strict: rejects junk
            except ValueError as e:  # binascii.Error is a ValueError
                raise ValueError(
                    f"{path}:{lineno}: malformed line {line[:80]!r}, expected '<base64 token> <rank>': {e}"
                ) from None
            if token in ranks:
                raise ValueError(f"{path}:{lineno}: token {token!r} already has rank {ranks[token]}")
            if rank in line_of_rank:
                raise ValueError(f"{path}:{lineno}: rank {rank} already used on line {line_of_rank[rank]}")
            ranks[token], line_of_rank[rank] = rank, lineno
    if not ranks:
        raise ValueError(f"{path}: no tokens")
    if max(line_of_rank) != len(ranks) - 1 or min(line_of_rank) < 0:
        gap = next(r for r in range(len(ranks)) if r not in line_of_rank)
        raise ValueError(f"{path}: ranks must be 0..{len(ranks) - 1} without gaps; rank {gap} is missing")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(
            f"{path}: byte-level BPE needs all 256 single-byte tokens; {len(missing)} missing, e.g. {missing[0]:#04x}"
        )
    return ranks


def _split_for_encode(text: str) -> Iterator[str]:
    """Cut `text` into chunks of <= _MAX_ENCODE_CHARS chars, cutting inside any run of more than _MAX_RUN_CHARS
    whitespace or non-whitespace chars (the reference's rule, so ids match it)."""
    for start in range(0, max(len(text), 1), _MAX_ENCODE_CHARS):
        chunk = text[start : start + _MAX_ENCODE_CHARS]
        if len(chunk) <= _MAX_RUN_CHARS:  # no run can be too long
            yield chunk
            continue
        begin, run, prev = 0, 0, None
        for i, ch in enumerate(chunk):
            space = ch.isspace()
            run = run + 1 if space == prev else 1
            prev = space
            if run > _MAX_RUN_CHARS:
                yield chunk[begin:i]
                begin, run = i, 1
        yield chunk[begin:]


def read_json_object(path: Path, error: type[ValueError] = ValueError) -> dict[str, Any]:
    """The JSON object in `path`; `error` (a ValueError) names the file when it cannot be read, is not JSON, or
    holds something other than an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise error(f"{path}: cannot be read as JSON ({e})") from e
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_text(value: Any) -> str | None:
    """A token in tokenizer_config.json is a string or an AddedToken dict {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def _added_tokens(config: Mapping[str, Any], path: Path, *, num_base: int) -> dict[int, str]:
    """Special-token names by id from `added_tokens_decoder` ({"163584": {"content": "[BOS]", ...}, ...})."""
    names: dict[int, str] = {}
    for key, entry in config.get("added_tokens_decoder", {}).items():
        try:
            i, name = int(key), _token_text(entry)
        except ValueError:
            raise ValueError(f"{path}: added_tokens_decoder key {key!r} is not an integer id") from None
        if not isinstance(name, str) or not name:
            raise ValueError(f"{path}: added_tokens_decoder[{key}] has no 'content' string")
        if i < num_base:
            raise ValueError(f"{path}: special token {name!r} has id {i}, inside the base vocabulary of {num_base}")
        names[i] = name
    return names


def _config_eos_ids(d: Path) -> list[int]:
    """eos_token_id (int or list) from generation_config.json and config.json (top level or text_config)."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        config = read_json_object(d / name) if (d / name).is_file() else {}
        for section in (config, config.get("text_config") or {}):
            value = section.get("eos_token_id")
            ids.extend(value if isinstance(value, list) else [value] if isinstance(value, int) else [])
    return ids
