"""The docs stay true to the tree: links resolve, shown commands parse, the config reference is current.

Checked in README.md, docs/**/*.md and slurm_templates/README.md: every relative link and image
points at a file of the repository (anchors are not checked), and every command line in a fenced
block that starts with ``python jobs/``, ``rlhpc-`` or ``make`` names a real entry point or Make
target and only options its real parser accepts.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import io
import re
import shlex
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

import pytest

from rlhpc import config
from rlhpc.cli import config_reference

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted([REPO / "README.md", REPO / "slurm_templates" / "README.md", *(REPO / "docs").rglob("*.md")])

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
PLACEHOLDERS = {"...", "…"}


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


# ---------------------------------------------------------------- links


def broken_links(path: Path) -> list[str]:
    """Relative links and images in ``path`` whose target does not exist."""
    text = FENCE.sub("", path.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans are not links, e.g. `a[0](x)`
    bad = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # another site (http:, mailto:) or an anchor on this page
        if not (path.parent / target.split("#", 1)[0]).exists():
            bad.append(f"{_rel(path)}: {target}")
    return bad


def test_docs_pages_exist():
    # the pages the README promises; a rename that forgets one fails here and in the links
    assert (REPO / "docs" / "reference" / "config.md") in DOCS and len(DOCS) > 10


def test_relative_links_and_images_resolve():
    bad = [b for p in DOCS for b in broken_links(p)]
    assert not bad, "links to files that do not exist:\n" + "\n".join(bad)


def test_a_broken_link_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](page.md) ![img](missing.png) `[code](gone.md)`\n```\n[x](gone.md)\n```\n[web](https://x.org)\n"
    )
    assert broken_links(page) == [f"{page}: missing.png"]


# ---------------------------------------------------------------- commands


def shown_commands(text: str) -> list[tuple[int, list[str]]]:
    """(line, words) of each command in the fenced blocks of ``text`` that starts with
    ``python jobs/``, ``rlhpc-`` or ``make``; backslash-continued lines joined, comments dropped,
    ``&&``/``;``/``|`` chains split into their commands."""
    found = []
    for block in FENCE.finditer(text):
        first = text.count("\n", 0, block.start(1)) + 1
        lines = block.group(1).split("\n")
        i = 0
        while i < len(lines):
            start, line = first + i, lines[i].strip()
            while line.endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line[:-1] + " " + lines[i].strip()
            i += 1
            line = line.removeprefix("$ ")
            if not re.match(r"(python3? jobs/|rlhpc-|make\b)", line):
                continue
            words, part = [], []
            for w in shlex.split(line, comments=True) + [";"]:
                if w in ("&&", "||", ";", "|"):
                    words.append(part)
                    part = []
                else:
                    part.append(w)
            found += [(start, p) for p in words if p]
    return found


def _scripts() -> dict[str, str]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def _job_module(script: Path) -> str:
    """The rlhpc.cli module a ``jobs/*.py`` script hands its command line to."""
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and any(a.name == "main" for a in node.names):
            return node.module
    raise AssertionError(f"{_rel(script)} imports no main()")


def _make_names() -> tuple[set[str], set[str]]:
    """(targets, variables) of the Makefile."""
    text = (REPO / "Makefile").read_text()
    targets, variables = set(), set()
    for line in text.splitlines():
        if line.startswith("\t") or line.startswith("#"):
            continue
        if m := re.match(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:\?|:|\+)?=", line):
            variables.add(m.group(1))
        elif m := re.match(r"([^:=#$]+):(?!=)", line):
            targets.update(t for t in m.group(1).split() if not t.startswith("."))
    return targets, variables


def _check_parser(module_name: str, args: list[str]) -> str | None:
    module = importlib.import_module(module_name)
    if not hasattr(module, "build_parser"):
        # no argparse (rlhpc.cli.task takes one run dir): options cannot be right
        opts = [a for a in args if a.startswith("-")]
        return f"{module_name} takes no options, got {opts}" if opts else None
    parser = module.build_parser()
    if "-h" in args or "--help" in args:
        return None  # argparse prints the help before it looks at anything else
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(args)
    except SystemExit:
        return err.getvalue().strip().splitlines()[-1]
    return None


def check_command(words: list[str]) -> str | None:
    """Why ``words`` is not a command of this repository, or None."""
    words = [w for w in words if w not in PLACEHOLDERS and not re.fullmatch(r"\[.*\]", w)]
    head, args = words[0], words[1:]
    if head == "make":
        targets, variables = _make_names()
        for a in args:
            if "=" in a and a.split("=", 1)[0] not in variables:
                return f"make: no variable {a.split('=', 1)[0]} in the Makefile"
            if "=" not in a and not re.fullmatch(r"-[jkn]\d*", a) and a not in targets:
                return f"make: no target {a!r} in the Makefile (targets: {', '.join(sorted(targets))})"
        return None
    if head.startswith("rlhpc-"):
        spec = _scripts().get(head)
        if spec is None:
            return f"{head} is not in pyproject's [project.scripts]"
        return _check_parser(spec.split(":")[0], args)
    script = REPO / args[0]
    if not script.is_file():
        return f"{args[0]} does not exist"
    return _check_parser(_job_module(script), args[1:])


def test_shown_commands_are_real():
    bad, seen = [], 0
    for path in DOCS:
        for line, words in shown_commands(path.read_text()):
            seen += 1
            if why := check_command(words):
                bad.append(f"{_rel(path)}:{line}: {' '.join(words)}\n    {why}")
    assert seen > 10  # the README and the guides show commands: none found means the finder broke
    assert not bad, "commands in the docs that would fail:\n" + "\n".join(bad)


def test_the_readme_keeps_the_two_set_up_commands():
    shown = [" ".join(w) for _, w in shown_commands((REPO / "README.md").read_text())]
    assert shown[:2] == ["make run", "make test"]


def test_the_readme_status_calls_nothing_unbuilt_that_ships():
    """The README's "Not built yet" names none of the ways in that examples/ ships and the guides
    document (issue 42: it still listed the generate-function and agent ways)."""
    status = (REPO / "README.md").read_text().split("## Status", 1)[1]
    unbuilt = " ".join(status.split("Not built yet", 1)[1].split(".", 1)[0].split())
    for shipped in ("generate", "agent", "environment", "teacher", "judge", "tools"):
        assert shipped not in unbuilt, f"README Status says {shipped!r} is not built: {unbuilt}"


@pytest.mark.parametrize(
    "snippet, error",
    [
        ("```bash\npython jobs/submit.py --nodes 2 --bogus-flag\n```", "unrecognized arguments: --bogus-flag"),
        ("```\npython jobs/submit.py --config my.yaml \\\n    --nodes two\n```", "invalid int value"),
        ("```\nrlhpc-status\n```", "the following arguments are required: target"),
        ("```\nrlhpc-nope x\n```", "rlhpc-nope is not in pyproject"),
        ("```\npython jobs/nope.py\n```", "jobs/nope.py does not exist"),
        ("```\nmake lint && make tset\n```", "no target 'tset'"),
        ("```\nmake run RUNDIR=x\n```", "no variable RUNDIR"),
        ("```\nrlhpc-task --now RUN_DIR\n```", "takes no options"),
    ],
)
def test_a_wrong_command_is_found(snippet, error):
    (found,) = [why for _, words in shown_commands(snippet) if (why := check_command(words))]
    assert error in found


def test_placeholders_and_comments_are_not_arguments():
    text = "```\npython jobs/submit.py ... --dry-run   # the plan, it's printed\nrlhpc-show-rollout RUN_DIR [ID]\n```"
    commands = shown_commands(text)
    assert [w for _, w in commands] == [
        ["python", "jobs/submit.py", "...", "--dry-run"],
        ["rlhpc-show-rollout", "RUN_DIR", "[ID]"],
    ]
    assert [check_command(w) for _, w in commands] == [None, None]


# ---------------------------------------------------------------- the config reference


def test_config_reference_is_current():
    committed = config_reference.OUT.read_text() if config_reference.OUT.is_file() else ""
    assert committed == config_reference.render(), (
        f"{_rel(config_reference.OUT)} is stale: run `{config_reference.COMMAND}` and commit it"
    )


def _keys(cls: type, where: str = "") -> list[str]:
    """Every dotted key of the config, walked here independently of the generator."""
    out = []
    for f in dataclasses.fields(cls):
        key = f"{where}.{f.name}" if where else f.name
        tp = typing.get_type_hints(cls)[f.name]
        inner = [a for a in (tp, *typing.get_args(tp)) if dataclasses.is_dataclass(a)]
        if typing.get_origin(tp) is dict:  # named sections: the map itself and each one's keys
            out += [key, *(_keys(inner[0], f"{key}.NAME") if inner else [])]
        else:
            out += _keys(inner[0], key) if inner else [key]
    return out


def test_config_reference_names_every_key():
    text = config_reference.OUT.read_text()
    missing = [k for k in _keys(config.Config) if f"| `{k}` |" not in text]
    assert not missing and len(_keys(config.Config)) > 50, missing


def test_the_verl_guides_key_table_is_the_one_did_you_mean_reads():
    guide = config_reference.GUIDE.read_text()
    assert config_reference.with_foreign_table(guide) == guide, f"run {config_reference.COMMAND}"
    assert "| verl | `actor_rollout_ref.rollout.n` | `rollout.n_samples_per_prompt` |" in guide


def test_config_reference_describes_every_key():
    """Every key has a description (the comment at its field, or its base class's for an inherited
    one): issue 42 found 94 of 207 without (seed, actor.lr, checkpoint.resume, ...)."""
    undescribed = [k.key for b in config_reference.blocks() for k in b.keys if not k.comment.strip()]
    assert not undescribed, f"describe these keys with a comment at their field in rlhpc/config.py: {undescribed}"


@dataclass
class _Nested(config.Section):
    SECTION: ClassVar[str] = "extra.nested"

    # above the field,
    # on two lines
    depth: int = 3  # and beside it

    def check(self) -> None:
        self._at_least(2, "depth")


@dataclass
class _Extra(config.Section):
    """A section a colleague adds."""

    SECTION: ClassVar[str] = "extra"

    mode: Literal["a", "b"] = "a"
    note: str = "# not a comment"
    ratio: float = 0.5
    nested: _Nested | None = field(default_factory=_Nested)

    def check(self) -> None:
        self._above(0, "ratio")
        if self.ratio > 1:
            self._refuse("ratio", "must be at most 1", "lower it")


def test_a_new_section_and_key_reach_the_reference():
    blocks = {b.name: b for b in config_reference.blocks(_Extra, "extra")}
    mode, note, ratio = blocks["extra"].keys
    assert (mode.key, mode.default, mode.rules) == ("extra.mode", '"a"', ["one of `a`, `b`"])
    assert (note.default, note.comment) == ('"# not a comment"', "")
    assert ratio.rules == ["> 0", "must be at most 1"]
    (depth,) = blocks["extra.nested"].keys
    assert (depth.key, depth.comment, depth.rules) == (
        "extra.nested.depth",
        "above the field, on two lines and beside it",
        [">= 2"],
    )
    assert blocks["extra"].doc == "A section a colleague adds."
