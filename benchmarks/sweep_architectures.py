"""Sweep every causal-LM model type of the installed transformers through `distconf new` and `distconf check`.

For each model type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (minus the exclusions, each with its reason):
write the config class's defaults to a config.json (``AutoConfig.for_model(type)``), draft a family file with
``distconf new``, prove the draft with ``distconf check``, each a subprocess with a timeout, one at a time.
A failure is classified by cause (the first error line matched against the classes of
``sweep_architectures.yaml``); the summary counts each class and the types passing as drafted. A type whose
defaults transformers itself cannot build is run once more with the repair the data lists for it
(``sweep_repairs.py``) and reported apart.

Examples:
  python benchmarks/sweep_architectures.py --out sweep.json             every type (takes long)
  python benchmarks/sweep_architectures.py --only TYPE,TYPE --out s.json   some model_type values
  python benchmarks/sweep_architectures.py --skip TYPE --timeout 120 --workdir /tmp/sweep
  python benchmarks/sweep_architectures.py --list                        the swept and excluded types, no run
  python benchmarks/sweep_architectures.py --reclassify sweep.json --out sweep.json   after editing the classes
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling module, also when loaded by file path
from sweep_classes import classify, config_hint_text, first_error
from sweep_repairs import read_repairs, write_repaired

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).with_suffix(".yaml")


META_BUILD = """
import sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
with torch.device("meta"):
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sys.argv[1]))
"""


@dataclass
class Outcome:
    """The sweep's record for one model type."""

    model_type: str
    status: str  # "pass", "fail" or "excluded"
    stage: str = ""  # config, new, check (where it failed)
    cause: str = ""  # a key of the classes table
    error: str = ""  # the first error line
    reason: str = ""  # why excluded
    seconds: float = 0.0
    evidence: list[str] = field(default_factory=list)
    repaired: dict = field(default_factory=dict)  # defaults that do not build: the run with sweep_repairs' values


class Interrupted(Exception):
    """Ctrl-C while a child ran (the child was stopped)."""


