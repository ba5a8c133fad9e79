"""The check of a family: every tiny-config variant through steps 1-4, failures recorded per variant."""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import Any

from distconf.errors import FamilyValidationError
from distconf.tools.checker.carried import check_carried_bounds
from distconf.tools.checker.causal import non_causal_cause
from distconf.tools.checker.failures import CheckFailure, crash_failure, located_failure, validation_failure
from distconf.tools.checker.kinds import check_coverage
from distconf.tools.checker.layout import (
    attention_class,
    check_attention_gets_cache,
    check_layer_tensors,
    check_meta_build,
    first_attention_block,
    load_blocks,
)
from distconf.tools.checker.reference import build_reference, record_layer_io, save_sharded, tiny_variants
from distconf.tools.checker.result import CheckResult
from distconf.tools.checker.runs import compare_cached, compare_full
from distconf.tools.checker.sizes import check_block_sizes, check_kv_cache

__all__ = ["check_family", "check_variant"]

logger = logging.getLogger(__name__)


def check_variant(cls: type, values: dict[str, Any], result: CheckResult) -> None:
    """Check one tiny config of ``cls``; fill ``result`` and raise `CheckFailure` on the first mismatch."""
    from distconf.blocks.weights import checkpoint_files

    reference = build_reference(cls, values)
    result.layers = reference.blocks
    attn_class = attention_class(cls)
    with tempfile.TemporaryDirectory(prefix="distconf-check-") as tmp:
        directory = Path(tmp)
        save_sharded(reference.model, directory)
        files = checkpoint_files(directory)
        result.shards = len(set(files.values()))
        check_layer_tensors(cls, reference, files)
        blocks = load_blocks(cls, directory, reference, attn_class)
    result.params_per_block = sum(p.numel() for p in blocks[0].parameters())
    try:
        ref_in, ref_out = record_layer_io(reference)  # first: it checks the hidden state's streams
        check_carried_bounds(cls, reference, values)  # before the runs, which a wrong keyword makes crash
        check_attention_gets_cache(cls, first_attention_block(blocks), attn_class, reference.config.wire_width)
        compare_full(cls, blocks, ref_in, ref_out, result)
        caches = compare_cached(cls, blocks, ref_in, ref_out, result)
    except Exception as exc:
        cause = non_causal_cause(reference.model, getattr(reference.config, "vocab_size", 2) or 2)
        if cause is not None:  # the cause, not a symptom no family file could cure
            raise located_failure(cls, ("block",), cause) from None
        carried = _carried_streams(cls, reference)
        if carried and (not isinstance(exc, CheckFailure) or exc.field == "block"):
            # a block's own error (e.g. a layer refusing None for the value) or a mismatch; advice naming fields
            # cannot help here
            symptom = (exc.message.partition(": check ")[0] if isinstance(exc, CheckFailure)
                       else f"a block failed: {type(exc).__name__}: {exc}")
            raise located_failure(cls, ("block",), f"{symptom}; the model passes {', '.join(carried)} from each "
                                  "layer's output into the next layer's call besides the hidden states, which a "
                                  "block gets as None (blocks exchange hidden states only): the likely cause, which "
                                  "no family file can cure") from None
        raise
    check_kv_cache(cls, reference.config, caches, result, int(ref_in.shape[1]))
    check_block_sizes(cls, reference.config, blocks, result)
    check_meta_build(cls, reference.config)


def _carried_streams(cls: type, reference: Any) -> list[str]:
    """What the reference model carries from layer to layer besides the hidden states (`carried_streams`)."""
    from distconf.tools.drafting.streams import carried_streams

    owner, _, attribute = cls.family_spec.block.prefix.rpartition(".")  # type: ignore[attr-defined]
    try:
        module = reference.model.get_submodule(owner) if owner else reference.model
    except AttributeError:
        return []
    hidden_state = cls.family_spec.hidden_state  # type: ignore[attr-defined]
    declared = {stream.argument for stream in hidden_state.carried} if hidden_state is not None else set()
    return [name for name in carried_streams(module, attribute) if name not in declared]


def check_family(name_or_path: str | Path) -> list[CheckResult]:
    """Check every tiny-config variant of a family; failures are recorded, not raised.

    A family name that is on no search path raises `FamilyNotFoundError` (a usage mistake,
    not a defect of a family file).
    """
    from distconf.loader import load_family
    from distconf.loader.search import is_family_path

    try:
        cls = load_family(name_or_path)
    except FamilyValidationError as exc:
        result = CheckResult(Path(name_or_path).stem if is_family_path(name_or_path) else str(name_or_path), "-")
        result.failure = validation_failure(exc)
        return [result]
    spec = cls.family_spec
    if not spec.tiny_config:
        result = CheckResult(spec.family, "-")
        result.failure = located_failure(cls, ("tiny_config",),
                                         "no tiny_config: add a few-layer, small-dimension config")
        return [result]
    results = [_check_one(cls, variant, values) for variant, values in tiny_variants(spec.tiny_config)]
    _check_kinds(cls, results)
    return results


def _check_kinds(cls: type, results: list[CheckResult]) -> None:
    """Every layer kind of the real model must run in some tiny variant.

    The summary goes to every result's ``kinds``; a failure goes to the last variant that
    passed its comparisons (they do not prove the family while a kind never ran), once.
    """
    start = time.perf_counter()
    failure: CheckFailure | None = None
    try:
        kinds = check_coverage(cls)
        summary = kinds.summary()
    except CheckFailure as exc:
        failure, summary = exc, "layer kinds not covered"
    except FamilyValidationError as exc:
        failure, summary = validation_failure(exc), "layer kinds not listed"
    except Exception as exc:
        logger.debug("layer kinds of %s crashed", cls.family_spec.family, exc_info=True)  # type: ignore[attr-defined]
        failure = located_failure(cls, ("tiny_config",), f"cannot list the layer kinds: {type(exc).__name__}: {exc}")
        summary = "layer kinds not listed"
    for result in results:
        result.kinds = summary
    passed = [r for r in results if r.ok]
    if failure is not None and passed:
        passed[-1].failure = failure
    elif failure is not None:
        results[0].notes.append(str(failure))
    results[-1].seconds += time.perf_counter() - start


def _check_one(cls: type, variant: str, values: dict[str, Any]) -> CheckResult:
    result = CheckResult(cls.family_spec.family, variant)  # type: ignore[attr-defined]
    start = time.perf_counter()
    try:
        check_variant(cls, values, result)
    except CheckFailure as exc:
        result.failure = exc
    except FamilyValidationError as exc:
        result.failure = validation_failure(exc)
    except Exception as exc:
        logger.debug("check of %s [%s] crashed", result.family, variant, exc_info=True)
        result.failure = crash_failure(cls, exc)
    result.seconds = time.perf_counter() - start
    return result
