"""benchmarks/planner_sweep.py --replay: the planner's built-in constants pick, on the recorded H200 sweep
(every plan of the grid timed), a plan within 10% of the fastest timed one for every shape; --refit
finds such constants from the run's calibrated ones (no GPU: the recorded timings are judged)."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SWEEP = ROOT / "benchmarks" / "results" / "planner_sweep.json"


def _replay(*extra):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "planner_sweep.py"), "--replay", str(SWEEP),
                           *extra], capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


def test_default_constants_pick_within_ten_percent_on_the_recorded_sweep():
    rc, text = _replay()
    shapes = len(json.loads(SWEEP.read_text())["rows"])
    assert rc == 0, text[-3000:]
    assert f"default constants: {shapes}/{shapes}" in text, text[-3000:]


def test_refit_finds_constants_that_pick_within_ten_percent():
    rc, text = _replay("--refit", "40")
    assert rc == 0, text[-3000:]
    assert "refitted constants" in text
