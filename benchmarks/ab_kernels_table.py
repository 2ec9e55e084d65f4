"""The table of benchmarks/ab_kernels.sh: the standalone check's timed rows of each tree side by side,
each with its ratio to the baseline tree's time (the first tree given, or with AB_BASELINE=head the working
tree), and the working tree's second run (`head again`) where there is one.

    python benchmarks/ab_kernels_table.py OUT_DIR head tree ...   # OUT_DIR/headline_<name>.log per tree

A row is a line of the check that names a case, its plan, PASS or FAIL and a time in µs: the timed modes'
table (`--headline`, `--ablate`: the time right after the verdict) and `--profile-small`'s line (the
errors between the verdict and the time).
"""

from __future__ import annotations

import os
import re
import sys

ROW = re.compile(r"^(.+?)\s+((?:H )?(?:decode|prefill) hpb=.*?)\s+(PASS|FAIL)(?:\s.*?)?\s([0-9.]+) us\b")


def rows(path: str) -> dict:
    """{(case, plan): (verdict, µs)} of one log (empty when there is no such log)."""
    table = {}
    try:
        with open(path) as log:
            for line in log:
                m = ROW.match(line)
                if m:
                    table[(m.group(1).strip(), m.group(2).strip())] = (m.group(3), float(m.group(4)))
    except FileNotFoundError:
        pass
    return table


def table(out: str, names: list[str], baseline_is_head: bool) -> str:
    runs = [(n, rows(f"{out}/headline_{n}.log")) for n in names]
    again = rows(f"{out}/headline_head_again.log")  # none with AB_REPEAT_HEAD=0: no column then
    runs += [("head again", again)] if again else []
    keys = list(runs[0][1]) or [k for _, r in runs for k in r]
    base = runs[1][1] if len(names) > 1 and not baseline_is_head else runs[0][1]
    lines = ["| case | plan | " + " | ".join(n for n, _ in runs) + " |", "|---|---|" + "---|" * len(runs)]
    for k in dict.fromkeys(keys):
        cells = []
        for _, r in runs:
            if k not in r:
                cells.append("—")
                continue
            ok, us = r[k]
            ratio = f" ({us / base[k][1]:.2f})" if k in base and base[k][1] > 0 else ""
            cells.append(f"{us:.1f}{ratio}{'' if ok == 'PASS' else ' FAIL'}")
        lines.append(f"| {k[0]} | {k[1]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(sys.argv[1], sys.argv[2:], os.environ.get("AB_BASELINE") == "head"))
