"""benchmarks/bench_sharded.py on 8 forced host CPU devices: the sharded step equals the unsharded
calls and its compiled programs contain no collective (the CPU run of the multi-GPU benchmark)."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_sharded_benchmark_has_no_collective_and_matches_unsharded(tmp_path):
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_sharded.py"), "--platform", "cpu", "--tokens_per_rank", "2",
         "--heads", "16", "--topk", "64", "--pool_bytes", "500000", "--steps", "2", "--repeats", "1",
         "--out_dir", str(tmp_path)], env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "bench_sharded_cpu.json").read_text())["rows"]
    assert [r["devices"] for r in rows] == [1, 2, 4, 8]
    assert [tuple(r["mesh"]) for r in rows] == [(1, 1), (1, 2), (2, 2), (4, 2)]
    for r in rows:
        assert r["collectives"] == [] and r["max_diff_vs_unsharded"] == 0.0
        assert r["full_us"] > 0 and r["last_rank_empty_us"] > 0


def test_collective_detection():
    from jax_sparse_mla.sharding import collectives_in

    assert collectives_in("%x = f32[4] all-reduce(f32[4] %y), replica_groups={}") == ["all-reduce"]
    assert collectives_in("%s = (f32[8]) all-gather-start(%p)\n%d = all-gather-done(%s)") == ["all-gather"]
    assert collectives_in("%c = f32[4] custom-call(%a), custom_call_target=\"jax_sparse_mla_fwd_v2\"") == []
