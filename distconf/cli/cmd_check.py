"""``distconf check``: prove family files on tiny real models (exact match, KV cache, size)."""

from __future__ import annotations

import argparse
import logging
import sys

from distconf.cli.helptext import add_command

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``check`` subcommand."""
    p = add_command(
        subparsers, "check", summary="run each family's tiny model through its blocks and compare with transformers",
        description="For each family (name or family-file path; default: every family on the search path): "
                    "build its tiny_config model with transformers, save it as a sharded safetensors "
                    "checkpoint, load every block through the family file alone, and compare hidden states "
                    "(full sequence, token by token with the KV cache, and in multi-token steps), the KV cache "
                    "held per token and the block size; check that the tiny variants run every layer kind "
                    "(mask, positions, per-layer settings, dense/MoE) of the real model (the family's presets, "
                    "else its tiny config at full depth). Exit 1 naming the family-file field to fix "
                    "(path:line:column) on any mismatch.",
        examples=[("distconf check", "every family on the search path"),
                  ("distconf check FAMILY", "one family, by name"),
                  ("distconf check my_families/x.yaml", "a family file being written")],
    )
    p.add_argument("families", nargs="*", metavar="FAMILY|PATH", help="family names or family-file paths")
    p.set_defaults(func=run)


def _fmt(value: object, spec: str = "") -> str:
    if value is None:
        return "-"
    return format(value, spec) if spec else str(value)


def run(args: argparse.Namespace) -> int:
    """Check the families; print a table, then every failure."""
    import logging
    import time

    from distconf.cli.table import format_table
    from distconf.loader.search import find_family_file, is_family_path, list_families
    from distconf.tools.checker import TOLERANCE, check_family
    from distconf.tools.checker.failures import CheckFailure
    from distconf.tools.checker.result import CheckResult
    from distconf.tools.drafting.common import crash_line

    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass
    targets = args.families or list_families()
    if not targets:
        print("distconf check: no families found", file=sys.stderr)
        return 1
    for target in targets:  # a misspelt name fails now, not after checking the others
        if not is_family_path(target):
            find_family_file(target)
    start = time.perf_counter()
    results = []
    for target in targets:
        try:
            results.extend(check_family(target))
        except Exception as exc:  # a defect of the checker: one line naming the family, the traceback with -v
            logger.debug("distconf check %s crashed", target, exc_info=True)
            result = CheckResult(str(target), "-")
            result.failure = CheckFailure("<check>", f"the check itself failed: {crash_line(exc)} (a checker "
                                          "bug: please report it; -v prints the traceback)", str(target))
            results.append(result)
    rows = []
    for r in results:
        kv = f"{_fmt(r.kv_declared)}/{_fmt(r.kv_actual)}" + (" per seq" if r.cache_unit == "sequence" else "")
        size = "ok" if r.size_declared is not None and r.size_declared == r.size_actual else "-"
        rows.append([
            r.family, r.variant if len(r.variant) <= 48 else r.variant[:45] + "...", _fmt(r.layers or None),
            _fmt(r.params_per_block or None), _fmt(r.full_diff, ".1e"), _fmt(r.incremental_diff, ".1e"), kv,
            size, f"{r.seconds:.1f}s", "ok" if r.ok else f"FAIL {r.failure.field}",
        ])
    print(format_table(["family", "variant", "layers", "params/block", "full max|d|", "incr max|d|",
                        "KV B/token decl/held", "size", "time", "result"], rows))
    failures = [r for r in results if not r.ok]
    elapsed = time.perf_counter() - start
    print(f"\n{len(results) - len(failures)}/{len(results)} variant(s) passed in {elapsed:.1f}s "
          f"(float32, tolerance {TOLERANCE:.0e} relative; KV bytes per token per block in float32)")
    coverage = {r.family: r.kinds for r in results if r.kinds}
    for family, kinds in coverage.items():
        print(f"{family}: {kinds}")
    for r in failures:
        print(f"\n{r.family} [{r.variant}]: {r.failure}", file=sys.stderr)
    return 1 if failures else 0
