"""benchmarks/ab_kernels.sh's runs of the standalone check: AB_MODE's ";"-separated argument lists, each one
run of a tree's portable_check appended to that tree's log (the default: one `--headline` run). The
script's run_headline function is taken from the script itself and run against a stand-in check that
prints how many arguments it got and what they are (the rest of the script builds CUDA trees and needs a GPU);
and its table (benchmarks/ab_kernels_table.py) of the rows those runs print."""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "ab_kernels.sh"
sys.path.insert(0, str(ROOT / "benchmarks"))
import ab_kernels_table  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run_headline(tmp_path, ab_mode):
    """The lines the stand-in check printed, in the log run_headline wrote for a stand-in tree."""
    function = re.search(r"^run_headline\(\) \{.*?^\}", SCRIPT.read_text(), re.M | re.S)
    assert function, "ab_kernels.sh defines run_headline"
    name = f"pytest_{os.getpid()}_{tmp_path.name}"  # the script's builds are /tmp/jsmla_ab_build_<tree name>
    build = pathlib.Path(f"/tmp/jsmla_ab_build_{name}")
    build.mkdir(parents=True, exist_ok=True)
    check = build / "portable_check"
    check.write_text('#!/usr/bin/env bash\necho "$# args: $*"\n')
    check.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "AB_MODE"}
    if ab_mode is not None:
        env["AB_MODE"] = ab_mode
    try:
        subprocess.run(["bash", "-c", f'out="{tmp_path}"; status=0\n{function.group(0)}\n'
                        f'run_headline {name} run.log; run_headline {name} run.log; exit $status'],
                       env=env, check=True)
        return (tmp_path / "run.log").read_text().splitlines()
    finally:
        shutil.rmtree(build, ignore_errors=True)


def test_default_is_one_headline_run(tmp_path):
    # Each call starts the log afresh: the second call's lines replace the first's.
    assert _run_headline(tmp_path, None) == ["1 args: --headline"]


def test_modes_run_in_order_with_their_arguments(tmp_path):
    lines = _run_headline(tmp_path, "--profile-small h64 128 16 4 25; --profile-small h64 128 32 2 25;--ablate")
    assert lines == ["6 args: --profile-small h64 128 16 4 25", "6 args: --profile-small h64 128 32 2 25",
                     "1 args: --ablate"]


# benchmarks/ab_kernels_table.py: the rows of both kinds of timed line the check prints, side by side.

HEADLINE = "{:<30s} {:<30s} {:<5s} {:10.1f} us {:7.1f} TFLOP/s\n"  # print_timed_rows' format
PROFILE_SMALL = ("{:<34s} {:<30s} {} max_abs=8.07e-04 (ref 0.28) relL2=2.27e-03 lse=8.39e-07 det=1 bad=0  "
                 "{:f} us\n")  # --profile-small's line (errors between the verdict and the time)


def _write_logs(tmp_path, times):
    for name, (decode_us, small_us, verdict) in times.items():
        (tmp_path / f"headline_{name}.log").write_text(
            "building...\n"
            + HEADLINE.format("dsv3_2 T=128 H=128 k=2048", "H decode hpb=64 splits=1x2048", verdict, decode_us, 360.0)
            + PROFILE_SMALL.format("dsv3_2 T=16 H=128 k=2048", "H decode hpb=64 splits=4x512", verdict, small_us))


def test_table_has_both_kinds_of_row_with_ratios(tmp_path):
    _write_logs(tmp_path, {"head": (200.0, 36.0, "PASS"), "knob": (220.0, 36.0, "FAIL"),
                           "head_again": (202.0, 37.8, "PASS")})
    lines = ab_kernels_table.table(str(tmp_path), ["head", "knob"], baseline_is_head=True).splitlines()
    assert lines[0] == "| case | plan | head | knob | head again |"
    assert lines[2] == "| dsv3_2 T=128 H=128 k=2048 | H decode hpb=64 splits=1x2048 | 200.0 (1.00) | 220.0 (1.10) FAIL | 202.0 (1.01) |"
    assert lines[3] == "| dsv3_2 T=16 H=128 k=2048 | H decode hpb=64 splits=4x512 | 36.0 (1.00) | 36.0 (1.00) FAIL | 37.8 (1.05) |"
    assert len(lines) == 4


def test_table_baseline_is_the_first_tree_given(tmp_path):
    _write_logs(tmp_path, {"head": (200.0, 40.0, "PASS"), "base": (100.0, 20.0, "PASS")})
    lines = ab_kernels_table.table(str(tmp_path), ["head", "base"], baseline_is_head=False).splitlines()
    assert lines[0] == "| case | plan | head | base |"  # no second run of head: no column
    assert lines[2].endswith("| 200.0 (2.00) | 100.0 (1.00) |")
    assert lines[3].endswith("| 40.0 (2.00) | 20.0 (1.00) |")
