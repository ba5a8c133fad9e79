"""Safe YAML parsing that keeps the line and column of every value.

Family files are untrusted input (`distconf.loader.files` reads their bytes safely).
This loader accepts only plain YAML data:
mappings with string keys, sequences, and the standard scalar tags. It rejects
python/custom tags, anchors used as aliases (no alias bombs), and duplicate keys, each
with the line where it occurs.

Scalars follow the YAML 1.2 core schema (what JSON-minded readers and editors expect):
``null``/``~``/empty, ``true``/``false``, decimal / ``0o`` / ``0x`` integers and decimal
floats; anything else is a string, and quoted scalars are always strings. A plain
scalar that YAML 1.1 (PyYAML, older tools) reads as a different value -- ``yes``,
``on``, ``0100``, ``1:20``, ``1_000``, ``1e-5`` -- is rejected at its line, so a file
never means one thing here and another elsewhere. Integers are bounded to
`MAX_INT_DIGITS` digits, and ``.inf``/``.nan`` are rejected (JSON has neither).
"""

from __future__ import annotations

import math
import re
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from distconf.errors import excerpt

__all__ = ["Location", "YamlProblem", "parse_yaml", "MAX_INT_DIGITS"]

Location = tuple[int, int]  # 1-based (line, column)
LocPath = tuple[Any, ...]

MAX_INT_DIGITS = 40
"""Most digits an integer in a family file may have (2**128 has 39)."""

_TAG = "tag:yaml.org,2002:"
_SCALAR_TAGS = {_TAG + kind for kind in ("str", "int", "float", "bool", "null")}
_PLAIN = "tag:distconf,2024:plain"  # an untagged plain scalar, resolved here by the YAML 1.2 core schema
_MAX_DEPTH = 32

