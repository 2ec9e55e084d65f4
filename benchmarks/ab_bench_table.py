"""The table of benchmarks/ab_bench.sh: bench.py's step time of every case in each run of an A/B of
source trees, side by side, with each run's ratio to the first run's time (a run is one tree built and
timed; the first tree runs again last, so the drift between builds shows beside the differences).

    python benchmarks/ab_bench_table.py OUT_DIR     # OUT_DIR/<i>_<tree>/bench.json, runs in order of i
"""

from __future__ import annotations

import json
import pathlib
import sys


def case_key(row: dict) -> str:
    """One case of bench.py's rows: format, T, H, variant and what set it apart (impl, staging)."""
    extra = [row["impl"]] if row.get("impl") not in (None, "auto", "prefill") else []
    if row.get("staging"):
        extra.append(f"staging {row['staging']}")
    return " ".join([row["format"], f"T={row['T']}", f"H={row['H']}", row["variant"], *extra])


def load(path: pathlib.Path) -> dict:
    """{case: (µs, check)} of one run's bench.json."""
    rows = json.loads(path.read_text())["rows"]
    return {case_key(r): (r["us"], r["check"]) for r in rows}


def table(runs: list[tuple[str, dict]]) -> str:
    """Markdown: a row per case (in the first run's order), a column per run, ratios to the first run."""
    names = [name for name, _ in runs]
    first = runs[0][1]
    cases = list(first) + [c for _, run in runs[1:] for c in run if c not in first]
    lines = ["| case | " + " | ".join(f"{n} µs" for n in names) + " | " +
             " | ".join(f"{n} / {names[0]}" for n in names[1:]) + " |",
             "|---|" + "---|" * (2 * len(names) - 1)]
    for case in cases:
        cells, ratios = [], []
        for _, run in runs:
            us, check = run.get(case, (None, None))
            cells.append("—" if us is None else f"{us:.1f}" + ("" if check == "ok" else f" ({check})"))
        base = first.get(case, (None, None))[0]
        for _, run in runs[1:]:
            us = run.get(case, (None, None))[0]
            ratios.append("—" if us is None or not base else f"{us / base:.3f}")
        lines.append(f"| {case} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines) + "\n"


def main(out_dir: str) -> int:
    runs = []
    for run_dir in sorted(pathlib.Path(out_dir).iterdir(), key=lambda p: p.name):
        results = run_dir / "bench.json"
        if run_dir.is_dir() and results.exists():
            runs.append((run_dir.name, load(results)))
    if not runs:
        print(f"no bench.json under {out_dir}")
        return 1
    print(table(runs))
    return 0 if all(check == "ok" for _, run in runs for _, check in run.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