def run_child(cmd: list[str], timeout: float, cwd: Path, source: Path) -> tuple[int | None, str, str]:
    """Run ``cmd`` in its own process group, importing distconf from ``source``.

    Returns (rc or None on timeout, stdout, stderr). On timeout or Ctrl-C the whole group is stopped
    (SIGTERM, then SIGKILL after 5 s).
    """
    path = os.pathsep.join(p for p in (str(source), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        out, err = _stop(proc)
        return None, out, err
    except KeyboardInterrupt:
        _stop(proc)
        raise Interrupted from None


def _stop(proc: subprocess.Popen) -> tuple[str, str]:
    for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            return proc.communicate(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
    return "", ""


def swept_types(data: dict) -> tuple[list[str], dict[str, str]]:
    """(types to sweep, {excluded type: reason}) from transformers' metadata plus the explicit list."""
    import transformers.models.auto.modeling_auto as auto
    from transformers import CONFIG_MAPPING

    causal = auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    masked = set(auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES)
    multimodal = set(auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES) | set(auto.MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES)
    keep = data["exclusions"].get("keep") or {}
    excluded: dict[str, str] = dict(data["exclusions"].get("explicit") or {})
    for model_type in causal:
        if model_type in excluded or model_type in keep:
            continue
        config_class = CONFIG_MAPPING[model_type]
        own_type = getattr(config_class, "model_type", model_type)
        text_type = _text_sub_type(config_class)
        if own_type != model_type and own_type in causal:
            excluded[model_type] = f"alias: its config class {config_class.__name__} is {own_type}'s"
        elif text_type in causal and text_type != model_type:
            kind = "multimodal wrapper" if model_type in multimodal else "wrapper (no multimodal mapping)"
            excluded[model_type] = f"{kind}: its text_config is {text_type}, swept under its own type"
        elif _default(config_class, "is_encoder_decoder"):
            excluded[model_type] = "encoder-decoder decoder: config.is_encoder_decoder"
        elif model_type in masked:
            excluded[model_type] = f"bidirectional encoder: {auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES[model_type]}"
    return [t for t in causal if t not in excluded], excluded


def _text_sub_type(config_class: type) -> str | None:
    spec = (getattr(config_class, "sub_configs_defaults", None) or {}).get("text_config")
    if spec is not None and getattr(spec, "model_type", None):
        return spec.model_type
    sub = (getattr(config_class, "sub_configs", None) or {}).get("text_config")
    return getattr(sub, "model_type", None) or None


def _default(config_class: type, name: str) -> bool:
    try:
        return bool(getattr(config_class(), name, False))
    except Exception:  # a config whose defaults do not build is swept (and fails there)
        return bool(getattr(config_class, name, False))


def write_defaults(model_type: str, folder: Path) -> str:
    """Write the config class's defaults to ``folder/config.json``; return the error line ('' if written)."""
    from transformers import AutoConfig

    try:
        AutoConfig.for_model(model_type).save_pretrained(folder)
    except Exception as exc:  # the defaults of this config class do not validate
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    return ""


def sweep_one(model_type: str, args: argparse.Namespace, classes: dict) -> Outcome:
    """Write the defaults, draft, check; classify a failure; rerun a repairable one with its repair."""
    start = time.monotonic()
    family = re.sub(r"[^a-z0-9_]", "_", model_type.lower())
    folder = args.workdir / family
    folder.mkdir(parents=True, exist_ok=True)
    outcome = Outcome(model_type, "fail")
    error = write_defaults(model_type, folder)
    if error:
        outcome.stage, outcome.cause, outcome.error = "config", "defaults_do_not_build", error
    else:
        draft_and_check(outcome, family, folder, args, classes)
    repair = args.repairs.get(model_type)
    if outcome.cause == "defaults_do_not_build" and repair is not None and not error:
        again = Outcome(model_type, "fail")
        draft_and_check(again, family, folder / "repaired", args, classes,
                        config=write_repaired(folder / "config.json", repair, folder / "repaired"))
        outcome.repaired = {"status": again.status, "stage": again.stage, "cause": again.cause,
                            "error": again.error, "why": repair.why, "set": repair.values}
    outcome.seconds = round(time.monotonic() - start, 1)
    return outcome


def draft_and_check(outcome: Outcome, family: str, folder: Path, args: argparse.Namespace, classes: dict,
                    config: Path | None = None) -> None:
    """``distconf new`` on ``config`` (default ``folder/config.json``), then ``distconf check``; fill ``outcome``."""
    config = config or folder / "config.json"
    py = [sys.executable, "-m", "distconf"]
    steps = [
        ("new", [*py, "new", family, "--from-config", str(config), "--out", str(folder), "--force"]),
        ("check", [*py, "check", str(folder / f"{family}.yaml")]),
    ]
    review = ""
    for stage, cmd in steps:
        rc, out, err = run_child(cmd, args.timeout, folder, args.source)
        (folder / f"{stage}.log").write_text(f"$ {' '.join(cmd)}\nrc={rc}\n{out}\n--- stderr\n{err}", "utf-8")
        if stage == "new":
            review = "\n".join(ln for ln in out.splitlines() if ln.startswith("  - ") or "layer kinds" in ln)
        if rc == 0:
            continue
        outcome.stage = stage
        if rc is None:
            outcome.cause, outcome.error = "timeout", f"{stage} took over {args.timeout:.0f} s"
            return
        explain(outcome, out, err, review, folder, classes, args.timeout)
        return
    outcome.status = "pass"


def explain(outcome: Outcome, out: str, err: str, review: str, folder: Path, classes: dict,
            timeout: float) -> None:
    """Set a failed step's first error line, evidence and class from its output.

    When the draft failed, transformers alone is tried first: if its own model class cannot be built from the
    defaults (on the meta device), that is the cause (a passing draft means they built).
    """
    family = folder.name
    outcome.error, outcome.evidence = first_error(out, err, family)
    if outcome.stage == "new":
        rc, bout, berr = run_child([sys.executable, "-c", META_BUILD, str(folder)], timeout, folder, folder)
        if rc not in (0, None):
            outcome.cause = "defaults_do_not_build"
            outcome.evidence.append("transformers' meta-device build: " + first_error(bout, berr, family)[0])
            return
    text = "\n".join((outcome.error, review))
    outcome.cause, matched = classify(text, config_hint_text(folder / "config.json"), classes)
    if matched:
        outcome.evidence.append(matched)


def read_log(path: Path) -> tuple[str, str]:
    """(stdout, stderr) of a step log written by ``sweep_one``."""
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    body = text.split("\n", 2)[2] if text.count("\n") >= 2 else ""
    out, _, err = body.partition("\n--- stderr\n")
    return out, err


def reclassify(path: Path, classes: dict, timeout: float) -> tuple[dict, list[Outcome]]:
    """Classify a finished (or partial) result file's failures again from the step logs in its workdir."""
    result = json.loads(path.read_text(encoding="utf-8"))
    workdir = Path(result["workdir"])
    outcomes = [Outcome(**record) for record in result["results"]]
    for outcome in outcomes:
        if outcome.status != "fail" or outcome.stage not in ("new", "check") or outcome.cause == "timeout":
            continue
        folder = workdir / re.sub(r"[^a-z0-9_]", "_", outcome.model_type.lower())
        new_out, _ = read_log(folder / "new.log")
        review = "\n".join(ln for ln in new_out.splitlines() if ln.startswith("  - ") or "layer kinds" in ln)
        explain(outcome, *read_log(folder / f"{outcome.stage}.log"), review, folder, classes, timeout)
    keys = ("results", "swept", "passed", "excluded", "per_class")
    return {k: v for k, v in result.items() if k not in keys}, outcomes


def tree_state(source: Path) -> dict:
    """The commit the run measures, and whether its distconf/ had uncommitted changes."""
    def git(*argv: str) -> str:
        done = subprocess.run(["git", *argv], cwd=source, capture_output=True, text=True, check=False)
        return done.stdout.strip()
    commit = git("rev-parse", "HEAD")
    if not commit:  # an exported tree (git archive) keeps its commit in the file the export wrote
        stamp = source / ".sweep-commit"
        commit = stamp.read_text(encoding="utf-8").strip() if stamp.exists() else "unknown"
        return {"source": str(source), "commit": commit, "dirty_distconf": False}
    return {"source": str(source), "commit": commit,
            "dirty_distconf": bool(git("status", "--porcelain", "distconf"))}


def write_result(path: Path, meta: dict, outcomes: list[Outcome], classes: dict) -> None:
    """The JSON result: run metadata, totals, counts per class, and one record per type."""
    swept = [o for o in outcomes if o.status != "excluded"]
    counts = Counter(o.cause for o in swept if o.status == "fail")
    result = dict(meta, swept=len(swept), passed=sum(o.status == "pass" for o in swept),
                  passed_once_repaired=sum(o.repaired.get("status") == "pass" for o in swept),
                  excluded=sum(o.status == "excluded" for o in outcomes),
                  per_class={k: {"label": classes[k]["label"], "count": n} for k, n in counts.most_common()},
                  results=[asdict(o) for o in outcomes])
    path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


def print_summary(outcomes: list[Outcome], classes: dict, partial: bool) -> None:
    """Counts per class, the failures with their first error line, and the pass total."""
    swept = [o for o in outcomes if o.status != "excluded"]
    fails = [o for o in swept if o.status == "fail"]
    counts = Counter(o.cause for o in fails)
    print(f"\n{'class':<58} {'#':>4}")
    print("-" * 63)
    for key, count in counts.most_common():
        print(f"{classes[key]['label']:<58} {count:>4}")
    print("-" * 63)
    for o in sorted(fails, key=lambda o: (o.cause, o.model_type)):
        print(f"  [{o.cause}] {o.model_type} ({o.stage}): {o.error[:240]}")
    repaired = sorted(o.model_type for o in fails if o.repaired.get("status") == "pass")
    for o in sorted((o for o in fails if o.repaired), key=lambda o: o.model_type):
        print(f"  repaired {o.model_type}: {o.repaired['status']}"
              f"{'' if o.repaired['status'] == 'pass' else ' ' + o.repaired['error'][:200]} ({o.repaired['why']})")
    passed = len(swept) - len(fails)
    note = " (PARTIAL: interrupted)" if partial else ""
    print(f"\n{passed} of {len(swept)} swept types pass as drafted{note}; "
          f"{sum(o.status == 'excluded' for o in outcomes)} excluded")
    if repaired:
        print(f"{len(repaired)} more pass once transformers' defaults that do not build are repaired "
              f"({', '.join(repaired)}): {passed + len(repaired)} of {len(swept)}")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("Examples:")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="comma-separated model types to sweep (still excluded ones are reported)")
    parser.add_argument("--skip", help="comma-separated model types not to sweep")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per step (default 240)")
    parser.add_argument("--jobs", type=int, default=1, choices=[1], help="types at a time (only 1: shared cores)")
    parser.add_argument("--workdir", type=Path, help="folder for configs, drafts and logs (default: a temp dir)")
    parser.add_argument("--out", type=Path, help="JSON result file (rewritten after every type)")
    parser.add_argument("--source", type=Path, default=REPO,
                        help="distconf source tree to measure (default: this checkout); e.g. an export of one "
                             "commit: git archive HEAD | tar -x -C DIR; git rev-parse HEAD > DIR/.sweep-commit")
    parser.add_argument("--reclassify", type=Path, metavar="RESULT_JSON",
                        help="classify the failures of a result file again from its workdir's logs (no run); "
                             "writes --out if given")
    parser.add_argument("--list", action="store_true", help="print the swept and excluded types and exit")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the sweep; exit 0 when it completed (whatever passed), 130 when interrupted."""
    args = parse_args(argv)
    signal.signal(signal.SIGINT, _interrupt)  # also when started in the background, where SIGINT is ignored
    signal.signal(signal.SIGTERM, _interrupt)
    data = yaml.safe_load(DATA.read_text(encoding="utf-8"))
    classes = data["classes"]
    args.repairs = read_repairs(data)
    if args.reclassify:
        meta, outcomes = reclassify(args.reclassify, classes, args.timeout)
        if args.out:
            write_result(args.out, meta, outcomes, classes)
        print_summary(outcomes, classes, bool(meta.get("partial")))
        return 0
    types, excluded = swept_types(data)
    outcomes = [Outcome(t, "excluded", reason=r) for t, r in sorted(excluded.items())]
    if args.only:
        wanted = [t.strip() for t in args.only.split(",") if t.strip()]
        unknown = [t for t in wanted if t not in types and t not in excluded]
        if unknown:
            sys.exit(f"not in the causal-LM mapping: {', '.join(unknown)}")
        types = [t for t in types if t in wanted]
        outcomes = [o for o in outcomes if o.model_type in wanted]
    skip = {t.strip() for t in (args.skip or "").split(",") if t.strip()}
    types = [t for t in types if t not in skip]
    if args.list:
        print("\n".join(f"sweep    {t}" for t in types))
        print("\n".join(f"exclude  {o.model_type}: {o.reason}" for o in outcomes))
        return 0
    args.workdir = args.workdir or Path(tempfile.mkdtemp(prefix="distconf-sweep-"))
    args.workdir.mkdir(parents=True, exist_ok=True)
    args.source = args.source.resolve()
    import transformers

    meta = dict(tree_state(args.source), transformers=transformers.__version__, timeout=args.timeout,
                workdir=str(args.workdir), started=time.strftime("%Y-%m-%dT%H:%M:%S"),
                load_at_start=os.getloadavg()[0], partial=True)
    print(f"sweeping {len(types)} types ({len(excluded)} excluded), commit {meta['commit'][:10]}"
          f"{' + uncommitted distconf/ changes' if meta['dirty_distconf'] else ''}, workdir {args.workdir}",
          flush=True)
    partial = False
    try:
        for index, model_type in enumerate(types, 1):
            outcome = sweep_one(model_type, args, classes)
            outcomes.append(outcome)
            verdict = "pass" if outcome.status == "pass" else f"FAIL [{outcome.cause}] {outcome.error[:160]}"
            print(f"[{index}/{len(types)}] {model_type}: {verdict} ({outcome.seconds:.0f}s)", flush=True)
            if args.out:
                write_result(args.out, dict(meta, load_now=os.getloadavg()[0]), outcomes, classes)
    except (Interrupted, KeyboardInterrupt):
        partial = True
        print("\ninterrupted: the running step was stopped", flush=True)
    meta.update(partial=partial, finished=time.strftime("%Y-%m-%dT%H:%M:%S"), load_now=os.getloadavg()[0])
    if args.out:
        write_result(args.out, meta, outcomes, classes)
    print_summary(outcomes, classes, partial)
    return 130 if partial else 0


if __name__ == "__main__":
    sys.exit(main())
