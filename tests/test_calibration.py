"""The calibration file (docs/planning.md, calibration), the fit of calibrate() and the planner's use of both;
no GPU needed."""

from __future__ import annotations

import dataclasses
import functools
import json
import multiprocessing
import os

import jax
import jax.numpy as jnp
import pytest

import jax_sparse_mla as jsm
from jax_sparse_mla import calibration, calibration_store, planner

DEVICE = planner.DeviceInfo(name="Test GPU 9000", platform="cuda", arch=90, sm_count=132,
                            smem_per_block=227 << 10)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(calibration_store.ENV_CACHE_DIR, str(tmp_path))
    planner.clear_cache()
    yield tmp_path
    planner.clear_cache()


def _write(path, payload):
    path.write_text(payload if isinstance(payload, str) else json.dumps(payload))
    # Make the change token differ even within one mtime tick.
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 1_000_000))


def test_directory_override_by_environment(cache_dir):
    assert calibration_store.calibration_path() == cache_dir / "calibration.json"


def test_missing_file_means_no_constants(cache_dir):
    assert calibration_store.device_constants("anything") is None
    assert calibration_store.load() == {}


def test_store_then_read_back(cache_dir):
    calibration_store.store("A", {"block_us": 1.5})
    calibration_store.store("B", {"block_us": 2.5})
    assert calibration_store.device_constants("A") == {"block_us": 1.5}
    assert calibration_store.device_constants("B") == {"block_us": 2.5}
    data = json.loads(calibration_store.calibration_path().read_text())
    assert data["schema"] == calibration_store.SCHEMA_VERSION
    assert set(data["devices"]) == {"A", "B"}
    leftovers = [p for p in cache_dir.iterdir() if p.name.startswith(".calibration.")]
    assert leftovers == [], "atomic write left a temporary file"


@pytest.mark.parametrize("payload", ["{not json", json.dumps([1, 2]), json.dumps({"schema": 0, "devices": {}}),
                                     json.dumps({"schema": calibration_store.SCHEMA_VERSION + 1,
                                                 "devices": {"A": {"constants": {"block_us": 9}}}})])
def test_corrupt_or_other_schema_is_ignored(cache_dir, payload):
    _write(calibration_store.calibration_path(), payload)
    assert calibration_store.device_constants("A") is None


def test_stale_file_is_not_reparsed_until_it_changes(cache_dir, monkeypatch):
    path = calibration_store.calibration_path()
    _write(path, {"schema": 0, "devices": {"A": {"constants": {"block_us": 9}}}})
    parses = []
    real_parse = calibration_store._parse
    monkeypatch.setattr(calibration_store, "_parse", lambda text: parses.append(1) or real_parse(text))
    for _ in range(5):
        assert calibration_store.device_constants("A") is None
    assert len(parses) == 1, "a stale file must be remembered by its change token"
    _write(path, {"schema": calibration_store.SCHEMA_VERSION, "devices": {"A": {"constants": {"block_us": 3}}}})
    assert calibration_store.device_constants("A") == {"block_us": 3}
    assert len(parses) == 2


def test_changed_file_is_reread(cache_dir):
    calibration_store.store("A", {"block_us": 1.0})
    assert calibration_store.device_constants("A") == {"block_us": 1.0}
    calibration_store.store("A", {"block_us": 7.0})
    assert calibration_store.device_constants("A") == {"block_us": 7.0}


def test_store_replaces_an_old_schema_file(cache_dir):
    _write(calibration_store.calibration_path(), {"schema": 0, "devices": {"old": {}}})
    calibration_store.store("A", {"block_us": 1.0})
    data = json.loads(calibration_store.calibration_path().read_text())
    assert data["schema"] == calibration_store.SCHEMA_VERSION and set(data["devices"]) == {"A"}


def _writer(args):
    directory, name, count = args
    os.environ[calibration_store.ENV_CACHE_DIR] = directory
    for i in range(count):
        calibration_store.store(f"{name}-{i % 3}", {"block_us": float(i)})
    return name


def test_two_processes_writing_at_once(cache_dir):
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        assert sorted(pool.map(_writer, [(str(cache_dir), "p", 40), (str(cache_dir), "q", 40)])) == ["p", "q"]
    data = json.loads(calibration_store.calibration_path().read_text())
    assert data["schema"] == calibration_store.SCHEMA_VERSION
    assert set(data["devices"]) == {f"{n}-{i}" for n in "pq" for i in range(3)}, "an update was lost"


def test_calibrate_refuses_inside_a_trace(cache_dir):
    def traced(x):
        calibration.calibrate()
        return x

    with pytest.raises(RuntimeError, match="inside a jax.jit trace"):
        jax.jit(traced)(jnp.zeros(()))


