"""Imports the benchmark scripts (benchmarks/*.py, a script directory, not a package) for the tests that
use their functions. Each script defines its absl flags at import, several under the same names
(``--steps``), which absl refuses twice in one process; the flags a script defined are dropped once it
is loaded, since the tests call its functions, never its ``main``."""

from __future__ import annotations

import importlib.util
import pathlib

from absl import flags

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str):
    """benchmarks/<name>.py as a module, without its flags."""
    before = set(flags.FLAGS)
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for flag in set(flags.FLAGS) - before:
        delattr(flags.FLAGS, flag)
    return module
