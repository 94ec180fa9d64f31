"""The documentation stays true: every `jaxspec`, `jaxspec-convert` and `demos/multi_gpu.py` command in a bash block of
README.md or docs/*.md parses with the real argument parser and names only flags its `--help` lists; every flag named
in the prose of a section titled after a command is one of that command's; every relative link and anchor resolves;
every section that left the README has its page; and the test extra covers what `speculators` needs at run time.
The parsers are built in-process (`jaxspec.cli.build_parser`), so no command is spawned."""

import argparse
import contextlib
import importlib.metadata
import importlib.util
import io
import re
import shlex
import tomllib
from functools import cache
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from converters.__main__ import build_parser as convert_parser
from jaxspec.cli import build_parser as jaxspec_parser
from tests import install

ROOT = Path(__file__).resolve().parent.parent
PAGES = {p.relative_to(ROOT).as_posix(): p.read_text() for p in [ROOT / "README.md", *sorted(ROOT.glob("docs/*.md"))]}
FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", flags=re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def multi_gpu_parser() -> argparse.ArgumentParser:
    spec = importlib.util.spec_from_file_location("demos_multi_gpu", ROOT / "demos" / "multi_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_parser()


PARSERS = {"jaxspec": jaxspec_parser, "jaxspec-convert": convert_parser, "multi_gpu": multi_gpu_parser}


@cache
def parser(name: str) -> argparse.ArgumentParser:
    """The named parser, strict: no abbreviated flags (`--prompt` must not pass for `--prompts-file`)."""
    return _strict(PARSERS[name]())


def _strict(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.allow_abbrev = False
    for sub in _subparsers(p).values():
        _strict(sub)
    return p


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices) if actions else {}


def command_lines() -> list[tuple[str, str, list[str]]]:
    """(page, parser name, argv) of every command line in the pages' bash blocks (continuations joined)."""
    found = []
    for page, text in PAGES.items():
        for lang, body in FENCE.findall(text):
            if lang != "bash":
                continue
            for line in body.replace("\\\n", " ").splitlines():
                line = line.rstrip().removesuffix("&")  # a process started in the background
                words = shlex.split(line, comments=True) if line.startswith(("jaxspec", "python ")) else []
                if words[:1] in (["jaxspec"], ["jaxspec-convert"]):
                    found.append((page, words[0], words[1:]))
                elif words[:3] == ["python", "-m", "jaxspec"]:
                    found.append((page, "jaxspec", words[3:]))
                elif words[:2] == ["python", "demos/multi_gpu.py"]:
                    found.append((page, "multi_gpu", words[2:]))
    return found


COMMANDS = command_lines()
IDS = [f"{page}: {name} {' '.join(argv)}"[:100] for page, name, argv in COMMANDS]


def _parse(name: str, argv: list[str]) -> argparse.Namespace:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser(name).parse_args(argv)
    except SystemExit:
        pytest.fail(f"{name} {shlex.join(argv)}: does not parse:\n{err.getvalue()}")


def _help_for(name: str, argv: list[str]) -> tuple[str, str]:
    """(command, `--help` text) of the parser a command line ends in: the subcommand's, after the global options."""
    p, command = parser(name), name
    subs = _subparsers(p)
    text = p.format_help()
    word = next((w for w in argv if not w.startswith("-") and w in subs), None)
    if word is not None:
        command, text = f"{name} {word}", text + subs[word].format_help()
    return command, text


@pytest.mark.parametrize(("page", "name", "argv"), COMMANDS, ids=IDS)
def test_documented_command_parses(page, name, argv):
    _parse(name, argv)


def check_flags_in_help(page: str, name: str, argv: list[str]) -> None:
    command, text = _help_for(name, argv)
    for word in argv:
        if word.startswith("--"):
            flag = word.split("=", 1)[0]
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text), f"{page}: `{command}` has no {flag}"


@pytest.mark.parametrize(("page", "name", "argv"), COMMANDS, ids=IDS)
def test_documented_flags_are_in_help(page, name, argv):
    check_flags_in_help(page, name, argv)


def test_the_flag_check_catches_a_flag_that_does_not_exist():
    command, text = _help_for("jaxspec", ["--cpu-devices", "8", "generate", "--num-steps", "3"])
    assert command == "jaxspec generate" and "--num-steps" in text and "--cpu-devices" in text
    check_flags_in_help("x.md", "jaxspec", ["--cpu-devices", "8", "generate", "--num-steps", "3"])
    with pytest.raises(AssertionError, match="x.md: `jaxspec generate` has no --num-stepz"):
        check_flags_in_help("x.md", "jaxspec", ["generate", "--num-stepz", "3"])
    with pytest.raises(AssertionError, match="`jaxspec-convert target` has no --max-k"):
        check_flags_in_help("x.md", "jaxspec-convert", ["target", "--src", "a", "--max-k", "3"])


