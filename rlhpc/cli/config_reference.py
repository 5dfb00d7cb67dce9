"""Write docs/reference/config.md from the config dataclasses in rlhpc/config.py, and the table of
verl's and slime's key names (rlhpc/foreign_keys.py) into docs/guides/coming-from-verl.md.

    python -m rlhpc.cli.config_reference            # rewrite both
    python -m rlhpc.cli.config_reference --check    # exit 1 if either committed file is stale

Every key comes from the dataclasses themselves (dotted key, type, default), its description from
the comment beside or above the field in the source, and its rule from what the section's
``check()`` says in a form that can be read without running it (Literal choices, ``_at_least``,
``_above``, and ``_refuse`` with a fixed message). A unit test compares the committed file with
``render()``, so a key added without regenerating the page fails the tests.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import io
import json
import sys
import textwrap
import tokenize
import types
import typing
from pathlib import Path
from typing import Any, Literal

from rlhpc import config, foreign_keys

OUT = Path(__file__).resolve().parents[2] / "docs" / "reference" / "config.md"
GUIDE = Path(__file__).resolve().parents[2] / foreign_keys.GUIDE
COMMAND = "python -m rlhpc.cli.config_reference"
TABLE_BEGIN = f"<!-- verl's and slime's keys: generated from rlhpc/foreign_keys.py by `{COMMAND}` -->"
TABLE_END = "<!-- end of the generated table -->"


@dataclasses.dataclass
class Key:
    key: str
    type: str
    default: str
    comment: str
    rules: list[str]


@dataclasses.dataclass
class Block:
    name: str  # dotted section, "" for the top level
    doc: str
    keys: list[Key]


def _section_type(tp: Any) -> type | None:
    """The dataclass a field holds (also inside ``X | None``), or None for a plain value."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        return inner[0] if len(inner) == 1 else None
    return None


@functools.cache
def _source(cls: type) -> tuple[ast.ClassDef, dict[int, str], set[int]] | None:
    """The class's AST, its comments by line, and the lines that hold only a comment."""
    try:
        lines, first = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return None  # a class built at run time has no source: its keys get no comment
    text = textwrap.dedent("".join(lines))
    comments: dict[int, str] = {}
    alone: set[int] = set()
    # tokenize, not a search for '#': a '#' inside a string is not a comment
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            row = tok.start[0] + first - 1
            comments[row] = tok.string.lstrip("#").strip()
            if not tok.line[: tok.start[1]].strip():
                alone.add(row)
    tree = ast.parse(text).body[0]
    ast.increment_lineno(tree, first - 1)
    assert isinstance(tree, ast.ClassDef)
    return tree, comments, alone


def _comments(cls: type) -> dict[str, str]:
    """Each field's comment: the comment lines right above it, then the one beside it; a field
    a subclass inherits has its base class's (``reward_model.tiny``'s are ``model.tiny``'s)."""
    out: dict[str, str] = {}
    for base in reversed(cls.__mro__[1:]):
        if dataclasses.is_dataclass(base):
            out.update(_comments(base))
    found = _source(cls)
    if found is None:
        return out
    tree, comments, alone = found
    for node in tree.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above = []
        row = node.lineno - 1
        while row in alone:
            above.insert(0, comments[row])
            row -= 1
        beside = [comments[r] for r in range(node.lineno, node.end_lineno + 1) if r in comments and r not in alone]
        if above or beside or node.target.id not in out:
            out[node.target.id] = " ".join(above + beside)
    return out


def _number(node: ast.expr) -> str | None:
    try:
        return repr(ast.literal_eval(node))
    except ValueError:
        return None


