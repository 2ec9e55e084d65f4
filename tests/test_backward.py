"""The backward pass of ``sparse_mla`` (docs/semantics.md, differentiation): gradients of q, of bf16 caches
and of the sinks from the C++ CPU kernel and from impl="xla" (XLA's autodiff of the pure-JAX lowering),
against a float64 oracle of the derivative that is itself checked by finite differences; the edge cases of
the forward (poisoned unreferenced slots, junk indices, empty rows, infinite sinks, lengths, the dual
cache, valid_tokens, leading axes); jit, vmap and shard_map of the gradient; determinism; what cannot be
differentiated.

Unless a test says otherwise, every cache slot not referenced by a valid candidate is 0xFF (NaN): a
gradient that read one, or let a masked value into its arithmetic, shows NaN.
"""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_sparse_mla as jsm
from jax_sparse_mla.export import export

import cases
import oracle
from cases import make_case
from multi_device import child_main, run_checks

# The backward's accuracy contract (docs/semantics.md): per gradient, against the float64 oracle.
GRAD_MAX_TOL = 2e-2  # max |g - ref| <= GRAD_MAX_TOL * max |ref|
GRAD_L2_TOL = 1e-2  # ||g - ref||_2 <= GRAD_L2_TOL * ||ref||_2


# --------------------------------------------------------------------------------------------------
# The float64 oracle of the derivative (written from docs/semantics.md)
# --------------------------------------------------------------------------------------------------

def attention_vjp(q, sources, *, key, sm_scale, d_out, d_lse, attn_sink=None, valid_tokens=None,
                  rounded_out=None):
    """float64 cotangents ``(d_q [T, H, d_qk], [d_keys [num_slots, d_qk] per source], d_sink [H])`` of
    ``sum(out * d_out) + sum(lse * d_lse)`` for :func:`oracle.attention`, whose softmax is joint over the
    sources. Rows with lse = -inf (empty, or padding) contribute nothing; rows with lse = +inf (an infinite
    sink, all the weight) contribute d_lse to d_sink. ``rounded_out`` (the bfloat16 output) replaces
    D = sum_j P_j dP_j, i.e. <dO, O>, by <dO, rounded_out>, to measure what that rounding costs."""
    spec = oracle.SPECS[key]
    q = np.asarray(q).astype(np.float64)
    d_out = np.asarray(d_out).astype(np.float64)
    d_lse = np.asarray(d_lse).astype(np.float64)
    _, lse = oracle.attention(q, sources, key=key, sm_scale=sm_scale, attn_sink=attn_sink, valid_tokens=valid_tokens)
    num_tokens, num_heads, _ = q.shape
    d_q = np.zeros_like(q)
    d_keys = [np.zeros_like(s.keys) for s in sources]
    d_sink = np.zeros(num_heads)
    masks = [s.mask(spec.window) for s in sources]
    for t in range(num_tokens):
        slots = [s.indices[t][m[t]].astype(np.int64) for s, m in zip(sources, masks)]
        keys = np.concatenate([s.keys[i] for s, i in zip(sources, slots)], axis=0)
        for h in range(num_heads):
            if lse[t, h] == -np.inf:
                continue
            if lse[t, h] == np.inf:
                d_sink[h] += d_lse[t, h]
                continue
            p = np.exp(sm_scale * (keys @ q[t, h]) - lse[t, h])
            dp = keys[:, : spec.d_v] @ d_out[t, h]
            d_row = p @ dp if rounded_out is None else d_out[t, h] @ np.asarray(rounded_out[t, h], np.float64)
            ds = p * (dp - d_row + d_lse[t, h])
            d_q[t, h] = sm_scale * ds @ keys
            d_k = sm_scale * ds[:, None] * q[t, h][None, :]
            d_k[:, : spec.d_v] += p[:, None] * d_out[t, h][None, :]
            start = 0
            for d_key, i in zip(d_keys, slots):
                np.add.at(d_key, i, d_k[start: start + i.size])
                start += i.size
            if attn_sink is not None and attn_sink[h] > -np.inf:
                d_sink[h] += np.exp(attn_sink[h] - lse[t, h]) * (d_lse[t, h] - d_row)
    return d_q, d_keys, d_sink


def case_vjp(case: cases.AttentionCase, d_out, d_lse, **kwargs):
    """The oracle's cotangents of an attention case: {"q", "kv_cache" ([num_slots, d_qk]), "attn_sink"}."""
    d_q, d_keys, d_sink = attention_vjp(case.q, case.sources(), key=case.key, sm_scale=case.sm_scale, d_out=d_out,
                                        d_lse=d_lse, attn_sink=case.attn_sink, valid_tokens=case.valid_tokens,
                                        **kwargs)
    return {"q": d_q, "kv_cache": d_keys[0], "attn_sink": d_sink}


def loss_value(case: cases.AttentionCase, d_out, d_lse, q=None, keys=None, attn_sink=None) -> float:
    """sum(out * d_out) + sum over finite lse of lse * d_lse, in float64 (the oracle's forward)."""
    sources = case.sources()
    if keys is not None:
        sources[0] = dataclasses.replace(sources[0], keys=keys)
    out, lse = oracle.attention(case.q if q is None else q, sources, key=case.key, sm_scale=case.sm_scale,
                                attn_sink=case.attn_sink if attn_sink is None else attn_sink,
                                valid_tokens=case.valid_tokens)
    finite = np.isfinite(lse)
    return float((out * d_out).sum() + (lse[finite] * np.asarray(d_lse, np.float64)[finite]).sum())


# --------------------------------------------------------------------------------------------------
# The library's gradients
# --------------------------------------------------------------------------------------------------

