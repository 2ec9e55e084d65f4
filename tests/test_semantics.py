"""The semantics of ``sparse_mla`` (docs/semantics.md) against the float64 oracle, for the CPU FFI kernel
and impl="xla".

Unless a test says otherwise, every cache slot not referenced by a valid candidate, and every padding
byte, is 0xFF (NaN as FP8, UE8M0, FP32 and BF16): any read of an unused byte shows up as NaN.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_sparse_mla as jsm
from jax_sparse_mla import api

import cases
import oracle
from cases import make_case

ALL_FORMATS = list(oracle.SPECS)


def _page_form(key, page_size):
    """3-D when the format allows this page size there, else the 2-D padded-page form."""
    return "3d" if page_size % oracle.min_3d_page_multiple(key) == 0 else "2d"


@pytest.mark.parametrize("page_size", [1, 2, 64])
@pytest.mark.parametrize("key", ALL_FORMATS)
def test_every_format_and_page_size(rng, impl, key, page_size):
    case = make_case(rng, key, num_tokens=4, num_heads=3, topk=16, page_size=page_size,
                     form=_page_form(key, page_size))
    case.check(impl)


@pytest.mark.parametrize("num_heads,topk", [(1, 1), (1, 7), (1, 64), (3, 1), (3, 7), (3, 64), (16, 1), (16, 7),
                                            (16, 64), (20, 7), (128, 1), (128, 7)])
@pytest.mark.parametrize("key", ["glm_nsa", "dsv4"])
def test_heads_and_topk(rng, impl, key, num_heads, topk):
    case = make_case(rng, key, num_tokens=3, num_heads=num_heads, topk=topk, page_size=64,
                     invalid_fraction=0.1 if topk == 1 else 0.25)
    case.check(impl)


@pytest.mark.parametrize("key,row_bytes", [("dsv3_2", 672), ("glm_nsa", 768), ("glm53_nope", 656),
                                           ("glm53_nope", 544)])
def test_padded_inline_rows_are_never_read(rng, impl, key, row_bytes):
    """Padding after the payload of each row (0xFF here) never influences results; 656 is the legacy
    glm53_nope pool width."""
    case = make_case(rng, key, num_heads=4, topk=24, page_size=2, row_bytes=row_bytes)
    assert case.main.array.shape[-1] == row_bytes
    _, lse, *_ = case.check(impl)
    assert np.isfinite(lse).any()


@pytest.mark.parametrize("page_size", [1, 3, 64])
@pytest.mark.parametrize("key", oracle.QUANTIZED)
def test_two_dimensional_caches_with_page_gaps(rng, impl, key, page_size):
    case = make_case(rng, key, num_heads=2, topk=12, page_size=page_size, form="2d",
                     page_bytes=cases.padded_page_bytes(key, page_size, extra=48))
    geom = case.main.geometry
    assert geom.page_stride > page_size * oracle.SPECS[key].bytes_per_token
    case.check(impl)


@pytest.mark.parametrize("form", ["nhd", "hnd"])
@pytest.mark.parametrize("key", ["dsv3_2", "glm53_nope", "dsv4", "dsv4_1", "dots3_swa", "bf16_576", "bf16_512"])
def test_four_dimensional_views(rng, impl, key, form):
    case = make_case(rng, key, num_heads=3, topk=10, page_size=2, form=form)
    assert case.main.array.ndim == 4
    case.check(impl)


@pytest.mark.parametrize("key", ["bf16_576", "bf16_512"])
def test_bf16_slot_rows(rng, impl, key):
    case = make_case(rng, key, num_heads=3, topk=10, page_size=4, form="2d")
    assert case.main.array.shape == (case.main.num_slots, oracle.SPECS[key].d_qk)
    case.check(impl)


@pytest.mark.parametrize("view", [np.int8, ml_dtypes.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("key", oracle.QUANTIZED)
def test_int8_and_fp8_views_of_the_same_bytes(rng, impl, key, view):
    case = make_case(rng, key, num_heads=2, topk=12, page_size=2, form=_page_form(key, 2))
    out, lse, *_ = case.check(impl)
    viewed = dataclasses.replace(case, main=case.main.viewed(view))
    out_view, lse_view = viewed.run(impl)
    np.testing.assert_array_equal(out_view.view(np.uint16), out.view(np.uint16))
    np.testing.assert_array_equal(lse_view, lse)


@pytest.mark.parametrize("kind", cases.INVALID_INDEX_KINDS)
@pytest.mark.parametrize("key", ["dsv3_2", "dsv4_1", "bf16_512", "dsv4_nvfp4"])
def test_invalid_indices_are_masked(rng, impl, key, kind):
    case = make_case(rng, key, num_tokens=4, num_heads=2, topk=9, page_size=4, invalid_fraction=0.0,
                     topk_length=None, poison=False)
    num_slots = case.main.num_slots
    indices = case.indices.copy()
    indices[:, 1::2] = [[cases.invalid_index(rng, kind, num_slots) for _ in range(indices[:, 1::2].shape[1])]
                        for _ in range(indices.shape[0])]
    indices[3, :] = cases.invalid_index(rng, kind, num_slots)  # a row with no valid candidate
    case = dataclasses.replace(case, indices=indices).poison_unused()
    out, lse, *_ = case.check(impl)
    assert np.all(lse[3] == -np.inf) and np.all(out[3].astype(np.float32) == 0)


@pytest.mark.parametrize("with_sink", [False, True])
@pytest.mark.parametrize("key", ["glm_nsa", "dsv4", "bf16_576", "dsv4_1_fp4"])
def test_empty_rows(rng, impl, key, with_sink):
    """Rows with no valid candidate: out = 0 and lse = -inf, or lse = sink with a sink."""
    sink = rng.standard_normal(3).astype(np.float32) if with_sink else None
    case = cases.empty_rows_case(rng, key, num_tokens=cases.EMPTY_ROWS, attn_sink=sink)
    out, lse, *_ = case.check(impl)
    assert np.all(out.astype(np.float32) == 0)
    want = np.broadcast_to(sink if with_sink else -np.inf, lse.shape)
    np.testing.assert_array_equal(lse, want)


@pytest.mark.parametrize("key", ["dsv3_2", "glm53_nope", "dsv4", "dots3_swa", "bf16_512", "dsv4_nvfp4"])
def test_sinks_finite_infinite_and_absent(rng, impl, key):
    sink = np.array([0.7, np.inf, -np.inf, -2.5, 30.0], np.float32)
    case = make_case(rng, key, num_tokens=4, num_heads=5, topk=12, page_size=2, attn_sink=sink)
    out, lse, *_ = case.check(impl)
    assert np.all(lse[:, 1] == np.inf) and np.all(out[:, 1].astype(np.float32) == 0)
    absent = dataclasses.replace(case, attn_sink=None)
    out_absent, lse_absent, *_ = absent.check(impl)
    # A -inf sink has no effect: head 2 equals the no-sink result.
    np.testing.assert_array_equal(lse[:, 2], lse_absent[:, 2])
    np.testing.assert_array_equal(out[:, 2].view(np.uint16), out_absent[:, 2].view(np.uint16))
    # A finite sink adds exp(sink) to the normaliser.
    has = np.isfinite(lse_absent[:, 0])
    np.testing.assert_allclose(lse[has, 0], np.logaddexp(lse_absent[has, 0], 0.7), atol=1e-4)


def test_topk_length_edge_values(rng, impl):
    topk = 8
    lengths = np.array([0, -1, -100, cases.INT32_MIN, 1, 3, topk, topk + 1, 1000, cases.INT32_MAX], np.int32)
    case = make_case(rng, "dsv3_2", num_tokens=lengths.size, num_heads=2, topk=topk, page_size=4,
                     invalid_fraction=0.0, topk_length=lengths)
    out, lse, *_ = case.check(impl)
    assert np.all(lse[:4] == -np.inf) and np.all(np.isfinite(lse[4:]))
    # Rows 6..9 all use the whole row: their results depend only on q and the indices.
    full = dataclasses.replace(case, topk_length=None)
    out_full, lse_full = full.run(impl)
    np.testing.assert_array_equal(lse[6:], lse_full[6:])


@pytest.mark.parametrize("poisoned", [True, False])
def test_dots3_swa_window_of_513(rng, impl, poisoned):
    """Positions >= 513 of an index row are ignored even when valid (and, poisoned, never read)."""
    topk, window = 600, 513
    case = make_case(rng, "dots3_swa", num_tokens=3, num_heads=2, topk=topk, page_size=64, cache_tokens=6 * 64,
                     topk_length=None, poison=False)
    num_slots = case.main.num_slots
    inside, outside = np.arange(0, 256), np.arange(256, num_slots)
    indices = cases.random_indices(rng, 3, topk, num_slots, 0.1, pool=inside)
    indices[:, window:] = rng.choice(outside, (3, topk - window))
    topk_length = np.array([topk, 520, 100], np.int32)
    # Rows 0 and 1 point their queries at a slot past the window, so including it would dominate.
    keys = case.main.keys()
    q = case.q.astype(np.float32)
    for t, j in ((0, 590), (1, 515)):
        k = keys[indices[t, j]]
        q[t, :] = k * (30.0 / (case.sm_scale * (k @ k)))
    case = dataclasses.replace(case, indices=indices, topk_length=topk_length, q=q.astype(ml_dtypes.bfloat16))
    if poisoned:
        case = case.poison_unused()
        assert np.isnan(case.main.keys()[outside]).all()
    out, lse, ref_out, ref_lse = case.check(impl)
    if not poisoned:  # the test can tell: without the window the first two rows would differ
        _, unwindowed_lse = oracle.attention(case.q, case.sources(), key="dots3_swa", sm_scale=case.sm_scale,
                                             window=0)
        assert np.all(unwindowed_lse[:2] - ref_lse[:2] > 1e-2)  # 10x the lse tolerance
        np.testing.assert_array_equal(unwindowed_lse[2], ref_lse[2])


DUAL_PAIRS = [("dsv4", "dsv4"), ("dsv4_1", "dsv4_1"), ("dsv4_nvfp4", "dsv4_nvfp4"), ("dsv4_1_fp4", "dsv4_1_fp4"),
              ("dsv4", "dsv4_nvfp4"), ("dsv4_1", "dsv4_1_fp4")]


@pytest.mark.parametrize("extra_form,extra_page", [("3d", 2), ("2d", 3), ("hnd", 4)])
@pytest.mark.parametrize("key,extra_key", DUAL_PAIRS)
def test_dual_cache_joint_softmax(rng, impl, key, extra_key, extra_form, extra_page):
    if extra_form != "2d" and extra_page % oracle.min_3d_page_multiple(extra_key):
        extra_form = "2d"
    extra = dict(page_size=extra_page, form=extra_form, topk=7, cache_tokens=5 * extra_page + 1, kv_format=extra_key)
    case = make_case(rng, key, num_tokens=5, num_heads=3, topk=11, page_size=64, extra=extra)
    out, lse, ref_out, ref_lse = case.check(impl)
    # Joint normalisation: lse is the logaddexp of the two caches' own lse.
    main_only = dataclasses.replace(case, extra=None, extra_indices=None, extra_topk_length=None)
    _, lse_main = main_only.reference()
    extra_only = dataclasses.replace(case, indices=np.full_like(case.indices, -1))
    _, lse_extra = extra_only.reference()
    np.testing.assert_allclose(np.logaddexp(lse_main, lse_extra), ref_lse)
    assert np.isfinite(lse_extra).any() and np.isfinite(lse_main).any()
    extra_only.check(impl)


@pytest.mark.parametrize("key,extra_key", DUAL_PAIRS)
def test_dual_cache_lengths_and_sinks(rng, impl, key, extra_key):
    sink = np.array([0.3, -np.inf, np.inf, 1.0], np.float32)
    extra = dict(page_size=1, form="2d", topk=9, topk_length=np.array([0, -4, 9, 3, 100, 1], np.int32),
                 kv_format=extra_key)
    case = make_case(rng, key, num_tokens=6, num_heads=4, topk=5, page_size=2 * oracle.min_3d_page_multiple(key),
                     topk_length=np.array([5, 0, 0, 2, -1, 70], np.int32), attn_sink=sink, extra=extra)
    case.check(impl)
    without_lengths = dataclasses.replace(case, extra_topk_length=None).poison_unused()
    without_lengths.check(impl)


TWO_FORMAT_PAIRS = [pair for pair in DUAL_PAIRS if pair[0] != pair[1]]


@pytest.mark.parametrize("key,extra_key", TWO_FORMAT_PAIRS)
def test_two_format_dual_cache_as_one_call_per_cache(rng, monkeypatch, key, extra_key):
    """A dual cache of two formats as one kernel call per cache merged by lse with the sink (how the CUDA
    kernels run it), here over the CPU kernel: the accuracy contract, the joint kernel's result within
    a BF16 rounding of each part, padding rows and sinks as in the joint call."""
    sink = np.array([0.3, -np.inf, np.inf, 1.0], np.float32)
    extra = dict(page_size=2, topk=9, topk_length=np.array([0, -4, 9, 3, 100, 1], np.int32), kv_format=extra_key,
                 cache_tokens=41)
    case = make_case(rng, key, num_tokens=6, num_heads=4, topk=21, page_size=2 * oracle.min_3d_page_multiple(key),
                     topk_length=np.array([21, 0, 0, 2, -1, 70], np.int32), attn_sink=sink,
                     valid_tokens=np.int32(5), extra=extra)
    joint_out, joint_lse, *_ = case.check("auto")
    monkeypatch.setattr(api, "_JOINT_TWO_FORMAT_PLATFORMS", frozenset())
    out, lse, ref_out, _ = case.check("auto")
    assert np.all(out[5:].astype(np.float32) == 0) and np.all(lse[5:] == -np.inf)  # the padding row
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(joint_lse))
    finite = np.isfinite(joint_lse)
    np.testing.assert_allclose(lse[finite], joint_lse[finite], atol=1e-5)
    bf16_step = 2.0 ** -7 * max(1.0, float(np.abs(ref_out).max()))
    assert np.abs(out.astype(np.float32) - joint_out.astype(np.float32)).max() <= bf16_step
    case_without_sink = dataclasses.replace(case, attn_sink=None, valid_tokens=None)
    case_without_sink.check("auto")


@pytest.mark.parametrize("key", ["glm_nsa", "dsv4_1_fp4"])
@pytest.mark.parametrize("valid_tokens", [0, 2, 5, 9, -3], ids=lambda v: f"vt{v}")
@pytest.mark.parametrize("shape", [(), (1,)], ids=["scalar", "[1]"])
def test_valid_tokens(rng, impl, key, valid_tokens, shape):
    """Rows t >= valid_tokens give out = 0 and lse = -inf, even with a sink."""
    case = make_case(rng, key, num_tokens=5, num_heads=2, topk=8, page_size=4,
                     valid_tokens=np.full(shape, valid_tokens, np.int32),
                     attn_sink=np.array([0.5, -1.0], np.float32) if shape else None)
    out, lse, *_ = case.check(impl)
    rows = int(np.clip(valid_tokens, 0, 5))
    assert np.all(lse[rows:] == -np.inf) and np.all(out[rows:].astype(np.float32) == 0)
    full, _ = dataclasses.replace(case, valid_tokens=None).run(impl)
    np.testing.assert_array_equal(out[:rows].view(np.uint16), full[:rows].view(np.uint16))


@pytest.mark.parametrize("key", ["dsv3_2", "dsv4", "dots3_swa", "dsv4_nvfp4"])
def test_deterministic(rng, impl, key):
    case = make_case(rng, key, num_tokens=6, num_heads=16, topk=64, page_size=64)
    kwargs = case.kwargs(impl)
    static = {k: kwargs.pop(k) for k in cases.STATIC_ARGS if k in kwargs}
    fn = jax.jit(lambda q, c, i, kw: jsm.sparse_mla(q, c, i, **static, **kw))
    args = (jnp.asarray(case.q), jnp.asarray(case.main.array), jnp.asarray(case.indices),
            {k: None if v is None else jnp.asarray(v) for k, v in kwargs.items()})
    first = [np.asarray(x) for x in fn(*args)]
    for _ in range(3):
        again = [np.asarray(x) for x in fn(*args)]
        np.testing.assert_array_equal(again[0].view(np.uint16), first[0].view(np.uint16))
        np.testing.assert_array_equal(again[1].view(np.uint32), first[1].view(np.uint32))
    recompiled = case.run(impl)
    np.testing.assert_array_equal(recompiled[0].view(np.uint16), first[0].view(np.uint16))


def test_peaked_softmax_large_scores(rng, impl):
    """A large sm_scale makes one candidate dominate; lse stays finite and accurate."""
    case = make_case(rng, "bf16_576", num_tokens=3, num_heads=4, topk=32, page_size=64, sm_scale=0.5)
    _, lse, *_ = case.check(impl)
    assert np.abs(lse[np.isfinite(lse)]).max() > 20


def test_duplicate_indices_count_twice(rng, impl):
    case = make_case(rng, "dsv3_2", num_tokens=2, num_heads=2, topk=6, page_size=4, topk_length=None,
                     invalid_fraction=0.0, poison=False)
    indices = np.array([[3, 3, 3, 5, 5, 9], [1, 1, 1, 1, 1, 1]], np.int32)
    case = dataclasses.replace(case, indices=indices).poison_unused()
    case.check(impl)


def test_modest_larger_case(rng, impl):
    """A serving-like shape, still small enough for CI (no timing)."""
    case = make_case(rng, "dsv3_2", num_tokens=24, num_heads=32, topk=256, page_size=64, cache_tokens=4096,
                     invalid_fraction=0.05)
    case.check(impl)


def _round_fp32_scales(cache, key, dtype):
    """Copy of an inline FP32-scale cache with every group scale rounded through ``dtype``."""
    spec = oracle.SPECS[key]
    out = cache.copy()
    raw = oracle.cache_bytes(out)
    geom = oracle.geometry(cache.shape, key)
    for slot in range(geom.num_slots):
        start = oracle.slot_byte_ranges(geom, key, slot)[0][0] + spec.scale_offset
        scales = raw[start: start + 4 * spec.groups].copy().view("<f4")
        raw[start: start + 4 * spec.groups] = scales.astype(dtype).astype("<f4").view(np.uint8)
    return out


@pytest.mark.parametrize("key", ["glm_nsa", "glm53_nope"])
def test_arbitrary_fp32_scales_are_used_at_full_precision(rng, impl, key):
    """With large logits, scales rounded to 16 bits would move lse far past its 1e-3 tolerance."""
    case = make_case(rng, key, num_tokens=4, num_heads=2, topk=16, page_size=4, topk_length=None,
                     invalid_fraction=0.0)
    keys = case.main.keys()
    q = case.q.astype(np.float32)
    for t in range(4):
        k = keys[case.indices[t, t]]
        q[t, :] = k * (250.0 / (case.sm_scale * (k @ k)))
    case = dataclasses.replace(case, q=q.astype(ml_dtypes.bfloat16))
    _, lse, _, ref_lse = case.check(impl)
    assert np.all(ref_lse > 200)
    for dtype in (ml_dtypes.bfloat16, np.float16):
        rounded = dataclasses.replace(case, main=dataclasses.replace(
            case.main, array=_round_fp32_scales(case.main.array, key, dtype)))
        _, rounded_lse = rounded.reference()
        assert np.abs(rounded_lse - ref_lse).max() > 1e-2


def _available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@pytest.mark.skipif(_available_memory_bytes() < 12 * 2**30, reason="needs ~12 GiB of free host memory")
def test_cache_larger_than_4gib(rng, impl):
    """Slots whose bytes lie past 4 GiB are addressed with 64-bit offsets (footer scales included)."""
    key, page_size, num_pages = "dsv4", 64, 125_000
    assert num_pages * page_size * 584 > 2**32 + 2**28
    kv = cases.random_kv(rng, 2 * page_size, 512)
    pages = oracle.quantize(kv, key, page_size)
    targets = jnp.asarray([0, num_pages - 1])
    cache = jax.jit(lambda p: jnp.zeros((num_pages, page_size, 584), jnp.uint8).at[targets].set(p))(
        jnp.asarray(pages))
    slots = np.concatenate([np.arange(page_size), (num_pages - 1) * page_size + np.arange(page_size)])
    indices = rng.choice(slots, (3, 32)).astype(np.int32)
    indices[:, 0] = slots[-1]
    q = cases.random_q(rng, (3, 4, 512))
    out, lse = cases.call_sparse_mla(q, cache, indices, kv_format=key, sm_scale=512 ** -0.5, impl=impl)
    del cache
    small = np.where(indices >= page_size, indices - (num_pages - 2) * page_size, indices)  # same rows, 2 pages
    ref = oracle.attention(q, [oracle.CandidateSource(oracle.decode(pages, key), small)], key=key,
                           sm_scale=512 ** -0.5)
    oracle.check_accuracy(out, lse, *ref)


@pytest.mark.parametrize("key", ["dsv3_2", "dsv4"])
def test_batch_invariant_rows_do_not_depend_on_the_batch(rng, key):
    """With batch_invariant=True a row's bits do not depend on T. Kernel path only: impl="xla" leaves
    the reduction order to XLA, whose CPU dot blocking changes the last bit with T."""
    impl = "auto"
    case = make_case(rng, key, num_tokens=6, num_heads=16, topk=64, page_size=64)
    kw = case.kwargs(impl)
    kw["batch_invariant"] = True
    out, lse = cases.call_sparse_mla(case.q, case.main.array, case.indices, **kw)
    oracle.check_accuracy(out, lse, *case.reference())
    for t in (0, 5):
        alone = dict(kw, topk_length=case.topk_length[t: t + 1])
        out_t, lse_t = cases.call_sparse_mla(case.q[t: t + 1], case.main.array, case.indices[t: t + 1], **alone)
        np.testing.assert_array_equal(out_t[0].view(np.uint16), out[t].view(np.uint16))
        np.testing.assert_array_equal(lse_t[0], lse[t])


@pytest.mark.parametrize("key", ["dsv3_2", "bf16_576", "dsv4_nvfp4"])
def test_running_max_moves_on_every_tile(rng, key):
    """Ascending scores spread so that the running max rises on every 32-candidate tile."""
    case = cases.rising_max_case(rng, key, num_heads=16)
    keys = case.main.keys()
    for t in range(case.q.shape[0]):
        scores = keys[case.indices[t]] @ case.q[t, 0].astype(np.float64) * case.sm_scale * np.log2(np.e)
        assert np.all(np.diff(scores.reshape(-1, 32).max(axis=1)) > 8.0)
    for impl in ("auto", "xla"):
        case.check(impl)
