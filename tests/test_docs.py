"""The README and the pages under docs/: every code block runs, links resolve, no placeholders.

Code blocks, each found by its fence's language:

- ``python``: written to a file in a fresh temporary directory and run there as a script, with
  the repository's ``src`` on the path and a time limit; it must exit with status 0.
- ``bash``/``sh``/``shell``/``console``: each command line (``\\`` continuations joined,
  ``#`` comments dropped; in ``console`` only the lines after ``$``) runs in the page's temporary
  directory. ``interlace``, ``python -m interlace``, ``python X.py`` and ``torchrun`` lines run
  for real and must exit with status 0.
- ``text``: output shown to the reader, not code; never run. A fence without a language fails
  the test, so every block says which of the two it is.

A comment on the line before a block changes what happens to it, and says why:

- ``<!-- test: parse-only (reason) -->`` for commands that train or benchmark for minutes, need
  root, or need files a user brings: each line goes through its program's real argument parser
  (``argparse``'s ``parse_args``, stopped right after it returns), so a renamed or removed option
  still fails here. A block's programs are parsed one after another in one interpreter, each
  with its own arguments and environment. ``make TARGET`` lines, which set up a virtual
  environment, are checked with ``make -n`` (the target exists and its recipe expands); they are
  accepted only in such blocks.
- ``<!-- test: file NAME -->`` before a ``python`` block: the block is the script ``NAME`` that
  the page's shell blocks run (for example ``train.py`` under ``interlace launch``); it is written
  to the page's directory and must be used by one of them.
- ``<!-- test: skip (reason) -->``: not run (``pip``, ``git``: commands that change the machine).

Identical blocks on several pages run once.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# The long description of the package (pyproject's readme).
PACKAGE_DESCRIPTION = ROOT / "docs" / "package-description.md"
MAX_README_LINES = 300
PLACEHOLDERS = ("LINK_TABLE", "TODO", "TBD", "XXX")
# Files the repository does not have, which nothing may cite; the names are built so that this
# file does not contain them.
ABSENT_FILES = tuple(stem + ".md" for stem in ("PAPERS", "DESIGN"))
# Where such a citation could be read: the guide, the docs, the code, its tests and benchmarks.
CITING_PLACES = ("docs", "src", "tests", "benchmarks")
TEXT_SUFFIXES = (".md", ".py", ".json", ".log", ".sh", ".txt", ".toml")
TIMEOUT_S = 240  # one block; the 2-core CI machine is shared, so this is generous on purpose

# [text](target) and ![alt](target); the target ends at whitespace or the closing parenthesis.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.DOTALL | re.MULTILINE)
INLINE_CODE = re.compile(r"`[^`\n]*`")
EXTERNAL = ("http://", "https://", "mailto:")

OPENING = re.compile(r"^(```|~~~)\s*([\w+-]*)\s*$")
MARKER = re.compile(r"^<!--\s*test:\s*(?P<mode>[\w-]+)\s*(?P<detail>.*?)\s*-->$")
SHELL = ("bash", "sh", "shell", "console")
OUTPUT = ("text",)
MODES = ("run", "parse-only", "file", "skip")

# Run in place of Python programs, this stops each right after its argument parser returns.
# It runs a block's programs one after another in one interpreter (starting one that imports
# torch costs seconds): each with its own argv and environment, and a line of JSON after each
# that says how it ended.
PARSE_ONLY_RUNNER = """\
import argparse, json, os, runpy, sys, traceback
from pathlib import Path

parsed = False
parse_args = argparse.ArgumentParser.parse_args

def parse_then_stop(self, args=None, namespace=None):
    global parsed
    result = parse_args(self, args, namespace)
    parsed = True
    print(f"parse-only: {self.prog} accepted {result}")
    raise SystemExit(0)

argparse.ArgumentParser.parse_args = parse_then_stop
try:  # interlace's own parsers override parse_args (their errors name the subcommand)
    from interlace.cliutil import OneLineArgumentParser
