"""docs/formats.md: the format table, quantize/dequantize/update_kv bit-exactness, and accepted cache shapes."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_sparse_mla as jsm
from jax_sparse_mla import _ffi
from jax_sparse_mla.formats import Layout, ScaleKind, cache_layout

import cases
import oracle

ALL_FORMATS = list(oracle.SPECS)


# --------------------------------------------------------------------------------------------------
# The format table
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key", ALL_FORMATS)
def test_format_table_matches_spec(key):
    spec, fmt = oracle.SPECS[key], jsm.FORMATS[key]
    assert jsm.get_format(key) is fmt and fmt.key == key and str(fmt) == key
    expected_layout = {"inline": Layout.INLINE, "footer": Layout.FOOTER, "bf16": Layout.BF16}[spec.kind]
    expected_scale = {"fp32": ScaleKind.FP32, "ue8m0": ScaleKind.UE8M0, "e4m3": ScaleKind.E4M3,
                      None: ScaleKind.NONE}[spec.scale]
    assert fmt.layout == expected_layout
    assert fmt.scale_kind == expected_scale
    assert fmt.scale_bytes == spec.scale_width
    assert fmt.quantized == spec.quantized
    assert (fmt.d_qk, fmt.d_v, fmt.bytes_per_token) == (spec.d_qk, spec.d_v, spec.bytes_per_token)
    assert (fmt.quant_dim, fmt.bf16_dim) == (spec.quant_lanes, spec.bf16_lanes)
    assert fmt.quant_bits == (spec.bits if spec.quantized else 0)
    assert (fmt.group_size, fmt.num_groups) == (spec.group, spec.groups)
    assert fmt.data_row_bytes == spec.data_row
    assert fmt.scale_row_bytes == spec.scale_row
    assert fmt.bf16_offset == spec.bf16_offset
    if spec.kind != "bf16":
        assert fmt.scale_offset == spec.scale_offset
    assert fmt.max_candidates == spec.window
    assert fmt.pow2_scales == spec.pow2
    assert fmt.dual_cache == spec.dual


def test_format_registry_is_exactly_the_spec_table():
    assert set(jsm.FORMATS) == set(oracle.SPECS)
    assert sorted(f.id for f in jsm.FORMATS.values()) == list(range(len(oracle.SPECS)))


def test_python_table_equals_cpp_table():
    table = _ffi.cpu_format_table()
    assert len(table) == len(jsm.FORMATS)
    compared = {f.name for f in dataclasses.fields(jsm.KVFormat)} - {"key", "description"}
    for entry in table:
        assert set(entry) == compared, f"C++ and Python tables have different fields: {set(entry) ^ compared}"
        fmt = next(f for f in jsm.FORMATS.values() if f.id == entry["id"])
        for field in sorted(compared):
            python_value = getattr(fmt, field)
            if isinstance(python_value, (Layout, ScaleKind)):
                python_value = int(python_value)
            assert entry[field] == python_value, f"{fmt.key}.{field}: C++ {entry[field]} != Python {python_value}"


def test_byte_size_never_selects_a_format():
    a, b = jsm.FORMATS["glm53_nope"], jsm.FORMATS["dsv4_1"]
    assert a.bytes_per_token == b.bytes_per_token == 528
    assert a != b and a.id != b.id
    shape = jax.ShapeDtypeStruct((2, 4, 528), jnp.uint8)
    assert cache_layout(shape, "glm53_nope").row_stride == 528
    assert cache_layout(shape, "dsv4_1").row_stride == 512
    with pytest.raises(ValueError, match="kv_format"):
        jsm.get_format("528")


def test_unregistered_format_object_rejected():
    fake = dataclasses.replace(jsm.FORMATS["dsv4"], d_v=448)
    with pytest.raises(ValueError, match="kv_format"):
        jsm.get_format(fake)


# --------------------------------------------------------------------------------------------------
# quantize_kv: bit-exact against the numpy quantizer
# --------------------------------------------------------------------------------------------------

def crafted_rows(key: str) -> np.ndarray:
    """Rows aimed at the rounding corners of the quantizer (docs/formats.md, quantize_kv)."""
    spec = oracle.SPECS[key]
    rows = np.zeros((6, spec.d_qk), np.float32)  # row 0: an all-zero real token (clamped amax)
    rng = np.random.default_rng(7)
    groups = max(spec.groups, 1)
    group = spec.group or spec.d_qk
    for g in range(groups):
        lanes = slice(g * group, (g + 1) * group)
        boundary = np.float32(448.0 * 2.0 ** (g - 3))  # amax/448 exactly a power of two
        rows[1, lanes] = rng.uniform(-1, 1, group).astype(np.float32) * boundary
        rows[1, g * group] = boundary
        rows[2, lanes] = rows[1, lanes]
        rows[2, g * group] = np.nextafter(boundary, np.float32(np.inf))  # just above it
        rows[3, lanes] = rng.uniform(-5e-5, 5e-5, group)  # below the 1e-4 amax floor
    if spec.quantized:
        # amax 448 gives scale 1 for power-of-two formats: x is then quantized as is. Ties of the
        # 3-bit mantissa and values a hair above them catch double rounding (e.g. through float16).
        ties = np.array([448.0, 1.0625, 1.0625 + 2.0**-15, -1.1875, 1.1875 - 2.0**-14, 2.0**-10, 3 * 2.0**-10,
                         -3 * 2.0**-10 - 2.0**-20, 0.0, -0.0, 464.0 / 1.0001, 17.0, 19.0, 240.0, 248.0],
                        np.float32)
        rows[4, : ties.size] = ties
    rows[5] = rng.choice([-1, 1], spec.d_qk) * np.exp(rng.uniform(-12, 10, spec.d_qk))
    if spec.bf16_lanes:
        rope = np.array([1 + 2.0**-8, 1 + 3 * 2.0**-8, 1 + 2.0**-8 + 2.0**-20, -(1 + 2.0**-8), 3.0e38, 1e-30],
                        np.float32)
        rows[1:3, spec.quant_lanes: spec.quant_lanes + rope.size] = rope
    if spec.bits == 4:
        rows = np.concatenate([rows, fp4_crafted_rows(spec)])
    return rows


def fp4_crafted_rows(spec) -> np.ndarray:
    """FP4 corners: E2M1 ties (to the even code) with a scale of exactly 1, negative values that round to
    zero, saturation at ±6 when the E4M3 scale rounds down, and the 2^-9 scale clamp."""
    rows = np.zeros((4, spec.d_qk), np.float32)
    ties = np.array([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -2.5, -5.0, -0.1, 0.7499999,
                     0.2500001, 4.9999995], np.float32)
    assert ties.size == spec.group
    for g in range(spec.groups):  # amax 6 in every group: scale e4m3(6 / 6) = 1
        lanes = slice(g * spec.group, (g + 1) * spec.group)
        rows[0, lanes] = ties if g % 2 == 0 else -ties
        rows[1, lanes] = ties * np.float32(1.06)  # amax 6.36: the scale rounds down to 1, ±6 saturates
        rows[2, lanes] = np.linspace(-1e-3, 1e-3, spec.group, dtype=np.float32)  # scale clamped to 2^-9
        rows[3, lanes] = -np.linspace(0.0, 3.0, spec.group, dtype=np.float32) * 2.0 ** (g % 7 - 3)
    return rows


def _quantize_jit(kv, key, page_size):
    return np.asarray(jax.jit(jsm.quantize_kv, static_argnames=("kv_format", "page_size"))(
        jnp.asarray(kv), kv_format=key, page_size=page_size))


def _assert_same_bytes(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    g, w = oracle.cache_bytes(got), oracle.cache_bytes(want)
    diff = np.nonzero(g != w)[0]
    assert diff.size == 0, f"{diff.size} bytes differ, first at flat offset {diff[:8]}: got {g[diff[:8]]} want {w[diff[:8]]}"


@pytest.mark.parametrize("kv_dtype", [np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("page_size,num_tokens", [(1, 5), (3, 7), (64, 70)])
@pytest.mark.parametrize("key", ALL_FORMATS)
def test_quantize_kv_bit_exact(rng, key, page_size, num_tokens, kv_dtype):
    spec = oracle.SPECS[key]
    kv = cases.random_kv(rng, num_tokens, spec.d_qk)
    kv[: min(6, num_tokens)] = crafted_rows(key)[: min(6, num_tokens)]
    kv = kv.astype(kv_dtype)
    got = _quantize_jit(kv, key, page_size)
    want = oracle.quantize(kv, key, page_size)
    num_pages = -(-num_tokens // page_size)
    assert got.shape == (num_pages, page_size, spec.bytes_per_token if spec.quantized else spec.d_qk)
    _assert_same_bytes(got, want)


@pytest.mark.parametrize("key", ALL_FORMATS)
def test_quantize_kv_crafted_rows_bit_exact(key):
    rows = crafted_rows(key)
    _assert_same_bytes(_quantize_jit(rows, key, 2), oracle.quantize(rows, key, 2))


@pytest.mark.parametrize("key", [k for k, s in oracle.SPECS.items() if s.bits == 4])
def test_fp4_rounding_corners(key):
    """E2M1 rounding by value: ties go to the even code, ±6 saturates, a negative value that rounds to
    zero keeps its sign, and the scales are E4M3 of amax / 6 clamped to [2^-9, 448]."""
    spec = oracle.SPECS[key]
    rows = fp4_crafted_rows(spec)
    data, scales = oracle.read_slots(_quantize_jit(rows, key, 4), key, np.arange(4))
    codes = np.stack([data[:, :spec.quant_lanes // 2] & 0xF, data[:, :spec.quant_lanes // 2] >> 4], -1).reshape(4, -1)
    scale = scales[:, :spec.groups].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert np.all(scale[0] == 1.0) and np.all(scale[1] == 1.0) and np.all(scale[2] == 2.0**-9)
    want = {6.0: 7, 0.25: 0, 0.75: 2, 1.25: 2, 1.75: 4, 2.5: 4, 3.5: 6, 5.0: 6, -0.25: 8, -0.75: 10, -2.5: 12,
            -5.0: 14, -0.1: 8, 0.7499999: 1, 0.2500001: 1, 4.9999995: 6}
    want = {float(np.float32(value)): code for value, code in want.items()}
    for lane, value in enumerate(rows[0, :spec.group]):
        assert codes[0, lane] == want[float(value)], (value, codes[0, lane])
        assert codes[0, spec.group + lane] == want[float(value)] ^ 8  # the negated group: the sign bit flips
    assert np.all((codes[1] & 7)[np.abs(rows[1, :spec.quant_lanes]) > 6.0] == 7)  # saturated at ±6
    k, _ = jsm.dequantize_kv(jnp.asarray(_quantize_jit(rows, key, 4)), key)
    assert np.abs(np.asarray(k)[1, :spec.quant_lanes]).max() == 6.0


@pytest.mark.parametrize("key", ["dsv3_2", "dsv4", "dsv4_1", "dots3_swa"])
def test_power_of_two_scales_at_the_boundary(key):
    """amax = 448*2^k gives scale 2^k exactly; one ulp above gives 2^(k+1)."""
    spec = oracle.SPECS[key]
    cache = _quantize_jit(crafted_rows(key), key, 6)
    data, scales = oracle.read_slots(cache, key, [1, 2])
    if spec.scale == "fp32":
        raw = data[:, spec.scale_offset: spec.scale_offset + 4 * spec.groups].copy().view("<f4")
        decoded_scales = raw.astype(np.float64)
    else:
        decoded_scales = 2.0 ** (scales[:, : spec.groups].astype(np.int64) - 127)
    exact = 2.0 ** (np.arange(spec.groups) - 3)
    np.testing.assert_array_equal(decoded_scales[0], exact)
    np.testing.assert_array_equal(decoded_scales[1], 2 * exact)
    assert decoded_scales.shape == (2, spec.groups)


@pytest.mark.parametrize("key", ["dsv4", "dsv3_2", "glm_nsa", "dsv4_1"])
def test_padding_tokens_and_pad_bytes_are_zero(rng, key):
    spec = oracle.SPECS[key]
    cache = _quantize_jit(cases.random_kv(rng, 5, spec.d_qk), key, 4)  # 3 padding tokens
    got_data, got_scales = oracle.read_slots(cache, key, np.arange(5, 8))
    assert not got_data.any() and (got_scales is None or not got_scales.any())
    real_data, real_scales = oracle.read_slots(cache, key, np.arange(5))
    assert real_data.any()
    if key == "dsv4":
        assert not real_scales[:, 7].any(), "the dsv4 scale pad byte must be zero"


def test_quantize_kv_rejects_bad_arguments():
    kv = jnp.zeros((4, 576), jnp.float32)
    for page_size in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="page_size"):
            jsm.quantize_kv(kv, "dsv3_2", page_size=page_size)
    with pytest.raises(ValueError, match="kv"):
        jsm.quantize_kv(jnp.zeros((4, 512), jnp.float32), "dsv3_2")
    with pytest.raises(TypeError, match="kv"):
        jsm.quantize_kv(jnp.zeros((4, 576), jnp.int32), "dsv3_2")
    with pytest.raises(ValueError, match="kv_format"):
        jsm.quantize_kv(kv, "fp8")


def test_quantize_kv_zero_tokens_gives_one_zero_page():
    cache = _quantize_jit(np.zeros((0, 576), np.float32), "dsv3_2", 4)
    assert cache.shape == (1, 4, 656) and not cache.any()


# --------------------------------------------------------------------------------------------------
# dequantize_kv: against the oracle's byte-level decoder
# --------------------------------------------------------------------------------------------------

def random_byte_cache(rng, key, shape, page_size=None, dtype=np.uint8):
    """Random bytes everywhere (fp8 NaNs included) with finite, normal scales and bf16 lanes."""
    spec = oracle.SPECS[key]
    if not spec.quantized:
        return rng.standard_normal(shape).astype(ml_dtypes.bfloat16)
    cache = rng.integers(0, 256, shape, dtype=np.uint8)
    geom = oracle.geometry(shape, key, page_size)
    raw = oracle.cache_bytes(cache)
    slots = np.arange(geom.num_slots)
    page, row = slots // geom.page_size, slots % geom.page_size
    base = page * geom.page_stride
    data = base + row * geom.row_stride
    if spec.kind == "inline":
        scale_start = data + spec.scale_offset
    else:
        scale_start = base + geom.page_size * geom.row_stride + row * spec.scale_row + spec.scale_offset
    if spec.scale == "fp32":
        values = (rng.uniform(2.0**-10, 16.0, (slots.size, spec.groups))
                  * rng.choice([-1, 1], (slots.size, spec.groups))).astype("<f4")
        scale_bytes = values.view(np.uint8)
    else:
        scale_bytes = rng.integers(110, 145, (slots.size, spec.groups)).astype(np.uint8)
    raw[scale_start[:, None] + np.arange(scale_bytes.shape[1])] = scale_bytes
    if spec.bf16_lanes:
        rope = rng.standard_normal((slots.size, spec.bf16_lanes)).astype(ml_dtypes.bfloat16).view(np.uint8)
        raw[(data + spec.bf16_offset)[:, None] + np.arange(rope.shape[1])] = rope
    return cache.view(dtype)


DEQUANT_LAYOUTS = [
    ("dsv3_2", (3, 4, 656), None), ("dsv3_2", (3, 2, 1, 672), None), ("dsv3_2", (2, 1040 * 2), 3),
    ("glm_nsa", (2, 1, 3, 768), None), ("glm_nsa", (4, 656), 1),
    ("glm53_nope", (3, 2, 528), None), ("glm53_nope", (3, 2, 656), None), ("glm53_nope", (2, 1600), 3),
    ("dsv4", (2, 4, 584), None), ("dsv4", (3, 1, 2, 584), None), ("dsv4", (3, 1760), 3), ("dsv4", (4, 592), 1),
    ("dsv4_1", (3, 1, 528), None), ("dsv4_1", (2, 3, 1, 528), None), ("dsv4_1", (2, 2656), 5),
    ("dots3_swa", (2, 2, 1160), None), ("dots3_swa", (2, 3488), 3),
    ("bf16_576", (7, 576), None), ("bf16_576", (2, 3, 576), None), ("bf16_512", (2, 1, 4, 512), None),
    ("bf16_512", (3, 2, 1, 512), None),
]


@pytest.mark.parametrize("key,shape,page_size", DEQUANT_LAYOUTS, ids=lambda v: str(v).replace(" ", ""))
def test_dequantize_kv_matches_oracle(rng, key, shape, page_size):
    cache = random_byte_cache(rng, key, shape, page_size)
    k, v = jax.jit(jsm.dequantize_kv, static_argnames=("kv_format", "page_size"))(
        jnp.asarray(cache), kv_format=key, page_size=page_size)
    want = oracle.decode(cache, key, page_size).astype(np.float32)
    spec = oracle.SPECS[key]
    assert k.dtype == jnp.float32 and v.dtype == jnp.float32
    assert k.shape == (want.shape[0], spec.d_qk) and v.shape == (want.shape[0], spec.d_v)
    np.testing.assert_array_equal(np.asarray(k), want)
    np.testing.assert_array_equal(np.asarray(v), want[:, : spec.d_v])


@pytest.mark.parametrize("view", [np.int8, ml_dtypes.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("key", ["glm_nsa", "dsv4"])
def test_dequantize_kv_byte_views(rng, key, view):
    shape = (2, 4, oracle.SPECS[key].bytes_per_token)
    cache = random_byte_cache(rng, key, shape)
    as_view = jnp.asarray(cache.view(view))
    np.testing.assert_array_equal(np.asarray(as_view).view(np.uint8), cache)  # the transfer keeps the bits
    k, _ = jsm.dequantize_kv(as_view, key)
    np.testing.assert_array_equal(np.asarray(k), oracle.decode(cache, key).astype(np.float32))


@pytest.mark.parametrize("key", ALL_FORMATS)
def test_quantize_dequantize_round_trip_error(rng, key):
    """Dequantized values are within the FP8 step of the input (BF16 lanes within bf16 rounding)."""
    spec = oracle.SPECS[key]
    kv = cases.random_kv(rng, 9, spec.d_qk)
    k, _ = jsm.dequantize_kv(jsm.quantize_kv(jnp.asarray(kv), key, page_size=4), key)
    k = np.asarray(k)[:9]
    assert np.all(np.isfinite(k))
    if spec.quantized:
        nope = slice(0, spec.quant_lanes)
        amax = np.abs(kv[:, nope]).reshape(9, spec.groups, spec.group).max(-1, keepdims=True)
        err = np.abs(k[:, nope] - kv[:, nope]).reshape(9, spec.groups, spec.group)
        # Half an FP8 step (3 mantissa bits) of the group's largest value, or for FP4 half the widest E2M1
        # step (2 at magnitudes 4..6) times the E4M3-rounded scale amax/6 (rounding up by up to 2^-4).
        step = 2 * 2.0**-4 if spec.bits == 8 else (1.0 / 6.0) * (1 + 2.0**-4)
        assert np.all(err <= amax * step + 1e-30)
    rope = slice(spec.quant_lanes, spec.d_qk)
    np.testing.assert_allclose(k[:, rope], kv[:, rope], rtol=2.0**-8)


def test_glm53_nope_and_dsv4_1_read_the_same_bytes_differently(rng):
    kv = cases.random_kv(rng, 8, 512)
    a = _quantize_jit(kv, "glm53_nope", 4)
    b = _quantize_jit(kv, "dsv4_1", 4)
    assert a.shape == b.shape == (2, 4, 528)
    assert not np.array_equal(a, b)
    for bytes_, own, other in ((a, "glm53_nope", "dsv4_1"), (b, "dsv4_1", "glm53_nope")):
        k_own, _ = jsm.dequantize_kv(jnp.asarray(bytes_), own)
        np.testing.assert_array_equal(np.asarray(k_own), oracle.decode(bytes_, own).astype(np.float32))
        np.testing.assert_allclose(np.asarray(k_own)[:8], kv, atol=0.07 * np.abs(kv).max())
        k_other, _ = jsm.dequantize_kv(jnp.asarray(bytes_), other)  # the same bytes read as the other format
        assert not np.allclose(np.nan_to_num(np.asarray(k_other)[:8]), kv, atol=0.07 * np.abs(kv).max())


# --------------------------------------------------------------------------------------------------
# update_kv
# --------------------------------------------------------------------------------------------------

# (key, form, page_size, row_bytes or page_bytes)
UPDATE_LAYOUTS = [
    ("dsv3_2", "3d", 4, None), ("dsv3_2", "nhd", 2, None), ("dsv3_2", "hnd", 3, None), ("dsv3_2", "2d", 3, 2000),
    ("glm_nsa", "3d", 2, 672), ("glm_nsa", "2d", 1, 672),
    ("glm53_nope", "3d", 3, 656), ("glm53_nope", "2d", 4, 2128), ("glm53_nope", "hnd", 1, None),
    ("dsv4", "3d", 2, None), ("dsv4", "nhd", 4, None), ("dsv4", "2d", 3, 1792), ("dsv4", "2d", 1, 592),
    ("dsv4_1", "3d", 1, None), ("dsv4_1", "hnd", 3, None), ("dsv4_1", "2d", 5, 2656),
    ("dots3_swa", "3d", 2, None), ("dots3_swa", "2d", 3, 3488),
    ("bf16_576", "2d", None, None), ("bf16_576", "3d", 4, None), ("bf16_512", "nhd", 2, None),
    ("bf16_512", "hnd", 3, None), ("bf16_512", "2d", None, None),
]


def _layout_shape(key, form, page_size, width, num_pages):
    spec = oracle.SPECS[key]
    if not spec.quantized:
        if form == "2d":
            return (num_pages * 3, spec.d_qk)
        row = spec.d_qk
    elif form == "2d":
        return (num_pages, width)
    else:
        row = width or spec.bytes_per_token
    return {"3d": (num_pages, page_size, row), "nhd": (num_pages, page_size, 1, row),
            "hnd": (num_pages, 1, page_size, row)}[form]


def expected_update(cache, key, slots, kv, page_size):
    """The oracle's update: encoded bytes of valid slots written through the geometry, rest untouched."""
    geom = oracle.geometry(cache.shape, key, page_size)
    out = np.ascontiguousarray(cache).copy()
    raw = oracle.cache_bytes(out)
    data, scales = oracle.encode_tokens(kv, key)
    for i, slot in enumerate(slots):
        if not 0 <= slot < geom.num_slots:
            continue
        payloads = [data[i], scales[i]] if oracle.SPECS[key].kind == "footer" else [data[i]]
        for (start, stop), payload in zip(oracle.slot_byte_ranges(geom, key, slot), payloads):
            assert stop - start == payload.size
            raw[start:stop] = payload
    return out


