"""A Griffe extension that lets mkdocstrings render phalanx's reST-flavoured docstrings.

phalanx's docstrings are Google style with a few reStructuredText habits. This
extension rewrites them, in memory and for the documentation only, into the
Markdown that mkdocstrings renders:

* roles (``:class:`~phalanx_core.Collective```, ``:meth:`setup```) become
  cross-references to the documented object, resolved in the scope of the
  docstring like Python names; roles naming something outside phalanx
  (``:func:`importlib.util.find_spec```) become plain code;
* a paragraph ending in ``::`` followed by an indented block becomes a
  fenced Python code block;
* the items of a class's ``Attributes:`` (or ``Class attributes:``) section
  become the docstrings of the attributes they describe, so that each is
  rendered, with its type and value, and can be linked to;
* ``#:`` comments above a module or class attribute become its docstring.

It is loaded from ``mkdocs.yml`` and changes nothing in the code.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

#: Top-level packages whose objects are documented on this site.
INTERNAL = ("phalanx", "phalanx_core", "phalanx_torch")

_ROLE = re.compile(
    r":(?:py:)?(?P<role>class|meth|func|attr|data|mod|exc|obj|const):`(?P<tilde>~?)(?P<body>[^`]+)`"
)
_EXPLICIT = re.compile(r"^(?P<title>.*?)\s*<(?P<target>[^<>]+)>$")


def _canonical(collection: Any, path: str) -> str:
    """``path`` with re-exports followed (``phalanx_core.Collective.rank`` ->
    ``phalanx_core.collective.Collective.rank``), where the object is loaded."""
    try:
        return str(collection[path].canonical_path)
    except Exception:  # noqa: BLE001 - not loaded (yet): autorefs resolves the path as written
        return path


def _resolve(obj: griffe.Object, target: str, collection: Any) -> str | None:
    """The absolute path of ``target`` as seen from ``obj``, or ``None``."""
    first, _, rest = target.partition(".")
    if first in INTERNAL:
        return _canonical(collection, target)
    try:
        base = obj.resolve(first)
    except Exception:  # noqa: BLE001 - an unresolvable name is rendered as code
        return None
    if base.partition(".")[0] not in INTERNAL:
        return None
    return _canonical(collection, f"{base}.{rest}" if rest else base)


def _roles(obj: griffe.Object, text: str, collection: Any) -> str:
    def replace(match: re.Match[str]) -> str:
        role, tilde, body = match["role"], match["tilde"], match["body"].strip()
        explicit = _EXPLICIT.match(body)
        if explicit:
            title, target = explicit["title"], explicit["target"].lstrip("~")
        else:
            target = body
            title = body.rsplit(".", 1)[-1] if tilde else body
            if role in ("meth", "func"):
                title += "()"
        path = _resolve(obj, target, collection)
        if path is None:
            return f"`{title}`"
        return f"[`{title}`][{path}]"

    return _ROLE.sub(replace, text)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _literal_blocks(text: str) -> str:
    """Turn ``paragraph::`` + indented block into ``paragraph:`` + a fenced block."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.rstrip()
        if not stripped.endswith("::"):
            out.append(line)
            i += 1
            continue
        base = _indent(line)
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        if j == len(lines) or _indent(lines[j]) <= base:
            out.append(line)
            i += 1
            continue
        block_indent = _indent(lines[j])
        end = j
        last = j
        while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) >= block_indent):
            if lines[end].strip():
                last = end
            end += 1
        head = stripped[:-2].rstrip()
        if head.strip():
            out.append(head + ("" if stripped.endswith(" ::") else ":"))
            out.append("")
        pad = " " * base
        out.append(f"{pad}```python")
        out.extend(pad + ln[block_indent:] if ln.strip() else "" for ln in lines[j : last + 1])
        out.append(f"{pad}```")
        i = last + 1
    return "\n".join(out)


_ATTRIBUTES = re.compile(r"^(?:Class )?[Aa]ttributes:\s*$")
_ITEM = re.compile(r"^(?P<name>\w+)(?:\s*\([^)]*\))?:\s*(?P<text>.*)$")


def _attributes_to_members(obj: griffe.Object, text: str) -> str:
    """Give each attribute an ``Attributes:`` section describes its own
    docstring, and drop the items so moved from the section."""
    if not obj.is_class or obj.docstring is None:
        return text
    lines = text.split("\n")
    start = next((i for i, line in enumerate(lines) if _ATTRIBUTES.match(line.strip())), None)
    if start is None:
        return text
    base = _indent(lines[start])
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > base):
        end += 1
    body = lines[start + 1 : end]
    items: list[tuple[str, list[str]]] = []
    item_indent = min((_indent(ln) for ln in body if ln.strip()), default=base + 4)
    for ln in body:
        match = _ITEM.match(ln.strip()) if _indent(ln) == item_indent else None
        if match:
            items.append((match["name"], [match["text"]]))
        elif items:
            items[-1][1].append(ln.strip())
    kept: list[str] = []
    for name, description in items:
        member = obj.members.get(name)
        if member is None or member.is_alias or member.docstring is not None:
            kept.append(" " * item_indent + f"{name}: " + f"\n{' ' * (item_indent + 4)}".join(description))
            continue
        member.docstring = griffe.Docstring(
            "\n".join(description).strip(),
            lineno=obj.docstring.lineno,
            endlineno=obj.docstring.endlineno,
            parent=member,  # type: ignore[arg-type]
            parser=obj.docstring.parser,
            parser_options=obj.docstring.parser_options,
        )
    section = ([" " * base + "Attributes:", *kept] if kept else []) + ([""] if end < len(lines) else [])
    return "\n".join([*lines[:start], *section, *lines[end:]]).strip("\n")


def _rewrite(obj: griffe.Object, collection: Any) -> None:
    docstring = obj.docstring
    if docstring is None or getattr(docstring, "_phalanx_rewritten", False):
        return
    text = _literal_blocks(docstring.value)
    text = _attributes_to_members(obj, text)
    docstring.value = _roles(obj, text, collection)
    docstring._phalanx_rewritten = True  # type: ignore[attr-defined]


def _walk(obj: griffe.Object, collection: Any) -> None:
    _rewrite(obj, collection)
    for member in obj.members.values():
        if member.is_alias:
            continue
        _walk(member, collection)  # type: ignore[arg-type]


class RestDocstrings(griffe.Extension):
    """Rewrite reST habits in docstrings into Markdown mkdocstrings renders."""

    def on_attribute_instance(self, *, node: Any, attr: griffe.Attribute, agent: Any, **kwargs: Any) -> None:
        if attr.docstring is not None or attr.lineno is None or attr.filepath is None:
            return
        try:
            lines = attr.lines_collection[attr.filepath]  # type: ignore[index]
        except KeyError:
            return
        comment: list[str] = []
        index = attr.lineno - 2
        while index >= 0 and lines[index].strip().startswith("#:"):
            comment.insert(0, lines[index].strip()[2:].strip())
            index -= 1
        if comment:
            attr.docstring = griffe.Docstring(
                "\n".join(comment),
                lineno=index + 2,
                endlineno=attr.lineno - 1,
                parent=attr,
                parser=getattr(agent, "docstring_parser", None),
                parser_options=getattr(agent, "docstring_options", None),
            )

    def on_package(self, *, pkg: griffe.Module, loader: Any, **kwargs: Any) -> None:
        _walk(pkg, loader.modules_collection)