def random_cotangents(rng, case: cases.AttentionCase):
    t, h = case.q.shape[:2]
    d_out = rng.standard_normal((t, h, oracle.SPECS[case.key].d_v)).astype(ml_dtypes.bfloat16)
    d_lse = rng.standard_normal((t, h)).astype(np.float32)
    return d_out, d_lse


def differentiable_names(case: cases.AttentionCase):
    names = ["q"]
    if case.attn_sink is not None:
        names.append("attn_sink")
    if not oracle.SPECS[case.key].quantized:
        names.append("kv_cache")
    return tuple(names)


def case_arrays(case: cases.AttentionCase, impl: str):
    kwargs = case.kwargs(impl)
    static = {k: kwargs.pop(k) for k in cases.STATIC_ARGS if k in kwargs}
    arrays = {k: jnp.asarray(v) for k, v in kwargs.items() if v is not None}
    arrays.update(q=jnp.asarray(case.q), kv_cache=jnp.asarray(case.main.array), indices=jnp.asarray(case.indices))
    return static, arrays


def attend(static, arrays):
    arrays = dict(arrays)
    return jsm.sparse_mla(arrays.pop("q"), arrays.pop("kv_cache"), arrays.pop("indices"), **static, **arrays)


def library_vjp(case: cases.AttentionCase, impl: str, d_out, d_lse, wrt=None):
    """``(out, lse, {name: cotangent})`` of the library for cotangents ``d_out``/``d_lse``; cotangents as
    float64, the cache's reshaped to [num_slots, d_qk]."""
    static, arrays = case_arrays(case, impl)
    wrt = differentiable_names(case) if wrt is None else wrt
    wrt_arrays = {name: arrays.pop(name) for name in wrt}

    def run(wrt_arrays, arrays, d_out, d_lse):
        (out, lse), pullback = jax.vjp(lambda w: attend(static, {**arrays, **w}), wrt_arrays)
        return out, lse, pullback((d_out, d_lse))[0]

    out, lse, grads = jax.jit(run)(wrt_arrays, arrays, jnp.asarray(d_out), jnp.asarray(d_lse))
    for name, g in grads.items():  # each gradient has its operand's shape and dtype
        assert g.shape == wrt_arrays[name].shape and g.dtype == wrt_arrays[name].dtype, name
    grads = {name: np.asarray(g).astype(np.float64) for name, g in grads.items()}
    if "kv_cache" in grads:
        grads["kv_cache"] = grads["kv_cache"].reshape(case.main.num_slots, -1)
    return np.asarray(out), np.asarray(lse), grads


def check_gradient(name, got, ref, max_tol=GRAD_MAX_TOL, l2_tol=GRAD_L2_TOL, exact_zeros=True):
    """The backward's accuracy contract for one gradient (docs/semantics.md); with ``exact_zeros``, where the
    reference is exactly zero (a padding row, an empty row, an unreferenced slot) the gradient must be
    exactly zero too."""
    assert got.shape == ref.shape, (name, got.shape, ref.shape)
    assert not np.isnan(got).any(), f"{name}: NaN in the gradient"
    if exact_zeros:
        assert np.all(got[ref == 0] == 0), f"{name}: nonzero gradient where the reference is exactly zero"
    scale = np.abs(ref).max()
    assert scale > 0, f"{name}: the reference gradient is zero everywhere: the test data is degenerate"
    err = np.abs(got - ref).max()
    assert err <= max_tol * scale, f"{name}: max |g - ref| = {err} > {max_tol} * {scale}"
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert rel <= l2_tol, f"{name}: relative L2 error {rel} > {l2_tol}"
    return err / scale, rel


def check_case(rng, case: cases.AttentionCase, impl: str, wrt=None):
    d_out, d_lse = random_cotangents(rng, case)
    out, lse, grads = library_vjp(case, impl, d_out, d_lse, wrt)
    oracle.check_accuracy(out, lse, *case.reference())  # the forward rule's outputs are the forward's
    ref = case_vjp(case, d_out, d_lse)
    for name, g in grads.items():
        check_gradient(name, g, ref[name])
    return grads, ref


def _page_form(key, page_size):
    return "3d" if page_size % oracle.min_3d_page_multiple(key) == 0 else "2d"


# --------------------------------------------------------------------------------------------------
# The oracle is the derivative: central finite differences in float64
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["bf16_576", "dsv4"])
def test_oracle_and_kernel_match_finite_differences(rng, key):
    """Directional derivatives of the float64 forward along random directions of q, of the main cache's
    keys and of the sink (finite sinks, lengths, empty rows, and for dsv4 a dual cache) equal the oracle's
    gradient to 1e-6, and the CPU kernel's within the accuracy contract."""
    extra = dict(page_size=2, topk=5) if key == "dsv4" else None
    case = make_case(rng, key, num_tokens=4, num_heads=3, topk=10, page_size=4, attn_sink=rng.standard_normal(3),
                     topk_length=np.array([10, 4, 0, 7], np.int32), extra=extra)
    d_out, d_lse = random_cotangents(rng, case)
    ref = case_vjp(case, d_out, d_lse)
    _, _, got = library_vjp(case, "auto", d_out, d_lse, wrt=("q", "attn_sink"))
    q = case.q.astype(np.float64)
    keys = case.main.keys()
    referenced = np.isfinite(keys).all(axis=1)
    sink = case.attn_sink.astype(np.float64)
    eps = 1e-6
    for name, point, perturb in (
            ("q", q, lambda x: dict(q=x)),
            ("kv_cache", keys, lambda x: dict(keys=x)),
            ("attn_sink", sink, lambda x: dict(attn_sink=x))):
        direction = rng.standard_normal(point.shape)
        if name == "kv_cache":
            direction[~referenced] = 0  # unreferenced slots hold NaN: they are no point to move from
        slope = (loss_value(case, d_out, d_lse, **perturb(point + eps * direction))
                 - loss_value(case, d_out, d_lse, **perturb(point - eps * direction))) / (2 * eps)
        predicted = float((ref[name] * direction).sum())
        assert abs(slope - predicted) <= 1e-6 * max(1.0, abs(slope)), (name, slope, predicted)
        if name in got:
            kernel = float((got[name] * direction).sum())
            assert abs(kernel - slope) <= GRAD_L2_TOL * max(1.0, abs(slope)), (name, kernel, slope)


