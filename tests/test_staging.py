"""Staged plans (planner module docstring, docs/planning.md): a quantized cache dequantized once per call
into a BF16 copy that the BF16 kernels read. Here: which formats can be staged, when the planner stages,
the environment override, and the staged lowering run on the CPU kernel against the direct call."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cases
import oracle

import jax_sparse_mla as jsm
from jax_sparse_mla import _ffi, api, formats, planner, validate
from jax_sparse_mla.export import export

STAGEABLE = {"dsv3_2": "bf16_576", "dsv4": "bf16_512", "dsv4_1": "bf16_512", "dsv4_nvfp4": "bf16_512",
             "dsv4_1_fp4": "bf16_512"}
DEVICE = planner.DEFAULT_CUDA_DEVICE
MODEL = planner.CostModel()
# A prefill over a pool of about 300 000 slots (the benchmark's 192 MB dsv3_2 cache).
POOL = 306944


@pytest.fixture
def staging(monkeypatch):
    """Sets JSMLA_CUDA_STAGING for the test (tests run with it off by default: conftest.py)."""
    return lambda mode: monkeypatch.setenv(planner.STAGING_ENV, mode)


def _plan(key, tokens, heads=128, topk=2048, **kwargs):
    return jsm.plan((tokens, heads, jsm.get_format(key).d_qk), key, topk, platform="cuda", device=DEVICE,
                    cost_model=MODEL, **kwargs)


def test_staging_format_is_the_bf16_format_of_exactly_converted_rows():
    got = {key: (None if planner.staging_format(key) is None else planner.staging_format(key).key)
           for key in jsm.FORMATS}
    assert got == {key: STAGEABLE.get(key) for key in jsm.FORMATS}


def test_a_long_prefill_over_a_pool_of_its_size_is_staged(staging):
    staging("auto")
    plan = _plan("dsv3_2", 4096, num_slots=POOL)
    bf16 = _plan("bf16_576", 4096)
    assert plan.staged_format == "bf16_576" and plan.staged_bytes == POOL * 1152
    assert (plan.variant, plan.heads_per_block, plan.family) == (bf16.variant, bf16.heads_per_block, bf16.family)
    stage_us = MODEL.stage_us(POOL, jsm.get_format("dsv3_2"), jsm.get_format("bf16_576"))
    assert plan.predicted_us == pytest.approx(bf16.predicted_us + stage_us)
    assert plan.predicted_us < _plan("dsv3_2", 4096).predicted_us
    assert "staging: the dsv3_2 cache is dequantized into a bf16_576 copy" in plan.describe()


@pytest.mark.parametrize("why,key,tokens,kwargs", [
    ("a decode step: the copy costs more than it saves", "dsv3_2", 1, dict(num_slots=POOL)),
    ("the slot count is not given", "dsv3_2", 4096, {}),
    ("batch invariance: staging depends on T", "dsv3_2", 4096, dict(num_slots=POOL, batch_invariant=True)),
    ("a dual cache", "dsv4", 4096, dict(num_slots=POOL, extra_topk=64)),
    ("the copy would exceed STAGE_MAX_BYTES", "dsv3_2", 4096,
     dict(num_slots=planner.STAGE_MAX_BYTES // 1152 + 1)),
    ("arbitrary FP32 scales are not exact in BF16", "glm_nsa", 4096, dict(num_slots=POOL)),
    ("a BF16 cache", "bf16_576", 4096, dict(num_slots=POOL)),
])
def test_plans_that_are_not_staged(staging, why, key, tokens, kwargs):
    staging("auto")
    assert _plan(key, tokens, **kwargs).staged_format is None, why


def test_the_environment_overrides_the_choice(staging):
    staging("off")
    assert _plan("dsv3_2", 4096, num_slots=POOL).staged_format is None
    staging("on")
    assert _plan("dsv3_2", 1, num_slots=POOL).staged_format == "bf16_576"
    assert _plan("glm_nsa", 1, num_slots=POOL).staged_format is None  # nothing to stage into
    assert _plan("dsv3_2", 1, num_slots=POOL, batch_invariant=True).staged_format is None
    staging("sometimes")
    with pytest.raises(ValueError, match="JSMLA_CUDA_STAGING: expected one of auto, on, off, got 'sometimes'"):
        _plan("dsv3_2", 1, num_slots=POOL)
    assert jsm.plan((4096, 128, 576), "dsv3_2", 2048, platform="cpu", num_slots=POOL).staged_format is None


@pytest.mark.parametrize("value", [0, -3, 2.5, True])
def test_num_slots_must_be_a_positive_int(value):
    with pytest.raises(ValueError, match="num_slots: expected a positive int or None"):
        _plan("dsv3_2", 1, num_slots=value)


@pytest.mark.parametrize("form", ["3d", "2d", "nhd"])
@pytest.mark.parametrize("key", sorted(jsm.FORMATS))
def test_all_rows_are_the_gathered_rows_of_every_slot(rng, key, form):
    cache = cases.build_cache(rng, key, 45, page_size=16 if oracle.SPECS[key].quantized else 4, form=form)
    layout = formats.cache_layout(jnp.asarray(cache.array), key, cache.page_size_arg)
    slots = jnp.arange(layout.num_slots, dtype=jnp.int32)
    got = formats.all_rows(jnp.asarray(cache.array), layout, key)
    want = formats.gather_rows(jnp.asarray(cache.array), layout, key, slots)
    for x, y in zip(got, want):
        assert (x is None) == (y is None)
        if x is not None:
            np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


def _cpu_call(problem, arrays):
    plan = jsm.plan((problem.num_tokens, problem.num_heads, problem.fmt.d_qk), problem.fmt, problem.topk,
                    platform="cpu")
    get = arrays.get
    return _ffi.call(plan, problem, get("q"), get("kv_cache"), get("indices"), get("topk_length"),
                     get("attn_sink"), None, None, None, get("valid_tokens"))


@pytest.mark.parametrize("form", ["3d", "2d"])
@pytest.mark.parametrize("key", sorted(STAGEABLE))
def test_the_staged_call_is_the_direct_call(rng, key, form):
    """The staged lowering (api._staged) on the CPU kernel: bitwise the direct call, on a cache whose unused
    slots and page padding are NaN (0xFF: the copy holds NaN rows the kernel never reads), with lengths,
    junk indices, a sink and padding rows; and within the accuracy contract of the float64 oracle."""
    case = cases.make_case(rng, key, num_tokens=6, num_heads=5, topk=40, page_size=16, form=form,
                           attn_sink=rng.standard_normal(5).astype(np.float32), valid_tokens=np.int32(5))
    problem = validate.normalize(case.q, case.main.array, case.indices, kv_format=key, sm_scale=case.sm_scale,
                                 page_size=case.main.page_size_arg, topk_length=case.topk_length,
                                 attn_sink=case.attn_sink, valid_tokens=case.valid_tokens)
    arrays = {"q": jnp.asarray(case.q), "kv_cache": jnp.asarray(case.main.array),
              "indices": jnp.asarray(case.indices), "topk_length": jnp.asarray(case.topk_length),
              "attn_sink": jnp.asarray(case.attn_sink), "valid_tokens": jnp.asarray(case.valid_tokens)}
    staged_problem, _ = api._staged(problem, arrays, jsm.get_format(STAGEABLE[key]))
    assert staged_problem.fmt.key == STAGEABLE[key] and staged_problem.layout.num_slots == case.main.num_slots
    direct = jax.jit(lambda a: _cpu_call(problem, a))(arrays)
    staged = jax.jit(lambda a: _cpu_call(staged_problem, api._staged(problem, a, staged_problem.fmt)[1]))(arrays)
    for x, y in zip(staged, direct):
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
    ref_out, ref_lse = case.reference()
    oracle.check_accuracy(np.asarray(staged[0]), np.asarray(staged[1]), ref_out, ref_lse)


def test_export_for_cuda_bakes_the_staging_into_the_program(staging):
    """A long prefill exported for CUDA from this host: the program dequantizes the cache (behind the
    barrier that ties the copy to the call) and calls the BF16 kernel."""
    staging("auto")
    fmt = jsm.get_format("dsv3_2")
    args = (jax.ShapeDtypeStruct((4096, 128, 576), jnp.bfloat16),
            jax.ShapeDtypeStruct((POOL // 64, 64, fmt.bytes_per_token), jnp.uint8),
            jax.ShapeDtypeStruct((4096, 2048), jnp.int32))

    def prefill():  # a new function each time: the setting is read when a function is traced
        return lambda q, cache, indices: jsm.sparse_mla(q, cache, indices, kv_format="dsv3_2", sm_scale=576 ** -0.5)

    text = export(prefill(), *args, platforms=("cuda",)).mlir_module()
    assert "optimization_barrier" in text
    formats_called = {int(v) for v in re.findall(r"kv_format = (\d+) : i32", text)}
    assert formats_called == {jsm.get_format("bf16_576").id}, formats_called
    staging("off")
    text = export(prefill(), *args, platforms=("cuda",)).mlir_module()
    assert {int(v) for v in re.findall(r"kv_format = (\d+) : i32", text)} == {fmt.id}
    assert "optimization_barrier" not in text


def test_calibration_times_the_copy_pass():
    """calibrate() stores the copy pass's bandwidth (CostModel.stage_gbps) from time_staging, which times
    the pass alone; here on the CPU, where only its plumbing is checked (a positive, finite rate)."""
    from jax_sparse_mla import calibration
    from jax_sparse_mla.timing import RandomCache

    rate = calibration.time_staging(RandomCache("dsv4_nvfp4", pool_bytes=1 << 20))
    assert np.isfinite(rate) and rate > 0
    with pytest.raises(ValueError, match="'glm_nsa' has no staged plans"):
        calibration.time_staging(RandomCache("glm_nsa", pool_bytes=1 << 20))
