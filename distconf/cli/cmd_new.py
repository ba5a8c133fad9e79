"""``distconf new``: draft a family file from a model's ``config.json``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``new`` subcommand."""
    p = subparsers.add_parser(
        "new", help="draft a family file from a model's config.json (for review)",
        description="Write a first draft of a family file:\n"
                    "  - the Hugging Face config class (from model_type),\n"
                    "  - the decoder-layer and attention classes and the state-dict prefix (from the model\n"
                    "    built on the meta device), the layer's keyword names, the mask rule,\n"
                    "  - a KV-groups formula and a KV-cache geometry checked against tiny models,\n"
                    "  - a tiny_config made by shrinking the given config: every field that goes with the\n"
                    "    heads, layers or hidden size shrinks with them (names read through the config\n"
                    "    class's attribute_map), only fields the config class reads are copied, and every\n"
                    "    kind of layer is kept (a variant per shipped preset of the model_type with others).\n"
                    "Findings and TODOs are written as comments. Review the draft, then run `distconf check`.",
        epilog="example:\n  distconf new myfamily --from-config ~/models/my-model/config.json --out my_families/",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("family", help="family name (lower case, digits, '_'); the file is named <family>.yaml")
    p.add_argument("--from-config", required=True, metavar="CONFIG_JSON",
                   help="the model's config.json, or a folder holding one")
    p.add_argument("--out", metavar="PATH",
                   help="output file or existing folder (default: ./<family>.yaml)")
    p.add_argument("--force", action="store_true", help="overwrite an existing file")
    p.add_argument("--no-run", action="store_true",
                   help="do not build and run the tiny model (no KV-cache check, tiny_config unverified)")
    p.set_defaults(func=run)


def _output_path(family: str, out: str | None) -> Path:
    if out is None:
        return Path.cwd() / f"{family}.yaml"
    path = Path(out)
    if path.is_dir() or out.endswith(("/", os.sep)):
        return path / f"{family}.yaml"
    return path


def _schema_reference(output: Path) -> str:
    """The ``$schema`` of a draft written to ``output``: never an absolute path of this machine.

    A relative path to the schema when the draft sits in the tree that holds the
    schema (a source checkout's ``families/``), else the schema's ``$id`` URL, which
    does not depend on where distconf is installed.
    """
    from distconf.loader.data import schema_path
    from distconf.loader.spec import SCHEMA_ID

    schema = schema_path()
    root = schema.parent.parent
    target = output.resolve().parent
    if target == root or root in target.parents:
        return Path(os.path.relpath(schema, target)).as_posix()
    return SCHEMA_ID


def _kind_coverage(output: Path, config: dict, source: str) -> str:
    """How many layer kinds of the config drafted from the tiny variants run (as ``distconf check`` counts them)."""
    from distconf.loader import load_family
    from distconf.tools.checker.kinds import compare_kinds, tiny_configs

    try:
        cls = load_family(output)
        kinds = compare_kinds([(str(source), cls(**config))], tiny_configs(cls))
    except Exception as exc:  # only a report: the draft is written either way
        return f"not listed ({type(exc).__name__}: {exc})"
    covered = len(set(kinds.real) & kinds.tiny)
    text = f"the tiny config runs {covered} of the {len(kinds.real)} kinds of {source}"
    return text + (f"; never runs: {', '.join(kinds.missing)}" if kinds.missing else " (all)")


def run(args: argparse.Namespace) -> int:
    """Draft, write, validate; print what was found and what to review."""
    from distconf.errors import FamilyValidationError
    from distconf.loader.source import read_family_file
    from distconf.tools.drafting import DraftingError, draft_family, read_config_json
    from distconf.tools.drafting.common import crash_line, one_line

    output = _output_path(args.family, args.out)
    if output.suffix not in (".yaml", ".yml") or output.stem != args.family:
        print(f"distconf new: the file must be named {args.family}.yaml (the family name), not {output.name}",
              file=sys.stderr)
        return 2
    if output.exists() and not args.force:
        print(f"distconf new: {output} exists; use --force to overwrite it", file=sys.stderr)
        return 1
    try:
        config = read_config_json(args.from_config)
        draft = draft_family(args.family, config, run_tiny=not args.no_run)
    except DraftingError as exc:
        print(f"distconf new: {one_line(str(exc))}", file=sys.stderr)
        return 1
    except Exception as exc:  # a defect of the drafter or of transformers: one line, the traceback with -v
        logger.debug("distconf new %s crashed", args.family, exc_info=True)
        print(f"distconf new: cannot draft {args.family!r} from {args.from_config}: {crash_line(exc)} "
              "(a drafter bug: please report it; -v prints the traceback)", file=sys.stderr)
        return 1
    text = draft.to_yaml(schema_path=_schema_reference(output))
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text, encoding="utf-8")
    try:
        read_family_file(output)
    except FamilyValidationError as exc:
        print(f"distconf new: wrote {output}, but the draft does not validate (please report this):\n{exc}",
              file=sys.stderr)
        return 1
    print(f"wrote {output}")
    for fact in draft.facts:
        print(f"  found: {fact}")
    if not args.no_run:
        print(f"  layer kinds: {_kind_coverage(output, config, args.from_config)}")
    if draft.undecided:
        print(f"{len(draft.undecided)} part(s) not drafted (the tiny model's probe failed; `distconf check` runs "
              "it again and says the same):")
        for item in draft.undecided:
            print(f"  - {item}")
    if draft.review:
        print(f"{len(draft.review)} item(s) to review (also written as TODO comments):")
        for item in draft.review:
            print(f"  - {item}")
    print("next: review the draft, then run")
    print(f"  distconf check {output}")
    print(f"  (or put it in a folder listed in DISTCONF_FAMILIES_PATH and use the name {args.family!r})")
    return 0
