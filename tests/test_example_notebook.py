"""The notebooks under examples/: committed without outputs, and examples/tour.ipynb runs top to bottom.

The tour asserts its own numbers (the op against the attention it recomputes from the dequantized cache,
each format's error against bf16); executing it here in a fresh kernel makes those assertions tests.
"""

from __future__ import annotations

import glob
import os

import nbformat
import pytest

EXAMPLES = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, "examples"))
NOTEBOOKS = sorted(glob.glob(os.path.join(EXAMPLES, "**", "*.ipynb"), recursive=True))


def test_there_are_notebooks():
    assert os.path.join(EXAMPLES, "tour.ipynb") in NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: os.path.relpath(path, EXAMPLES))
def test_committed_notebook_has_no_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    for number, cell in enumerate(notebook.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (
                f"cell {number} of {path} has outputs; strip them before committing (e.g. jupyter nbconvert "
                f"--clear-output --inplace {os.path.relpath(path)})")


def test_tour_runs():
    from nbclient import NotebookClient

    notebook = nbformat.read(os.path.join(EXAMPLES, "tour.ipynb"), as_version=4)
    # The kernel starts in examples/ (as Jupyter would), not in the source tree's root.
    # A failing cell (the notebook asserts its numbers) raises CellExecutionError here.
    NotebookClient(notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": EXAMPLES}}).execute()
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    figures = [output for output in outputs if output.output_type == "display_data" and "image/png" in output.data]
    assert len(figures) == 2
