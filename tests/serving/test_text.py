"""`ChoiceText` (serving/text.py): a stream's deltas join to the non-streamed text for every placement of a stop
string, and the token count is exactly the tokens the returned text needs. The expected values come from a brute
force over token prefixes (decode each prefix, find the first prefix that contains a stop string), independent of
the incremental code. The bundled vocabulary is byte-level, so multi-byte characters span tokens (token 3375 is
" " + the first two bytes of a three-byte character such as "”")."""

import pytest

from jaxspec import bundled
from jaxspec.serving.text import ChoiceText
from jaxspec.tokenizer import load_tokenizer
from tests.serving.support import TEXT_EOS as EOS
from tests.serving.support import expected_text as expected


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(bundled.paths()[0])


def run(tokenizer, ids: list[int], stops: list[str], chunk: int) -> tuple[str, str, int]:
    """(joined deltas, final text, counted tokens) for `ids` arriving `chunk` at a time."""
    out = ChoiceText(tokenizer, {EOS}, stops)
    deltas = [out.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(out.finish())
    return "".join(deltas), out.text, len(out.tokens)


CASES = [
    # (text generated, stop strings): a stop inside a token, spanning tokens, at the first token, in a multi-byte
    # character, complete in a token that ends in a partial character, none at all, two competing
    ("def parse(path):\n    return path", ["("]),
    ("def parse(path):\n    return path", ["rse(pa"]),
    ("def parse(path):\n    return path", ["def"]),
    ("x = 'café' + y", ["é"]),
    ("x = 'café' + y", ["fé'"]),
    ("say x ”done”", ["x "]),
    ("say x ”done”", ["”"]),
    ("say x ”done”", ["zzz"]),
    ("abcdef", ["cde", "d"]),
    ("abcdef", ["bcd", "c"]),
]


@pytest.mark.parametrize("text, stops", CASES)
@pytest.mark.parametrize("chunk", [1, 2, 3, 100])
def test_stream_equals_answer_and_counts_exact_tokens(tokenizer, text, stops, chunk):
    ids = tokenizer.encode(text) + [EOS]
    want_text, want_count = expected(tokenizer, ids, stops)
    joined, final, count = run(tokenizer, ids, stops, chunk)
    assert (joined, final, count) == (want_text, want_text, want_count)


def test_the_cases_cover_what_they_claim(tokenizer):
    """The table really puts stops at the first token, across tokens and inside multi-byte characters."""
    assert expected(tokenizer, tokenizer.encode("def parse(path)"), ["def"]) == ("", 1)
    cafe = tokenizer.encode("x = 'café' + y")
    assert tokenizer.decode(cafe[:6]).endswith("\ufffd")  # é spans two tokens; "é" needs both
    text, count = expected(tokenizer, cafe, ["é"])
    assert text == "x = 'caf" and tokenizer.decode(cafe[:count]).endswith("é")
    quote = tokenizer.encode("say x ”done”")
    assert 3375 in quote  # " " + a partial "”" in one token: "x " completes inside it
    text, count = expected(tokenizer, quote, ["x "])
    assert text == "say " and quote[count - 1] == 3375


def test_held_back_text_never_leaks_a_stop_string(tokenizer):
    """While a stop string could still complete, the deltas sent so far never contain its start."""
    ids = tokenizer.encode("value = compute(value)\n")
    out = ChoiceText(tokenizer, {EOS}, ["(value)"])
    sent = "".join(out.push([t]) for t in ids)
    assert sent == "value = compute" and out.stopped
    assert out.push(tokenizer.encode(" more")) == "" and out.finish() == ""


def test_stop_id_counts_but_has_no_text_and_later_tokens_are_ignored(tokenizer):
    ids = tokenizer.encode("return x")
    out = ChoiceText(tokenizer, {EOS, 7}, [])
    assert out.push(ids + [EOS]) + out.finish() == "return x" and out.tokens == ids + [EOS]
    ignoring = ChoiceText(tokenizer, {EOS}, [])  # ignore_eos: eos mid-output is counted, not shown
    assert ignoring.push(ids + [EOS] + ids) + ignoring.finish() == "return xreturn x"
    assert len(ignoring.tokens) == 2 * len(ids) + 1
