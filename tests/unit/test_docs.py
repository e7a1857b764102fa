"""The documentation holds together: README.md and docs/*.md link only to files and headings that exist, every
recipe command they show composes with Hydra, and the README stays short enough to read.

The commands are checked in-process with Hydra's compose API, on the config ``recipes/train.py`` declares
(``conf/``, ``config``, version_base 1.3); one of them also runs as ``python recipes/train.py ... --cfg job``
to show that the in-process check composes what the script composes.
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
CONF = ROOT / "conf"
#: As ``@hydra.main`` in recipes/train.py declares it.
CONFIG_NAME, VERSION_BASE = "config", "1.3"
README_MAX_LINES = 250

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`+[^`]*`+")


def split_fences(text: str) -> tuple[list[str], list[list[str]]]:
    """(prose lines, code blocks as lists of lines) of a Markdown text."""
    prose: list[str] = []
    blocks: list[list[str]] = []
    block: list[str] | None = None
    for line in text.splitlines():
        if FENCE.match(line):
            if block is None:
                block = []
            else:
                blocks.append(block)
                block = None
        elif block is None:
            prose.append(line)
        else:
            block.append(line)
    return prose, blocks


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lowercased, punctuation but '-' and '_' dropped,
    spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"<[^>]+>", "", text).lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LMN")
    return kept.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a page; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    result: set[str] = set()
    for line in split_fences(page.read_text())[0]:
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def links(page: Path) -> list[str]:
    """The link targets of a page's prose (code blocks and code spans are not links; a link's text may wrap)."""
    prose = "\n".join(CODE_SPAN.sub("", line) for line in split_fences(page.read_text())[0])
    return LINK.findall(prose)


def broken_links(page: Path) -> list[str]:
    problems = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http(s), mailto: not checked here
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            problems.append(f"{page.relative_to(ROOT)}: {target} (no file {path})")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            problems.append(f"{page.relative_to(ROOT)}: {target} (no heading #{anchor} in {file.relative_to(ROOT)})")
    return problems


# --- the recipe commands shown in the docs -----------------------------------------------------------------

LAUNCHERS = ("python", "python3", "torchrun", "srun", "make")


def logical_lines(block: list[str]) -> list[str]:
    """A code block's lines with backslash continuations joined."""
    lines, current = [], ""
    for line in block:
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
        else:
            lines.append(current + line)
            current = ""
    if current:
        lines.append(current)
    return lines


def recipe_overrides(line: str) -> list[str] | None:
    """The Hydra overrides of a shown ``recipes/train.py`` command (python, torchrun, srun, ``make train
    ARGS=...``), or None when the line is not one."""
    stripped = line.strip()
    if not stripped.startswith(LAUNCHERS):
        return None
    if "recipes/train.py" not in stripped and not stripped.startswith("make train"):
        return None
    tokens = shlex.split(stripped, comments=True)
    if tokens[:2] == ["make", "train"]:
        args = [token.partition("=")[2] for token in tokens[2:] if token.startswith("ARGS=")]
        return shlex.split(args[0]) if args else []
    if tokens[0] == "make":
        return None
    return tokens[tokens.index("recipes/train.py") + 1 :]


def shown_commands() -> list[tuple[str, str, list[str]]]:
    """(page, the command as shown, its overrides) for every recipe command in a code block."""
    commands = []
    for page in PAGES:
        for block in split_fences(page.read_text())[1]:
            for line in logical_lines(block):
                overrides = recipe_overrides(line)
                if overrides is not None:
                    commands.append((str(page.relative_to(ROOT)), " ".join(line.split()), overrides))
    return commands


COMMANDS = shown_commands()


def compositions(overrides: list[str]) -> list[list[str]]:
    """The override lists a command composes: ``-m`` dropped, a sweep (``a=1,2``) expanded into each of its
    values."""
    flags = [o for o in overrides if o.startswith("-")]
    unknown = [flag for flag in flags if flag not in ("-m", "--multirun")]
    if unknown:
        raise ValueError(f"unexpected command-line flags {unknown}")
    parsed = OverridesParser.create().parse_overrides([o for o in overrides if not o.startswith("-")])
    choices = []
    for override in parsed:
        if override.is_sweep_override():
            key = override.input_line.partition("=")[0]
            choices.append([f"{key}={value}" for value in override.sweep_string_iterator()])
        else:
            choices.append([override.input_line])
    return [list(combination) for combination in itertools.product(*choices)]


def compose_job(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base=VERSION_BASE):
        return compose(CONFIG_NAME, overrides=overrides)


# --- the tests ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(page):
    problems = broken_links(page)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_readme_links_every_docs_page():
    linked = {(README.parent / target.partition("#")[0]).resolve() for target in links(README)}
    unlinked = [str(page.relative_to(ROOT)) for page in sorted(DOCS.glob("*.md")) if page.resolve() not in linked]
    assert not unlinked, f"README.md links none of {unlinked}"


def test_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail into docs/"


def test_the_docs_show_recipe_commands():
    pages = {page for page, _, _ in COMMANDS}
    assert "README.md" in pages and len(COMMANDS) >= 20, (len(COMMANDS), pages)


@pytest.mark.parametrize(("page", "command", "overrides"), COMMANDS, ids=[f"{p}: {c[:80]}" for p, c, _ in COMMANDS])
def test_shown_command_composes(page, command, overrides):
    try:
        for combination in compositions(overrides):
            compose_job(combination)
    except Exception as error:  # noqa: BLE001 - the command and Hydra's reason are the message
        pytest.fail(f"{page}: `{command}` does not compose with Hydra: {type(error).__name__}: {error}")


def test_the_script_composes_what_the_check_composes(tmp_path):
    """One shown command through ``recipes/train.py --cfg job`` (no training): the same config."""
    single = [(page, command, o) for page, command, o in COMMANDS if not any(x.startswith("-") for x in o)]
    # The one with the most overrides: the most to check.
    page, command, overrides = max(single, key=lambda item: len(item[2]))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "train.py"), *overrides, "--cfg", "job"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, f"{page}: `{command} --cfg job` failed:\n{done.stderr[-2000:]}"
    printed = OmegaConf.to_container(OmegaConf.create(done.stdout), resolve=False)
    composed = OmegaConf.to_container(compose_job(overrides), resolve=False)
    assert printed == composed, f"{page}: `{command}`: --cfg job and compose() differ"