@pytest.mark.skipif(jsm.cuda_available(), reason="checks the error without the CUDA extension")
def test_calibrate_needs_the_cuda_extension(cache_dir):
    with pytest.raises(RuntimeError, match="CUDA extension"):
        calibration.calibrate()


def test_planner_uses_calibrated_constants(cache_dir):
    shape, topk = (16, 128, 576), 2048
    default = jsm.plan(shape, "dsv3_2", topk, platform="cuda", device=DEVICE)
    assert "default constants" in default.describe()
    # A device with free conversion and no fixed costs: every extra block is free, so the small head
    # tile in one pass wins, unlike the default constants' choice.
    constants = {"combine_gbps": 1e6, "warp_combine_gbps": 1e6, "block_us": 0.0, "launch_us": 0.0, "dequant_ns": 0.0,
                 "portable_block_us": 0.0, "portable_dequant_ns": 0.0}
    calibration_store.store(DEVICE.name, constants)
    calibrated = jsm.plan(shape, "dsv3_2", topk, platform="cuda", device=DEVICE)
    assert "calibrated constants" in calibrated.describe()
    choice = lambda p: (p.variant, p.heads_per_block, p.num_splits)  # noqa: E731
    assert choice(calibrated) != choice(default)
    model = planner.CostModel.from_dict(constants)
    blocks = 16 * (128 // calibrated.heads_per_block) * calibrated.num_splits
    expected = model.kernel_us(blocks, calibrated.split_size, calibrated.heads_per_block, DEVICE.sm_count,
                               family=calibrated.family)
    if calibrated.variant == "decode":
        expected += model.combine_us(calibrated.num_splits, 16, 128, 512, DEVICE.sm_count)
    assert calibrated.predicted_us == pytest.approx(expected)
    # A changed file is picked up by the next trace without clearing anything.
    calibration_store.store(DEVICE.name, {"combine_gbps": 1.0, "warp_combine_gbps": 1.0})
    slow_combine = jsm.plan(shape, "dsv3_2", topk, platform="cuda", device=DEVICE)
    assert slow_combine.variant == "prefill"


def test_plan_is_memoised_and_immutable(cache_dir):
    a = jsm.plan((8, 64, 576), "dsv3_2", 2048, platform="cuda", device=DEVICE)
    b = jsm.plan((8, 64, 576), "dsv3_2", 2048, platform="cuda", device=DEVICE)
    assert a is b
    with pytest.raises(Exception):
        a.num_splits = 3


@pytest.mark.parametrize("key", ["dsv3_2", "dsv4", "dots3_swa"])
def test_default_model_routes_few_tokens_to_split_decode_and_many_to_prefill(cache_dir, key):
    fmt = jsm.get_format(key)
    few = jsm.plan((1, 128, fmt.d_qk), key, 2048, platform="cuda", device=DEVICE)
    many = jsm.plan((4096, 128, fmt.d_qk), key, 2048, platform="cuda", device=DEVICE)
    assert few.variant == "decode" and few.num_splits > 1 and few.workspace_bytes > 0
    assert many.variant == "prefill" and many.workspace_bytes == 0
    assert few.predicted_us < many.predicted_us


def test_forced_variants_and_batch_invariance(cache_dir):
    shape = (1024, 128, 576)
    assert jsm.plan(shape, "dsv3_2", 2048, platform="cuda", device=DEVICE, impl="decode").variant == "decode"
    assert jsm.plan((1, 16, 576), "dsv3_2", 2048, platform="cuda", device=DEVICE, impl="prefill").variant == "prefill"
    sizes = {jsm.plan((t, 16, 576), "dsv3_2", 2048, platform="cuda", device=DEVICE, batch_invariant=True).split_size
             for t in (1, 7, 64, 4096)}
    tiles = {jsm.plan((t, 16, 576), "dsv3_2", 2048, platform="cuda", device=DEVICE,
                      batch_invariant=True).heads_per_block for t in (1, 7, 64, 4096)}
    assert len(sizes) == 1 and len(tiles) == 1
    with pytest.raises(ValueError, match="batch_invariant"):
        jsm.plan(shape, "dsv3_2", 2048, platform="cuda", device=DEVICE, impl="prefill", batch_invariant=True)


def test_cuda_plans_respect_the_kernel_contract(cache_dir):
    from jax_sparse_mla import kernel_tables

    for key, fmt in jsm.FORMATS.items():
        if not kernel_tables.has_cuda_kernels(key):
            continue
        for t in (1, 3, 64, 1000):
            for h in (1, 16, 20, 64, 128):
                for topk in (1, 63, 2048):
                    p = jsm.plan((t, h, fmt.d_qk), key, topk, platform="cuda", device=DEVICE)
                    # A portable tile, or a Hopper-only one (dots3_swa's 64) on this sm_90 device.
                    assert p.heads_per_block in planner.head_tiles(key, DEVICE)
                    if p.heads_per_block not in kernel_tables.HEAD_TILES[key]:
                        assert p.family == "hopper" and DEVICE.arch == kernel_tables.HOPPER_COMPUTE_CAPABILITY
                    if p.variant == "decode":
                        # The splits cover the positions the kernels read (dots3_swa: its window), and
                        # none is empty.
                        positions = kernel_tables.decode_positions(key, topk)
                        assert positions == (min(topk, fmt.max_candidates) if fmt.max_candidates else topk)
                        assert p.split_size % kernel_tables.SPLIT_GRANULE == 0
                        assert p.num_splits * p.split_size >= positions
                        assert (p.num_splits - 1) * p.split_size < positions
                        assert p.workspace_bytes == kernel_tables.workspace_bytes(p.num_splits, t, h, fmt.d_v)


def test_fit_recovers_a_known_cost_model():
    """calibrate()'s least-squares fit, on times a known model predicts for the calibration shapes,
    predicts every timed choice within 3% and plans like the known model on other shapes."""
    from jax_sparse_mla import calibration

    fmt = jsm.get_format("dsv3_2")
    truth = planner.CostModel(launch_us=9.0, block_us=1.5, dequant_ns=70.0, mma_ns_per_head=0.7,
                              co_residency_gain=1.6, combine_gbps=2000.0, tail=0.5)
    samples = []
    for heads in (16, 64, 128):
        for tokens in calibration.CALIBRATION_TOKENS:
            for variant, tile, splits in calibration.calibration_choices(tokens, heads, fmt.key):
                us = planner.option_us(truth, fmt, tokens, heads, 2048, variant, tile, splits, DEVICE)
                samples.append((fmt.key, tokens, heads, 2048, variant, tile, splits, us))
    fitted = calibration.fit_cost_model(samples, DEVICE)
    assert fitted != planner.CostModel()
    for key, tokens, heads, candidates, variant, tile, splits, us in samples:
        predicted = planner.option_us(fitted, fmt, tokens, heads, candidates, variant, tile, splits, DEVICE)
        assert predicted == pytest.approx(us, rel=0.03)
    for tokens, heads in ((1, 16), (16, 128), (64, 16), (128, 128), (1024, 64)):
        a = jsm.plan((tokens, heads, 576), fmt, 2048, platform="cuda", device=DEVICE, cost_model=truth)
        b = jsm.plan((tokens, heads, 576), fmt, 2048, platform="cuda", device=DEVICE, cost_model=fitted)
        assert b.predicted_us == pytest.approx(a.predicted_us, rel=0.05)


def test_row_and_block_costs_are_the_kernel_familys():
    """A block's fixed and row cost come from its family and (Hopper) the format's row conversion; the
    combine's bandwidth from the shape the launch picks."""
    m = planner.CostModel(block_us=1.0, dequant_ns=10.0, exact_scales_row_ns=20.0, direct_row_ns=30.0,
                          portable_block_us=2.0, portable_dequant_ns=40.0, mma_ns_per_head=0.0)
    assert m.block_time_us(100, 64, "hopper", "converted") == pytest.approx(1.0 + 1.0)
    assert m.block_time_us(100, 64, "hopper", "exact_scales") == pytest.approx(1.0 + 2.0)
    assert m.block_time_us(100, 64, "hopper", "direct") == pytest.approx(1.0 + 3.0)
    for conversion in ("converted", "exact_scales", "direct"):
        assert m.block_time_us(100, 16, "portable", conversion) == pytest.approx(2.0 + 4.0)
    with pytest.raises(ValueError, match="family"):
        m.block_time_us(100, 16, "cpu_reference")
    with pytest.raises(ValueError, match="row conversion"):
        m.block_time_us(100, 16, "hopper", "fp16")
    # The planner's option costs follow the formats' conversions (10, 20, 30 ns a row here).
    us = {key: planner.option_us(m, jsm.get_format(key), 128, 128, 2048, "prefill", 64, 1, DEVICE)
          for key in ("dsv3_2", "glm_nsa", "bf16_576")}
    assert us["dsv3_2"] < us["glm_nsa"] < us["bf16_576"]
    # T = 4 H = 128: 8 splits merge in the warp shape, 11 in the wide one.
    fast_warp = dataclasses.replace(m, combine_gbps=100.0, warp_combine_gbps=1e9)
    assert fast_warp.combine_us(8, 4, 128, 512, 132) == pytest.approx(fast_warp.launch_us, rel=1e-3)
    moved = 11 * 4 * 128 * (512 * planner.COMBINE_FIT_PARTIAL_BYTES + 4) + 4 * 128 * (2 * 512 + 4)  # partials in, out
    assert fast_warp.combine_us(11, 4, 128, 512, 132) == pytest.approx(fast_warp.launch_us + moved / 100e3)


def test_fit_keeps_the_defaults_of_conversions_no_sample_times():
    """dsv3_2 alone times Hopper plans of converted rows and portable ones (its 64-split plans): the fit
    leaves the exact-scales and BF16 row costs at their defaults."""
    fmt = jsm.get_format("dsv3_2")
    truth = planner.CostModel(launch_us=6.0, block_us=2.5, dequant_ns=55.0, portable_block_us=1.0,
                              portable_dequant_ns=90.0, exact_scales_row_ns=1.0, direct_row_ns=1.0)
    samples = [(fmt.key, tokens, heads, 2048, variant, tile, splits,
                planner.option_us(truth, fmt, tokens, heads, 2048, variant, tile, splits, DEVICE))
               for heads in (16, 128) for tokens in calibration.CALIBRATION_TOKENS
               for variant, tile, splits in calibration.calibration_choices(tokens, heads, fmt.key)]
    fitted = calibration.fit_cost_model(samples, DEVICE)
    defaults = planner.CostModel()
    assert fitted.exact_scales_row_ns == defaults.exact_scales_row_ns
    assert fitted.direct_row_ns == defaults.direct_row_ns
    assert fitted.dequant_ns == pytest.approx(55.0, rel=0.1)


def test_step_timing_queues_calls_and_divides_by_all_steps(monkeypatch):
    """median_step_seconds: two warm-up calls, then `calls` queued calls per sample, one wait per sample,
    and the sample's time divided by calls x steps."""
    from jax_sparse_mla import timing

    launched, waited = [], []
    clock = iter(range(0, 1000, 1))  # perf_counter: 0, 1, 2, ... (one tick per reading)

    def run(x):
        launched.append(x)
        return x

    monkeypatch.setattr(timing.time, "perf_counter", lambda: float(next(clock)))
    monkeypatch.setattr(timing.jax, "block_until_ready", lambda value: waited.append(value) or value)
    median, fastest, slowest = timing.median_step_seconds(run, (7,), steps=5, repeats=3, calls=4)
    assert len(launched) == 2 + 3 * 4
    assert waited[:2] == [7, 7] and waited[2:] == [[7, 7, 7, 7]] * 3  # one wait per sample, on all its calls
    assert median == fastest == slowest == pytest.approx(1.0 / (4 * 5))  # one tick per 20 steps


@functools.lru_cache(maxsize=None)
def _load_benchmark_script(name):
    """Imports benchmarks/<name>.py (a script directory, not a package) once: its absl flags are global."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_step_profile_summary_reads_the_measured_call(tmp_path, capsys):
    """benchmarks/step_profile.py --summarize: the last of two identical kernel sequences is the call."""
    module = _load_benchmark_script("step_profile")
    header = '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"\n'
    setup = [("setup_fusion", "5,000")]
    call = [("attention", "10,000"), ("reduce", "1,000"), ("attention", "12,000"), ("reduce", "1,000"),
            ("add", "500")]
    rows = setup + call + call  # warm-up call, then the measured one
    csv_path = tmp_path / "kernels.csv"
    csv_path.write_text("==PROF== noise\n" + header + "".join(
        f'"{i}","{name}","gpu__time_duration.sum","nsecond","{value}"\n' for i, (name, value) in enumerate(rows)))
    module.summarize(str(csv_path), 2)
    text = capsys.readouterr().out
    assert "measured call: 5 kernels over 2 steps" in text
    assert "setup_fusion" not in text
    # attention: (10 + 12) µs over 2 steps; all kernels: (22 + 2 + 0.5) / 2 = 12.25 µs per step.
    assert [float(line.split()[-1]) for line in text.splitlines() if line.startswith("attention")] == [11.0]
    assert float(text.splitlines()[-1].split()[-1]) == pytest.approx(12.25, abs=0.051)


def test_bench_baseline_in_chunks_matches_the_whole_baseline():
    """benchmarks/bench.py: the frozen baseline applied over sequential token chunks (used where the whole
    batch does not fit in device memory) gives every token the whole-batch baseline's result."""
    import numpy as np

    bench = _load_benchmark_script("bench")
    rng = np.random.default_rng(3)
    fmt = jsm.get_format("dsv3_2")
    kv = jnp.asarray(rng.standard_normal((4 * 16, fmt.d_qk)), jnp.float32)
    cache = jsm.quantize_kv(kv, fmt, page_size=16)
    view = bench.baseline_view(cache, "dsv3_2", 16)
    q = jnp.asarray(rng.standard_normal((8, 4, fmt.d_qk)), jnp.bfloat16)
    indices = jnp.asarray(rng.integers(-1, 64, (8, 12)), jnp.int32)
    whole = bench.baseline_attention(q, view, indices, 0.05, "dsv3_2")
    chunked = jax.jit(lambda q, v, i: bench.baseline_in_chunks(q, v, i, 0.05, "dsv3_2", 2))(q, view, indices)
    assert chunked.shape == whole.shape
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(whole), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="chunks of 3"):
        bench.baseline_in_chunks(q, view, indices, 0.05, "dsv3_2", 3)


