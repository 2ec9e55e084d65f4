"""What the accuracy-model scripts (fp8_pv_accuracy.py, scale_rounding_accuracy.py) share: the accuracy
contract's two error measures of an output against its float64 reference, a table cell of them, and the
command line (print the markdown table; --out also writes it to a file)."""

from __future__ import annotations

import argparse

import numpy as np


def errors(out, ref) -> tuple[float, float]:
    """(max |out - ref| / max(1, max |ref|), relative L2 error): the measures docs/semantics.md bounds."""
    return (float(np.abs(out - ref).max() / max(1.0, np.abs(ref).max())),
            float(np.linalg.norm(out - ref) / np.linalg.norm(ref)))


def cells(rows: dict) -> str:
    """The table cells of {column: (max error, relative L2 error)}, in the dict's order."""
    return " | ".join(f"{m:.2e} / {l2:.2e}" for m, l2 in rows.values())


def main(description: str, table_lines, argv=None) -> str:
    """Prints the table table_lines() returns (markdown lines) and, with --out PATH, writes it there."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", default="", help="also write the table (markdown) here")
    args = parser.parse_args(argv)
    text = "\n".join(table_lines()) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return text
