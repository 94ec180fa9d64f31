"""A Kimi-format tokenizer directory built in a test: a small byte-level vocabulary (`tiktoken.model`) with Kimi's
special tokens at Kimi's offsets (its chat markers included), for tests of tokenizing and of the chat template."""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path

# Each merge is the concatenation of two earlier tokens, so byte-level BPE can reach it.
MERGES = [t.encode() for t in "he|ll|llo|hello|th|the| the| w|or| wor|ld| world|in|ing".split("|")]
MERGES += [b"\xe4\xbd", "你".encode(), b"\xe5\xa5", "好".encode(), "你好".encode()]
NUM_BASE = 256 + len(MERGES)
# Kimi's special tokens at Kimi's offsets from the end of the base vocabulary (163584 + offset in the real model).
SPECIAL_OFFSETS = {
    "[BOS]": 0, "[EOS]": 1, "<|im_end|>": 2, "<|im_user|>": 3, "<|im_assistant|>": 4, "<|im_system|>": 10,
    "<|im_middle|>": 17, "<think>": 22, "</think>": 23, "[PAD]": 255,
}  # fmt: skip


def write_kimi(d: Path, tokens: list[bytes], specials: dict[str, int], *, shuffle: bool = True, **config) -> Path:
    """A Kimi-format tokenizer directory: tiktoken.model ("<base64> <rank>" lines) + tokenizer_config.json."""
    d.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)]
    if shuffle:  # ranks come from the second field, not from line order
        random.Random(0).shuffle(lines)
    (d / "tiktoken.model").write_text("".join(lines))
    added = {str(i): {"content": name, "special": True} for name, i in specials.items()}
    (d / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": added, **config}))
    return d


def kimi_vocab(d: Path) -> Path:
    """The small Kimi-format vocabulary (MERGES, SPECIAL_OFFSETS) written into `d`."""
    specials = {name: NUM_BASE + off for name, off in SPECIAL_OFFSETS.items()}
    return write_kimi(d, [bytes([b]) for b in range(256)] + MERGES, specials, bos_token="[BOS]", eos_token="[EOS]")
