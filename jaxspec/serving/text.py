"""The text of one choice as its tokens arrive: stop ids left out, cut before the first stop string, and the
deltas a stream may send now (text that could still be the start of a stop string, or a multi-byte character split
across tokens, is held back). A stream and a non-streamed answer are built from the same `ChoiceText`, so their
text and token count are equal by construction.

Tokens are taken one at a time, so a stop string is found at the token that completes it wherever it falls: inside
an engine update, across two updates, at the first token, or inside a multi-byte character. The count of completion
tokens is exactly the tokens whose text is returned, the stop string's tokens included (and a stop id that ended
the choice, as OpenAI and vLLM count eos); tokens the engine made after the match are not counted.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from jaxspec.tokenizer import StreamDecoder, Tokenizer


class ChoiceText:
    """Feed `push(new_tokens)` as they arrive and `finish()` once; read `text`, `tokens` and `stopped`."""

    def __init__(self, tokenizer: Tokenizer, stop_ids: Collection[int], stops: list[str]):
        self._tokenizer, self._stop_ids, self._stops = tokenizer, frozenset(stop_ids), stops
        self._decoder = StreamDecoder(tokenizer)
        self._hold = max((len(s) for s in stops), default=1) - 1  # characters a stop string may still complete
        self._text_ids: list[int] = []  # tokens with text (no stop ids)
        self._ends: list[int] = []  # for each of them, len(self.tokens) once it was taken
        self.tokens: list[int] = []  # the counted completion tokens
        self.text = ""  # decoded so far (a trailing partial character not yet)
        self.stopped = False  # a stop string matched: text ends before it, and later tokens are ignored
        self._sent = 0

    def push(self, new: Iterable[int]) -> str:
        """Take new tokens; return the text that can be sent now."""
        for token in new:
            if self.stopped:
                break
            self.tokens.append(token)
            if token in self._stop_ids:  # no text (it ends the choice, or is skipped with ignore_eos)
                continue
            self._text_ids.append(token)
            self._ends.append(len(self.tokens))
            before = len(self.text)
            self.text += self._decoder.push([token])
            self._match(max(0, before - self._hold))
        return self._delta(final=self.stopped)

    def finish(self) -> str:
        """The rest of the text once the choice has ended (a trailing partial character included)."""
        if not self.stopped:
            before = len(self.text)
            self.text += self._decoder.flush()
            self._match(max(0, before - self._hold))
        return self._delta(final=True)

    def _match(self, start: int) -> None:
        """Cut at the earliest stop string that ends in the new text (none ended before it)."""
        hits = [(at, at + len(s)) for at, s in ((self.text.find(s, start), s) for s in self._stops) if at >= 0]
        if not hits:
            return
        at, end = min(hits)
        matched = self.text[:end]
        # The decoder held text back while it ended in a partial character: the stop string may have been complete
        # a few tokens earlier. Count only the tokens its text needs.
        needed = len(self._text_ids)
        while needed > 1 and self._tokenizer.decode(self._text_ids[: needed - 1]).startswith(matched):
            needed -= 1
        del self.tokens[self._ends[needed - 1] :]
        self.text, self.stopped = self.text[:at], True

    def _delta(self, final: bool) -> str:
        end = max(len(self.text) - (0 if final else self._hold), self._sent)
        delta, self._sent = self.text[self._sent : end], end
        return delta