# --------------------------------------------------------------------------------------------------
# Formats, edge cases
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key", list(oracle.SPECS))
def test_gradients_every_format(rng, impl, key):
    """Junk indices of every kind, random lengths, a finite sink, NaN in every unreferenced slot."""
    case = make_case(rng, key, num_tokens=4, num_heads=3, topk=16, page_size=2, form=_page_form(key, 2),
                     attn_sink=rng.standard_normal(3))
    check_case(rng, case, impl)


@pytest.mark.parametrize("form", ["3d", "nhd", "hnd", "2d"])
@pytest.mark.parametrize("key", ["bf16_576", "bf16_512"])
def test_bf16_cache_gradient_in_every_cache_shape(rng, impl, key, form):
    """The cache's gradient comes back in the cache's own shape and dtype; slots listed several times
    (also twice in one row) add up, and unreferenced slots get exactly zero."""
    case = make_case(rng, key, num_tokens=6, num_heads=2, topk=12, page_size=4, cache_tokens=12, form=form,
                     poison=False)
    indices = case.indices.copy()
    indices[:, :4] = [3, 3, 5, 7]  # shared by every row, slot 3 twice per row
    case = dataclasses.replace(case, indices=indices).poison_unused()
    grads, ref = check_case(rng, case, impl)  # checks the gradient's shape and dtype too
    unreferenced = ~np.isin(np.arange(case.main.num_slots),
                            case.indices[oracle.valid_candidates(case.indices, case.main.num_slots, case.topk_length)])
    assert unreferenced.any() and np.all(grads["kv_cache"][unreferenced] == 0)


def test_cache_gradient_of_heavily_shared_slots(rng, impl):
    """128 rows of 64 candidates over 16 slots: each slot's gradient sums about 500 contributions per head,
    which a bfloat16 accumulation (XLA's own transpose of the gather) gets wrong by several percent."""
    case = make_case(rng, "bf16_576", num_tokens=128, num_heads=4, topk=64, page_size=4, cache_tokens=16,
                     attn_sink=rng.standard_normal(4), topk_length=None, invalid_fraction=0.05)
    check_case(rng, case, impl)


@pytest.mark.parametrize("key", ["dsv3_2", "dsv4", "bf16_576"])
def test_sinks_finite_infinite_and_absent(rng, impl, key):
    """A +inf sink takes all the weight: d_sink = sum of d_lse over the rows, nothing reaches q; a -inf sink
    has no effect and no gradient; a large finite sink leaves a small weight to the candidates."""
    sink = np.array([0.7, np.inf, -np.inf, 30.0], np.float32)
    case = make_case(rng, key, num_tokens=4, num_heads=4, topk=12, page_size=2, attn_sink=sink, topk_length=None)
    d_out, d_lse = random_cotangents(rng, case)
    _, lse, grads = library_vjp(case, impl, d_out, d_lse)
    ref = case_vjp(case, d_out, d_lse)
    assert np.all(lse[:, 1] == np.inf)
    assert np.all(grads["q"][:, 1] == 0) and np.all(grads["q"][:, 2] != 0)
    np.testing.assert_allclose(grads["attn_sink"][1], d_lse[:, 1].astype(np.float64).sum(), rtol=1e-6)
    assert grads["attn_sink"][2] == 0
    for name, g in grads.items():
        check_gradient(name, g, ref[name])


@pytest.mark.parametrize("with_sink", [False, True])
@pytest.mark.parametrize("key", ["glm_nsa", "dsv4", "bf16_576"])
def test_empty_rows(rng, impl, key, with_sink):
    """Rows without a valid candidate (junk indices, lengths <= 0) give zero gradients, except through a
    finite sink, where lse = sink: d_sink gets d_lse."""
    sink = rng.standard_normal(3).astype(np.float32) if with_sink else None
    case = cases.empty_rows_case(rng, key, num_tokens=cases.EMPTY_ROWS + 1, attn_sink=sink)  # row 5 valid
    d_out, d_lse = random_cotangents(rng, case)
    _, _, grads = library_vjp(case, impl, d_out, d_lse)
    ref = case_vjp(case, d_out, d_lse)
    assert np.all(grads["q"][:5] == 0) and np.any(grads["q"][5] != 0)
    for name, g in grads.items():
        check_gradient(name, g, ref[name])


@pytest.mark.parametrize("valid_tokens", [0, 2, 5])
@pytest.mark.parametrize("key", ["dsv3_2", "bf16_576"])
def test_valid_tokens(rng, impl, key, valid_tokens):
    """Padding rows (t >= valid_tokens) get zero gradient and contribute nothing, even with NaN in their
    queries and cotangents; valid_tokens = 0 gives zero gradients everywhere."""
    case = make_case(rng, key, num_tokens=5, num_heads=3, topk=10, page_size=4, attn_sink=rng.standard_normal(3),
                     topk_length=np.array([10, 3, 10, 0, 10], np.int32), valid_tokens=np.int32(valid_tokens))
    q = case.q.copy()
    q[valid_tokens:] = np.nan
    case = dataclasses.replace(case, q=q)
    d_out, d_lse = random_cotangents(rng, case)
    d_out[valid_tokens:] = np.nan
    d_lse[valid_tokens:] = np.nan
    _, _, grads = library_vjp(case, impl, d_out, d_lse)
    for name, g in grads.items():
        assert not np.isnan(g).any(), name
    assert np.all(grads["q"][valid_tokens:] == 0)
    if valid_tokens == 0:
        assert all(np.all(g == 0) for g in grads.values())
        return
    # The valid rows equal the call on those rows alone.
    head = dataclasses.replace(case, q=case.q[:valid_tokens], indices=case.indices[:valid_tokens],
                               topk_length=case.topk_length[:valid_tokens], valid_tokens=None)
    ref = case_vjp(head, d_out[:valid_tokens], d_lse[:valid_tokens])
    ref["q"] = np.concatenate([ref["q"], np.zeros_like(grads["q"][valid_tokens:])])
    for name, g in grads.items():
        check_gradient(name, g, ref[name])


