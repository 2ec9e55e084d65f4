"""benchmarks/ab_kernels.sh's runs of the standalone check: AB_MODE's ";"-separated argument lists, each one
run of a tree's portable_check appended to that tree's log (the default: one `--headline` run). The
script's run_headline function is taken from the script itself and run against a stand-in check that
prints how many arguments it got and what they are (the rest of the script builds CUDA trees and needs a GPU)."""

import os
import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "ab_kernels.sh"

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