@pytest.mark.parametrize("key", [k for k, f in jsm.FORMATS.items() if f.quantized and k not in ("dsv3_2", "dsv4")])
def test_bench_generic_baseline_rows_are_dequantize_kv(key):
    """benchmarks/bench.py: the baseline of the formats without a hand-written one reads K and V from the
    format's byte layout exactly as dequantize_kv does, and applies the format's candidate window."""
    import numpy as np

    bench = _load_benchmark_script("bench")
    fmt = jsm.get_format(key)
    page_size = 16
    kv = jnp.asarray(np.random.default_rng(5).standard_normal((3 * page_size, fmt.d_qk)), jnp.float32)
    cache = jsm.quantize_kv(kv, fmt, page_size=page_size)
    dequantized = jsm.dequantize_kv(cache, fmt, page_size=page_size)
    rows = (dequantized[0] if isinstance(dequantized, tuple) else dequantized).reshape(-1, fmt.d_qk)
    width = max(fmt.max_candidates + 2, 6)
    indices = jnp.asarray(np.random.default_rng(6).integers(-1, 3 * page_size, (2, width)), jnp.int32)
    k, v, masked = bench.generic_baseline_rows(bench.baseline_view(cache, key, page_size), indices, key)
    expected = rows[jnp.maximum(indices, 0)].astype(jnp.bfloat16)
    window = fmt.max_candidates or width  # past the window the masked candidates gather slot 0
    assert np.array_equal(np.asarray(k[:, :window]), np.asarray(expected[:, :window]))
    assert np.array_equal(np.asarray(v[:, :window]), np.asarray(expected[:, :window, :fmt.d_v]))
    assert np.array_equal(np.asarray(masked[:, :window]), np.asarray(indices[:, :window]))
    assert bool(jnp.all(masked[:, window:] == -1))


