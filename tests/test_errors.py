"""docs/errors.md: every trace-time rejection, with the right exception type and a message naming the argument.

Wrong dtypes raise TypeError; everything else ValueError. Arguments are numpy arrays (so int64 and other
dtypes JAX would canonicalise reach the validation as given) or ShapeDtypeStructs under eval_shape.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_sparse_mla as jsm
from jax_sparse_mla import _ffi, planner, validate
from jax_sparse_mla.formats import CacheLayout

T, H, TOPK = 7, 4, 16


def _arrays(key="dsv3_2", cache_shape=None, num_tokens=T, num_heads=H, topk=TOPK):
    fmt = jsm.FORMATS[key]
    if cache_shape is None:
        cache_shape = (4, 64, fmt.bytes_per_token if fmt.quantized else fmt.d_qk)
    cache_dtype = np.uint8 if fmt.quantized else ml_dtypes.bfloat16
    return dict(q=np.zeros((num_tokens, num_heads, fmt.d_qk), ml_dtypes.bfloat16),
                kv_cache=np.zeros(cache_shape, cache_dtype),
                indices=np.zeros((num_tokens, topk), np.int32))


def _call(key="dsv3_2", arrays=None, **kwargs):
    arrays = arrays or _arrays(key)
    kwargs.setdefault("kv_format", key)
    kwargs.setdefault("sm_scale", 0.1)
    return jsm.sparse_mla(arrays["q"], arrays["kv_cache"], arrays["indices"], **kwargs)


def _with(key="dsv3_2", **changes):
    arrays = _arrays(key)
    arrays.update(changes)
    return arrays


def test_the_baseline_call_is_valid():
    out, lse = _call()
    assert out.shape == (T, H, 512) and lse.shape == (T, H)
    out, lse = _call(arrays=_arrays("dsv4"), key="dsv4", extra_kv_cache=np.zeros((2, 2, 584), np.uint8),
                     extra_indices=np.zeros((T, 3), np.int32))
    np.testing.assert_allclose(np.asarray(lse), np.log(TOPK + 3), rtol=1e-6)  # an all-zero cache: uniform


# --------------------------------------------------------------------------------------------------
# dtypes -> TypeError
# --------------------------------------------------------------------------------------------------

def test_spec_example_message():
    arrays = _with(indices=np.zeros((7, 2048), np.int64))
    expected = "indices: expected int32 [T, topk] or [T, 1, topk] with T=7, got int64 [7, 2048]"
    with pytest.raises(TypeError) as info:
        _call(arrays=arrays)
    assert expected in str(info.value)


@pytest.mark.parametrize("name,value,kwargs", [
    ("q", np.zeros((T, H, 576), np.float32), {}),
    ("q", np.zeros((T, H, 576), np.float16), {}),
    ("indices", np.zeros((T, TOPK), np.int64), {}),
    ("indices", np.zeros((T, TOPK), np.uint32), {}),
    ("kv_cache", np.zeros((4, 64, 656), np.float32), {}),
    ("kv_cache", np.zeros((4, 64, 328), ml_dtypes.bfloat16), {}),
    ("topk_length", None, {"topk_length": np.zeros(T, np.int64)}),
    ("topk_length", None, {"topk_length": np.zeros(T, np.float32)}),
    ("attn_sink", None, {"attn_sink": np.zeros(H, ml_dtypes.bfloat16)}),
    ("attn_sink", None, {"attn_sink": np.zeros(H, np.float64)}),
    ("valid_tokens", None, {"valid_tokens": np.int64(3)}),
    ("valid_tokens", None, {"valid_tokens": np.zeros((1,), np.float32)}),
], ids=lambda v: v if isinstance(v, str) else None)
def test_wrong_dtypes_raise_type_error(name, value, kwargs):
    arrays = _with(**{name: value}) if value is not None else _arrays()
    with pytest.raises(TypeError, match=f"^{name}: expected"):
        _call(arrays=arrays, **kwargs)


def test_bf16_format_cache_dtype():
    with pytest.raises(TypeError, match="kv_cache"):
        _call("bf16_576", arrays=_with("bf16_576", kv_cache=np.zeros((4, 64, 576), np.float32)))
    with pytest.raises(TypeError, match="kv_cache"):
        _call("bf16_576", arrays=_with("bf16_576", kv_cache=np.zeros((4, 64, 1152), np.uint8)))


def test_extra_dtypes():
    arrays = _arrays("dsv4")
    extra = dict(extra_kv_cache=np.zeros((2, 2, 584), np.uint8), extra_indices=np.zeros((T, 3), np.int32))
    with pytest.raises(TypeError, match="extra_indices"):
        _call("dsv4", arrays, **{**extra, "extra_indices": np.zeros((T, 3), np.int64)})
    with pytest.raises(TypeError, match="extra_topk_length"):
        _call("dsv4", arrays, **extra, extra_topk_length=np.zeros(T, np.int64))
    with pytest.raises(TypeError, match="extra_kv_cache"):
        _call("dsv4", arrays, **{**extra, "extra_kv_cache": np.zeros((2, 2, 584), np.float32)})


@pytest.mark.parametrize("sm_scale", ["0.1", None, jnp.float32(0.1), np.array([0.1]), True])
def test_non_float_sm_scale(sm_scale):
    with pytest.raises(TypeError, match="sm_scale"):
        _call(sm_scale=sm_scale)


def test_sm_scale_traced_under_jit_is_rejected():
    with pytest.raises(TypeError, match="sm_scale"):
        jax.jit(lambda s: _call(sm_scale=s))(0.1)


@pytest.mark.parametrize("sm_scale", [float("inf"), float("nan")])
def test_non_finite_sm_scale(sm_scale):
    with pytest.raises(ValueError, match="sm_scale"):
        _call(sm_scale=sm_scale)


def test_integer_sm_scale_is_accepted():
    _call(sm_scale=1)
    _call(sm_scale=np.float32(0.25))


# --------------------------------------------------------------------------------------------------
# shapes and values -> ValueError
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("q_shape", [(T, H, 512), (T, H, 577), (T, 129, 576), (T, 0, 576), (T, 576),
                                     (1, T, 1, H, 576)], ids=str)
def test_bad_q_shapes(q_shape):
    with pytest.raises(ValueError, match="^q: expected"):
        _call(arrays=_with(q=np.zeros(q_shape, ml_dtypes.bfloat16)))


def test_q_width_names_the_format():
    with pytest.raises(ValueError, match="glm53_nope") as info:
        _call("glm53_nope", arrays=_with("glm53_nope", q=np.zeros((T, H, 576), ml_dtypes.bfloat16)))
    assert "576" in str(info.value) and "512" in str(info.value)


def test_heads_limits_are_inclusive():
    for heads in (1, 128):
        out, _ = _call(arrays=_arrays(num_heads=heads, topk=1))
        assert out.shape == (T, heads, 512)


@pytest.mark.parametrize("shape", [(T, 0), (T, 1, 0)], ids=str)
def test_topk_zero(shape):
    with pytest.raises(ValueError, match="^indices: expected topk >= 1"):
        _call(arrays=_with(indices=np.zeros(shape, np.int32)))


@pytest.mark.parametrize("name,kwargs,arrays", [
    ("indices", {}, {"indices": np.zeros((T + 1, TOPK), np.int32)}),
    ("indices", {}, {"indices": np.zeros((T, 2, TOPK), np.int32)}),
    ("indices", {}, {"indices": np.zeros((TOPK,), np.int32)}),
    ("topk_length", {"topk_length": np.zeros(T - 1, np.int32)}, {}),
    ("topk_length", {"topk_length": np.zeros((T, 1), np.int32)}, {}),
    ("attn_sink", {"attn_sink": np.zeros(H + 1, np.float32)}, {}),
    ("attn_sink", {"attn_sink": np.zeros((1, H), np.float32)}, {}),
    ("valid_tokens", {"valid_tokens": np.zeros((2,), np.int32)}, {}),
    ("valid_tokens", {"valid_tokens": np.zeros((1, 1), np.int32)}, {}),
], ids=lambda v: v if isinstance(v, str) else None)
def test_mismatched_shapes(name, kwargs, arrays):
    with pytest.raises(ValueError, match=f"^{name}: expected"):
        _call(arrays=_with(**arrays), **kwargs)


def test_leading_axes_must_agree():
    q = np.zeros((2, 3, H, 576), ml_dtypes.bfloat16)
    with pytest.raises(ValueError, match=r"indices: expected int32 \[B, S, topk\] with B=2, S=3"):
        _call(arrays=_with(q=q, indices=np.zeros((6, TOPK), np.int32)))
    with pytest.raises(ValueError, match="topk_length"):
        _call(arrays=_with(q=q, indices=np.zeros((2, 3, TOPK), np.int32)), topk_length=np.zeros(6, np.int32))


@pytest.mark.parametrize("key,cache_shape,page_size,match", [
    ("dsv4", (4, 2, 592), None, "row_bytes"),  # footer cache with padded rows
    ("dsv4_1", (4, 2, 544), None, "row_bytes"),
    ("dots3_swa", (4, 2, 1168), None, "row_bytes"),
    ("dsv4", (4, 3, 584), None, "page_size"),  # footer page not 16-byte aligned
    ("dots3_swa", (4, 1, 1160), None, "page_size"),
    ("dsv3_2", (4, 64, 640), None, "row_bytes"),  # inline rows narrower than the payload
    ("glm53_nope", (4, 64, 512), None, "row_bytes"),
    ("glm53_nope", (4, 64, 536), None, "row_bytes"),  # not % 16
    ("glm_nsa", (4, 64, 664), None, "row_bytes"),
    ("dsv3_2", (4, 2624), None, "page_size"),  # 2-D quantized without page_size
    ("dsv4", (4, 1168), None, "page_size"),
    ("dsv3_2", (4, 2608), 4, "page_bytes"),  # too small
    ("dsv3_2", (4, 2632), 4, "page_bytes"),  # not aligned
    ("dsv4", (4, 584), 1, "page_bytes"),
    ("dsv3_2", (4, 64, 656), 32, "page_size"),  # page_size contradicts the shape
    ("dsv3_2", (4, 2, 2, 656), None, "kv_cache"),
    ("bf16_576", (4, 64, 512), None, "kv_cache"),
    ("bf16_512", (256, 512), 64, "page_size"),
], ids=str)
def test_bad_caches(key, cache_shape, page_size, match):
    arrays = _arrays(key, cache_shape=cache_shape)
    kwargs = {} if page_size is None else {"page_size": page_size}
    with pytest.raises(ValueError, match=match) as info:
        _call(key, arrays, **kwargs)
    assert str(info.value).startswith("kv_cache: ")


def test_bad_page_size_values():
    arrays = _arrays(cache_shape=(4, 2624))
    with pytest.raises(ValueError, match="page_size"):
        _call(arrays=arrays, page_size=0)
    with pytest.raises(TypeError, match="page_size"):
        _call(arrays=arrays, page_size=4.0)


# --------------------------------------------------------------------------------------------------
# Dual cache
# --------------------------------------------------------------------------------------------------

EXTRA_CACHE = np.zeros((2, 2, 584), np.uint8)
EXTRA_INDICES = np.zeros((T, 3), np.int32)


@pytest.mark.parametrize("kwargs,match", [
    ({"extra_kv_cache": EXTRA_CACHE}, "extra_kv_cache/extra_indices: expected both or neither, got only extra_kv_cache"),
    ({"extra_indices": EXTRA_INDICES}, "extra_kv_cache/extra_indices: expected both or neither, got only extra_indices"),
    ({"extra_topk_length": np.zeros(T, np.int32)}, "^extra_topk_length"),
    ({"extra_page_size": 2}, "^extra_page_size"),
    ({"extra_kv_cache": EXTRA_CACHE, "extra_topk_length": np.zeros(T, np.int32)}, "extra_indices"),
], ids=["cache_only", "indices_only", "length_only", "page_size_only", "cache_and_length"])
def test_partial_dual_cache_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _call("dsv4", _arrays("dsv4"), **kwargs)


@pytest.mark.parametrize("key", ["dsv3_2", "glm_nsa", "glm53_nope", "dots3_swa", "bf16_576", "bf16_512"])
def test_dual_cache_for_a_format_without_one(key):
    fmt = jsm.FORMATS[key]
    extra = np.zeros((2, 2, fmt.bytes_per_token if fmt.quantized else fmt.d_qk),
                     np.uint8 if fmt.quantized else ml_dtypes.bfloat16)
    with pytest.raises(ValueError, match=f"extra_kv_cache: format {key} has no dual-cache form"):
        _call(key, _arrays(key), extra_kv_cache=extra, extra_indices=EXTRA_INDICES)


@pytest.mark.parametrize("kwargs,match", [
    ({"extra_indices": np.zeros((T + 1, 3), np.int32)}, "^extra_indices: expected"),
    ({"extra_indices": np.zeros((T, 0), np.int32)}, "^extra_indices: expected topk >= 1"),
    ({"extra_topk_length": np.zeros(T + 2, np.int32)}, "^extra_topk_length: expected"),
    ({"extra_kv_cache": np.zeros((2, 3, 584), np.uint8)}, "^extra_kv_cache"),  # 3*584 % 16
    ({"extra_kv_cache": np.zeros((2, 1184), np.uint8)}, "^extra_kv_cache.*page_size"),  # 2-D, no page size
    ({"extra_kv_cache": np.zeros((2, 1184), np.uint8), "extra_page_size": 3}, "^extra_kv_cache"),  # < 3*584
], ids=["indices_T", "indices_topk0", "lengths_T", "odd_footer_page", "2d_no_page_size", "2d_small_page"])
def test_bad_extra_arguments(kwargs, match):
    full = {"extra_kv_cache": EXTRA_CACHE, "extra_indices": EXTRA_INDICES, **kwargs}
    with pytest.raises(ValueError, match=match):
        _call("dsv4", _arrays("dsv4"), **full)


# --------------------------------------------------------------------------------------------------
# Keys, impl, vmap
# --------------------------------------------------------------------------------------------------

def test_unknown_kv_format():
    with pytest.raises(ValueError, match="^kv_format: expected one of .*got 'dsv5'"):
        _call(kv_format="dsv5")
    with pytest.raises(TypeError, match="^kv_format"):
        _call(kv_format=3)


def test_unknown_impl():
    with pytest.raises(ValueError, match="^impl: expected one of .*got 'fast'"):
        _call(impl="fast")
    with pytest.raises(TypeError, match="^impl"):
        _call(impl=None)


@pytest.mark.parametrize("impl", ["decode", "prefill"])
def test_cuda_only_impl_on_cpu(impl):
    if jsm.cuda_available() and jax.default_backend() == "gpu":
        pytest.skip("the CUDA variants are available here")
    with pytest.raises(ValueError, match="^impl"):
        _call(impl=impl)
    with pytest.raises(ValueError, match="^impl"):
        jax.jit(lambda q: _call(arrays=_with(q=q), impl=impl))(jnp.zeros((T, H, 576), jnp.bfloat16))


def test_batched_caches_and_sinks_under_vmap():
    arrays = _arrays("dsv4")
    q = jnp.stack([jnp.asarray(arrays["q"])] * 2)
    cache = jnp.asarray(arrays["kv_cache"])
    indices = jnp.asarray(arrays["indices"])
    with pytest.raises(ValueError, match="^kv_cache: a cache batched under jax.vmap"):
        jax.vmap(lambda q, c: jsm.sparse_mla(q, c, indices, kv_format="dsv4", sm_scale=0.1))(q, jnp.stack([cache] * 2))
    extra = jnp.zeros((2, 2, 2, 584), jnp.uint8)
    with pytest.raises(ValueError, match="^extra_kv_cache: a cache batched under jax.vmap"):
        jax.vmap(lambda q, e: jsm.sparse_mla(q, cache, indices, kv_format="dsv4", sm_scale=0.1, extra_kv_cache=e,
                                             extra_indices=jnp.asarray(EXTRA_INDICES)))(q, extra)
    sinks = jnp.zeros((2, H), jnp.float32)
    with pytest.raises(ValueError, match="^attn_sink"):
        jax.vmap(lambda q, s: jsm.sparse_mla(q, cache, indices, kv_format="dsv4", sm_scale=0.1, attn_sink=s))(q, sinks)


def test_errors_are_raised_at_trace_time():
    """Under eval_shape nothing runs: validation alone raises."""
    q = jax.ShapeDtypeStruct((T, 129, 576), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((4, 64, 656), jnp.uint8)
    indices = jax.ShapeDtypeStruct((T, TOPK), jnp.int32)
    op = functools.partial(jsm.sparse_mla, kv_format="dsv3_2", sm_scale=0.1)
    with pytest.raises(ValueError, match="^q"):
        jax.eval_shape(op, q, cache, indices)
    out = jax.eval_shape(op, jax.ShapeDtypeStruct((T, H, 576), jnp.bfloat16), cache, indices)
    assert out[0].shape == (T, H, 512) and out[1].shape == (T, H)


# --------------------------------------------------------------------------------------------------
# The C++ handler re-checks what it relies on (InvalidArgument, not a crash)
# --------------------------------------------------------------------------------------------------

def _raw_call(problem, q, cache, indices, plan=None):
    plan = plan or planner.plan((T, H, 576), problem.fmt, TOPK, platform="cpu")
    return jax.jit(lambda q, c, i: _ffi.call(plan, problem, q, c, i, None, None, None, None, None,
                                             jnp.int32(T)))(q, cache, indices)


def _problem():
    arrays = _arrays()
    problem = validate.normalize(arrays["q"], arrays["kv_cache"], arrays["indices"], kv_format="dsv3_2",
                                 sm_scale=0.1)
    return problem, (jnp.asarray(arrays["q"]), jnp.asarray(arrays["kv_cache"]), jnp.asarray(arrays["indices"]))


@pytest.mark.parametrize("layout,match", [
    (CacheLayout(num_pages=5, page_size=64, page_stride=64 * 656, row_stride=656), "kv_cache: geometry"),
    (CacheLayout(num_pages=4, page_size=64, page_stride=64 * 656, row_stride=600), "kv_cache: geometry"),
    (CacheLayout(num_pages=4, page_size=64, page_stride=656, row_stride=656), "kv_cache: geometry"),
    (CacheLayout(num_pages=4, page_size=0, page_stride=64 * 656, row_stride=656), "kv_cache: geometry"),
], ids=["too_many_pages", "rows_too_narrow", "pages_overlap", "page_size_0"])
def test_handler_rejects_geometry_outside_the_buffer(layout, match):
    problem, args = _problem()
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(_raw_call(dataclasses.replace(problem, layout=layout), *args))


def test_handler_rejects_a_cuda_variant_on_cpu():
    problem, args = _problem()
    cpu_plan = planner.plan((T, H, 576), "dsv3_2", TOPK, platform="cpu")
    with pytest.raises(Exception, match="variant"):
        jax.block_until_ready(_raw_call(problem, *args, plan=dataclasses.replace(cpu_plan, variant="decode")))


# --------------------------------------------------------------------------------------------------
# FP4 formats and mixed dual caches: the CPU kernel and impl="xla" serve them, CUDA does not yet
# --------------------------------------------------------------------------------------------------

def _dual_operands(main_key, extra_key):
    main = jnp.zeros((2, 4, jsm.get_format(main_key).bytes_per_token), jnp.uint8)
    extra = jnp.zeros((1, 4, jsm.get_format(extra_key).bytes_per_token), jnp.uint8)
    return jnp.zeros((2, 3, 512), jnp.bfloat16), main, jnp.zeros((2, 5), jnp.int32), extra, jnp.zeros((2, 3), jnp.int32)


def test_extra_kv_format_pairs():
    q, main, idx, extra, extra_idx = _dual_operands("dsv4", "dsv4_1_fp4")
    with pytest.raises(ValueError, match=r"extra_kv_format: expected one of \['dsv4', 'dsv4_nvfp4'\] for a dsv4 main "
                                         r"cache, got 'dsv4_1_fp4'"):
        jsm.sparse_mla(q, main, idx, kv_format="dsv4", sm_scale=0.1, extra_kv_cache=extra, extra_indices=extra_idx,
                       extra_kv_format="dsv4_1_fp4")
    with pytest.raises(ValueError, match="extra_kv_format: given without extra_kv_cache"):
        jsm.sparse_mla(q, main, idx, kv_format="dsv4", sm_scale=0.1, extra_kv_format="dsv4_nvfp4")
    q, main, idx, extra, extra_idx = _dual_operands("dsv4_1", "dsv4_1_fp4")
    out, lse = jsm.sparse_mla(q, main, idx, kv_format="dsv4_1", sm_scale=0.1, extra_kv_cache=extra,
                              extra_indices=extra_idx, extra_kv_format="dsv4_1_fp4")
    assert out.shape == (2, 3, 512)
    # The extra cache is validated against its own format: a dsv4_1-sized extra cache is not an FP4 cache.
    with pytest.raises(ValueError, match="extra_kv_cache: footer format dsv4_1_fp4 needs row_bytes == 288"):
        jsm.sparse_mla(q, main, idx, kv_format="dsv4_1", sm_scale=0.1, extra_kv_cache=main, extra_indices=extra_idx,
                       extra_kv_format="dsv4_1_fp4")


def test_supported_configs_and_check_supported_list_the_dual_pairs():
    configs = jsm.supported_configs()
    assert configs["dsv4_1"]["extra_formats"] == ["dsv4_1", "dsv4_1_fp4"]
    assert configs["dsv4_nvfp4"]["extra_formats"] == ["dsv4_nvfp4"]
    assert configs["dsv3_2"]["extra_formats"] == []
    for key in ("dsv4", "dsv4_nvfp4", "dsv4_1_fp4"):
        assert configs[key]["platforms"]["cuda"]["variants"] == ["decode", "prefill"], key
    jsm.check_supported("dsv4_1", extra_kv_format="dsv4_1_fp4")
    with pytest.raises(ValueError, match=r"extra_kv_format='dsv4_1_fp4' \(allowed \['dsv4', 'dsv4_nvfp4'\]\)"):
        jsm.check_supported("dsv4", extra_kv_format="dsv4_1_fp4")
    jsm.check_supported("dsv4_nvfp4", platform="cuda")
    jsm.check_supported("dsv4_nvfp4", platform="cpu")


@pytest.mark.parametrize("key", ["dsv4_nvfp4", "dsv4_1_fp4"])
def test_fp4_formats_plan_for_cuda(key):
    p = jsm.plan((1, 16, 512), key, 2048, platform="cuda")
    assert p.variant == "decode" and p.heads_per_block == 16 and p.num_splits > 1
    assert "family=hopper" in jsm.plan((64, 128, 512), key, 2048, platform="cuda").describe()
    assert jsm.plan((1, 16, 512), key, 64, platform="cpu").variant == "reference"


@pytest.mark.parametrize("key,extra_key", [("dsv4", "dsv4_nvfp4"), ("dsv4_1", "dsv4_1_fp4")])
def test_two_format_pairs_lower_for_cuda_as_one_call_per_cache(key, extra_key):
    """The CUDA kernels read one format per call: a CUDA program for a dual cache of two formats holds two
    kernel calls, the main cache's format then the extra cache's (merged in the program); one format, one call."""
    import re

    from jax_sparse_mla.export import export

    def formats_called(extra_format):
        q, main, idx, extra, extra_idx = _dual_operands(key, extra_format)

        def attention(q):
            return jsm.sparse_mla(q, main, idx, kv_format=key, sm_scale=0.1, extra_kv_cache=extra,
                                  extra_indices=extra_idx, extra_kv_format=extra_format)

        module = export(jax.jit(attention), q, platforms=("cuda",)).mlir_module()
        return [int(v) for v in re.findall(r"\bkv_format = (\d+) : i32", module)]

    assert formats_called(extra_key) == [jsm.get_format(key).id, jsm.get_format(extra_key).id]
    assert formats_called(key) == [jsm.get_format(key).id]
    jsm.check_supported(key, extra_kv_format=extra_key, platform="cuda")