except ImportError:
    pass
else:
    own_parse_args = OneLineArgumentParser.parse_args

    def own_parse_then_stop(self, args=None, namespace=None):
        global parsed
        result = own_parse_args(self, args, namespace)
        parsed = True
        print(f"parse-only: {self.prog} accepted {result}")
        raise SystemExit(0)

    OneLineArgumentParser.parse_args = own_parse_then_stop
environ = dict(os.environ)
for index, (env, kind, target, argv) in enumerate(json.loads(sys.argv[1])):
    parsed = False
    os.environ.clear()
    os.environ.update({**environ, **env})
    sys.argv = [target, *argv]
    try:
        if kind == "-m":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, str(Path(target).resolve().parent))
            runpy.run_path(target, run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        if not isinstance(stop.code, int | None):
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    print(json.dumps({"parse-only command": index, "code": code, "parsed": parsed}), flush=True)
"""
#: Plain file commands a page may show between its own (``ls`` a run folder, ``rm`` a file);
#: they run in the test's folder for that page.
FILE_COMMANDS = ("ls", "rm", "cat")


def markdown_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def relative_name(path: Path) -> str:
    return str(path.relative_to(ROOT))


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page, with what its marker comment asks for."""

    page: Path
    line: int  # the opening fence's line, 1-based
    language: str
    text: str
    mode: str
    detail: str  # the reason in parentheses, or a file block's name

    @property
    def where(self) -> str:
        return f"{relative_name(self.page)}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    """The fenced blocks of ``page`` in order (fences nested in lists included)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    index = 0
    while index < len(lines):
        opening = OPENING.match(lines[index].strip())
        if opening is None:
            index += 1
            continue
        fence, language = opening.groups()
        end = index + 1
        while end < len(lines) and lines[end].strip() != fence:
            end += 1
        mode, detail = "run", ""
        before = index - 1
        while before >= 0 and not lines[before].strip():
            before -= 1
        marker = MARKER.match(lines[before].strip()) if before >= 0 else None
        if marker is not None:
            mode, detail = marker["mode"], marker["detail"].strip()
        indent = len(lines[index]) - len(lines[index].lstrip())
        body = "\n".join(line[indent:] for line in lines[index + 1 : end])
        found.append(Block(page, index + 1, language, body + "\n", mode, detail))
        index = end + 1
    return found


def all_blocks() -> list[Block]:
    return [block for page in markdown_files() for block in blocks_of(page)]


def code_blocks() -> list[Block]:
    """Every block that holds code, identical ones once."""
    unique: dict[tuple[str, str, str], Block] = {}
    for block in all_blocks():
        if block.language in OUTPUT:
            continue
        unique.setdefault((block.language, block.mode, block.text), block)
    return list(unique.values())


def command_lines(block: Block) -> list[list[str]]:
    """The shell commands of ``block`` as words: continuations joined, comments and output
    dropped."""
    text = block.text.replace("\\\n", " ")
    commands: list[list[str]] = []
    for raw in text.splitlines():
        line = raw.strip()
        if block.language == "console":
            if not line.startswith("$ "):
                continue
            line = line[2:]
        words = shlex.split(line, comments=True)
        if words:
            commands.append(words)
    return commands


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        part for part in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if part
    )
    env["MPLBACKEND"] = "Agg"
    env.update(extra or {})
    return env