def test_step_profile_gradient_step_runs(tmp_path):
    """benchmarks/step_profile.py --gradient cache: a jitted step of jax.grad with respect to q and a bf16
    cache runs and reports its time; a quantized cache is refused with the reason."""
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "step_profile.py")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, script, "--format", "bf16_576", "--tokens", "2", "--heads", "4",
                           "--gradient", "cache", "--steps", "1", "--repeats", "1"],
                          env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "bf16_576 T=2 H=4 impl=auto gradient=cache steps=1: median" in proc.stdout
    refused = subprocess.run([sys.executable, script, "--format", "dsv3_2", "--gradient", "cache"],
                             env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert refused.returncode != 0 and "needs a bf16_* cache" in refused.stderr


def test_bench_compare_grid_is_the_flashmla_side_by_side():
    """benchmarks/bench.py --grid compare: the small-batch rows (T <= 32 at H = 128 and 16), the tile-pace
    rows (T >= 64 at H = 128, T = 128 at H = 64 and 16) and prefill T = 4096; the flag accepts it and the
    other grids keep their shapes."""
    bench = _load_benchmark_script("bench")
    decode = bench.decode_grid("compare")
    assert len(decode) == len(set(decode))
    assert {(1, 128), (16, 128), (32, 128), (64, 128), (128, 128), (128, 64), (1, 16), (128, 16)} <= set(decode)
    assert bench.prefill_grid("compare") == [(4096, 128)]
    assert "compare" in bench.FLAGS["grid"].parser.enum_values
    assert bench.decode_grid("smoke") == [(1, 128), (128, 128), (64, 16)]
    assert len(bench.decode_grid("full")) == 15 and bench.prefill_grid("full") == [(1024, 128), (4096, 128)]