@pytest.mark.parametrize("key,extra_format", [("dsv4", "dsv4"), ("dsv4_1", "dsv4_1"), ("dsv4", "dsv4_nvfp4"),
                                              ("dsv4_1", "dsv4_1_fp4")])
def test_dual_cache(rng, impl, key, extra_format):
    """One joint softmax over both caches (of one format or two): q and the sink see both; a quantized extra
    cache is a constant."""
    extra = dict(page_size=4, form="3d", topk=7, cache_tokens=21, kv_format=extra_format)
    case = make_case(rng, key, num_tokens=5, num_heads=3, topk=11, page_size=64, extra=extra,
                     attn_sink=rng.standard_normal(3))
    grads, ref = check_case(rng, case, impl)
    main_only = dataclasses.replace(case, extra=None, extra_indices=None, extra_topk_length=None)
    d_out, d_lse = random_cotangents(rng, case)
    without_extra = case_vjp(main_only, d_out, d_lse)["q"]
    with_extra = case_vjp(case, d_out, d_lse)["q"]
    assert np.abs(with_extra - without_extra).max() > 0.1 * np.abs(with_extra).max(), "the extra cache must matter"


def test_precision_fp8(rng, impl):
    """precision="fp8": the sink's and a bf16 cache's gradients are those of the operation on the quantized
    query; q itself has no gradient there."""
    case = make_case(rng, "bf16_576", num_tokens=4, num_heads=3, topk=12, page_size=4,
                     attn_sink=rng.standard_normal(3))
    quantized = dataclasses.replace(case, q=oracle.quantize_query_fp8(case.q).astype(ml_dtypes.bfloat16))
    assert np.any(quantized.q != case.q), "the quantization must change the query"
    d_out, d_lse = random_cotangents(rng, case)
    static, arrays = case_arrays(case, impl)
    wrt = {name: arrays.pop(name) for name in ("kv_cache", "attn_sink")}

    def vjp(wrt):
        _, pullback = jax.vjp(lambda w: attend(dict(static, precision="fp8"), {**arrays, **w}), wrt)
        return pullback((jnp.asarray(d_out), jnp.asarray(d_lse)))[0]

    grads = jax.jit(vjp)(wrt)
    ref = case_vjp(quantized, d_out, d_lse)
    check_gradient("kv_cache", np.asarray(grads["kv_cache"], np.float64).reshape(case.main.num_slots, -1),
                   ref["kv_cache"])
    check_gradient("attn_sink", np.asarray(grads["attn_sink"], np.float64), ref["attn_sink"])
    q = arrays.pop("q")
    with pytest.raises(NotImplementedError, match="^precision: 'fp8' computes with the FP8-quantized query"):
        jax.grad(lambda q: attend(dict(static, precision="fp8"), {**arrays, **wrt, "q": q})[1].sum())(q)


def test_topk_length_edge_values(rng, impl):
    topk = 8
    lengths = np.array([0, -1, cases.INT32_MIN, 1, 3, topk, topk + 1, cases.INT32_MAX], np.int32)
    case = make_case(rng, "bf16_512", num_tokens=lengths.size, num_heads=2, topk=topk, page_size=4,
                     invalid_fraction=0.0, topk_length=lengths)
    grads, _ = check_case(rng, case, impl)
    assert np.all(grads["q"][:3] == 0) and np.all(grads["q"][3:] != 0)


@pytest.mark.parametrize("lse_only", [False, True])
def test_one_output_differentiated(rng, impl, lse_only):
    """A loss of out alone or of lse alone (the other cotangent is a symbolic zero)."""
    case = make_case(rng, "bf16_576", num_tokens=3, num_heads=2, topk=8, page_size=4,
                     attn_sink=rng.standard_normal(2))
    static, arrays = case_arrays(case, impl)
    wrt = {name: arrays.pop(name) for name in ("q", "kv_cache", "attn_sink")}
    d_out, d_lse = random_cotangents(rng, case)

    def loss(w):
        out, lse = attend(static, {**arrays, **w})
        if lse_only:
            return (jnp.where(jnp.isfinite(lse), lse, 0.0) * d_lse).sum()
        return (out.astype(jnp.float32) * jnp.asarray(d_out, jnp.float32)).sum()

    grads = jax.jit(jax.grad(loss))(wrt)
    ref = case_vjp(case, np.zeros_like(d_out) if lse_only else d_out, d_lse if lse_only else np.zeros_like(d_lse))
    check_gradient("q", np.asarray(grads["q"], np.float64), ref["q"])
    check_gradient("kv_cache", np.asarray(grads["kv_cache"], np.float64).reshape(case.main.num_slots, -1),
                   ref["kv_cache"])
    check_gradient("attn_sink", np.asarray(grads["attn_sink"], np.float64), ref["attn_sink"])


