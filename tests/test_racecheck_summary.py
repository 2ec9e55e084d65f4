"""kernels/cuda/tests/racecheck_summary.py: racecheck's reports grouped by kernel, hazard and site pair,
read from a log file or streamed on standard input (every report of a run, none of them stored)."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "kernels" / "cuda" / "tests" / "racecheck_summary.py"


def report(hazard, write_line, read_line, backtrace=True):
    lines = [
        f"========= Error: Potential {hazard} hazard detected at __shared__ 0x38660 in block (16,0,0) :",
        "=========     Write Thread (160,0,0) at auto void jsmla::cuda::hopper::sparse_mla_hopper_kernel<jsmla::cuda::"
        "hopper::HopperConfig<(jsmla::FormatId)6, (int)64>>(jsmla::cuda::SplitKvParams)::[lambda(T1) (instance 1)]"
        f"::operator ()<...>(T1) const in /src/k/sparse_mla_kernel.cuh:{write_line}",
        f"=========     Read Thread (288,0,0) at void sparse_mla_hopper_kernel(...) in /src/k/sparse_mla_kernel.cuh:{read_line}",
        "=========     Current Value : 0",
    ]
    if backtrace:
        lines += ["=========     Saved host backtrace up to driver entry point at kernel launch time",
                  "=========         Host Frame:  [0xe0e23] in _cuda_ext.so"]
    return lines + ["========= "]


def log_text(backtrace):
    lines = ["........"]
    for _ in range(3):
        lines += report("RAW", 441, 490, backtrace)
    lines += report("WAR", 524, 533, backtrace)
    lines += ["46 passed, 1 skipped, 2166 deselected in 100.29s",
              "========= RACECHECK SUMMARY: 4 hazards displayed (4 errors, 0 warnings)"]
    return "\n".join(lines) + "\n"


def run(args, stdin=None):
    return subprocess.run([sys.executable, str(SCRIPT), *args], input=stdin, capture_output=True, text=True,
                          check=True).stdout.splitlines()


def test_groups_a_log_file(tmp_path):
    path = tmp_path / "racecheck.log"
    path.write_text(log_text(backtrace=True))
    out = run([str(path), "0"])
    assert out[0].split() == ["3", "RAW", "sparse_mla_hopper_kernel<6,64>", "sparse_mla_kernel.cuh:441", "/",
                              "sparse_mla_kernel.cuh:490"]
    assert out[1].split()[:2] == ["1", "WAR"]
    assert "reports read: 4 in 2 groups; 'hazard detected' seen 4 times" in out
    assert out[-2].startswith("46 passed") and out[-1].startswith("RACECHECK SUMMARY: 4 hazards")


def test_counts_reports_streamed_without_backtraces():
    out = run(["-", "1"], stdin=log_text(backtrace=False))
    assert out[0].split()[:2] == ["3", "RAW"]
    assert out[1].strip().startswith("Error: Potential RAW hazard")  # the first group's example report
    assert "reports read: 4 in 2 groups; 'hazard detected' seen 4 times" in out


def test_no_reports():
    out = run(["-"], stdin="12 passed in 3.0s\n========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n")
    assert out[0] == "racecheck summary: no hazard reports"
    assert "reports read: 0 in 0 groups; 'hazard detected' seen 0 times" in out
