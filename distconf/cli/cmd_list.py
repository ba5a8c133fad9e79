"""``distconf list``: the families on the search path."""

from __future__ import annotations

import argparse

from distconf.cli.table import format_table


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``list`` subcommand."""
    p = subparsers.add_parser("list", help="list the families on the search path",
                              description="List every family file on the search path (built-ins first, "
                                          "then DISTCONF_FAMILIES_PATH) with its model_type and class.")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print one row per family; invalid files are reported, not hidden."""
    from distconf.errors import FamilyValidationError
    from distconf.family.source import find_family_file, list_families, read_family_file

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