def test_kernel_matches_xla_autodiff(rng):
    """The CPU kernel against jax.grad of impl="xla" on the same case (both against the oracle above)."""
    case = make_case(rng, "bf16_576", num_tokens=8, num_heads=20, topk=24, page_size=4,
                     attn_sink=rng.standard_normal(20))
    d_out, d_lse = random_cotangents(rng, case)
    _, _, kernel = library_vjp(case, "auto", d_out, d_lse)
    _, _, xla = library_vjp(case, "xla", d_out, d_lse)
    for name in kernel:  # float32 sums can cancel to an exact zero where the kernel's do not
        check_gradient(name, kernel[name], xla[name], exact_zeros=False)


# --------------------------------------------------------------------------------------------------
# Leading axes, jit, vmap
# --------------------------------------------------------------------------------------------------

def _bits(x):
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def test_leading_axes_and_eager(rng, impl):
    """q [B, S, H, d] gives the flattened call's gradients, bit for bit, jitted or (the kernel) not."""
    case = make_case(rng, "bf16_576", num_tokens=6, num_heads=3, topk=10, page_size=4,
                     attn_sink=rng.standard_normal(3), valid_tokens=np.int32(5))
    static, arrays = case_arrays(case, impl)
    d_out, d_lse = random_cotangents(rng, case)

    def vjp(arrays, lead):
        wrt = {name: arrays.pop(name) for name in ("q", "kv_cache", "attn_sink")}
        shaped = dict(arrays, indices=arrays["indices"].reshape(*lead, -1),
                      topk_length=arrays["topk_length"].reshape(lead))
        wrt["q"] = wrt["q"].reshape(*lead, *wrt["q"].shape[1:])
        _, pullback = jax.vjp(lambda w: attend(static, {**shaped, **w}), wrt)
        return pullback((jnp.asarray(d_out).reshape(*lead, *d_out.shape[1:]),
                         jnp.asarray(d_lse).reshape(*lead, -1)))[0]

    flat = jax.jit(vjp, static_argnums=1)(dict(arrays), (6,))
    batched = jax.jit(vjp, static_argnums=1)(dict(arrays), (2, 3))
    assert batched["q"].shape == (2, 3, 3, 576)
    for name in flat:
        np.testing.assert_array_equal(_bits(batched[name]).reshape(-1), _bits(flat[name]).reshape(-1))
    if impl == "auto":  # op by op, impl="xla" is slow and lets XLA fuse differently
        eager = vjp(dict(arrays), (2, 3))
        for name in flat:
            np.testing.assert_array_equal(_bits(eager[name]).reshape(-1), _bits(flat[name]).reshape(-1))


@pytest.mark.parametrize("order", ["vmap_of_grad", "grad_of_vmap"])
def test_vmap_and_grad_compose(rng, impl, order):
    """jax.vmap over q, indices, lengths and valid_tokens (cache and sink shared), inside or outside
    jax.grad, equals a loop over the batch: q's gradient bit for bit on the kernel, the shared gradients
    (summed over the batch) within the accuracy contract."""
    batch = 3
    case = make_case(rng, "bf16_512", num_tokens=4, num_heads=3, topk=10, page_size=4,
                     attn_sink=rng.standard_normal(3), poison=False)
    indices = np.stack([cases.random_indices(rng, 4, 10, case.main.num_slots) for _ in range(batch)])
    lengths = rng.integers(-1, 12, (batch, 4)).astype(np.int32)
    referenced = np.concatenate([i[oracle.valid_candidates(i, case.main.num_slots, n)]
                                 for i, n in zip(indices, lengths)])
    case = dataclasses.replace(case, main=case.main.poisoned(referenced))
    static, arrays = case_arrays(case, impl)
    qs = jnp.asarray(cases.random_q(rng, (batch, *case.q.shape)))
    indices, lengths = jnp.asarray(indices), jnp.asarray(lengths)
    valid = jnp.asarray(np.array([4, 2, 0], np.int32))
    d_outs = jnp.asarray(rng.standard_normal((batch, 4, 3, 512)), jnp.bfloat16)
    cache, sink = arrays["kv_cache"], arrays["attn_sink"]

    def loss(q, cache, sink, indices, length, valid, d_out):
        out, lse = attend(static, dict(q=q, kv_cache=cache, attn_sink=sink, indices=indices, topk_length=length,
                                       valid_tokens=valid))
        return (out.astype(jnp.float32) * d_out).sum() + jnp.where(jnp.isfinite(lse), lse, 0.0).sum()

    grad = jax.grad(loss, argnums=(0, 1, 2))
    axes = (0, None, None, 0, 0, 0, 0)
    if order == "vmap_of_grad":
        dq, dcache, dsink = jax.jit(jax.vmap(grad, in_axes=axes))(qs, cache, sink, indices, lengths, valid, d_outs)
        dcache, dsink = dcache.astype(jnp.float32).sum(0), dsink.sum(0)
    else:
        def total(q, cache, sink, *rest):
            return jax.vmap(loss, in_axes=axes)(q, cache, sink, *rest).sum()

        dq, dcache, dsink = jax.jit(jax.grad(total, argnums=(0, 1, 2)))(qs, cache, sink, indices, lengths, valid,
                                                                        d_outs)
    loop = [jax.jit(grad)(qs[b], cache, sink, indices[b], lengths[b], valid[b], d_outs[b]) for b in range(batch)]
    want_dq = np.stack([np.asarray(g[0], np.float32) for g in loop])
    want_cache = sum(np.asarray(g[1], np.float64) for g in loop)
    want_sink = sum(np.asarray(g[2], np.float64) for g in loop)
    if impl == "auto":
        np.testing.assert_array_equal(_bits(dq), _bits(jnp.asarray(want_dq, jnp.bfloat16)))
    else:
        check_gradient("q", np.asarray(dq, np.float64), want_dq.astype(np.float64))
    assert np.all(np.asarray(dq[2], np.float32) == 0), "element 2 has valid_tokens = 0"
    # The loop's sum of rounded per-element gradients can cancel to an exact zero where the folded
    # kernel's float32 sum does not; slots that no element references are zero either way.
    check_gradient("kv_cache", np.asarray(dcache, np.float64), want_cache, exact_zeros=False)
    unreferenced = ~np.isin(np.arange(case.main.num_slots), referenced)
    dcache_rows = np.asarray(dcache, np.float32).reshape(case.main.num_slots, -1)
    assert unreferenced.any() and np.all(dcache_rows[unreferenced] == 0)
    check_gradient("attn_sink", np.asarray(dsink, np.float64), want_sink, max_tol=1e-5, l2_tol=1e-5)


