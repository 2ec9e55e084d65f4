"""benchmarks/ab_bench.sh and ab_bench_table.py, the A/B of source trees in the JAX harness: every
case's step time per run side by side, each run's ratio to the first, and a failed check marked."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import ab_bench_table  # noqa: E402


def _row(us, T=1, H=128, impl="auto", variant="decode", check="ok", **extra):
    return dict(format="dsv3_2", T=T, H=H, impl=impl, variant=variant, us=us, check=check, **extra)


def _write(out, name, rows):
    (out / name).mkdir()
    (out / name / "bench.json").write_text(json.dumps({"device": "test", "rows": rows}))


def test_table_sets_runs_side_by_side(tmp_path):
    _write(tmp_path, "0_main", [_row(20.0), _row(7.5, T=16, impl="valid_tokens=0")])
    _write(tmp_path, "1_pdl", [_row(18.0), _row(6.0, T=16, impl="valid_tokens=0")])
    _write(tmp_path, "2_main", [_row(21.0), _row(7.5, T=16, impl="valid_tokens=0", check="FAIL")])
    runs = [(p.name, ab_bench_table.load(p / "bench.json")) for p in sorted(tmp_path.iterdir())]
    lines = ab_bench_table.table(runs).splitlines()
    assert lines[0] == "| case | 0_main µs | 1_pdl µs | 2_main µs | 1_pdl / 0_main | 2_main / 0_main |"
    assert lines[2] == "| dsv3_2 T=1 H=128 decode | 20.0 | 18.0 | 21.0 | 0.900 | 1.050 |"
    assert lines[3] == "| dsv3_2 T=16 H=128 decode valid_tokens=0 | 7.5 | 6.0 | 7.5 (FAIL) | 0.800 | 1.000 |"
    assert ab_bench_table.main(str(tmp_path)) == 1  # a failed check fails the run


def test_cases_missing_from_a_run_and_staging_rows(tmp_path):
    _write(tmp_path, "0_a", [_row(5000.0, T=4096, variant="prefill", impl="prefill", staged="bf16_576")])
    _write(tmp_path, "1_b", [_row(5100.0, T=4096, variant="prefill", impl="prefill", staged="bf16_576"),
                             _row(6000.0, T=4096, variant="prefill", impl="prefill", staging="off")])
    runs = [(p.name, ab_bench_table.load(p / "bench.json")) for p in sorted(tmp_path.iterdir())]
    lines = ab_bench_table.table(runs).splitlines()
    assert lines[2] == "| dsv3_2 T=4096 H=128 prefill | 5000.0 | 5100.0 | 1.020 |"
    assert lines[3] == "| dsv3_2 T=4096 H=128 prefill staging off | — | 6000.0 | — |"
    assert ab_bench_table.main(str(tmp_path)) == 0


def test_no_results(tmp_path, capsys):
    assert ab_bench_table.main(str(tmp_path)) == 1
    assert "no bench.json" in capsys.readouterr().out


def test_script_needs_a_tree():
    result = subprocess.run(["bash", str(ROOT / "benchmarks" / "ab_bench.sh")], capture_output=True, text=True)
    assert result.returncode == 2 and "usage" in result.stdout


def test_script_packs_each_run(tmp_path):
    """The whole script over a stub gpu_session.sh: the table of the runs (the first tree again last) in
    ab_bench.md, each run's folder packed into runs.tgz (a device call returns few files)."""
    import shutil
    import tarfile

    repo = tmp_path / "repo"
    (repo / "benchmarks").mkdir(parents=True)
    for name in ("ab_bench.sh", "ab_bench_table.py"):
        shutil.copy(ROOT / "benchmarks" / name, repo / "benchmarks" / name)
    (repo / "benchmarks" / "gpu_session.sh").write_text(
        "mkdir -p \"$OUT\"\n"
        "us=$([ \"$(basename \"$JSMLA_SESSION_TREE\")\" = variant ] && echo 9.0 || echo 10.0)\n"
        "printf '{\"device\": \"stub\", \"rows\": [{\"format\": \"dsv3_2\", \"T\": 1, \"H\": 128, \"impl\": \"auto\", "
        "\"variant\": \"decode\", \"us\": %s, \"check\": \"ok\"}]}' \"$us\" > \"$OUT/bench.json\"\n"
        "echo \"session bench-cases: status 0\"\n")
    (tmp_path / "variant").mkdir()
    out = tmp_path / "out"
    result = subprocess.run(["bash", str(repo / "benchmarks" / "ab_bench.sh"), str(repo), str(tmp_path / "variant")],
                            capture_output=True, text=True, env={**os.environ, "OUT": str(out)})
    assert result.returncode == 0, result.stdout + result.stderr
    table = (out / "ab_bench.md").read_text().splitlines()
    assert table[2] == "| dsv3_2 T=1 H=128 decode | 10.0 | 9.0 | 10.0 | 0.900 | 1.000 |"
    with tarfile.open(out / "runs.tgz") as packed:
        names = set(packed.getnames())
    assert {"0_main/bench.json", "1_variant/bench.json", "2_main/bench.json"} <= names
    assert not (out / "0_main").exists()