def _update_inputs(rng, key, form, page_size, width, kv_dtype=np.float32):
    shape = _layout_shape(key, form, page_size, width, num_pages=4)
    page_arg = page_size if (form == "2d" and oracle.SPECS[key].quantized) else None
    cache = random_byte_cache(rng, key, shape, page_arg)
    num_slots = oracle.geometry(shape, key, page_arg).num_slots
    valid = rng.permutation(num_slots)[: max(1, num_slots // 2)]
    invalid = np.array([-1, -5, cases.INT32_MIN, num_slots, num_slots + 7, cases.INT32_MAX])
    slots = rng.permutation(np.concatenate([valid, invalid])).astype(np.int32)
    kv = cases.random_kv(rng, slots.size, oracle.SPECS[key].d_qk, kv_dtype)
    return cache, slots, kv, page_arg


@pytest.mark.parametrize("key,form,page_size,width", UPDATE_LAYOUTS, ids=lambda v: str(v))
def test_update_kv_writes_exactly_the_target_rows(rng, key, form, page_size, width):
    cache, slots, kv, page_arg = _update_inputs(rng, key, form, page_size, width)
    got = jax.jit(jsm.update_kv, static_argnames=("kv_format", "page_size"))(
        jnp.asarray(cache), jnp.asarray(slots), jnp.asarray(kv), kv_format=key, page_size=page_arg)
    got = np.asarray(got)
    want = expected_update(cache, key, slots, kv, page_arg)
    _assert_same_bytes(got, want)
    assert not np.array_equal(oracle.cache_bytes(want), oracle.cache_bytes(cache))


@pytest.mark.parametrize("key", ["dsv3_2", "dsv4", "bf16_576"])
def test_update_kv_bfloat16_rows(rng, key):
    form, page_size = "3d", 2
    cache, slots, kv, page_arg = _update_inputs(rng, key, form, page_size, None, ml_dtypes.bfloat16)
    got = np.asarray(jsm.update_kv(jnp.asarray(cache), jnp.asarray(slots), jnp.asarray(kv), key))
    _assert_same_bytes(got, expected_update(cache, key, slots, kv, page_arg))


@pytest.mark.parametrize("view", [np.int8, ml_dtypes.float8_e4m3fn], ids=["int8", "fp8"])
def test_update_kv_keeps_the_byte_view(rng, view):
    cache, slots, kv, _ = _update_inputs(rng, "dsv4_1", "3d", 2, None)
    got = jsm.update_kv(jnp.asarray(cache.view(view)), jnp.asarray(slots), jnp.asarray(kv), "dsv4_1")
    assert got.dtype == np.dtype(view)
    _assert_same_bytes(np.asarray(got).view(np.uint8), expected_update(cache, "dsv4_1", slots, kv, None))


@pytest.mark.parametrize("key,form,page_size,width", [("glm_nsa", "3d", 4, 672), ("dsv4", "2d", 3, 1760),
                                                      ("bf16_512", "3d", 2, None)], ids=str)
def test_update_kv_in_place_with_donation(rng, key, form, page_size, width):
    cache, slots, kv, page_arg = _update_inputs(rng, key, form, page_size, width)
    step = jax.jit(jsm.update_kv, static_argnames=("kv_format", "page_size"), donate_argnums=0)
    want = cache
    device_cache = jnp.asarray(cache)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*[Dd]onat.*")
        for _ in range(2):  # a serving loop: two steps on the same buffer
            new = step(device_cache, jnp.asarray(slots), jnp.asarray(kv), kv_format=key, page_size=page_arg)
            assert device_cache.is_deleted(), "the donated cache was not consumed"
            want = expected_update(want, key, slots, kv, page_arg)
            device_cache = new
            slots = np.roll(slots, 1)
            kv = kv[::-1].copy()
    _assert_same_bytes(np.asarray(device_cache), want)
    hlo = step.lower(device_cache, jnp.asarray(slots), jnp.asarray(kv), kv_format=key,
                     page_size=page_arg).as_text()
    assert "tf.aliasing_output" in hlo or "jax.buffer_donor" in hlo


def test_update_kv_rejects_bad_slots():
    cache = jnp.zeros((2, 4, 656), jnp.uint8)
    kv = jnp.zeros((3, 576), jnp.float32)
    with pytest.raises(TypeError, match="slots"):
        jsm.update_kv(cache, jnp.zeros((3,), jnp.int16), kv, "dsv3_2")
    with pytest.raises(ValueError, match="slots"):
        jsm.update_kv(cache, jnp.zeros((2,), jnp.int32), kv, "dsv3_2")
    with pytest.raises(ValueError, match="kv"):
        jsm.update_kv(cache, jnp.zeros((3,), jnp.int32), jnp.zeros((3, 512), jnp.float32), "dsv3_2")


# --------------------------------------------------------------------------------------------------
# Accepted and rejected cache shapes
# --------------------------------------------------------------------------------------------------

ACCEPTED = [
    ("dsv3_2", (5, 64, 656), "uint8", None), ("dsv3_2", (5, 1, 656), "int8", 1),
    ("dsv3_2", (5, 3, 1, 768), "float8_e4m3fn", None), ("dsv3_2", (5, 1, 3, 672), "uint8", 3),
    ("dsv3_2", (5, 1968), "uint8", 3), ("dsv3_2", (5, 2000), "uint8", 3),
    ("glm_nsa", (2, 2, 656), "uint8", None), ("glm53_nope", (2, 2, 656), "uint8", None),
    ("glm53_nope", (2, 528), "uint8", 1), ("glm53_nope", (2, 1056), "uint8", 2),
    ("dsv4", (2, 2, 584), "uint8", None), ("dsv4", (2, 64, 1, 584), "uint8", 64), ("dsv4", (2, 1, 4, 584), "int8", None),
    ("dsv4", (2, 592), "uint8", 1), ("dsv4", (2, 1760), "uint8", 3),
    ("dsv4_1", (2, 1, 528), "uint8", None), ("dsv4_1", (2, 3, 528), "uint8", None), ("dsv4_1", (2, 528), "uint8", 1),
    ("dots3_swa", (2, 2, 1160), "uint8", None), ("dots3_swa", (2, 1168), "uint8", 1),
    ("bf16_576", (9, 576), "bfloat16", None), ("bf16_576", (9, 576), "bfloat16", 1),
    ("bf16_576", (3, 4, 576), "bfloat16", 4), ("bf16_512", (3, 1, 4, 512), "bfloat16", None),
    ("bf16_512", (3, 4, 1, 512), "bfloat16", None),
]


@pytest.mark.parametrize("key,shape,dtype,page_size", ACCEPTED, ids=str)
def test_cache_layout_accepts_and_matches_oracle_geometry(key, shape, dtype, page_size):
    layout = cache_layout(jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)), key, page_size)
    geom = oracle.geometry(shape, key, page_size)
    assert (layout.num_pages, layout.page_size, layout.page_stride, layout.row_stride) == dataclasses.astuple(geom)
    assert layout.num_slots == geom.num_slots


