"""Safe YAML parsing that keeps the line and column of every value.

Family files are untrusted input. This loader accepts only plain YAML data:
mappings with scalar keys, sequences, and the standard scalar tags. It rejects
python/custom tags, anchors used as aliases (no alias bombs), and duplicate keys, each
with the line where it occurs.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

__all__ = ["Location", "YamlProblem", "parse_yaml"]

Location = tuple[int, int]  # 1-based (line, column)
LocPath = tuple[Any, ...]

_STANDARD_TAGS = {
    "tag:yaml.org,2002:str", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float",
    "tag:yaml.org,2002:bool", "tag:yaml.org,2002:null", "tag:yaml.org,2002:map",
    "tag:yaml.org,2002:seq",
}
_MAX_DEPTH = 32


class YamlProblem(Exception):
    """A problem found while parsing; carries its location."""

    def __init__(self, message: str, line: int, column: int, loc: LocPath = ()) -> None:
        super().__init__(message)
        self.message = message
        self.line = line
        self.column = column
        self.loc = loc


# libyaml's composer when available (20x faster); aliases are caught after composing,
# as a node that occurs twice in the tree.
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_ALIAS_MESSAGE = "YAML anchors and aliases (&name, *name) are not allowed in family files"


def _where(node: Node) -> Location:
    return node.start_mark.line + 1, node.start_mark.column + 1


def _scalar(node: ScalarNode, loader: yaml.SafeLoader, loc: LocPath) -> Any:
    if node.tag not in _STANDARD_TAGS:
        raise YamlProblem(f"tag {node.tag!r} is not allowed (plain YAML data only)", *_where(node), loc)
    return loader.construct_object(node, deep=True)


def _build(node: Node, loader: yaml.SafeLoader, loc: LocPath, locs: dict[LocPath, Location],
           depth: int, seen: set[int]) -> Any:
    if id(node) in seen:
        raise YamlProblem(_ALIAS_MESSAGE, *_where(node), loc)
    seen.add(id(node))
    if depth > _MAX_DEPTH:
        raise YamlProblem(f"nesting deeper than {_MAX_DEPTH} levels", *_where(node), loc)
    locs[loc] = _where(node)
    if isinstance(node, ScalarNode):
        return _scalar(node, loader, loc)
    if node.tag not in _STANDARD_TAGS:
        raise YamlProblem(f"tag {node.tag!r} is not allowed (plain YAML data only)", *_where(node), loc)
    if isinstance(node, SequenceNode):
        return [_build(item, loader, (*loc, i), locs, depth + 1, seen) for i, item in enumerate(node.value)]
    if isinstance(node, MappingNode):
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            if id(key_node) in seen:
                raise YamlProblem(_ALIAS_MESSAGE, *_where(key_node), loc)
            seen.add(id(key_node))
            if not isinstance(key_node, ScalarNode):
                raise YamlProblem("mapping keys must be plain scalars", *_where(key_node), loc)
            key = _scalar(key_node, loader, loc)
            if isinstance(key, (dict, list)) or key is None:
                raise YamlProblem(f"invalid mapping key {key_node.value!r}", *_where(key_node), loc)
            if key in out:
                line, col = _where(key_node)
                first = locs.get((*loc, key), (0, 0))[0]
                raise YamlProblem(f"duplicate key {key!r} (first defined on line {first})",
                                  line, col, (*loc, key))
            locs[(*loc, key)] = _where(key_node)
            out[key] = _build(value_node, loader, (*loc, key), locs, depth + 1, seen)
            # Keep the key's own position: errors about a field point at its name.
            locs[(*loc, key)] = _where(key_node)
            locs[(*loc, key, "<value>")] = _where(value_node)
        return out
    raise YamlProblem(f"unsupported YAML node {type(node).__name__}", *_where(node), loc)


def parse_yaml(text: str) -> tuple[Any, dict[LocPath, Location]]:
    """Parse one YAML document safely.

    Returns the data and a map from field path (tuple of keys/indices) to the 1-based
    (line, column) where that field is written. Raises `YamlProblem` on any error.
    """
    try:
        loader = _Loader(text)
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        column = exc.position - (text.rfind("\n", 0, exc.position) + 1) + 1
        raise YamlProblem(f"invalid character {exc.character!r} in YAML text", line, column) from None
    try:
        try:
            node = loader.get_single_node()
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
            raise YamlProblem(f"invalid YAML: {exc.problem or exc}", line, col) from None
        except yaml.reader.ReaderError as exc:
            line = text.count("\n", 0, exc.position) + 1
            raise YamlProblem(f"invalid character {exc.character!r} in YAML text", line, 1) from None
        except yaml.YAMLError as exc:
            raise YamlProblem(f"invalid YAML: {exc}", 1, 1) from None
        locs: dict[LocPath, Location] = {}
        if node is None:
            return None, locs
        try:
            data = _build(node, loader, (), locs, 0, set())
        except yaml.constructor.ConstructorError as exc:
            mark = exc.problem_mark or exc.context_mark
            line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
            raise YamlProblem(f"invalid YAML value: {exc.problem or exc}", line, col) from None
        except (ValueError, OverflowError, TypeError) as exc:
            raise YamlProblem(f"invalid YAML value: {exc}", *_where(node)) from None
        return data, locs
    finally:
        loader.dispose()
