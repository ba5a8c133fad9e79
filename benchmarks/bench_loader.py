"""Family-core benchmark: synthesis, cached lookup, from_pretrained overhead, validate wall time.

Prints medians of repeated runs, each measured side by side with its reference in this one run:
- first ``load_family`` per family (transformers already imported; file read + validate + synthesize),
- a cached ``load_family`` call,
- ``from_pretrained`` of the synthesized class vs the plain HF class on the same local folder (ratio),
- wall time of ``distconf validate families`` vs ``python -c "import transformers"``.
Side-by-side measures alternate within each round, so a change of machine load affects both alike.
Targets: synthesis < 5 ms, cached < 20 us, from_pretrained ratio <= 1.3, validate < 0.5 s.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def median_time(fn, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def paired_median_times(fns: list, repeat: int) -> list[float]:
    """Median time of each of ``fns``, run in turn within each round (so load changes hit them alike)."""
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, times in zip(fns, samples):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return [statistics.median(times) for times in samples]


def first_loadable_preset(hub_ids: list[str]):
    """The first shipped preset whose family is on the search path."""
    import distconf

    for hub_id in hub_ids:
        try:
            return distconf.load_preset(hub_id)
        except distconf.FamilyNotFoundError:
            continue
    raise SystemExit("no preset has a family")


def main() -> None:
    import transformers  # noqa: F401 - measured with transformers already imported

    import distconf
    from distconf.loader.presets import list_presets
    from distconf.loader.registry import clear_cache

    families = distconf.list_families()
    probe = families[0]

    print(f"{'measure':<52}{'median':>12}{'target':>12}")
    for family in families:  # import each HF config module once: the benchmark measures distconf, not imports
        distconf.load_family(family)

    def synth(family: str) -> None:
        clear_cache()
        distconf.load_family(family)

    for family in families:
        t = median_time(lambda family=family: synth(family), 30)
        print(f"{'first load_family(' + repr(family) + ')':<52}{t * 1e3:>10.2f}ms{'< 5 ms':>12}")
    distconf.load_family(probe)
    n = 200_000
    t = timeit.timeit(lambda: distconf.load_family(probe), number=n) / n
    print(f"{'cached load_family':<52}{t * 1e6:>10.2f}us{'< 20 us':>12}")

    with tempfile.TemporaryDirectory() as tmp:
        preset = first_loadable_preset(list_presets())
        cls = type(preset)
        base = cls.hf_config_class
        base(**{k: v for k, v in preset.to_diff_dict().items() if k != "model_type"}).save_pretrained(tmp)
        plain, ours = paired_median_times([lambda: base.from_pretrained(tmp), lambda: cls.from_pretrained(tmp)], 200)
        print(f"{base.__name__ + '.from_pretrained (HF)':<52}{plain * 1e3:>10.2f}ms")
        print(f"{cls.__name__ + '.from_pretrained':<52}{ours * 1e3:>10.2f}ms")
        print(f"{'  ratio distconf / HF':<52}{ours / plain:>12.2f}{'<= 1.3':>12}")

    def run(args: list[str]) -> None:
        subprocess.run(args, check=True, capture_output=True, cwd=REPO)

    validate, imp, imp_cfg = paired_median_times([
        lambda: run([sys.executable, "-m", "distconf", "validate", "-q", "families"]),
        lambda: run([sys.executable, "-c", "import transformers"]),
        lambda: run([sys.executable, "-c", f"import transformers; transformers.{base.__name__}"]),
    ], 7)
    print(f"{'distconf validate families (wall, new process)':<52}{validate:>11.3f}s{'< 0.5 s':>12}")
    label_imp = 'python -c "import transformers" (wall)'
    label_cfg = f'python -c "...; transformers.{base.__name__}" (wall)'
    print(f"{label_imp:<52}{imp:>11.3f}s")
    print(f"{label_cfg:<52}{imp_cfg:>11.3f}s")
    print(f"{'  ratio validate / import transformers':<52}{validate / imp:>12.2f}")


if __name__ == "__main__":
    main()
