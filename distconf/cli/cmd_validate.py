"""``distconf validate``: check family files (for CI and pre-commit)."""

from __future__ import annotations

import argparse
import sys

from distconf.cli.helptext import add_command


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``validate`` subcommand."""
    p = add_command(
        subparsers, "validate", summary="validate family files (exit 0 valid, 1 invalid, 2 usage)",
        description="Validate family files against the schema: every problem of every file is reported as "
                    "path:line:column: field: message. Without PATH, validates the built-in families; a folder "
                    "stands for the *.yaml files in it. Does not import torch unless --resolve is given.",
        examples=[("distconf validate", "the built-in families"),
                  ("distconf validate my_families/ extra.yaml", "files and folders, every problem at once"),
                  ("distconf validate --resolve my_families/", "also import the classes the files name")],
    )
    p.add_argument("paths", nargs="*", metavar="PATH", help="family files or folders of them")
    p.add_argument("--resolve", action="store_true",
                   help="also import the config, layer and attention classes and check formula names "
                        "against the base config (imports transformers)")
    p.add_argument("-q", "--quiet", action="store_true", help="print only problems")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Validate; print one line per file, problems on stderr."""
    from distconf.errors import FamilyValidationError
    from distconf.loader.data import builtin_families_dir
    from distconf.loader.search import validate_paths

    paths = args.paths or [builtin_families_dir()]
    try:
        sources = validate_paths(paths)
    except FamilyValidationError as exc:
        print(exc, file=sys.stderr)
        print(f"{len(exc.problems)} problem(s) found", file=sys.stderr)
        return 1
    if not sources:
        print("no family files found in " + " ".join(map(str, paths)), file=sys.stderr)
        return 1
    if args.resolve:
        from distconf.loader.synthesis import resolve_source

        problems = []
        for source in sources:
            try:
                resolve_source(source)
            except FamilyValidationError as exc:
                problems.extend(exc.problems)
        if problems:
            print(FamilyValidationError(problems), file=sys.stderr)
            print(f"{len(problems)} problem(s) found", file=sys.stderr)
            return 1
    if not args.quiet:
        for source in sources:
            print(f"ok  {source.path}  ({source.spec.family} -> {source.spec.class_name})")
    return 0
