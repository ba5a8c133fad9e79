"""``distconf list``: the families on the search path."""

from __future__ import annotations

import argparse

from distconf.cli.helptext import add_command
from distconf.cli.table import format_table


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``list`` subcommand."""
    p = add_command(
        subparsers, "list", summary="list the families on the search path",
        description="List every family file on the search path (built-ins first, then the folders of "
                    "DISTCONF_FAMILIES_PATH) with its model_type, class and file. An invalid file is listed as "
                    "INVALID with its first problem, and the exit code is 1.",
        examples=[("distconf list", "the built-in families"),
                  ("DISTCONF_FAMILIES_PATH=my_families distconf list", "with your own family files too")],
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print one row per family; invalid files are reported, not hidden."""
    from distconf.errors import FamilyValidationError
    from distconf.loader.search import find_family_file, list_families
    from distconf.loader.source import read_family_file

    rows = []
    status = 0
    for name in list_families():
        try:
            source = read_family_file(find_family_file(name))
        except FamilyValidationError as exc:
            rows.append((name, "-", "INVALID", str(exc.problems[0])))
            status = 1
            continue
        rows.append((name, source.spec.model_type, source.spec.class_name, str(source.path)))
    print(format_table(("family", "model_type", "class", "file"), rows))
    return status
