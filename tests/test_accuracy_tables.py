"""benchmarks/accuracy_tables.py, what the accuracy-model scripts share: the contract's two error measures,
the table cells, and the command line that prints the table and writes it with --out."""

import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))

import accuracy_tables  # noqa: E402


def test_errors_are_the_contract_measures():
    ref = np.array([[4.0, -2.0], [0.5, 1.0]])
    out = ref + np.array([[0.0, 0.2], [-0.1, 0.0]])
    max_error, l2 = accuracy_tables.errors(out, ref)
    assert np.isclose(max_error, 0.2 / 4.0)  # scaled by max(1, max |ref|)
    assert np.isclose(l2, np.sqrt(0.05) / np.sqrt(21.25))
    small = np.full(3, 0.25)
    assert np.isclose(accuracy_tables.errors(small + 0.01, small)[0], 0.01)  # max |ref| < 1: not scaled up


def test_cells_keep_the_column_order():
    assert accuracy_tables.cells({"b": (1e-3, 2e-4), "a": (0.5, 0.25)}) == "1.00e-03 / 2.00e-04 | 5.00e-01 / 2.50e-01"


def test_main_prints_and_writes_the_table(tmp_path, capsys):
    path = tmp_path / "table.md"
    text = accuracy_tables.main("a table", lambda: ["| a |", "|---|", "| 1 |"], ["--out", str(path)])
    assert text == "| a |\n|---|\n| 1 |\n"
    assert path.read_text() == text
    assert "| 1 |" in capsys.readouterr().out
    assert accuracy_tables.main("a table", lambda: ["x"], []) == "x\n"
