"""benchmarks/planner_sweep.py --replay: the planner's built-in constants pick, on the recorded H200 sweep
(every plan of the grid timed), a plan within 10% of the fastest timed one for every shape; --refit
finds such constants from the run's calibrated ones (no GPU: the recorded timings are judged)."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SWEEP = RESULTS / "planner_sweep.json"
#: The sweeps the built-in constants were fitted to: dsv3_2, glm_nsa and bf16_576 (one format of each row
#: conversion) at T <= 64, and the three at T = 128 and 256.
FITTED = [SWEEP, RESULTS / "planner_sweep_glm_nsa.json", RESULTS / "planner_sweep_bf16_576.json",
          *sorted(RESULTS.glob("planner_sweep_large_t_*.json"))]


def _replay(*extra, sweeps=(SWEEP,)):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "planner_sweep.py"), "--replay",
                           ",".join(map(str, sweeps)), *extra], capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


def _assert_defaults_within_ten_percent(sweeps):
    # The replay prints each file's name, then its table and "default constants: k/n" (picks within 10%).
    rc, text = _replay(sweeps=sweeps)
    assert rc == 0, text[-3000:]
    for sweep in sweeps:
        shapes = len(json.loads(sweep.read_text())["rows"])
        assert f"{sweep}\n" in text and f"default constants: {shapes}/{shapes}" in text.split(f"{sweep}\n")[1], \
            text[-3000:]


def test_default_constants_pick_within_ten_percent_on_every_recorded_sweep():
    assert len(FITTED) == 6
    _assert_defaults_within_ten_percent(FITTED)


def test_refit_finds_constants_that_pick_within_ten_percent():
    rc, text = _replay("--refit", "40")
    assert rc == 0, text[-3000:]
    assert "refitted constants" in text


def test_default_constants_pick_within_ten_percent_on_the_held_out_sweeps():
    # Timed after the fit, never fitted to: other formats and head counts (dots3_swa's since its decode
    # plans split only its 513-position window).
    held_out = sorted(RESULTS.glob("planner_sweep_check_*.json"))
    assert len(held_out) == 4
    _assert_defaults_within_ten_percent(held_out)