def test_nested_vmap_of_grad(rng):
    """vmap of vmap of the kernel's gradient (an unbatched valid_tokens): every element's gradients, of the
    shared cache and sink too, equal its own call's bit for bit."""
    case = make_case(rng, "bf16_512", num_tokens=4, num_heads=2, topk=6, page_size=4,
                     attn_sink=rng.standard_normal(2), poison=False)
    static, arrays = case_arrays(case, "auto")
    qs = jnp.asarray(cases.random_q(rng, (2, 3, *case.q.shape)))
    indices = jnp.asarray(cases.random_indices(rng, 24, 6, case.main.num_slots).reshape(2, 3, 4, 6))

    def loss(q, cache, sink, indices):
        out, lse = attend(static, dict(q=q, kv_cache=cache, attn_sink=sink, indices=indices,
                                       valid_tokens=jnp.int32(3)))
        return out.astype(jnp.float32).sum() + jnp.where(jnp.isfinite(lse), lse, 0.0).sum()

    grad = jax.grad(loss, argnums=(0, 1, 2))
    inner = jax.vmap(grad, in_axes=(0, None, None, 0))
    nested = jax.jit(jax.vmap(inner, in_axes=(0, None, None, 0)))(qs, arrays["kv_cache"], arrays["attn_sink"], indices)
    for a in range(2):
        for b in range(3):
            want = jax.jit(grad)(qs[a, b], arrays["kv_cache"], arrays["attn_sink"], indices[a, b])
            for got, expected in zip(nested, want):
                np.testing.assert_array_equal(_bits(got[a, b]), _bits(expected))


# --------------------------------------------------------------------------------------------------
# Determinism
# --------------------------------------------------------------------------------------------------

def test_cpu_backward_is_deterministic_and_thread_independent(rng, monkeypatch):
    """Many rows sharing a few cache slots (and two head blocks): two runs, and runs on 1, 2 and 7 threads
    (JSMLA_CPU_THREADS), give the same bits for every gradient."""
    case = make_case(rng, "bf16_576", num_tokens=24, num_heads=20, topk=32, page_size=4, cache_tokens=16,
                     attn_sink=rng.standard_normal(20), invalid_fraction=0.1)
    d_out, d_lse = random_cotangents(rng, case)
    static, arrays = case_arrays(case, "auto")
    wrt = {name: arrays.pop(name) for name in ("q", "kv_cache", "attn_sink")}

    @jax.jit
    def vjp(wrt):
        _, pullback = jax.vjp(lambda w: attend(static, {**arrays, **w}), wrt)
        return pullback((jnp.asarray(d_out), jnp.asarray(d_lse)))[0]

    first = {k: _bits(v) for k, v in vjp(wrt).items()}
    for threads in ("", "1", "2", "7"):
        monkeypatch.setenv("JSMLA_CPU_THREADS", threads)
        again = vjp(wrt)
        for name, bits in first.items():
            np.testing.assert_array_equal(_bits(again[name]), bits, err_msg=f"{name}, JSMLA_CPU_THREADS={threads!r}")


def test_thread_count_environment_errors(rng, monkeypatch):
    case = make_case(rng, "dsv3_2", num_tokens=2, num_heads=2, topk=4, page_size=4)
    d_out, d_lse = random_cotangents(rng, case)
    monkeypatch.setenv("JSMLA_CPU_THREADS", "0")
    with pytest.raises(Exception, match=r"JSMLA_CPU_THREADS: expected a thread count in \[1, 4096\], got '0'"):
        library_vjp(case, "auto", d_out, d_lse, wrt=("q",))


# --------------------------------------------------------------------------------------------------
# What is not differentiable
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["kv_cache", "extra_kv_cache"])
def test_quantized_caches_are_not_differentiable(rng, impl, name):
    """A float8 view of a quantized cache is a float array to JAX, but its gradient is not defined."""
    case = make_case(rng, "dsv4", num_tokens=2, num_heads=2, topk=4, page_size=4, extra=dict(page_size=2))
    static, arrays = case_arrays(case, impl)
    arrays[name] = jax.lax.bitcast_convert_type(arrays[name], jnp.float8_e4m3fn)
    cache = arrays.pop(name)
    with pytest.raises(NotImplementedError, match=rf"^{name}: a dsv4 cache is quantized and has no gradient"):
        jax.grad(lambda c: attend(static, {**arrays, name: c})[1].sum())(cache)


def test_integer_operands_get_no_gradient(rng, impl):
    case = make_case(rng, "bf16_576", num_tokens=3, num_heads=2, topk=6, page_size=4, valid_tokens=np.int32(2))
    static, arrays = case_arrays(case, impl)
    grads = jax.jit(jax.grad(lambda a: attend(static, a)[0].astype(jnp.float32).sum(), allow_int=True))(arrays)
    for name in ("indices", "topk_length", "valid_tokens"):
        assert grads[name].dtype == jax.dtypes.float0, name
    assert grads["q"].dtype == jnp.bfloat16 and grads["kv_cache"].dtype == jnp.bfloat16


