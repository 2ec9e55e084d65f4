"""GPU tests of the CUDA backward kernel (gradients of q, attn_sink and a bf16 cache; docs/semantics.md,
differentiation): against the float64 oracle of the derivative (tests/test_backward.py, itself checked by
finite differences, with D as the serving kernel takes it: _reference) within the backward's accuracy
contract, over the forward's edge cases; bitwise
reproducible; under jit and vmap. Skipped without a GPU and the
CUDA extension; tests named *sanitize* also run under compute-sanitizer (memcheck)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

import cases  # noqa: E402
import oracle  # noqa: E402
import test_backward as tb  # noqa: E402

import jax_sparse_mla as jsm  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "kernels", "cuda"))
import generate_kernels  # noqa: E402

gpu = pytest.mark.gpu
ALL = ("q", "attn_sink", "kv_cache")
TENSOR_CORE_FORMATS = {key for family, key, _, _ in generate_kernels.instances() if family == "backward"}


def _tensor_core_backward(case):
    """Whether the tensor-core backward serves ``case`` on this GPU (docs/semantics.md, differentiation: a
    format of its family, an extra list in the main cache's format, an sm_90 GPU, JSMLA_CUDA_FAMILY not
    "portable")."""
    return (case.key in TENSOR_CORE_FORMATS and (case.extra is None or case.extra.key == case.key)
            and getattr(jax.devices()[0], "compute_capability", None) == "9.0" and os.environ.get("JSMLA_CUDA_FAMILY") != "portable")


def _reference(case, d_out, d_lse, out):
    """The oracle's gradients for the kernel that serves ``case``: the tensor-core kernels take D = <dO, out>
    from the returned bfloat16 ``out`` (FlashAttention's convention), the SIMT kernels compute D exactly."""
    return tb.case_vjp(case, d_out, d_lse, rounded_out=out if _tensor_core_backward(case) else None)


def _check(rng, case, wrt=ALL):
    """The CUDA kernel's gradients (impl="auto" on the GPU) against the oracle, and bitwise equal on a
    second run."""
    d_out, d_lse = tb.random_cotangents(rng, case)
    wrt = tuple(name for name in wrt if name in tb.differentiable_names(case))
    out, lse, grads = tb.library_vjp(case, "auto", d_out, d_lse, wrt)
    oracle.check_accuracy(out, lse, *case.reference())
    ref = _reference(case, d_out, d_lse, out)
    for name, g in grads.items():
        tb.check_gradient(name, g, ref[name])
    _, _, again = tb.library_vjp(case, "auto", d_out, d_lse, wrt)
    for name in grads:
        np.testing.assert_array_equal(grads[name], again[name], err_msg=f"{name}: not reproducible")
    return grads


@gpu
@pytest.mark.parametrize("key", list(oracle.SPECS))
def test_cuda_backward_every_format_sanitize(rng, key):
    """Junk indices, random lengths, a finite sink, NaN in every unreferenced slot."""
    case = cases.make_case(rng, key, num_tokens=4, num_heads=3, topk=16, page_size=2,
                           form=tb._page_form(key, 2), attn_sink=rng.standard_normal(3))
    _check(rng, case)


@gpu
@pytest.mark.parametrize("key", ["dsv3_2", "bf16_576", "bf16_512"])
def test_cuda_backward_many_heads_and_candidates(rng, key):
    """128 heads (32 blocks of four per token), 2048 candidates (256 chunks), lengths."""
    case = cases.make_case(rng, key, num_tokens=3, num_heads=128, topk=2048, attn_sink=rng.standard_normal(128),
                           topk_length=np.array([2048, 700, 1], np.int32))
    _check(rng, case)


@gpu
@pytest.mark.parametrize("sink", [np.inf, -np.inf])
def test_cuda_backward_infinite_sinks(rng, sink):
    """+inf: d_sink is the sum of d_lse over the valid rows and d_q is zero; -inf: no effect on d_q, zero d_sink."""
    case = cases.make_case(rng, "dsv3_2", num_tokens=4, num_heads=2, topk=8,
                           attn_sink=np.array([sink, 0.5], np.float32))
    _check(rng, case)


@gpu
def test_cuda_backward_empty_rows_padding_and_dual_cache_sanitize(rng):
    """Rows with no valid candidate, padding rows (valid_tokens) whose q holds NaN, a dual cache."""
    case = cases.make_case(rng, "dsv4", num_tokens=6, num_heads=4, topk=12, page_size=2,
                           attn_sink=rng.standard_normal(4), topk_length=np.array([12, 0, 5, 12, 3, 12], np.int32),
                           extra=dict(page_size=2, topk=5), valid_tokens=4)
    case.q[4:] = np.nan
    grads = _check(rng, case)
    assert np.all(grads["q"][4:] == 0)


@gpu
def test_cuda_backward_mixed_dual_cache(rng):
    """A dual cache of two formats (dsv4_1 main, dsv4_1_fp4 extra): one backward call reads both."""
    case = cases.make_case(rng, "dsv4_1", num_tokens=3, num_heads=4, topk=10, page_size=2,
                           attn_sink=rng.standard_normal(4), extra=dict(page_size=2, topk=6, kv_format="dsv4_1_fp4"))
    _check(rng, case)


@gpu
def test_cuda_backward_under_vmap(rng):
    """jax.vmap of the gradient: one kernel call for the batch, each element's sink gradient its own."""
    case = cases.make_case(rng, "dsv3_2", num_tokens=3, num_heads=2, topk=8, attn_sink=rng.standard_normal(2))
    static, arrays = tb.case_arrays(case, "auto")
    first = arrays.pop("q")
    q = jnp.stack([first, (first.astype(jnp.float32) * 0.5).astype(first.dtype)])
    sink = arrays.pop("attn_sink")

    def loss(q, sink):
        out, lse = tb.attend(static, {**arrays, "q": q, "attn_sink": sink})
        return out.astype(jnp.float32).sum() + jnp.where(jnp.isfinite(lse), lse, 0.0).sum()

    batched = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None)))(q, sink)
    for b in range(2):
        single = jax.jit(jax.grad(loss, argnums=(0, 1)))(q[b], sink)
        for got, want in zip(batched, single):
            np.testing.assert_allclose(np.asarray(got[b], np.float32), np.asarray(want, np.float32), rtol=2e-2,
                                       atol=2e-2 * float(np.abs(np.asarray(want, np.float32)).max()))