def _rules(cls: type) -> dict[str, list[str]]:
    """The rules ``check()`` states with constants: ``_at_least``, ``_above``, ``_refuse``."""
    found = _source(cls)
    rules: dict[str, list[str]] = {}
    if found is None:
        return rules
    check = next((n for n in found[0].body if isinstance(n, ast.FunctionDef) and n.name == "check"), None)
    for call in ast.walk(check) if check else ():
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)):
            continue
        name, args = call.func.attr, call.args
        consts = [a.value if isinstance(a, ast.Constant) else None for a in args]
        if name in ("_at_least", "_above") and args:
            low = _number(args[0])
            if low is None:
                continue
            op = ">=" if name == "_at_least" else ">"
            for field_name in consts[1:]:
                if isinstance(field_name, str):
                    rules.setdefault(field_name, []).append(f"{op} {low}")
        elif name == "_refuse" and len(consts) >= 2 and all(isinstance(c, str) for c in consts[:2]):
            rule = consts[1]
            rules.setdefault(consts[0], []).append(rule if rule.startswith("must") else f"refused: {rule}")
    return rules


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    if isinstance(value, tuple):
        value = list(value)
    try:
        return json.dumps(value)  # as YAML reads it: null, true, "auto", [0.9, 0.999]
    except TypeError:
        return repr(value)


def _doc(cls: type) -> str:
    doc = inspect.getdoc(cls) or ""
    # dataclasses invent a signature docstring for classes without one
    if doc.startswith(cls.__name__ + "("):
        return ""
    return " ".join(doc.split("\n\n", 1)[0].split())


def blocks(cls: type = config.Config, where: str = "") -> list[Block]:
    """One block per section, depth first, each listing its plain keys."""
    hints = typing.get_type_hints(cls)
    comments, rules = _comments(cls), _rules(cls)
    own = Block(where, _doc(cls), [])
    nested: list[Block] = []
    for f in dataclasses.fields(cls):
        key = f"{where}.{f.name}" if where else f.name
        section = _section_type(hints[f.name])
        if section is not None:
            nested += blocks(section, key)
            continue
        tp = hints[f.name]
        if typing.get_origin(tp) is dict and dataclasses.is_dataclass(element := typing.get_args(tp)[-1]):
            nested += blocks(element, f"{key}.NAME")  # a map of named sections (eval.sets.NAME.file)
        found = list(rules.get(f.name, []))
        if typing.get_origin(tp) is Literal:
            found.insert(0, "one of " + ", ".join(f"`{a}`" for a in typing.get_args(tp)))
        own.keys.append(Key(key, str(f.type), _default(f), comments.get(f.name, ""), found))
    return ([own] if own.keys else []) + nested


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    out = [
        "# Configuration reference",
        "",
        f"<!-- Generated from rlhpc/config.py by `{COMMAND}`; do not edit by hand. -->",
        "",
        "Every key of the run config, as YAML (`--config FILE`) or `--set key=value` spells it. Types and",
        "defaults are the dataclasses' in `rlhpc/config.py`; the description is the comment beside the",
        "field there; the rule is what the section's own check enforces (rules between sections, and",
        "those against files, the model and the code a key names, are in `rlhpc.preflight.check`, named by its errors).",
        "",
    ]
    for block in blocks():
        out += [f"## `{block.name}`" if block.name else "## Top level", ""]
        if block.doc:
            out += [block.doc, ""]
        out += ["| key | type | default | rule | description |", "|---|---|---|---|---|"]
        for k in block.keys:
            cells = [f"`{k.key}`", f"`{k.type}`", f"`{k.default}`", "; ".join(k.rules), k.comment]
            out.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        out.append("")
    return "\n".join(out)


def with_foreign_table(guide: str) -> str:
    """``guide`` with the table between its markers (``TABLE_BEGIN``, ``TABLE_END``) made anew."""
    head, sep, rest = guide.partition(TABLE_BEGIN)
    _, end, tail = rest.partition(TABLE_END)
    if not sep or not end:
        raise SystemExit(f"{GUIDE} lacks the markers {TABLE_BEGIN} ... {TABLE_END}")
    return f"{head}{TABLE_BEGIN}\n\n{foreign_keys.markdown_table()}\n\n{TABLE_END}{tail}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="compare with the committed files; write nothing")
    p.add_argument("--out", type=Path, default=OUT, help=f"where to write (default: {OUT})")
    args = p.parse_args(argv)
    outputs = [(args.out, render())]
    if GUIDE.is_file():
        outputs.append((GUIDE, with_foreign_table(GUIDE.read_text())))
    if args.check:
        stale = [str(f) for f, text in outputs if not f.is_file() or f.read_text() != text]
        for f in stale:
            print(f"{f} is stale: run {COMMAND}", file=sys.stderr)
        return 1 if stale else 0
    for f, text in outputs:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
        print(f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
