"""The bundled pair's corpus and tokenizer: Python standard library source, which every machine has offline.

Files are split by a hash of their path (5% held out, never trained on: the benchmark prompts come from them), so the
split does not depend on file order or count. The tokenizer is a byte-level BPE trained with the `tokenizers`
library on the training split only.
"""

from __future__ import annotations

import json
import sys
import sysconfig
import zlib
from pathlib import Path

import numpy as np

EOS = "<|endoftext|>"
SPECIALS = (EOS, "<|pad|>")
SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "__pycache__", "ensurepip"}
HELD_OUT_MOD = 20  # crc32(path) % 20 == 0 -> held out


def stdlib_files() -> list[tuple[str, Path]]:
    """(path relative to the stdlib, absolute path) of the stdlib's .py files, sorted, excluding tests/IDLE."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root)
        if not SKIP_DIRS.intersection(rel.parts[:-1]) and not rel.name.startswith("test_"):
            out.append((rel.as_posix(), f))
    if not out:
        raise RuntimeError(f"no Python source found under {root}")
    return out


def is_held_out(rel: str) -> bool:
    return zlib.crc32(rel.encode()) % HELD_OUT_MOD == 0


def read_split(held_out: bool) -> list[tuple[str, str]]:
    """(relative path, text) of one split; files that are not UTF-8 are skipped."""
    out = []
    for rel, f in stdlib_files():
        if is_held_out(rel) != held_out:
            continue
        try:
            out.append((rel, f.read_text(encoding="utf-8")))
        except UnicodeDecodeError:
            continue
    return out


def train_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """Byte-level BPE on the training split; writes tokenizer.json and tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((text for _, text in read_split(held_out=False)), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer: trained {tok.get_vocab_size()} tokens, expected {vocab_size}")
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": EOS, "pad_token": "<|pad|>", "bos_token": None, "model_max_length": 2048}, indent=2)
        + "\n"
    )


def encode_split(tokenizer_dir: Path, held_out: bool) -> np.ndarray:
    """The split as one int32 stream: each file's tokens followed by EOS."""
    from jaxspec.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for _, text in read_split(held_out):
        ids.extend(tok.encode(text, allow_special=False))
        ids.append(eos)
    return np.asarray(ids, np.int32)


def held_out_prompts(n: int, min_lines: int = 3, max_chars: int = 240) -> list[str]:
    """Prompts from held-out files: a function's `def` line plus the lines after it (up to max_chars), one per file
    round-robin, deterministic."""
    prompts = []
    files = read_split(held_out=True)
    cursors = {rel: 0 for rel, _ in files}
    while len(prompts) < n and files:
        progressed = False
        for rel, text in files:
            lines = text.splitlines(keepends=True)
            i = cursors[rel]
            while i < len(lines) and not lines[i].lstrip().startswith("def "):
                i += 1
            if i >= len(lines):
                continue
            chunk = "".join(lines[i : i + min_lines])[:max_chars]
            cursors[rel] = i + 1
            prompts.append(chunk)
            progressed = True
            if len(prompts) == n:
                break
        if not progressed:
            break
    return prompts


def main() -> None:
    """Write the held-out prompts file of the bundled pair."""
    import argparse

    p = argparse.ArgumentParser(description="write held-out prompts for the bundled pair")
    p.add_argument("--out", type=Path, default=Path("assets/kimi-py-tiny/prompts.json"))
    p.add_argument("-n", type=int, default=16)
    args = p.parse_args()
    files = stdlib_files()
    held = sorted(r for r, _ in files if is_held_out(r))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "python": sys.version.split()[0],
        "split": f"a file is held out when crc32(path relative to the stdlib) % {HELD_OUT_MOD} == 0",
        "held_out_files": held,
        "held_out": held_out_prompts(args.n),
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"python {record['python']}: {len(files)} files, {len(held)} held out; {args.n} prompts -> {args.out}")


if __name__ == "__main__":
    main()