@gpu
@pytest.mark.parametrize("form", ["3d", "2d"])
def test_cuda_cache_gradient_shared_and_unreferenced_slots_sanitize(rng, form):
    """Slots listed by several rows (and twice in one row) add up in (token, candidate) order;
    unreferenced slots get exactly zero; padding rows add nothing."""
    case = cases.make_case(rng, "bf16_576", num_tokens=6, num_heads=2, topk=12, page_size=4, cache_tokens=12,
                           form=form, poison=False, valid_tokens=5)
    indices = case.indices.copy()
    indices[:, :4] = [3, 3, 5, 7]
    case = dataclasses.replace(case, indices=indices).poison_unused()
    grads = _check(rng, case)
    referenced = oracle.valid_candidates(case.indices[:5], case.main.num_slots,
                                         None if case.topk_length is None else case.topk_length[:5])
    unreferenced = ~np.isin(np.arange(case.main.num_slots), case.indices[:5][referenced])
    assert unreferenced.any() and np.all(grads["kv_cache"][unreferenced] == 0)


@gpu
def test_cuda_cache_gradient_of_heavily_shared_slots(rng):
    """128 rows of 64 candidates over 16 slots (about 500 contributions per slot and head)."""
    case = cases.make_case(rng, "bf16_576", num_tokens=128, num_heads=4, topk=64, page_size=4, cache_tokens=16,
                           attn_sink=rng.standard_normal(4), topk_length=None, invalid_fraction=0.05)
    _check(rng, case)


@gpu
def test_cuda_backward_tensor_core_tiles_sanitize(rng):
    """The tensor-core kernel's edges: 80 heads (a second, partial 64-head tile), 45 + 13 candidates (partial
    32-candidate tiles at the end of each list) of a same-format dual cache, lengths, padding rows with NaN q."""
    case = cases.make_case(rng, "dsv4_1", num_tokens=5, num_heads=80, topk=45, page_size=4,
                           attn_sink=rng.standard_normal(80), topk_length=np.array([45, 0, 31, 33, 45], np.int32),
                           extra=dict(page_size=4, topk=13), valid_tokens=4)
    case.q[4:] = np.nan
    grads = _check(rng, case)
    assert np.all(grads["q"][4:] == 0)


