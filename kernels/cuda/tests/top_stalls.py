"""Prints the SASS instructions with the most warp-stall samples from an ncu source-page CSV.

Usage: ncu -i rep.ncu-rep --page source --csv --print-source sass > src.csv
       python3 kernels/cuda/tests/top_stalls.py src.csv [count]
"""

import csv
import sys


def main(path: str, count: int = 45) -> None:
    rows = list(csv.reader(open(path)))
    header_row = next(i for i, r in enumerate(rows) if any(c.startswith("Warp Stall Sampling (All") for c in r))
    header = rows[header_row]
    samples_column = next(j for j, c in enumerate(header) if c.startswith("Warp Stall Sampling (All"))
    source_column = header.index("Source")
    address_column = header.index("Address") if "Address" in header else 0
    data = []
    for r in rows[header_row + 1:]:
        try:
            data.append((float(r[samples_column].replace(",", "")), r[address_column], r[source_column]))
        except (ValueError, IndexError):
            continue
    total = sum(d[0] for d in data) or 1.0
    print("total samples", int(total))
    for samples, address, source in sorted(data, reverse=True)[:count]:
        print(f"{100 * samples / total:5.1f}% {address} {source[:110]}")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
