"""Tabulates the phase marks a JSMLA_PHASE_CLOCKS = 1 build prints (kernels/cuda/phase_clock.cuh).

Reads the `PHASE ...` lines of a run (a file or stdin), keeps the last launch of each kernel (a launch
ends where a (kernel, role, block) repeats), and prints per kernel and role the median and maximum over
the blocks of the SM clock cycles from a block's start (its earliest role's first statement) to each
mark, in µs at --ghz, and the launch's spread of block start and end times (global timer, ns).

    bash benchmarks/ab_tree.sh clocks main JSMLA_PHASE_CLOCKS=1
    /tmp/jsmla_ab_build_clocks/portable_check --profile-small h16 | python3 benchmarks/phase_clocks.py --ghz 1.98
"""

import argparse
import re
import statistics
import sys

LINE = re.compile(
    r"PHASE (\S+) (\S+) block=(\d+) split=(-?\d+) head_tile=(-?\d+) token=(-?\d+) start_ns=(\d+) end_ns=(\d+)"
    r"(?: start_cycles=(-?\d+))? c=([-\d,]+)"
)

# What each mark means, per kernel and role (the comments at the marks in the kernels).
MARK_NAMES = {
    ("h16", "producer"): ["tile 0 issued"] + [f"tile {i // 2} {'landed' if i % 2 == 0 else 'converted'}" for i in range(15)],
    ("h16", "consumer"): ["Q loaded"]
    + [f"tile {i // 3} {('full', 'S done', 'P written')[i % 3]}" for i in range(12)]
    + ["last O done", "out rows in smem", "stores issued"],
    ("h64", "producer"): ["tiles 0-1 issued"] + [f"tile {i // 2} {'landed' if i % 2 == 0 else 'converted'}" for i in range(15)],
    ("h64", "scorer"): ["Q loaded"]
    + [f"tile {i // 3} {('full', 'S done', 'P handed over')[i % 3]}" for i in range(12)]
    + ["last P·V done", "final max and sum", "stores issued"],
    ("h64", "pv"): ["Q loaded"]
    + [f"tile {i // 2} {'P ready' if i % 2 == 0 else 'P·V done'}" for i in range(12)]
    + ["last P·V done", "final max and sum", "stores issued"],
}
# The start marks after the 16 numbered ones (PhaseClock::StartMark): the block's valid-token count and
# lengths arrived, its coordinates computed, its first index arrived (producers).
START_MARKS = ["count and lengths arrived", "coordinates computed", "first index arrived"]
for _names in MARK_NAMES.values():
    _names.extend(START_MARKS)


def parse(stream):
    """The last launch of each kernel: {(kernel, role): [record]}."""
    launches = {}
    seen = {}
    for line in stream:
        m = LINE.search(line)
        if not m:
            continue
        kernel, role, block = m.group(1), m.group(2), int(m.group(3))
        record = {
            "block": block,
            "split": int(m.group(4)),
            "head_tile": int(m.group(5)),
            "token": int(m.group(6)),
            "start_ns": int(m.group(7)),
            "end_ns": int(m.group(8)),
            "start_cycles": int(m.group(9)) if m.group(9) is not None else None,
            "marks": [int(x) for x in m.group(10).split(",")],
        }
        keys = seen.setdefault(kernel, set())
        if (role, block) in keys:  # a new launch of this kernel
            keys.clear()
            launches[kernel] = {}
        keys.add((role, block))
        launches.setdefault(kernel, {}).setdefault(role, []).append(record)
    for roles in launches.values():
        _common_origin(roles)
    return launches


def _common_origin(roles):
    """Shifts each record's marks to cycles from the earliest start among its block's roles (where the
    records carry their start clock), so the roles of a block read on one time line."""
    origin = {}
    for records in roles.values():
        for r in records:
            if r["start_cycles"] is not None:
                origin[r["block"]] = min(origin.get(r["block"], r["start_cycles"]), r["start_cycles"])
    for records in roles.values():
        for r in records:
            if r["start_cycles"] is not None:
                shift = r["start_cycles"] - origin[r["block"]]
                r["marks"] = [m + shift if m >= 0 else m for m in r["marks"]]


def table(launches, ghz):
    out = []
    for kernel, roles in launches.items():
        records = [r for rs in roles.values() for r in rs]
        first = min(r["start_ns"] for r in records)
        starts = sorted(r["start_ns"] - first for r in records)
        ends = sorted(r["end_ns"] - first for r in records)
        blocks = len({r["block"] for r in records})
        out.append(f"## {kernel}: {blocks} blocks; block starts {starts[0]}..{starts[-1]} ns after the first, "
                   f"ends {ends[0]}..{ends[-1]} ns (median {statistics.median(ends):.0f})")
        for role, rs in roles.items():
            names = MARK_NAMES.get((kernel, role), [f"mark {i}" for i in range(16)] + START_MARKS)
            out.append(f"\n{role} ({len(rs)} blocks): cycles from the block's start (µs at {ghz} GHz)\n")
            out.append("| mark | median cycles | max cycles | median µs | max µs |")
            out.append("|---|---|---|---|---|")
            for i, name in enumerate(names):
                values = [r["marks"][i] for r in rs if i < len(r["marks"]) and r["marks"][i] >= 0]
                if not values:
                    continue
                med, top = statistics.median(values), max(values)
                out.append(f"| {i}: {name} | {med:.0f} | {top} | {med / ghz / 1000:.2f} | {top / ghz / 1000:.2f} |")
        out.append("")
    return "\n".join(out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", nargs="?", help="the run's output (default: stdin)")
    parser.add_argument("--ghz", type=float, default=1.98, help="SM clock for the µs columns")
    args = parser.parse_args(argv)
    stream = open(args.log) if args.log else sys.stdin
    launches = parse(stream)
    if not launches:
        print("phase_clocks.py: no PHASE lines (was the build made with JSMLA_PHASE_CLOCKS=1?)")
        return 1
    print(table(launches, args.ghz))
    return 0


if __name__ == "__main__":
    sys.exit(main())