@gpu
@pytest.mark.parametrize("key", ["bf16_576", "dsv3_2"])
def test_cuda_backward_gradient_of_lse_alone_and_of_the_sink_alone(rng, key):
    """A loss of lse alone (the cotangent of out is a symbolic zero: no dO reaches the kernels), and the
    sink's gradient without q's (no d_q kernel runs)."""
    case = cases.make_case(rng, key, num_tokens=3, num_heads=70, topk=40, attn_sink=rng.standard_normal(70))
    static, arrays = tb.case_arrays(case, "auto")

    def lse_loss(q):
        _, lse = tb.attend(static, {**arrays, "q": q})
        return jnp.where(jnp.isfinite(lse), lse, 0.0).sum()

    d_q = np.asarray(jax.jit(jax.grad(lse_loss))(arrays["q"])).astype(np.float64)
    t, h = case.q.shape[:2]
    d_out = np.zeros((t, h, oracle.SPECS[key].d_v), np.float32)
    ref = tb.case_vjp(case, d_out, np.ones((t, h), np.float32))
    tb.check_gradient("q", d_q, ref["q"])
    d_out, d_lse = tb.random_cotangents(rng, case)
    out, _, grads = tb.library_vjp(case, "auto", d_out, d_lse, ("attn_sink",))
    tb.check_gradient("attn_sink", grads["attn_sink"], _reference(case, d_out, d_lse, out)["attn_sink"])


@gpu
def test_cuda_cache_gradient_in_chunks_of_tokens_sanitize(rng, monkeypatch):
    """The tensor-core cache gradient taken 3 tokens at a time (JSMLA_BACKWARD_CHUNK_BYTES): slots shared
    across chunks, a padding row; the same bits as in one chunk (the running sums are kept in fp32)."""
    case = cases.make_case(rng, "bf16_576", num_tokens=7, num_heads=70, topk=40, page_size=4, cache_tokens=24,
                           attn_sink=rng.standard_normal(70), valid_tokens=6)
    whole = _check(rng, case)
    per_token = 2 * 70 * 64 * 2 + 40 * 576 * 2  # P and c (positions padded to 64), partial rows (bf16)
    monkeypatch.setenv("JSMLA_BACKWARD_CHUNK_BYTES", str(3 * per_token))
    assert jsm.kernel_tables.backward_chunk_tokens(7, 70, 40, 576) == 3
    d_out, d_lse = tb.random_cotangents(np.random.default_rng(1), case)
    out, _, chunked = tb.library_vjp(case, "auto", d_out, d_lse, ALL)
    monkeypatch.delenv("JSMLA_BACKWARD_CHUNK_BYTES")
    _, _, single = tb.library_vjp(case, "auto", d_out, d_lse, ALL)
    ref = _reference(case, d_out, d_lse, out)
    for name in single:
        tb.check_gradient(name, chunked[name], ref[name])
        np.testing.assert_array_equal(chunked[name], single[name], err_msg=name)
    assert whole["kv_cache"].shape == chunked["kv_cache"].shape


@gpu
@pytest.mark.skipif(os.environ.get("JSMLA_CUDA_FAMILY") == "portable", reason="already on the SIMT kernels")
def test_cuda_backward_simt_kernels_in_a_subprocess(tmp_path):
    """JSMLA_CUDA_FAMILY=portable (read once per process) keeps the backward on the SIMT kernels an sm_90
    GPU otherwise leaves to other devices: this file's format, edge-case and cache-gradient tests on them."""
    _run_this_file(tmp_path, "every_format or empty_rows or tensor_core_tiles or shared_and_unreferenced or lse_alone",
                   JSMLA_CUDA_FAMILY="portable")


@gpu
@pytest.mark.skipif(os.environ.get("JSMLA_CUDA_FAMILY") == "portable", reason="no tensor-core backward")
def test_cuda_cache_gradient_mma_partials_in_a_subprocess(tmp_path):
    """JSMLA_BACKWARD_PARTIALS=mma (read once per process): the cache gradient's partial rows of more than
    64 heads from the mma.sync kernel instead of the default wgmma one on sm_90; this file's many-head,
    lse-alone and chunked cache-gradient tests on it (each against the oracle, reproducible bit for bit,
    chunked equal to whole)."""
    _run_this_file(tmp_path, "many_heads or lse_alone or chunks_of_tokens", JSMLA_BACKWARD_PARTIALS="mma")


def _run_this_file(tmp_path, selection, **variables):
    """Runs this file's GPU tests matching `selection` in a child process with `variables` in its environment
    (the kernels read them once per process); every selected test must pass."""
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-k",
                             selection, __file__], env=dict(os.environ, **variables), capture_output=True, text=True,
                            timeout=900, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "failed" not in result.stdout
