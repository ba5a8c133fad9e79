"""``distconf schema``: write (or check) the JSON schema of a family file."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from distconf.cli.helptext import add_command


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``schema`` subcommand."""
    p = add_command(
        subparsers, "schema", summary="generate schemas/family.schema.json from the pydantic model",
        description="Write the JSON schema of a family file, generated from distconf's pydantic models. "
                    "Editors use it through the '# yaml-language-server: $schema=' comment.",
        examples=[("distconf schema", "rewrite the schema distconf ships"),
                  ("distconf schema --check", "exit 1 if it is stale (CI)"),
                  ("distconf schema -o -", "print it")],
    )
    p.add_argument("--check", action="store_true", help="exit 1 if the schema file is stale, write nothing")
    p.add_argument("-o", "--output", type=Path, default=None,
                   help="where to write (default: the schemas/family.schema.json distconf ships; '-' = stdout)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Generate, then write or compare."""
    from distconf.loader.data import schema_path
    from distconf.loader.json_schema import schema_text

    text = schema_text()
    target = args.output or schema_path()
    if str(target) == "-":
        sys.stdout.write(text)
        return 0
    if args.check:
        current = target.read_text(encoding="utf-8") if target.is_file() else None
        if current != text:
            print(f"{target} is stale: run `distconf schema` and commit the result", file=sys.stderr)
            return 1
        print(f"{target} is current")
        return 0
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(target)
    print(f"wrote {target}")
    return 0
