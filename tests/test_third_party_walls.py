"""Third-party internals stay behind their library's compat module (each checks the library's version).

Read from the source with `ast`: outside the compat modules (``*compat*.py``; `distconf.rpc.servicer` implements
hivemind's servicer hook for handler names), no module of ``distconf`` reads a private (``_name``) attribute of a
third-party module or class it imports, assigns an attribute of one (a monkeypatch), reads hivemind's stream
framing (``P2P.HEADER_LEN`` and the markers), or names a private attribute that third-party objects carry
(`PRIVATE_ATTRIBUTES`: configs', models', tensors' and hivemind's), as an attribute or a ``getattr`` string.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
THIRD_PARTY = ("torch", "transformers", "hivemind", "safetensors", "huggingface_hub", "starlette", "uvicorn",
               "bitsandbytes", "gguf", "numpy", "psutil", "msgpack", "yaml", "pydantic", "packaging", "google")
ALLOWED = {"distconf/rpc/servicer.py": "overrides hivemind's ServicerBase._get_handle_name, its hook for names"}
PRIVATE_ATTRIBUTES = {"_attn_implementation", "_experts_implementation", "_supports_sdpa", "_is_hf_initialized",
                      "_name_or_path", "_get_handle_name", "_weight_int8pack_mm", "_decode_ext_types",
                      "_validate_dictionary"}
FRAMING = {"HEADER_LEN", "BYTEORDER", "MESSAGE_MARKER", "ERROR_MARKER", "END_OF_STREAM", "receive_raw_data",
           "send_raw_data"}


def _imported_third_party(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] in THIRD_PARTY}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in THIRD_PARTY:
                names |= {a.asname or a.name for a in node.names}
    return names


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node


def violations(path: Path, root: Path = REPO) -> list[str]:
    """Every reach into third-party internals in one module, as ``path:line: code`` (``path`` under ``root``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    third = _imported_third_party(tree)
    found = []
    for node in ast.walk(tree):
        what = None
        if isinstance(node, ast.Attribute):
            base = _root(node)
            on_third = isinstance(base, ast.Name) and base.id in third
            if node.attr in PRIVATE_ATTRIBUTES:
                what = "a private attribute of third-party objects"
            elif on_third and node.attr.startswith("_") and not node.attr.startswith("__"):
                what = "a private attribute of a third-party import"
            elif on_third and node.attr in FRAMING:
                what = "hivemind's stream framing"
            elif on_third and isinstance(node.ctx, ast.Store):
                what = "an assignment to a third-party import (a monkeypatch)"
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in PRIVATE_ATTRIBUTES):
            what = "a private attribute of third-party objects, by name"
        if what is not None:
            found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)[:80]} ({what})")
    return found


def test_third_party_internals_stay_in_compat_modules() -> None:
    files = [p for p in sorted((REPO / "distconf").rglob("*.py"))
             if "compat" not in p.name and str(p.relative_to(REPO)) not in ALLOWED]
    found = [line for path in files for line in violations(path)]
    assert not found, "third-party internals outside the compat modules:\n  " + "\n  ".join(found)


def test_the_wall_test_sees_each_kind_of_reach(tmp_path: Path) -> None:
    """The checks fail on code that does what they forbid (so the first test can fail)."""
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nfrom hivemind.p2p import P2P\n"
                   "a = torch._weight_int8pack_mm\nb = config._attn_implementation\nc = P2P.HEADER_LEN\n"
                   "P2P.send_protobuf = None\nd = getattr(model, '_supports_sdpa', True)\n", encoding="utf-8")
    kinds = [line.rsplit("(", 1)[1] for line in violations(bad, tmp_path)]
    assert len(kinds) == 5, kinds
