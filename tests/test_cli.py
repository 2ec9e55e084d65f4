"""The command line (``python -m jax_sparse_mla``): plain-text help per command, one-line usage errors
with status 2 and no traceback, and a demo that names the kernel that ran and the shape kind."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import jax
import pytest

from jax_sparse_mla import __main__ as cli
from jax_sparse_mla import planner

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Signs of reST/Sphinx markup, which a terminal shows verbatim.
MARKUP = ("``", ":mod:", ":func:", ":class:", ".. ")


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "jax_sparse_mla", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_help_is_plain_text_and_exits_0():
    result = _cli("--help")
    assert result.returncode == 0, result.stderr
    assert "demo" in result.stdout and "calibrate" in result.stdout
    assert not [m for m in MARKUP if m in result.stdout], result.stdout


@pytest.mark.parametrize("command,own,other", [
    ("demo", ("--kv_format", "--num_heads", "--topk", "--pool_tokens", "--repeats"), ("--formats", "--heads", "--force")),
    ("calibrate", ("--formats", "--heads", "--topks", "--force"), ("--kv_format", "--num_heads", "--pool_tokens")),
])
def test_command_help_shows_only_its_flags(command, own, other):
    result = _cli(command, "--help")
    assert result.returncode == 0, result.stderr
    for flag in own:
        assert flag in result.stdout, f"{command} --help does not list {flag}"
    for flag in other:
        assert flag not in result.stdout, f"{command} --help lists another command's flag {flag}"
    assert not [m for m in MARKUP if m in result.stdout], result.stdout


@pytest.mark.parametrize("args,expected", [
    (("bogus",), "unknown command 'bogus' (commands: demo, calibrate)"),
    ((), "expected a command (demo, calibrate"),
    (("demo", "--kv_format", "nope"), "argument --kv_format: expected one of"),
    (("demo", "--num_heads", "0"), "argument --num_heads: expected an int >= 1, got 0"),
    (("demo", "--num_heads", "129"), "num_heads=129 (allowed 1..128)"),
    (("demo", "--topk", "many"), "argument --topk: expected an int >= 1, got 'many'"),
    (("demo", "--formats", "dsv4"), "unrecognized arguments: --formats"),
    (("calibrate", "--formats", "dsv3_2,nope"), "argument --formats: expected one of"),
    (("calibrate", "--heads", "16,x"), "argument --heads: expected an int >= 1, got 'x'"),
], ids=["unknown_command", "no_command", "bad_format", "zero_heads", "too_many_heads", "bad_topk",
        "other_commands_flag", "bad_format_list", "bad_head_list"])
def test_usage_errors_are_one_line(args, expected):
    result = _cli(*args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert expected in lines[0]


def test_demo_names_the_kernel_and_the_shape_kind():
    result = _cli("demo", "--pool_tokens", "256", "--topk", "32", "--num_heads", "4", "--repeats", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [re.split(r"\s{2,}", line) for line in result.stdout.splitlines()[1:]]
    assert rows[0][:3] == ["backend", "kernel", "shape"]
    backend = jax.default_backend()
    platform = "cuda" if backend == "gpu" else "cpu"
    assert len(rows) == 1 + len(cli.DEMO_SHAPES)
    for row, (kind, tokens) in zip(rows[1:], cli.DEMO_SHAPES):
        plan = planner.plan((tokens, 4, 576), "dsv3_2", 32, platform=platform)
        assert row[:3] == [backend, cli.kernel_name(plan), f"{kind} T={tokens} H=4 topk=32"], row
        assert row[-1] == "ok"
    assert [kind for kind, _ in cli.DEMO_SHAPES] == ["decode", "prefill"]
    if backend == "cpu":
        assert rows[1][1] == "C++ CPU kernel"


def test_kernel_names_cover_every_family():
    cpu = planner.plan((4, 16, 576), "dsv3_2", 64, platform="cpu")
    assert cli.kernel_name(cpu) == "C++ CPU kernel"
    hopper = planner.plan((4, 64, 576), "dsv3_2", 2048, platform="cuda", device=planner.DEFAULT_CUDA_DEVICE)
    assert hopper.family == "hopper" and cli.kernel_name(hopper).startswith("CUDA Hopper, decode (")
    ampere = planner.DeviceInfo(name="A100", platform="cuda", arch=80, sm_count=108, smem_per_block=163 * 1024,
                                smem_per_sm=164 * 1024)
    portable = planner.plan((4096, 16, 576), "dsv3_2", 2048, platform="cuda", device=ampere)
    assert portable.family == "portable" and cli.kernel_name(portable) == "CUDA portable, prefill"
    families = {plan.family for plan in (cpu, hopper, portable)}
    assert families == set(cli.KERNEL_NAMES)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the message without a GPU")
def test_calibrate_without_a_gpu_says_so():
    result = _cli("calibrate")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "default backend is 'cpu'" in lines[0] and "JSMLA_CUDA" not in lines[0], lines