def run_checked(argv: list[str], cwd: Path, where: str, env: dict[str, str] | None = None) -> str:
    """Run ``argv``; fail the test with its output unless it exits with status 0."""
    try:
        done = subprocess.run(
            argv,
            cwd=cwd,
            env=child_env(env),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{where}: {shlex.join(argv)} ran past {TIMEOUT_S} s")
    if done.returncode != 0:
        pytest.fail(
            f"{where}: {shlex.join(argv)} exited with {done.returncode}\n"
            f"--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-4000:]}"
        )
    return done.stdout


def python_program(words: list[str], cwd: Path) -> tuple[str, str, list[str]] | None:
    """``(kind, target, args)`` of a Python command line (``-m module`` or a script), else None.

    A script path that the page's directory lacks is taken from the repository root, where the
    pages' commands are meant to be typed (``python benchmarks/dp.py``).
    """
    program, *rest = words
    if program == "interlace":
        return "-m", "interlace", rest
    if program == "torchrun":
        return "-m", "torch.distributed.run", rest
    if program not in ("python", "python3") or not rest:
        return None
    if rest[0] == "-m" and len(rest) > 1:
        return "-m", rest[1], rest[2:]
    if rest[0].endswith(".py"):
        script = rest[0] if (cwd / rest[0]).exists() else str(ROOT / rest[0])
        return "script", script, rest[1:]
    return None


def split_env(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """Leading ``NAME=value`` words as an environment, and the command after them."""
    env: dict[str, str] = {}
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        name, value = words[0].split("=", 1)
        env[name] = value
        words = words[1:]
    return env, words


def run_command(line: list[str], block: Block, cwd: Path) -> None:
    """Run one command line of ``block`` as its mode asks (see the module docstring)."""
    env, words = split_env(line)
    where = f"{block.where}: `{shlex.join(line)}`"
    if not words:
        pytest.fail(f"{where}: no command")
    if words[0] == "make":
        if block.mode != "parse-only":
            pytest.fail(f"{where}: make sets up a virtual environment; mark the block parse-only")
        run_checked(["make", "-n", "-C", str(ROOT), *words[1:]], cwd, where, env)
        return
    if words[0] in FILE_COMMANDS:
        # Looking at or removing the files a page's own commands wrote, in the test's folder.
        if block.mode == "run":
            run_checked(words, cwd, where, env)
        return
    program = python_program(words, cwd)
    if program is None:
        pytest.fail(
            f"{where}: the test does not know how to run {words[0]!r}; mark the block "
            "'<!-- test: skip (reason) -->' if it must not run"
        )
    kind, target, args = program
    if block.mode == "parse-only":
        parse_only([(line, env, kind, target, args)], block, cwd)
    elif kind == "-m":
        run_checked([sys.executable, "-m", target, *args], cwd, where, env)
    else:
        run_checked([sys.executable, target, *args], cwd, where, env)


def parse_only(
    programs: list[tuple[list[str], dict[str, str], str, str, list[str]]], block: Block, cwd: Path
) -> None:
    """Put each ``(line, env, kind, target, args)`` of ``block`` through its program's argument
    parser, all in one interpreter; fail naming the first line that did not exit with status 0
    right after its parser returned."""
    commands = [[env, kind, target, args] for _, env, kind, target, args in programs]
    argv = [sys.executable, "-c", PARSE_ONLY_RUNNER, json.dumps(commands)]
    where = f"{block.where}: parse-only"
    try:
        done = subprocess.run(
            argv,
            cwd=cwd,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{where}: {len(programs)} command(s) ran past {TIMEOUT_S} s")
    ends = [
        json.loads(text)
        for text in done.stdout.splitlines()
        if text.startswith('{"parse-only command"')
    ]
    output = f"--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-4000:]}"
    for index, (line, *_) in enumerate(programs):
        command = f"{block.where}: `{shlex.join(line)}`"
        if index >= len(ends):
            pytest.fail(f"{command} never finished (the runner exited {done.returncode})\n{output}")
        if ends[index]["code"] != 0:
            pytest.fail(f"{command} exited with {ends[index]['code']}\n{output}")
        assert ends[index]["parsed"], f"{command}: the program never reached its argument parser"
    assert done.returncode == 0, f"{where}: the runner exited {done.returncode}\n{output}"


@pytest.fixture(scope="module")
def page_dirs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path], Path]:
    """Each page's working directory, holding the page's ``file`` blocks."""
    made: dict[Path, Path] = {}

    def directory(page: Path) -> Path:
        if page not in made:
            made[page] = tmp_path_factory.mktemp(page.stem)
            for block in blocks_of(page):
                if block.mode == "file":
                    (made[page] / block.detail).write_text(block.text, encoding="utf-8")
        return made[page]

    return directory


def block_id(block: Block) -> str:
    return block.where


@pytest.mark.parametrize("block", code_blocks(), ids=block_id)
def test_code_block_runs(block: Block, page_dirs: Callable[[Path], Path]) -> None:
    if block.language not in ("python", *SHELL):
        pytest.fail(
            f"{block.where}: a fence needs a language: python, one of {SHELL}, or text for output"
        )
    if block.mode not in MODES:
        pytest.fail(f"{block.where}: unknown test mode {block.mode!r} (one of {MODES})")
    if block.mode in ("parse-only", "skip") and not re.fullmatch(r"\(.+\)", block.detail):
        pytest.fail(
            f"{block.where}: a {block.mode} block says why: '<!-- test: {block.mode} (why) -->'"
        )
    if block.mode == "skip":
        pytest.skip(f"{block.where}: {block.detail[1:-1]}")
    cwd = page_dirs(block.page)
    if block.language == "python":
        if block.mode == "file":
            return  # run by the page's shell blocks; test_file_blocks_are_used checks that
        if block.mode != "run":
            pytest.fail(f"{block.where}: a python block runs; {block.mode!r} is for shell blocks")
        script = cwd / f"snippet_{block.line}.py"
        script.write_text(block.text, encoding="utf-8")
        run_checked([sys.executable, script.name], cwd, block.where)
        return
    lines = command_lines(block)
    assert lines, f"{block.where}: a shell block without commands"
    if block.mode == "parse-only":
        # The block's Python programs are parsed in one interpreter, after its other lines.
        programs = []
        for line in lines:
            env, words = split_env(line)
            program = python_program(words, cwd) if words else None
            if program is None:
                run_command(line, block, cwd)
            else:
                programs.append((line, env, *program))
        if programs:
            parse_only(programs, block, cwd)
        return
    for line in lines:
        run_command(line, block, cwd)


def file_blocks() -> list[Block]:
    return [block for block in all_blocks() if block.mode == "file"]


@pytest.mark.parametrize("block", file_blocks(), ids=block_id)
def test_file_blocks_are_used(block: Block) -> None:
    assert re.fullmatch(r"[\w.-]+\.py", block.detail), f"{block.where}: file needs a NAME.py"
    users = [
        other
        for other in blocks_of(block.page)
        if other.language in SHELL
        and other.mode == "run"
        and any(block.detail in line for line in command_lines(other))
    ]
    assert users, f"{block.where}: no shell block on the page runs {block.detail}"


def test_parse_only_rejects_an_unknown_option(tmp_path: Path) -> None:
    block = Block(README, 1, "bash", "", "parse-only", "(example)")
    with pytest.raises(pytest.fail.Exception, match="exited with 2"):
        run_command(["interlace", "train", "--no-such-option", "3"], block, tmp_path)
    with pytest.raises(pytest.fail.Exception, match="exited with 2"):
        run_command(
            ["interlace", "launch", "-n", "2", "--no-such-option", "--", "python", "x.py"],
            block,
            tmp_path,
        )


def test_parse_only_names_the_line_of_a_block_that_fails(tmp_path: Path) -> None:
    # A block's programs are parsed in one interpreter: the failure still names its own line.
    text = "interlace train --epochs 3\ninterlace train --no-such-option 3\ninterlace train\n"
    block = Block(README, 1, "bash", text, "parse-only", "(example)")
    with pytest.raises(pytest.fail.Exception, match="`interlace train --no-such-option 3` exited"):
        test_code_block_runs(block, lambda _: tmp_path)


def test_parse_only_stops_after_parsing(tmp_path: Path) -> None:
    # The full command trains for minutes; parse-only returns once the options are read.
    block = Block(README, 1, "bash", "", "parse-only", "(example)")
    run_command(shlex.split("interlace train --model resnet20 -n 4 --epochs 200"), block, tmp_path)
    assert not any(tmp_path.iterdir()), "a parse-only command must not start the job"


def test_blocks_are_found_with_their_markers(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "Intro\n\n<!-- test: parse-only (trains for minutes) -->\n```bash\ninterlace train \\\n"
        "  --epochs 9   # long\n```\n\n- item\n\n  ```python\n  print(1)\n  ```\n\n"
        "```text\nout\n```\n",
        encoding="utf-8",
    )
    found = blocks_of(page)
    assert [(b.line, b.language, b.mode, b.detail) for b in found] == [
        (4, "bash", "parse-only", "(trains for minutes)"),
        (11, "python", "run", ""),
        (15, "text", "run", ""),
    ]
    assert command_lines(found[0]) == [["interlace", "train", "--epochs", "9"]]
    assert found[1].text == "print(1)\n"


def prose(path: Path) -> str:
    """The file's text without fenced code blocks and inline code spans."""
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return INLINE_CODE.sub("", text)


def link_targets(path: Path) -> list[str]:
    return LINK.findall(prose(path))


@pytest.mark.parametrize("path", markdown_files(), ids=relative_name)
def test_relative_links_resolve(path: Path) -> None:
    missing: list[str] = []
    for target in link_targets(path):
        if target.startswith(EXTERNAL) or target.startswith("#"):
            continue
        local = target.split("#", 1)[0].split("?", 1)[0]
        if not local:
            continue
        if not (path.parent / local).exists():
            missing.append(target)
    assert not missing, f"{relative_name(path)} links to missing files: {missing}"


@pytest.mark.parametrize("path", markdown_files(), ids=relative_name)
def test_no_placeholder_words(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    found = [word for word in PLACEHOLDERS if re.search(rf"\b{word}\b", text)]
    assert not found, f"{relative_name(path)} contains placeholder words: {found}"


def citations_of_absent_files(paths: list[Path]) -> list[str]:
    """``"path: name"`` for every file of ``paths`` that names one of ``ABSENT_FILES``."""
    found: list[str] = []
    for path in paths:
        text = path.read_text(encoding="utf-8", errors="replace")
        found += [f"{path.name}: {name}" for name in ABSENT_FILES if name in text]
    return found


def test_nothing_cites_files_the_repository_lacks() -> None:
    paths = [README] + [
        path
        for place in CITING_PLACES
        for path in sorted((ROOT / place).rglob("*"))
        if path.is_file() and path.suffix in TEXT_SUFFIXES
    ]
    assert len(paths) > 100, "the walk found too few files to be checking the repository"
    found = citations_of_absent_files(paths)
    assert not found, f"citations of files the repository does not have: {found}"


def test_citation_check_finds_a_citation(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(f"See {ABSENT_FILES[0]} and docs/papers.md.\n", encoding="utf-8")
    assert citations_of_absent_files([page]) == [f"page.md: {ABSENT_FILES[0]}"]


def test_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES})"


def test_link_pattern_finds_links_and_images() -> None:
    sample = "See [a](docs/a.md#part) and ![b](img/b.png) but not `[c](d.md)`."
    assert LINK.findall(INLINE_CODE.sub("", sample)) == ["docs/a.md#part", "img/b.png"]


def test_package_description_needs_no_repository() -> None:
    # A package index shows this page without the repository around it: relative links and
    # images would be broken there.
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert f'file = "{relative_name(PACKAGE_DESCRIPTION)}"' in pyproject
    relative = [t for t in link_targets(PACKAGE_DESCRIPTION) if not t.startswith(EXTERNAL)]
    assert not relative, f"{relative_name(PACKAGE_DESCRIPTION)} has relative links: {relative}"
