"""``block.model_buffers``: buffers the model registers on its layers after building them.

Some models compute a tensor once from the config and register it on every layer
(``for layer in self.layers: layer.mixer.register_buffer("v", make_v(config))``). Such a
buffer is in no checkpoint and a layer built alone lacks it. The drafter finds them
by structure: the buffers of the model's layers that a freshly built layer of the same
class does not have; the model's ``__init__`` shows the function of the config that
makes each one, and calling it must give a tensor of the buffer's shape.
"""

from __future__ import annotations

import ast
import inspect
import logging
import textwrap
from collections.abc import Callable
from typing import Any

from distconf.tools.drafting.common import quiet_transformers
from distconf.tools.drafting.render import FamilyDraft
from distconf.tools.drafting.scan import ModelScan

__all__ = ["added_buffers", "buffer_function", "draft_model_buffers"]

logger = logging.getLogger(__name__)

_PASS_THROUGH_METHODS = ("clone", "to", "contiguous", "detach", "float")  # value.clone() is still the value


def _fresh_layer(draft: FamilyDraft, cls: type, config: Any, layer_idx: int) -> Any | None:
    """A layer of ``cls`` built alone on the meta device, with the family's constructor arguments."""
    import torch

    kwargs: dict[str, Any] = {draft.constructor.get("config_argument", "config"): config}
    idx = draft.constructor.get("layer_idx_argument", "layer_idx")
    if idx is not None:
        kwargs[idx] = layer_idx
    try:
        with quiet_transformers(), torch.device("meta"):
            return cls(**kwargs)
    except Exception:  # a layer that cannot be built alone: the check says why
        logger.debug("building %s alone failed", cls.__name__, exc_info=True)
        return None


def added_buffers(draft: FamilyDraft, scan: ModelScan, config: Any) -> dict[str, Any]:
    """Buffer path inside a layer -> the model's buffer, for buffers a layer built alone lacks."""
    added: dict[str, Any] = {}
    seen: set[type] = set()
    for i, layer in enumerate(scan.layers):
        if type(layer) in seen:
            continue
        seen.add(type(layer))
        fresh = _fresh_layer(draft, type(layer), config, i)
        if fresh is None:
            continue
        own = {name for name, _ in fresh.named_buffers()}
        added.update({name: buffer for name, buffer in layer.named_buffers() if name not in own})
    return added


def _init_trees(scan: ModelScan) -> list[tuple[ast.AST, dict[str, Any]]]:
    """The parsed ``__init__`` of the model's and its base model's classes, with their modules' globals."""
    trees = []
    for owner in dict.fromkeys([type(scan.base_model), type(scan.model)]):
        for cls in owner.__mro__:
            init = vars(cls).get("__init__")
            module = inspect.getmodule(cls)
            if init is None or module is None or not cls.__module__.startswith("transformers.models."):
                continue
            try:
                trees.append((ast.parse(textwrap.dedent(inspect.getsource(init))), vars(module)))
            except (OSError, TypeError, SyntaxError):
                continue
    return trees


def _attribute_chain(node: ast.AST) -> list[str]:
    chain = []
    while isinstance(node, ast.Attribute):
        chain.append(node.attr)
        node = node.value
    return chain[::-1]


def _made_by(tree: ast.AST, path: str) -> ast.expr | None:
    """The value ``tree`` registers (or assigns) as buffer ``path`` of a layer."""
    owner, _, name = path.rpartition(".")
    last_owner = owner.rpartition(".")[2]
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "register_buffer" and len(node.args) >= 2 \
                and isinstance(node.args[0], ast.Constant) and node.args[0].value == name:
            chain = _attribute_chain(node.func.value)
            if not last_owner or (chain and chain[-1] == last_owner):
                return node.args[1]
    return None


def _resolve(value: ast.expr, tree: ast.AST, names: dict[str, Any]) -> Callable[..., Any] | None:
    """The module function behind ``value``: ``f(config)``, through ``.clone()`` and one local variable."""
    while isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) \
            and value.func.attr in _PASS_THROUGH_METHODS:
        value = value.func.value
    if isinstance(value, ast.Name):
        assigned = [node.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == value.id for t in node.targets)]
        if len(assigned) != 1:
            return None
        value = assigned[0]
    if not (isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and len(value.args) == 1
            and not value.keywords):
        return None
    argument = value.args[0]
    if not ((isinstance(argument, ast.Name) and argument.id == "config")
            or _attribute_chain(argument)[-1:] == ["config"]):  # config or self.config
        return None
    function = names.get(value.func.id)
    return function if inspect.isfunction(function) else None


def buffer_function(scan: ModelScan, path: str, buffer: Any, config: Any) -> Callable[..., Any] | None:
    """The function of the config the model's ``__init__`` makes buffer ``path`` with (checked on its shape)."""
    for tree, names in _init_trees(scan):
        value = _made_by(tree, path)
        function = _resolve(value, tree, names) if value is not None else None
        if function is None:
            continue
        try:
            made = function(config)
        except Exception:  # not a function of this config after all
            logger.debug("%s(config) failed", function.__name__, exc_info=True)
            continue
        if tuple(getattr(made, "shape", ())) == tuple(buffer.shape):
            return function
    return None


def draft_model_buffers(draft: FamilyDraft, scan: ModelScan, config: Any) -> None:
    """``block.model_buffers`` for the buffers the model adds to its layers; a review note for one not found."""
    for path, buffer in sorted(added_buffers(draft, scan, config).items()):
        function = buffer_function(scan, path, buffer, config)
        if function is None:
            draft.review.append(f"the model registers buffer {path!r} on its layers after building them, and no "
                                "function of the config making it was found: declare it in block.model_buffers")
            continue
        draft.model_buffers[path] = f"{function.__module__}.{function.__qualname__}"
        draft.facts.append(f"the model registers buffer {path!r} on every layer, made by {function.__name__}(config) "
                           "(block.model_buffers)")
