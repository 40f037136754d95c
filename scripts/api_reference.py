"""Write docs/api.md, the API reference: every public name of tcoll, from its signature and docstring.

    PYTHONPATH=src python scripts/api_reference.py [--check]

tests/test_docs.py runs `render()` in the test run, so a public name or member without a
docstring fails the tests, and checks that docs/api.md has every name and member that
the code has (regenerate it when they change; wording changes show up when it is rerun).
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path
from typing import Any

import tcoll

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "api.md"

_INTRO = """# API reference

Every public name of `tcoll` (`tcoll.__all__`), generated from the docstrings by
`scripts/api_reference.py` (the tests check that this page is current). The guides are
[collectives.md](collectives.md), [torch.md](torch.md) and the [README](../README.md).
"""


def _signature(obj: Any, name: str) -> str:
    """`name(a: int, b: str = 'x') -> T`, with the annotations as written in the source."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return name
    params, marked = [], False
    for p in sig.parameters.values():
        if p.name == "self":
            continue
        if p.kind is p.KEYWORD_ONLY and not marked:
            params.append("*")
            marked = True
        text = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        marked |= p.kind is p.VAR_POSITIONAL
        if p.annotation is not p.empty:
            text += f": {p.annotation if isinstance(p.annotation, str) else inspect.formatannotation(p.annotation)}"
        if p.default is not p.empty:
            default = p.default
            text += f" = {f'{default.__module__}.{default.__qualname__}' if inspect.isclass(default) else repr(default)}"
        params.append(text)
    returns = sig.return_annotation
    tail = "" if returns is sig.empty or returns in ("None", None) else f" -> {returns}"
    return f"{name}({', '.join(params)}){tail}"


def _doc(obj: Any) -> str:
    doc = inspect.getdoc(obj)
    if not doc:
        raise ValueError(f"{getattr(obj, '__qualname__', obj)!r} has no docstring")
    return doc


def _members(cls: type) -> list[tuple[str, Any]]:
    """The public methods and properties a class defines or inherits from tcoll (not from builtins)."""
    found = []
    for name in sorted(dir(cls)):
        if name.startswith("_"):
            continue
        owner = next((c for c in cls.__mro__ if name in c.__dict__), None)
        if owner is None or not owner.__module__.startswith("tcoll"):
            continue
        found.append((name, owner.__dict__[name]))
    return found


def _member(name: str, attr: Any) -> list[str]:
    if isinstance(attr, property):
        return [f"#### `{name}` (property)", "", _doc(attr.fget), ""]
    if isinstance(attr, (staticmethod, classmethod)):
        attr = attr.__func__
    if callable(attr):
        return [f"#### `{_signature(attr, name)}`", "", _doc(attr), ""]
    return []  # class constants are described by the class docstring


def _entry(name: str, obj: Any) -> list[str]:
    if inspect.isclass(obj):
        kind = "exception" if issubclass(obj, BaseException) else "class"
        # Communicator and Work come from tcoll.init and the calls, never from their constructors
        try:
            made_here = "engine" not in inspect.signature(obj).parameters
        except (TypeError, ValueError):
            made_here = True
        lines = [f"### {kind} `{_signature(obj, name) if made_here else name}`", "", _doc(obj), ""]
        if not issubclass(obj, BaseException):
            for member, attr in _members(obj):
                lines += _member(member, attr)
        return lines
    if callable(obj):
        return [f"### `{_signature(obj, name)}`", "", _doc(obj), ""]
    return [f"### `{name}`", "", f"`{obj!r}`" if isinstance(obj, str) else f"An instance of `{type(obj).__name__}`: "
            f"{(inspect.getdoc(type(obj)) or '').splitlines()[0]}", ""]


def render() -> str:
    """The whole page."""
    groups: dict[str, list[str]] = {"Classes": [], "Functions": [], "Errors": [], "Constants": []}
    for name in sorted(tcoll.__all__, key=str.lower):
        obj = getattr(tcoll, name)
        if inspect.isclass(obj) and issubclass(obj, BaseException):
            group = "Errors"
        elif inspect.isclass(obj):
            group = "Classes"
        elif callable(obj):
            group = "Functions"
        else:
            group = "Constants"
        groups[group] += _entry(name, obj)
    lines = [_INTRO]
    for title, entries in groups.items():
        lines += [f"## {title}", "", *entries]
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is not current")
    args = parser.parse_args()
    text = render()
    if args.check:
        current = PAGE.read_text() if PAGE.exists() else ""
        if current != text:
            print("docs/api.md is not current: run scripts/api_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