_NULLS = {"", "~", "null", "Null", "NULL"}
_BOOLS = {"true": True, "True": True, "TRUE": True, "false": False, "False": False, "FALSE": False}
_INT = re.compile(r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+")
_FLOAT = re.compile(r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?")
_SPECIAL_FLOAT = re.compile(r"[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)")
_LEADING_ZERO = re.compile(r"[-+]?0[0-9]")
_YAML11_KINDS = {"bool": "bool", "int": "int", "float": "float", "null": "null", "timestamp": "date"}
_KIND_NAMES = {"null": "null", "bool": "a boolean", "int": "an integer", "float": "a float", "str": "a string",
               "date": "a date"}


class YamlProblem(Exception):
    """A problem found while reading or parsing; carries its location."""

    def __init__(self, message: str, line: int, column: int, loc: LocPath = ()) -> None:
        super().__init__(message)
        self.message = message
        self.line = line
        self.column = column
        self.loc = loc
        self.top_keys: list[str] | None = None
        """The document's top-level keys as written, when it is a mapping (set by `parse_yaml`)."""


# libyaml's composer when available (20x faster); aliases are caught after composing,
# as a node that occurs twice in the tree.
_Base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_ALIAS_MESSAGE = "YAML anchors and aliases (&name, *name) are not allowed in family files"


class _Loader(_Base):  # type: ignore[misc, valid-type]
    """Composes nodes only; untagged plain scalars keep a marker tag and are resolved by `_plain`."""

    def resolve(self, kind: type, value: Any, implicit: Any) -> str:
        if kind is ScalarNode and implicit[0]:
            return _PLAIN
        return super().resolve(kind, value, implicit)


def _short(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _where(node: Node) -> Location:
    return node.start_mark.line + 1, node.start_mark.column + 1


def _yaml11_kind(text: str) -> str:
    """What YAML 1.1 (PyYAML's resolver) reads a plain scalar as: null, bool, int, float, date or str."""
    for tag, regexp in yaml.resolver.Resolver.yaml_implicit_resolvers.get(text[:1], []):
        kind = _YAML11_KINDS.get(tag.rsplit(":", 1)[-1])
        if kind and regexp.match(text):
            return kind
    return "str"


def _core(text: str, node: Node, loc: LocPath) -> tuple[str, Any]:
    """Resolve a plain scalar by the YAML 1.2 core schema: (kind, value)."""
    if text in _NULLS:
        return "null", None
    if text in _BOOLS:
        return "bool", _BOOLS[text]
    if _INT.fullmatch(text):
        digits = text.lstrip("+-")
        if len(digits) > MAX_INT_DIGITS:
            raise YamlProblem(f"integer with more than {MAX_INT_DIGITS} digits ({excerpt(text)})", *_where(node), loc)
        base = {"0o": 8, "0x": 16}.get(digits[:2], 10)
        return "int", int(text, base) if base == 10 else int(digits[2:], base)
    if _FLOAT.fullmatch(text):
        value = float(text)
        if math.isinf(value):
            raise YamlProblem(f"number {excerpt(text)} is out of range", *_where(node), loc)
        return "float", value
    if _SPECIAL_FLOAT.fullmatch(text):
        raise YamlProblem(f"{text} is not allowed in a family file (JSON has no infinity or NaN)",
                          *_where(node), loc)
    return "str", text


def _plain(node: ScalarNode, loc: LocPath) -> tuple[str, Any]:
    """A plain scalar's kind and value; rejected when YAML 1.1 would read it differently."""
    text = node.value
    kind, value = _core(text, node, loc)
    old = _yaml11_kind(text)
    if old != kind or (kind == "int" and _LEADING_ZERO.match(text) and int(text, 8) != value):
        if old == "bool":
            hint = "write true or false, or quote it for the text"
        elif kind == "int":
            hint = "write it in decimal without leading zeros, or quote it for the text"
        elif kind == "float":
            hint = "write it with a dot and a signed exponent (e.g. 1.0e-5), or quote it for the text"
        else:
            hint = "quote it for the text"
        if old == kind:  # a leading zero: octal in YAML 1.1
            meaning = f"{value} in YAML 1.2 but octal {int(text, 8)} in YAML 1.1"
        else:
            meaning = f"{_KIND_NAMES[kind]} in YAML 1.2 but {_KIND_NAMES[old]} in YAML 1.1"
        raise YamlProblem(f"{excerpt(text)} is {meaning}; {hint}", *_where(node), loc)
    return kind, value


def _scalar(node: ScalarNode, loc: LocPath) -> Any:
    if node.tag == _PLAIN:
        return _plain(node, loc)[1]
    if node.tag == _TAG + "str":
        return node.value
    if node.tag not in _SCALAR_TAGS:
        raise YamlProblem(f"tag {excerpt(node.tag)} is not allowed (plain YAML data only)", *_where(node), loc)
    wanted = node.tag[len(_TAG):]
    kind, value = _plain(node, loc)
    if kind == wanted:
        return value
    if wanted == "float" and kind == "int":
        return float(value)
    raise YamlProblem(f"{excerpt(node.value)} is not a valid !!{wanted}", *_where(node), loc)


def _key(node: Node, loc: LocPath, seen: set[int]) -> str:
    if id(node) in seen:
        raise YamlProblem(_ALIAS_MESSAGE, *_where(node), loc)
    seen.add(id(node))
    if not isinstance(node, ScalarNode):
        raise YamlProblem("mapping keys must be plain scalars", *_where(node), loc)
    key = _scalar(node, loc)
    if not isinstance(key, str):
        kind = {type(None): "null", bool: "a boolean", int: "an integer", float: "a float"}.get(type(key), "a value")
        raise YamlProblem(f"mapping key {excerpt(node.value)} is {kind}; keys must be strings (quote it)",
                          *_where(node), (*loc, str(node.value)[:40]))
    return key


def _build(node: Node, loc: LocPath, locs: dict[LocPath, Location], depth: int, seen: set[int]) -> Any:
    if id(node) in seen:
        raise YamlProblem(_ALIAS_MESSAGE, *_where(node), loc)
    seen.add(id(node))
    if depth > _MAX_DEPTH:
        raise YamlProblem(f"nesting deeper than {_MAX_DEPTH} levels", *_where(node), loc)
    locs[loc] = _where(node)
    if isinstance(node, ScalarNode):
        return _scalar(node, loc)
    if isinstance(node, SequenceNode) and node.tag == _TAG + "seq":
        return [_build(item, (*loc, i), locs, depth + 1, seen) for i, item in enumerate(node.value)]
    if isinstance(node, MappingNode) and node.tag == _TAG + "map":
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            key = _key(key_node, loc, seen)
            if key in out:
                line, col = _where(key_node)
                first = locs.get((*loc, key), (0, 0))[0]
                raise YamlProblem(f"duplicate key {excerpt(key)} (first defined on line {first})",
                                  line, col, (*loc, key))
            locs[(*loc, key)] = _where(key_node)
            out[key] = _build(value_node, (*loc, key), locs, depth + 1, seen)
            # Keep the key's own position: errors about a field point at its name.
            locs[(*loc, key)] = _where(key_node)
            locs[(*loc, key, "<value>")] = _where(value_node)
        return out
    if isinstance(node, (SequenceNode, MappingNode)):
        raise YamlProblem(f"tag {excerpt(node.tag)} is not allowed (plain YAML data only)", *_where(node), loc)
    raise YamlProblem(f"unsupported YAML node {type(node).__name__}", *_where(node), loc)


def _compose(text: str) -> tuple[Node | None, Any]:
    """libyaml's node tree of ``text`` (and the loader, to dispose of)."""
    try:
        loader = _Loader(text)
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        column = exc.position - (text.rfind("\n", 0, exc.position) + 1) + 1
        raise YamlProblem(f"invalid character {exc.character!r} in YAML text", line, column) from None
    try:
        return loader.get_single_node(), loader
    except yaml.MarkedYAMLError as exc:
        loader.dispose()
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        raise YamlProblem(f"invalid YAML: {_short(str(exc.problem or exc))}", line, col) from None
    except yaml.reader.ReaderError as exc:
        loader.dispose()
        line = text.count("\n", 0, exc.position) + 1
        raise YamlProblem(f"invalid character {exc.character!r} in YAML text", line, 1) from None
    except yaml.YAMLError as exc:
        loader.dispose()
        raise YamlProblem(f"invalid YAML: {_short(str(exc))}", 1, 1) from None


def parse_yaml(text: str) -> tuple[Any, dict[LocPath, Location]]:
    """Parse one YAML document safely.

    Returns the data and a map from field path (tuple of keys/indices) to the 1-based
    (line, column) where that field is written. Raises `YamlProblem` on any error.
    """
    node, loader = _compose(text)
    try:
        locs: dict[LocPath, Location] = {}
        if node is None:
            return None, locs
        try:
            data = _build(node, (), locs, 0, set())
        except YamlProblem as exc:
            if isinstance(node, MappingNode):
                exc.top_keys = [key.value for key, _ in node.value if isinstance(key, ScalarNode)]
            raise
        except (ValueError, OverflowError, TypeError) as exc:
            raise YamlProblem(f"invalid YAML value: {_short(str(exc))}", *_where(node)) from None
        return data, locs
    finally:
        loader.dispose()