def test_forward_mode_is_not_supported(rng):
    case = make_case(rng, "dsv3_2", num_tokens=2, num_heads=2, topk=4, page_size=4)
    static, arrays = case_arrays(case, "auto")
    q = arrays.pop("q")
    with pytest.raises(TypeError, match="can't apply forward-mode autodiff"):
        jax.jvp(lambda q: attend(static, {**arrays, "q": q}), (q,), (jnp.ones_like(q),))


def test_second_derivatives_are_not_supported(rng, impl):
    case = make_case(rng, "bf16_576", num_tokens=2, num_heads=2, topk=4, page_size=4)
    static, arrays = case_arrays(case, impl)
    q = arrays.pop("q")

    def first(q):
        return attend(static, {**arrays, "q": q})[0].astype(jnp.float32).sum()

    with pytest.raises(NotImplementedError, match="^sparse_mla has no second derivative"):
        jax.grad(lambda q: jax.grad(first)(q).astype(jnp.float32).sum())(q)


def test_exported_gradient_round_trip(rng):
    """A jitted gradient exports (both targets have disabled_checks()) and the deserialised program gives
    the same bits."""
    pytest.importorskip("flatbuffers", reason="jax.export serialisation needs the 'flatbuffers' package")
    case = make_case(rng, "bf16_576", num_tokens=3, num_heads=2, topk=6, page_size=4,
                     attn_sink=rng.standard_normal(2))
    static, arrays = case_arrays(case, "auto")
    wrt = {name: arrays.pop(name) for name in ("q", "kv_cache", "attn_sink")}
    gradient = jax.jit(jax.grad(lambda w: attend(static, {**arrays, **w})[1].sum()))
    restored = jax.export.deserialize(export(gradient, wrt).serialize())
    want = gradient(wrt)
    for name, g in restored.call(wrt).items():
        np.testing.assert_array_equal(_bits(g), _bits(want[name]), err_msg=name)


def test_cuda_lowering_of_the_kernel_backward(rng):
    """Every gradient (q, the sink, a bf16 cache) lowers for CUDA (from this host too) to the backward
    target with its workspace result, sized as kernels/cuda/backward_workspace.h says; impl="xla" lowers
    for CUDA without any custom call."""
    case = make_case(rng, "bf16_576", num_tokens=2, num_heads=2, topk=4, page_size=4, attn_sink=rng.standard_normal(2))

    def gradient(impl, wrt):
        static, arrays = case_arrays(case, impl)
        w = {name: arrays.pop(name) for name in wrt}
        return jax.jit(jax.grad(lambda w: attend(static, {**arrays, **w})[1].sum())).trace(w)

    slots = case.main.num_slots
    for wrt, cache_gradient in ((("q", "attn_sink"), False), (("q", "kv_cache"), True)):
        cuda_text = gradient("auto", wrt).lower(lowering_platforms=("cuda",)).as_text()
        assert jsm._ffi.BACKWARD_TARGET in cuda_text
        workspace = jsm.kernel_tables.backward_workspace_bytes(2, 2, 4, 1, slots, cache_gradient, 576, 2)
        assert f"tensor<{workspace}xui8>" in cuda_text, wrt  # the CUDA handler's workspace result
        assert jsm._ffi.BACKWARD_TARGET in gradient("auto", wrt).lower(lowering_platforms=("cpu",)).as_text()
    xla_text = gradient("xla", ("q", "kv_cache")).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call" not in xla_text