REJECTED = [
    ("dsv4", (2, 2, 592), "uint8", None, ValueError, "row_bytes"),  # footer rows are packed
    ("dsv4_1", (2, 2, 544), "uint8", None, ValueError, "row_bytes"),
    ("dsv4", (2, 3, 584), "uint8", None, ValueError, "page_size"),  # 3*584 % 16 != 0
    ("dsv4", (2, 1, 1, 584), "uint8", None, ValueError, "page_size"),
    ("dots3_swa", (2, 1, 1160), "uint8", None, ValueError, "page_size"),
    ("dsv4", (2, 1168), "uint8", None, ValueError, "page_size"),  # 2-D without page_size
    ("glm_nsa", (2, 656), "uint8", None, ValueError, "page_size"),
    ("dsv3_2", (2, 1296), "uint8", 2, ValueError, "page_bytes"),  # < 2*656
    ("dsv3_2", (2, 1320), "uint8", 2, ValueError, "page_bytes"),  # not % 16
    ("dsv4", (2, 584), "uint8", 1, ValueError, "page_bytes"),  # 584 % 16 != 0
    ("dsv4", (2, 1744), "uint8", 3, ValueError, "page_bytes"),  # < 3*584
    ("dsv3_2", (2, 4, 640), "uint8", None, ValueError, "row_bytes"),  # narrower than 656
    ("glm53_nope", (2, 4, 520), "uint8", None, ValueError, "row_bytes"),
    ("glm53_nope", (2, 4, 536), "uint8", None, ValueError, "row_bytes"),  # not % 16
    ("dsv3_2", (2, 4, 664), "uint8", None, ValueError, "row_bytes"),
    ("dsv3_2", (2, 4, 656), "uint8", 2, ValueError, "page_size"),  # page_size contradicts the shape
    ("dsv3_2", (2, 2, 2, 656), "uint8", None, ValueError, "kv_cache"),  # non-unit head axis
    ("dsv3_2", (2, 1, 1, 1, 656), "uint8", None, ValueError, "kv_cache"),
    ("dsv3_2", (656,), "uint8", None, ValueError, "kv_cache"),
    ("dsv3_2", (2, 4, 656), "float32", None, TypeError, "kv_cache"),
    ("dsv3_2", (2, 4, 328), "bfloat16", None, TypeError, "kv_cache"),
    ("dsv4", (2, 4, 584), "uint16", None, TypeError, "kv_cache"),
    ("bf16_576", (2, 4, 576), "uint8", None, TypeError, "kv_cache"),
    ("bf16_576", (2, 4, 576), "float32", None, TypeError, "kv_cache"),
    ("bf16_576", (2, 4, 512), "bfloat16", None, ValueError, "kv_cache"),
    ("bf16_512", (8, 512), "bfloat16", 4, ValueError, "page_size"),
    ("dsv3_2", (2, 1312), "uint8", 0, ValueError, "page_size"),
]


@pytest.mark.parametrize("key,shape,dtype,page_size,error,match", REJECTED, ids=str)
def test_cache_layout_rejects(key, shape, dtype, page_size, error, match):
    with pytest.raises(error, match=match):
        cache_layout(jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)), key, page_size)


def test_caches_larger_than_4gib_use_64_bit_geometry():
    """Shape-only: a > 4 GiB cache gets a layout whose byte offsets exceed 32 bits."""
    shape = (70_000, 64, 1160)
    layout = cache_layout(jax.ShapeDtypeStruct(shape, jnp.uint8), "dots3_swa")
    assert layout.num_pages * layout.page_stride == np.prod(shape, dtype=np.int64) > 2**32
    assert layout.num_slots == 70_000 * 64
