"""benchmarks/bench_backward.py on a tiny shape: both implementations run forward and forward+backward, and
their gradients agree within the accuracy contract (docs/semantics.md)."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_backward_benchmark_runs_and_gradients_agree(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_backward.py"), "--tokens", "4", "--heads", "3",
         "--topk", "16", "--cache_tokens", "256", "--repeats", "1", "--cache_gradient", "both",
         "--check_tokens", "3", "--out_dir", str(tmp_path)],
        env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "bench_backward.json").read_text())["rows"]
    assert [r["format"] for r in rows] == ["bf16_576", "bf16_576", "dsv3_2"]
    assert [r["gradients"] for r in rows] == [["q", "attn_sink"], ["q", "attn_sink", "kv_cache"], ["q", "attn_sink"]]
    for r in rows:
        for impl in ("auto", "xla"):
            assert r[f"{impl}_forward_ms"] > 0 and r[f"{impl}_forward_backward_ms"] > 0
            # TFLOP/s from the products' FLOPs: forward (d_qk + d_v), backward (2 d_qk + d_v), cache (d_qk + d_v)
            flops = 2 * 4 * 3 * 16 * (576 + 512 + 2 * 576 + 512 + (576 + 512 if "kv_cache" in r["gradients"] else 0))
            assert abs(r[f"{impl}_forward_backward_tflops"] - flops / r[f"{impl}_forward_backward_ms"] * 1e-9) < 1e-9
        # Zero is a legitimate difference here: on a shape this small the two implementations' rounded
        # gradients can agree bit for bit (they did for q on one CI machine).
        assert all(0 <= d <= 2e-2 for d in r["max_gradient_difference"].values()), r["max_gradient_difference"]
        assert r["check_tokens"] == 3 and r["speedup"] > 0
    assert "| bf16_576 | 4 | 3 | 16 |" in (tmp_path / "bench_backward.md").read_text()


def test_backward_benchmark_reports_an_xla_baseline_out_of_memory():
    # In a child process: importing the benchmark defines its absl flags, which the other benchmarks'
    # tests define too.
    row = {"format": "bf16_576", "tokens": 4096, "heads": 128, "topk": 2048, "gradients": ["q"],
           "auto_forward_ms": 1.0, "xla_forward_ms": None, "auto_forward_backward_ms": 2.0,
           "xla_forward_backward_ms": None, "speedup": None, "auto_forward_backward_tflops": 3.0,
           "xla_forward_backward_tflops": None, "max_gradient_difference": {"q": 1e-3}, "check_tokens": 256}
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import bench_backward; "
            f"print(bench_backward.markdown([json.loads({json.dumps(row)!r})]).splitlines()[-1])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == ("| bf16_576 | 4096 | 128 | 2048 | q | 1.00 | OOM | 2.00 | OOM | OOM | 3.0 | OOM "
                                   "| q 1.0e-03 (256) |")


def test_backward_benchmark_side_by_side_of_two_runs(tmp_path):
    """--notime_xla (XLA only on the check sub-problem: "not timed" columns), then --side_by_side of two
    runs' JSON: each run's forward+backward time and its ratio to the first run's."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for name in ("base", "variant"):
        proc = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "bench_backward.py"), "--tokens", "4", "--heads", "3",
             "--topk", "16", "--cache_tokens", "256", "--repeats", "1", "--formats", "dsv3_2", "--notime_xla",
             "--check_tokens", "2", "--out_dir", str(tmp_path / name)],
            env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "base" / "bench_backward.json").read_text())["rows"]
    assert rows[0]["xla_forward_backward_ms"] == "not timed" and rows[0]["speedup"] == "not timed"
    assert 0 < rows[0]["max_gradient_difference"]["q"] <= 2e-2
    runs = ",".join(f"{n}={tmp_path / n / 'bench_backward.json'}" for n in ("base", "variant"))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_backward.py"), "--side_by_side", runs],
                          env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("| dsv3_2 ")][0]
    cells = [c.strip() for c in line.strip("|").split("|")]
    variant = json.loads((tmp_path / "variant" / "bench_backward.json").read_text())["rows"][0]
    assert cells[5].endswith("(1.00)")
    ratio = variant["auto_forward_backward_ms"] / rows[0]["auto_forward_backward_ms"]
    assert cells[6] == f"{variant['auto_forward_backward_ms']:.2f} ({ratio:.2f})"


def test_backward_benchmark_xla_max_tokens_and_rows_kept_when_a_run_stops(tmp_path):
    """--xla_max_tokens: XLA is timed only on rows of at most that many tokens (the others read "not timed",
    their gradients still compared on the check sub-problem); the results files are rewritten after every
    row, so a run that stops on a later row (here an unknown format) keeps the rows it finished."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_backward.py"), "--tokens", "2,4", "--heads", "3",
         "--topk", "16", "--cache_tokens", "256", "--repeats", "1", "--formats", "dsv3_2,no_such_format",
         "--xla_max_tokens", "2", "--check_tokens", "2", "--out_dir", str(tmp_path)],
        env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode != 0 and "no_such_format" in proc.stderr, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "bench_backward.json").read_text())["rows"]
    assert [(r["format"], r["tokens"]) for r in rows] == [("dsv3_2", 2), ("dsv3_2", 4)]
    assert rows[0]["xla_forward_backward_ms"] > 0 and rows[0]["speedup"] > 0
    assert rows[1]["xla_forward_ms"] == rows[1]["xla_forward_backward_ms"] == "not timed"
    assert rows[1]["auto_forward_backward_ms"] > 0
    assert all(0 <= r["max_gradient_difference"]["q"] <= 2e-2 for r in rows)
    assert "| dsv3_2 | 4 | 3 | 16 |" in (tmp_path / "bench_backward.md").read_text()