def test_backward_workspace_grows_with_the_cache_gradient():
    """The workspace holds two [T, H] double arrays; a cache gradient adds the sort's keys and pairs
    (T * topk of each, twice), the output rows' ranges, the tensor-core path's P and c (bf16, positions
    padded to 64) and partial rows (bf16) for one chunk of tokens, and the sort's scratch."""
    align = lambda b: -(-b // 16) * 16  # noqa: E731
    small = jsm.kernel_tables.backward_workspace_bytes(3, 5, 7, 1, 11, False, 576, 3)
    assert small == 2 * align(3 * 5 * 8)
    big = jsm.kernel_tables.backward_workspace_bytes(3, 5, 7, 2, 11, True, 576, 3)
    tensor_core = 2 * align(3 * 5 * 64 * 2) + align(3 * 7 * 576 * 2)
    assert big >= small + 2 * 21 * 8 + 2 * 21 * 4 + 2 * 22 * 4 + tensor_core
    # Two chunks of 2 and 1 tokens: the per-chunk parts for 2 tokens, plus the rows' fp32 running sums.
    chunked = jsm.kernel_tables.backward_workspace_bytes(3, 5, 7, 2, 11, True, 576, 2)
    assert chunked - big == 2 * align(2 * 5 * 64 * 2) + align(2 * 7 * 576 * 2) - tensor_core + align(22 * 576 * 4)


def test_backward_chunk_of_a_long_prefill():
    """By default the chunk keeps its P, c and partial rows within 4 GiB: T = 4096, H = 128, topk 2048 would
    need 14.0 GB at once; JSMLA_BACKWARD_CHUNK_BYTES sets another budget (at least one token a chunk)."""
    t, h, topk, d_qk = 4096, 128, 2048, 576
    per_token = 2 * h * topk * 2 + topk * d_qk * 2
    assert jsm.kernel_tables.BACKWARD_CHUNK_BUDGET_BYTES == 2 ** 32
    assert jsm.kernel_tables.backward_chunk_tokens(t, h, topk, d_qk) == 2 ** 32 // per_token
    assert jsm.kernel_tables.backward_chunk_tokens(64, h, topk, d_qk) == 64
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JSMLA_BACKWARD_CHUNK_BYTES", str(3 * per_token + 1))
        assert jsm.kernel_tables.backward_chunk_tokens(t, h, topk, d_qk) == 3
        mp.setenv("JSMLA_BACKWARD_CHUNK_BYTES", "1")
        assert jsm.kernel_tables.backward_chunk_tokens(t, h, topk, d_qk) == 1
        mp.setenv("JSMLA_BACKWARD_CHUNK_BYTES", "-5")
        with pytest.raises(ValueError, match="JSMLA_BACKWARD_CHUNK_BYTES"):
            jsm.kernel_tables.backward_chunk_tokens(t, h, topk, d_qk)


# --------------------------------------------------------------------------------------------------
# shard_map (8 forced host devices, in a subprocess: see tests/test_sharding.py)
# --------------------------------------------------------------------------------------------------

NUM_DEVICES = 8


def _sharded_gradients(mesh, specs, static, arrays, d_out, wrt):
    from jax_sparse_mla.sharding import sharded_sparse_mla

    attend_sharded = sharded_sparse_mla(mesh, **specs, **static)
    spec_table = jsm.sparse_mla_specs(**specs)
    placed = {k: jax.device_put(v, jax.sharding.NamedSharding(mesh, getattr(spec_table, k)))
              for k, v in arrays.items()}

    def loss(placed):
        placed = dict(placed)
        out, lse = attend_sharded(placed.pop("q"), placed.pop("kv_cache"), placed.pop("indices"), **placed)
        return (out.astype(jnp.float32) * d_out).sum() + jnp.where(jnp.isfinite(lse), lse, 0.0).sum()

    return jax.jit(jax.grad(lambda w: loss({**placed, **w})))({k: placed[k] for k in wrt})


def _check_sharded_gradient(axis_kind):
    """Tensor parallel (heads and sinks split, a bf16 cache replicated) or data parallel (tokens split,
    per-rank bf16 caches, an empty shard): the gradients of the sharded call equal the unsharded ones."""
    rng = np.random.default_rng(11)
    mesh = jax.make_mesh((NUM_DEVICES,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    t, h, topk, page_size = 16, 16, 12, 4
    pages = NUM_DEVICES * 2
    kv = rng.standard_normal((pages * page_size, 576)).astype(np.float32)
    cache = jsm.quantize_kv(jnp.asarray(kv), "bf16_576", page_size=page_size)
    slots_per_rank = cache.shape[0] // NUM_DEVICES * page_size
    static = dict(kv_format="bf16_576", sm_scale=576 ** -0.5)
    q = jnp.asarray(rng.standard_normal((t, h, 576)), jnp.bfloat16)
    sink = jnp.asarray(rng.standard_normal(h), jnp.float32)
    d_out = jnp.asarray(rng.standard_normal((t, h, 512)), jnp.float32)
    wrt = ("q", "kv_cache", "attn_sink")
    if axis_kind == "tensor":
        indices = rng.integers(-2, pages * page_size + 2, (t, topk)).astype(np.int32)
        arrays = dict(q=q, kv_cache=cache, indices=jnp.asarray(indices), attn_sink=sink)
        got = _sharded_gradients(mesh, dict(head_axis="x"), static, arrays, d_out, wrt)
        full_arrays, row_valid = arrays, np.ones(t, bool)
    else:
        rows = t // NUM_DEVICES
        local = rng.integers(-2, slots_per_rank + 2, (t, topk)).astype(np.int32)
        valid_tokens = np.array([2, 0, 1, 2, 2, 1, 0, 2], np.int32)
        arrays = dict(q=q, kv_cache=cache, indices=jnp.asarray(local), attn_sink=sink,
                      valid_tokens=jnp.asarray(valid_tokens))
        got = _sharded_gradients(mesh, dict(token_axis="x"), static, arrays, d_out, wrt)
        rank = np.arange(t) // rows
        in_range = (local >= 0) & (local < slots_per_rank)
        global_indices = np.where(in_range, local + rank[:, None] * slots_per_rank, -1).astype(np.int32)
        row_valid = np.arange(t) % rows < valid_tokens[rank]
        full_arrays = dict(q=q, kv_cache=cache, indices=jnp.asarray(np.where(row_valid[:, None], global_indices, -1)),
                           attn_sink=sink)

    def loss(w):
        out, lse = attend(static, {**full_arrays, **w})
        lse = jnp.where(jnp.asarray(row_valid)[:, None], lse, -jnp.inf)
        return ((out.astype(jnp.float32) * d_out).sum(where=jnp.asarray(row_valid)[:, None, None])
                + jnp.where(jnp.isfinite(lse), lse, 0.0).sum())

    want = jax.jit(jax.grad(loss))({k: full_arrays[k] for k in wrt})
    np.testing.assert_array_equal(_bits(got["q"]), _bits(want["q"]))
    check_gradient("kv_cache", np.asarray(got["kv_cache"], np.float64), np.asarray(want["kv_cache"], np.float64),
                   exact_zeros=False)  # the shards' parts are rounded before they are summed
    check_gradient("attn_sink", np.asarray(got["attn_sink"], np.float64), np.asarray(want["attn_sink"], np.float64),
                   max_tol=1e-5, l2_tol=1e-5)


SHARDED_CHECKS = {"tensor_parallel": lambda: _check_sharded_gradient("tensor"),
                  "data_parallel": lambda: _check_sharded_gradient("data")}


@pytest.fixture(scope="module")
def sharded_results(tmp_path_factory):
    return run_checks(__file__, tmp_path_factory.mktemp("backward_sharding") / "results.json", NUM_DEVICES)


@pytest.mark.parametrize("name", sorted(SHARDED_CHECKS))
def test_shard_map_of_the_gradient(sharded_results, name):
    assert sharded_results[name] == "ok", sharded_results[name]


if __name__ == "__main__":
    child_main(SHARDED_CHECKS, sys.argv[1], NUM_DEVICES)