def test_every_subcommand_has_an_example():
    documented = set()
    for _, name, argv in COMMANDS:
        if name != "multi_gpu":
            with contextlib.suppress(SystemExit), contextlib.redirect_stderr(io.StringIO()):
                documented.add((name, parser(name).parse_args(argv).command))
    for name in ("jaxspec", "jaxspec-convert"):
        for sub in _subparsers(parser(name)):
            assert (name, sub) in documented, f"no `{name} {sub}` example in a bash block of README.md or docs/"
    assert any(name == "multi_gpu" for _, name, _ in COMMANDS), "no demos/multi_gpu.py example in README.md or docs/"


def _sections(text: str) -> list[tuple[str, str]]:
    """(heading, text) of every `##`/`###` section."""
    parts = re.split(r"^(#{2,3} .*)$", text, flags=re.M)
    return list(zip(parts[1::2], parts[2::2], strict=True))


def _flags(p: argparse.ArgumentParser) -> set[str]:
    return {s for a in p._actions for s in a.option_strings}


def test_flags_named_in_command_sections_exist():
    """A `--flag` in the prose of a section titled after commands belongs to one of them (or is global)."""
    subs = {f"jaxspec {k}": v for k, v in _subparsers(parser("jaxspec")).items()}
    subs |= {f"jaxspec-convert {k}": v for k, v in _subparsers(parser("jaxspec-convert")).items()}
    globals_ = _flags(parser("jaxspec")) | _flags(parser("jaxspec-convert"))
    checked = 0
    for page, text in PAGES.items():
        for heading, body in _sections(text):
            commands = [c for c in subs if re.search(rf"`{re.escape(c)}`", heading)]
            if not commands:
                continue
            allowed = globals_ | set().union(*(_flags(subs[c]) for c in commands))
            for span in re.findall(r"`(--[a-z0-9-]+)", FENCE.sub("", body)):
                assert span in allowed, f"{page} {heading}: {span} is not a flag of {', '.join(commands)}"
                checked += 1
    assert checked >= 5  # the sections do name flags; an empty scan would prove nothing


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(text: str) -> set[str]:
    return {_slug(h) for h in re.findall(r"^#{1,6} (.*)$", FENCE.sub("", text), flags=re.M)}


def test_relative_links_and_anchors_resolve():
    checked = 0
    for page, text in PAGES.items():
        for target in LINK.findall(FENCE.sub("", text)):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            file = (ROOT / page).parent / path if path else ROOT / page
            assert file.exists(), f"{page}: link to {target}: {file.relative_to(ROOT)} does not exist"
            if anchor:
                assert anchor in _anchors(file.read_text()), f"{page}: link to {target}: no such heading"
            checked += 1
    assert checked >= 20


def test_readme_links_every_docs_page():
    linked = {m.partition("#")[0] for m in LINK.findall(PAGES["README.md"])}
    for page in PAGES:
        if page.startswith("docs/"):
            assert page in linked, f"README.md does not link {page}"


# Every section the README used to hold, and the page it lives on now.
MOVED = {
    "docs/design.md": ["Architecture", "Design notes (questions and answers)", "Layout", "The test set-up"],
    "docs/python-api.md": ["Python API"],
    "docs/cli.md": ["`jaxspec generate`", "`jaxspec tune`", "`jaxspec train-drafter`", "`jaxspec-convert`"],
    "docs/serving.md": ["Serving (`jaxspec serve`)"],
    "docs/tuning.md": ["How `jaxspec tune` measures", "Tree drafts"],
    "docs/deploy.md": ["Kimi-K2.5 on 8 devices", "Supported checkpoints", "Demos"],
    "docs/performance.md": ["What a step reads", "Attention over the live prefix", "Tree drafts: measured"],
    "docs/limits.md": ["Limits (not supported yet)"],
}


@pytest.mark.parametrize("page", sorted(MOVED))
def test_moved_sections_have_their_page(page):
    headings = re.findall(r"^#{1,3} (.*)$", PAGES[page], flags=re.M)
    for heading in MOVED[page]:
        assert heading in headings, f"{page} has no section {heading!r}"


def test_test_extra_covers_what_speculators_needs():
    """speculators is installed with --no-deps (tests/install.py), so the test extra must bring the rest of what its
    metadata declares, at versions it accepts; torchvision and torchaudio are the two it must not bring."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    ours = {canonicalize_name(Requirement(r).name) for r in project["dependencies"]}
    ours |= {canonicalize_name(Requirement(r).name) for r in project["optional-dependencies"]["test"]}
    name, _, pinned = install.WITHOUT_DEPENDENCIES[0].partition("==")
    assert importlib.metadata.version(name) == pinned, f"installed {name} is not the {pinned} tests/install.py pins"
    needs = [Requirement(r) for r in importlib.metadata.requires(name)]
    needs = [r for r in needs if r.marker is None]
    assert len(needs) >= 15  # speculators does declare its needs; an empty list would prove nothing
    for req in needs:
        key = canonicalize_name(req.name)
        if key in install.BREAK_TRANSFORMERS:
            assert key not in ours, f"the test extra must not install {key}: it breaks `import transformers`"
            continue
        assert key in ours, f"speculators needs {req}; add it to the test extra in pyproject.toml"
        version = importlib.metadata.version(req.name)
        assert req.specifier.contains(version, prereleases=True), f"speculators needs {req}, installed {version}"
