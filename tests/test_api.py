"""The public API around the op (docs/semantics.md, docs/planning.md, docs/errors.md): merging states, jit,
leading axes, vmap, T == 0, the lowered custom call, plan()/describe(), supported_configs() and
check_supported(). Gradients: tests/test_backward.py."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_sparse_mla as jsm
from jax_sparse_mla import _ffi

import cases
import oracle
from cases import make_case

TARGET = "jax_sparse_mla_fwd_v2"


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


# --------------------------------------------------------------------------------------------------
# merge_attention_states
# --------------------------------------------------------------------------------------------------

def _random_states(rng, shape, d, out_dtype):
    out = rng.standard_normal((*shape, d)).astype(out_dtype)
    lse = rng.normal(2.0, 3.0, shape).astype(np.float32)
    return out, lse


@pytest.mark.parametrize("out_dtype", [ml_dtypes.bfloat16, np.float32], ids=["bf16", "f32"])
def test_merge_attention_states_matches_oracle(rng, out_dtype):
    shape, d = (6, 5), 32
    out_a, lse_a = _random_states(rng, shape, d, out_dtype)
    out_b, lse_b = _random_states(rng, shape, d, out_dtype)
    # Row 0: a empty; row 1: b empty; row 2: both empty; row 3: a = +inf; row 4: both +inf.
    lse_a[0], lse_b[1], lse_a[2], lse_b[2] = -np.inf, -np.inf, -np.inf, -np.inf
    lse_a[3], lse_a[4], lse_b[4] = np.inf, np.inf, np.inf
    lse_b[5, :2] = -np.inf
    lse_b[5, 3] = np.inf
    out_a[0] = np.nan  # an empty state's values must never leak into the result
    out_b[2] = np.inf
    out, lse = jax.jit(jsm.merge_attention_states)(*map(jnp.asarray, (out_a, lse_a, out_b, lse_b)))
    assert out.dtype == out_dtype and lse.dtype == jnp.float32
    assert out.shape == out_a.shape and lse.shape == lse_a.shape
    ref_out, ref_lse = oracle.merge_states(np.where(lse_a[..., None] == -np.inf, 0, out_a.astype(np.float64)),
                                           lse_a, np.where(lse_b[..., None] == -np.inf, 0,
                                                           out_b.astype(np.float64)), lse_b)
    lse = np.asarray(lse)
    for sign in (np.inf, -np.inf):
        np.testing.assert_array_equal(lse == sign, ref_lse == sign)
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], atol=1e-5)
    out = np.asarray(out).astype(np.float64)
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out, ref_out, atol=2e-2 if out_dtype != np.float32 else 1e-5, rtol=1e-2)
    assert np.all(out[2] == 0) and np.all(out[3] == 0) and np.all(out[4] == 0)
    np.testing.assert_array_equal(lse[2], -np.inf)
    np.testing.assert_array_equal(lse[3], np.inf)
    np.testing.assert_allclose(out[1], out_a[1].astype(np.float64), atol=1e-6)  # merging with empty is identity


def test_merge_attention_states_rejects_mismatched_inputs():
    out, lse = jnp.zeros((2, 3, 8), jnp.bfloat16), jnp.zeros((2, 3), jnp.float32)
    with pytest.raises(TypeError, match="lse_a"):
        jsm.merge_attention_states(out, lse.astype(jnp.bfloat16), out, lse)
    with pytest.raises(ValueError, match="out"):
        jsm.merge_attention_states(out, lse, out[:, :2], lse[:, :2])


@pytest.mark.parametrize("key", ["dsv3_2", "dsv4"])
def test_merging_two_partial_results_equals_the_union(rng, impl, key):
    """sparse_mla over candidate sets A and B, merged, equals sparse_mla over A ++ B (sink in one part)."""
    case = make_case(rng, key, num_tokens=4, num_heads=3, topk=16, page_size=64, topk_length=None,
                     attn_sink=np.array([0.5, -1.0, np.inf], np.float32))
    first, second = case.indices[:, :9], case.indices[:, 9:]
    part_a = dataclasses.replace(case, indices=first)
    part_b = dataclasses.replace(case, indices=second, attn_sink=None)
    out_a, lse_a = part_a.run(impl)
    out_b, lse_b = part_b.run(impl)
    out, lse = jsm.merge_attention_states(jnp.asarray(out_a), jnp.asarray(lse_a), jnp.asarray(out_b),
                                          jnp.asarray(lse_b))
    ref_out, ref_lse = case.reference()
    oracle.check_accuracy(np.asarray(out), np.asarray(lse), ref_out, ref_lse)


# --------------------------------------------------------------------------------------------------
# jit, leading axes, vmap
# --------------------------------------------------------------------------------------------------

def _simple_inputs(rng, key="glm_nsa", num_tokens=6, num_heads=4, topk=10, page_size=4):
    case = make_case(rng, key, num_tokens=num_tokens, num_heads=num_heads, topk=topk, page_size=page_size)
    return case


def test_jit_traces_once_per_shape(rng):
    case = _simple_inputs(rng)
    traces = []

    @functools.partial(jax.jit, static_argnames=("impl",))
    def run(q, cache, indices, impl="auto"):
        traces.append(q.shape)
        return jsm.sparse_mla(q, cache, indices, kv_format="glm_nsa", sm_scale=0.05, impl=impl)

    cache = jnp.asarray(case.main.array)
    first = run(jnp.asarray(case.q), cache, jnp.asarray(case.indices))
    again = run(jnp.asarray(case.q), cache, jnp.asarray(case.indices))
    assert len(traces) == 1
    np.testing.assert_array_equal(_bits(first[0]), _bits(again[0]))
    run(jnp.asarray(case.q[:3]), cache, jnp.asarray(case.indices[:3]))
    assert len(traces) == 2


def test_eager_call_matches_jit(rng, impl):
    case = _simple_inputs(rng)
    kw = case.kwargs(impl)
    eager = jsm.sparse_mla(jnp.asarray(case.q), jnp.asarray(case.main.array), jnp.asarray(case.indices),
                           **{k: (jnp.asarray(v) if isinstance(v, np.ndarray) else v) for k, v in kw.items()})
    jitted = case.run(impl)
    np.testing.assert_array_equal(_bits(eager[0]), _bits(jitted[0]))
    np.testing.assert_array_equal(np.asarray(eager[1]), jitted[1])


def test_leading_axes(rng, impl):
    """q [B, S, H, d] with indices [B, S, topk] and topk_length [B, S] is the op on B*S flattened rows;
    valid_tokens counts flattened rows."""
    b, s = 2, 3
    case = make_case(rng, "dsv4_1", num_tokens=b * s, num_heads=4, topk=12, page_size=4,
                     valid_tokens=np.int32(4))
    kw = case.kwargs(impl)
    kw["topk_length"] = case.topk_length.reshape(b, s)
    out, lse = cases.call_sparse_mla(case.q.reshape(b, s, 4, 512), case.main.array,
                                     case.indices.reshape(b, s, 12), **kw)
    assert out.shape == (b, s, 4, 512) and lse.shape == (b, s, 4)
    assert out.dtype == ml_dtypes.bfloat16 and lse.dtype == np.float32
    flat_out, flat_lse = case.run(impl)
    np.testing.assert_array_equal(_bits(out.reshape(b * s, 4, 512)), _bits(flat_out))
    np.testing.assert_array_equal(lse.reshape(b * s, 4), flat_lse)
    ref_out, ref_lse = case.reference()
    oracle.check_accuracy(out.reshape(b * s, 4, 512), lse.reshape(b * s, 4), ref_out, ref_lse)
    assert np.all(lse[1, 1:] == -np.inf) and np.isfinite(lse[0]).any()


def test_indices_with_unit_axis(rng, impl):
    case = _simple_inputs(rng)
    kw = case.kwargs(impl)
    out, lse = cases.call_sparse_mla(case.q, case.main.array, case.indices[:, None, :], **kw)
    flat_out, flat_lse = case.run(impl)
    np.testing.assert_array_equal(_bits(out), _bits(flat_out))
    np.testing.assert_array_equal(lse, flat_lse)


def test_extra_indices_with_unit_axis(rng, impl):
    case = make_case(rng, "dsv4_1", num_tokens=4, num_heads=2, topk=6, page_size=4, extra=dict(page_size=2, topk=5))
    unit = dataclasses.replace(case, indices=case.indices[:, None, :], extra_indices=case.extra_indices[:, None, :])
    out, lse = unit.run(impl)
    flat_out, flat_lse = case.run(impl)
    np.testing.assert_array_equal(_bits(out), _bits(flat_out))
    np.testing.assert_array_equal(lse, flat_lse)


def _per_element(fn, batch, *args):
    results = [fn(*(a[i] if batched else a for a, batched in args)) for i in range(batch)]
    return [np.stack([np.asarray(r[k]) for r in results]) for k in range(2)]


def test_vmap_folds_batch_into_rows(rng, impl):
    batch, t, h, topk = 3, 4, 2, 8
    case = make_case(rng, "dsv3_2", num_tokens=batch * t, num_heads=h, topk=topk, page_size=4)
    q = jnp.asarray(case.q.reshape(batch, t, h, 576))
    indices = jnp.asarray(case.indices.reshape(batch, t, topk))
    lengths = jnp.asarray(case.topk_length.reshape(batch, t))
    cache = jnp.asarray(case.main.array)

    def op(q, indices, lengths):
        return jsm.sparse_mla(q, cache, indices, topk_length=lengths, kv_format="dsv3_2", sm_scale=case.sm_scale,
                              impl=impl)

    out, lse = jax.jit(jax.vmap(op))(q, indices, lengths)
    assert out.shape == (batch, t, h, 512) and lse.shape == (batch, t, h)
    want = _per_element(jax.jit(op), batch, (q, True), (indices, True), (lengths, True))
    np.testing.assert_allclose(np.asarray(out, np.float32), want[0].astype(np.float32), atol=1e-2, rtol=1e-2)
    np.testing.assert_allclose(np.asarray(lse), want[1], atol=1e-5)
    ref_out, ref_lse = case.reference()
    oracle.check_accuracy(np.asarray(out).reshape(batch * t, h, 512), np.asarray(lse).reshape(batch * t, h),
                          ref_out, ref_lse)
    # Only q batched: indices and lengths are shared by every element.
    out_q, lse_q = jax.vmap(op, in_axes=(0, None, None))(q, indices[0], lengths[0])
    want_q = _per_element(jax.jit(op), batch, (q, True), (indices[0], False), (lengths[0], False))
    np.testing.assert_allclose(np.asarray(lse_q), want_q[1], atol=1e-5)


def test_vmap_batched_valid_tokens_masks_each_element(rng, impl):
    batch, t, h = 4, 3, 2
    case = make_case(rng, "dsv4", num_tokens=t, num_heads=h, topk=6, page_size=4, topk_length=None,
                     invalid_fraction=0.0)
    cache = jnp.asarray(case.main.array)
    q = jnp.asarray(np.stack([case.q] * batch))
    valid = jnp.asarray([0, 1, 3, 7], jnp.int32)

    sink = jnp.asarray([0.25, 3.0], jnp.float32)  # masked rows stay -inf even with a sink

    def op(q, valid_tokens):
        return jsm.sparse_mla(q, cache, jnp.asarray(case.indices), valid_tokens=valid_tokens, kv_format="dsv4",
                              sm_scale=case.sm_scale, impl=impl, attn_sink=sink)

    out, lse = jax.jit(jax.vmap(op))(q, valid)
    out, lse = np.asarray(out), np.asarray(lse)
    full_out, full_lse = dataclasses.replace(case, attn_sink=np.asarray(sink)).run(impl)
    assert np.isfinite(full_lse).all()
    for i, v in enumerate([0, 1, 3, 3]):
        assert np.all(lse[i, v:] == -np.inf) and np.all(out[i, v:].astype(np.float32) == 0)
        np.testing.assert_allclose(lse[i, :v], full_lse[:v], atol=1e-5)
        np.testing.assert_allclose(out[i, :v].astype(np.float32), full_out[:v].astype(np.float32), atol=1e-2)
    # An unbatched valid_tokens applies to every element.
    out_u, lse_u = jax.vmap(op, in_axes=(0, None))(q, jnp.int32(2))
    assert np.all(np.asarray(lse_u)[:, 2:] == -np.inf) and np.isfinite(np.asarray(lse_u)[:, :2]).all()


def test_nested_vmap(rng, impl):
    case = make_case(rng, "bf16_512", num_tokens=2 * 3 * 2, num_heads=2, topk=5, page_size=4)
    cache = jnp.asarray(case.main.array)
    q = jnp.asarray(case.q.reshape(2, 3, 2, 2, 512))
    indices = jnp.asarray(case.indices.reshape(2, 3, 2, 5))
    lengths = jnp.asarray(case.topk_length.reshape(2, 3, 2))

    def op(q, i, n):
        return jsm.sparse_mla(q, cache, i, topk_length=n, kv_format="bf16_512", sm_scale=case.sm_scale, impl=impl)

    out, lse = jax.jit(jax.vmap(jax.vmap(op)))(q, indices, lengths)
    ref_out, ref_lse = case.reference()
    oracle.check_accuracy(np.asarray(out).reshape(12, 2, 512), np.asarray(lse).reshape(12, 2), ref_out, ref_lse)


def test_vmap_of_leading_axes(rng, impl):
    """vmap over a call that itself uses [B, S] leading axes: every row is one flattened row."""
    n, b, s_, h = 2, 2, 3, 2
    case = make_case(rng, "glm53_nope", num_tokens=n * b * s_, num_heads=h, topk=7, page_size=2)
    cache = jnp.asarray(case.main.array)

    def op(q, i, lengths):
        return jsm.sparse_mla(q, cache, i, topk_length=lengths, kv_format="glm53_nope", sm_scale=case.sm_scale,
                              impl=impl)

    out, lse = jax.jit(jax.vmap(op))(jnp.asarray(case.q.reshape(n, b, s_, h, 512)),
                                     jnp.asarray(case.indices.reshape(n, b, s_, 7)),
                                     jnp.asarray(case.topk_length.reshape(n, b, s_)))
    assert out.shape == (n, b, s_, h, 512) and lse.shape == (n, b, s_, h)
    ref_out, ref_lse = case.reference()
    oracle.check_accuracy(np.asarray(out).reshape(-1, h, 512), np.asarray(lse).reshape(-1, h), ref_out, ref_lse)


def test_vmap_dual_cache_with_batched_valid_tokens(rng, impl):
    batch, t, h = 2, 3, 2
    case = make_case(rng, "dsv4", num_tokens=batch * t, num_heads=h, topk=6, page_size=4,
                     extra=dict(page_size=2, topk=4))
    cache, extra = jnp.asarray(case.main.array), jnp.asarray(case.extra.array)
    valid = np.array([1, 3], np.int32)

    def op(q, i, n, ei, en, v):
        return jsm.sparse_mla(q, cache, i, topk_length=n, extra_kv_cache=extra, extra_indices=ei,
                              extra_topk_length=en, valid_tokens=v, kv_format="dsv4", sm_scale=case.sm_scale,
                              impl=impl)

    split = lambda x: jnp.asarray(x.reshape(batch, t, *x.shape[1:]))  # noqa: E731
    out, lse = jax.jit(jax.vmap(op))(split(case.q), split(case.indices), split(case.topk_length),
                                     split(case.extra_indices), split(case.extra_topk_length), jnp.asarray(valid))
    ref_out, ref_lse = case.reference()
    rows = (np.arange(t)[None, :] < valid[:, None]).reshape(-1)
    ref_out[~rows], ref_lse[~rows] = 0.0, -np.inf
    oracle.check_accuracy(np.asarray(out).reshape(-1, h, 512), np.asarray(lse).reshape(-1, h), ref_out, ref_lse)


def test_vmap_rejects_a_batched_cache(rng):
    case = _simple_inputs(rng)
    caches = jnp.stack([jnp.asarray(case.main.array)] * 2)
    qs = jnp.stack([jnp.asarray(case.q)] * 2)

    def op(q, cache):
        return jsm.sparse_mla(q, cache, jnp.asarray(case.indices), kv_format="glm_nsa", sm_scale=0.1)

    with pytest.raises(ValueError, match="kv_cache"):
        jax.vmap(op)(qs, caches)


# --------------------------------------------------------------------------------------------------
# T == 0, lowering
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("q_shape,index_shape", [((0, 4, 576), (0, 8)), ((2, 0, 4, 576), (2, 0, 8)),
                                                 ((0, 4, 576), (0, 1, 8))])
def test_zero_tokens(impl, q_shape, index_shape):
    cache = jnp.zeros((2, 4, 656), jnp.uint8)

    def run(q, indices):
        return jsm.sparse_mla(q, cache, indices, kv_format="dsv3_2", sm_scale=0.1, impl=impl,
                              valid_tokens=jnp.int32(0))

    q = jnp.zeros(q_shape, jnp.bfloat16)
    indices = jnp.zeros(index_shape, jnp.int32)
    out, lse = jax.jit(run)(q, indices)
    assert out.shape == (*q_shape[:-1], 512) and out.dtype == jnp.bfloat16
    assert lse.shape == q_shape[:-1] and lse.dtype == jnp.float32
    jaxpr = str(jax.make_jaxpr(run)(q, indices))
    assert "ffi_call" not in jaxpr and "custom" not in jaxpr
    hlo = jax.jit(run).lower(q, indices).as_text()
    assert "custom_call" not in hlo and TARGET not in hlo


def test_lowering_contains_the_versioned_custom_call(rng):
    case = _simple_inputs(rng)

    def run(q, cache, indices, impl):
        return jsm.sparse_mla(q, cache, indices, kv_format="glm_nsa", sm_scale=0.1, impl=impl)

    args = (jnp.asarray(case.q), jnp.asarray(case.main.array), jnp.asarray(case.indices))
    hlo = jax.jit(functools.partial(run, impl="auto")).lower(*args).as_text()
    assert TARGET in hlo and "custom_call" in hlo
    assert _ffi.TARGET == TARGET
    compiled = jax.jit(functools.partial(run, impl="auto")).lower(*args).compile().as_text()
    assert TARGET in compiled
    xla_hlo = jax.jit(functools.partial(run, impl="xla")).lower(*args).as_text()
    assert TARGET not in xla_hlo


# --------------------------------------------------------------------------------------------------
# plan() and describe()
# --------------------------------------------------------------------------------------------------

def test_plan_cpu():
    plan = jsm.plan((5, 16, 576), "dsv3_2", 64, platform="cpu")
    assert isinstance(plan, jsm.Plan)
    assert plan.platform == "cpu" and plan.variant == "reference"
    assert (plan.num_tokens, plan.num_heads, plan.topk, plan.kv_format) == (5, 16, 64, "dsv3_2")
    assert plan.workspace_bytes == 0 and plan.workspace_shape == (0,)
    assert plan.num_splits == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.num_splits = 2
    text = plan.describe()
    assert "cpu" in text and "dsv3_2" in text and "T=5" in text and "H=16" in text and "topk=64" in text
    assert jsm.plan((5, 16, 576), "dsv3_2", 64, platform="cpu") is plan  # memoised
    assert jsm.plan((5, 16, 576), jsm.FORMATS["dsv3_2"], 64, platform="cpu") == plan


def test_plan_cuda_without_a_gpu():
    decode = jsm.plan((2, 16, 576), "dsv3_2", 2048, platform="cuda")
    assert decode.platform == "cuda" and decode.variant == "decode"
    assert decode.num_splits > 1
    assert decode.num_splits * decode.split_size >= 2048
    assert (decode.num_splits - 1) * decode.split_size < 2048
    assert decode.workspace_bytes >= decode.num_splits * 2 * 16 * 4  # room for a partial lse per split
    assert decode.workspace_shape == (decode.workspace_bytes,)
    assert 1 <= decode.heads_per_block
    assert "decode" in decode.describe() and decode.device_name in decode.describe()
    prefill = jsm.plan((8192, 128, 576), "dsv3_2", 2048, platform="cuda")
    assert prefill.variant == "prefill" and prefill.num_splits == 1 and prefill.workspace_bytes == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        prefill.variant = "decode"
    attrs = decode.attrs()
    assert set(attrs) == {"variant", "num_splits", "split_size", "heads_per_block"}
    assert all(isinstance(v, int) for v in attrs.values())


def test_plan_cuda_overrides_devices_and_batch_invariance():
    forced = jsm.plan((8192, 128, 576), "dsv3_2", 2048, platform="cuda", impl="decode")
    assert forced.variant == "decode"
    assert jsm.plan((1, 16, 576), "dsv3_2", 2048, platform="cuda", impl="prefill").variant == "prefill"
    dual = jsm.plan((1, 16, 512), "dsv4", 512, extra_topk=128, platform="cuda")
    assert dual.extra_topk == 128 and dual.num_splits * dual.split_size >= 640
    small = jsm.DeviceInfo(name="tiny", platform="cuda", arch=80, sm_count=2)
    big = jsm.plan((4, 16, 576), "dsv3_2", 2048, platform="cuda")
    few = jsm.plan((4, 16, 576), "dsv3_2", 2048, platform="cuda", device=small)
    assert few.device_name == "tiny" and few.num_splits < big.num_splits
    inv = [jsm.plan((t, 16, 576), "dsv3_2", 2048, platform="cuda", batch_invariant=True) for t in (1, 7, 4096)]
    assert len({p.split_size for p in inv}) == 1 and all(p.variant == "decode" and p.batch_invariant for p in inv)
    assert jsm.plan((2, 3, 16, 576), "dsv3_2", 64, platform="cuda").num_tokens == 6


def test_plan_rejections():
    with pytest.raises(ValueError, match="impl"):
        jsm.plan((2, 16, 576), "dsv3_2", 64, platform="cpu", impl="decode")
    with pytest.raises(ValueError, match="impl"):
        jsm.plan((2, 16, 576), "dsv3_2", 64, platform="cpu", impl="xla")
    with pytest.raises(ValueError, match="platform"):
        jsm.plan((2, 16, 576), "dsv3_2", 64, platform="tpu")
    with pytest.raises(ValueError, match="kv_format"):
        jsm.plan((2, 16, 576), "nope", 64, platform="cpu")


# --------------------------------------------------------------------------------------------------
# supported_configs() and check_supported()
# --------------------------------------------------------------------------------------------------

def test_supported_configs_is_plain_data():
    configs = jsm.supported_configs()
    assert set(configs) == set(oracle.SPECS)
    for key, spec in oracle.SPECS.items():
        entry = configs[key]
        assert (entry["d_qk"], entry["d_v"], entry["bytes_per_token"]) == (spec.d_qk, spec.d_v,
                                                                           spec.bytes_per_token)
        assert entry["dual_cache"] == spec.dual
        assert tuple(entry["heads"]) == (1, 128)
        assert entry["min_topk"] == 1
        assert (entry["window"] or 0) == spec.window
        assert "cpu" in entry["platforms"] and "cuda" in entry["platforms"]
        assert isinstance(entry["page_size_rules"], str) and entry["page_size_rules"]
    text = json.dumps(configs)
    assert json.loads(text)["dots3_swa"]["window"] == 513
    configs["dsv3_2"]["d_qk"] = -1
    assert jsm.supported_configs()["dsv3_2"]["d_qk"] == 576  # a fresh copy every call


def test_check_supported_accepts_valid_configurations():
    assert jsm.check_supported("dsv3_2", num_heads=128, topk=1, page_size=64, platform="cuda") is None
    assert jsm.check_supported("dsv4", num_heads=1, dual_cache=True, platform="cpu") is None


def test_check_supported_names_every_violated_axis():
    with pytest.raises(ValueError) as info:
        jsm.check_supported("dsv3_2", num_heads=129, topk=0, page_size=0, platform="tpu", impl="fast",
                            dual_cache=True)
    message = str(info.value)
    for axis in ("num_heads=129", "topk=0", "page_size=0", "platform='tpu'", "impl='fast'", "dual_cache"):
        assert axis in message, f"{axis!r} not named in {message!r}"
    assert "1..128" in message and "dsv4" in message  # the allowed values
    with pytest.raises(ValueError, match="num_heads=0"):
        jsm.check_supported("glm_nsa", num_heads=0)
    with pytest.raises(ValueError, match="impl='decode'"):
        jsm.check_supported("glm_nsa", impl="decode", platform="cpu")
    with pytest.raises(ValueError, match="kv_format"):
        jsm.check_supported("unknown")


@pytest.mark.parametrize("valid_tokens,operand_type", [(None, "tensor<0xi32>"), (2, "tensor<1xi32>")])
def test_valid_tokens_operand_is_empty_when_absent(valid_tokens, operand_type):
    """Without ``valid_tokens`` the custom call takes an empty count (every row valid: the kernels read no
    count before their first gathers); with it, the count as ``[1]``."""
    cache = jnp.zeros((2, 64, 656), jnp.uint8)

    def run(q, indices):
        return jsm.sparse_mla(q, cache, indices, kv_format="dsv3_2", sm_scale=0.1, valid_tokens=valid_tokens)

    q, indices = jnp.zeros((3, 16, 576), jnp.bfloat16), jnp.zeros((3, 8), jnp.int32)
    calls = [line for line in jax.jit(run).lower(q, indices).as_text().splitlines() if TARGET in line]
    assert len(calls) == 1
    operand_types = calls[0].rsplit(": (", 1)[1].split(") ->")[0].split(", ")
    assert len(operand_types) == 9 and operand_types[-1] == operand_type
    out, lse = jax.jit(run)(q, indices)
    rows = 3 if valid_tokens is None else valid_tokens
    assert np.all(np.isfinite(np.asarray(lse[:rows]))) and np.all(np.asarray(lse[rows:]) == -np.inf)
