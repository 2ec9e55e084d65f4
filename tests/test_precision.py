"""precision="fp8": the FP8-quantized query (bit-exact against the oracle's NumPy quantizer), the operation
on it on the CPU kernel and impl="xla", its accuracy bound, and the errors where no kernel computes in FP8."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import cases
import oracle

import jax_sparse_mla as jsm
from jax_sparse_mla import api


def test_query_quantization_is_bit_exact():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((5, 7, 576)).astype(np.float32) * np.exp(rng.uniform(-12, 12, (5, 7, 1)))
    q[0, 0, :64] = 0.0                      # an all-zero group: the amax floor
    q[1, 1, :64] = 1e-35                    # below the floor
    q[2, 2, 64:128] = 448.0 * 2.0 ** 20     # a power-of-two ratio (no rounding up)
    q[3, 3, 5] = -3.0e38                    # the largest magnitudes bf16 holds
    q = q.astype(ml_dtypes.bfloat16)
    got = np.asarray(jsm.quantize_query_fp8(jnp.asarray(q)).astype(jnp.float32)).astype(np.float64)
    np.testing.assert_array_equal(got, oracle.quantize_query_fp8(q))
    # Idempotent: the quantized query quantizes to itself.
    again = jsm.quantize_query_fp8(jnp.asarray(got.astype(ml_dtypes.bfloat16)))
    np.testing.assert_array_equal(np.asarray(again.astype(jnp.float32)), got.astype(np.float32))


def test_query_quantization_needs_whole_groups():
    with pytest.raises(ValueError, match="multiple of 64"):
        jsm.quantize_query_fp8(jnp.zeros((1, 2, 100), jnp.bfloat16))


@pytest.mark.parametrize("impl", ["auto", "xla"])
@pytest.mark.parametrize("key", ["dsv3_2", "glm_nsa", "dsv4", "bf16_576", "dots3_swa"])
def test_fp8_mode_is_the_operation_on_the_quantized_query(rng, key, impl):
    case = cases.make_case(rng, key, num_tokens=3, num_heads=5, topk=40,
                           attn_sink=rng.standard_normal(5).astype(np.float32))
    if key == "dsv4":
        case = cases.make_case(rng, key, num_tokens=3, num_heads=5, topk=40, extra=dict(topk=24))
    fp8 = cases.call_sparse_mla(case.q, case.main.array, case.indices, precision="fp8", **case.kwargs(impl))
    quantized_q = np.asarray(jsm.quantize_query_fp8(jnp.asarray(case.q)))
    plain = cases.call_sparse_mla(quantized_q, case.main.array, case.indices, **case.kwargs(impl))
    np.testing.assert_array_equal(fp8[0], plain[0])
    np.testing.assert_array_equal(fp8[1], plain[1])
    # The mode's bound, against the float64 reference on the dequantized quantized query.
    ref_out, ref_lse = dataclasses.replace(case, q=oracle.quantize_query_fp8(case.q)).reference()
    oracle.check_accuracy(fp8[0], fp8[1], ref_out, ref_lse, out_tol=4e-2, l2_tol=2.5e-2, lse_tol=2e-3)


def test_fp8_mode_changes_the_result(rng):
    case = cases.make_case(rng, "dsv3_2", num_tokens=2, num_heads=4, topk=32, topk_length=None)
    a = cases.call_sparse_mla(case.q, case.main.array, case.indices, **case.kwargs("auto"))
    b = cases.call_sparse_mla(case.q, case.main.array, case.indices, precision="fp8", **case.kwargs("auto"))
    assert np.all(np.isfinite(a[1])) and np.all(np.isfinite(b[1]))
    assert not np.array_equal(a[1], b[1])


def test_precision_is_validated():
    q, cache, indices = jnp.zeros((1, 2, 576), jnp.bfloat16), jnp.zeros((1, 64, 656), jnp.uint8), jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError, match=r"precision: expected one of \('bf16', 'fp8'\), got 'fp16'"):
        jsm.sparse_mla(q, cache, indices, kv_format="dsv3_2", sm_scale=0.1, precision="fp16")
    with pytest.raises(TypeError, match="precision"):
        jsm.sparse_mla(q, cache, indices, kv_format="dsv3_2", sm_scale=0.1, precision=8)


def test_fp8_mode_raises_on_a_gpu_backend(monkeypatch):
    # No CUDA kernel computes in FP8 yet: on a GPU backend the mode must raise at trace time rather than
    # run the 16-bit kernels (impl="xla" still runs the reference there).
    q, cache, indices = jnp.zeros((1, 2, 576), jnp.bfloat16), jnp.zeros((1, 64, 656), jnp.uint8), jnp.zeros((1, 4), jnp.int32)
    monkeypatch.setattr(api.jax, "default_backend", lambda: "gpu")
    with pytest.raises(ValueError, match="precision: .fp8. has no CUDA kernel yet"):
        jax.eval_shape(lambda q: jsm.sparse_mla(q, cache, indices, kv_format="dsv3_2", sm_scale=0.1, precision="fp8"), q)
    with pytest.raises(ValueError, match="precision: .fp8. has no CUDA kernel yet"):
        jax.eval_shape(lambda q: jsm.sparse_mla(q, cache, indices, kv_format="dsv3_2", sm_scale=0.1, precision="fp8",
                                                impl="decode"), q)
    out = jax.eval_shape(lambda q: jsm.sparse_mla(q, cache, indices, kv_format="dsv3_2", sm_scale=0.1, precision="fp8",
                                                  impl="xla"), q)
    assert out[0].shape == (1, 2, 512)


def test_fp8_mode_under_vmap(rng):
    case = cases.make_case(rng, "dsv4", num_tokens=2, num_heads=3, topk=16, topk_length=None)
    cache, indices = jnp.asarray(case.main.array), jnp.asarray(case.indices)
    qs = jnp.stack([jnp.asarray(case.q), -jnp.asarray(case.q)[::-1]])
    f = lambda q: jsm.sparse_mla(q, cache, indices, kv_format="dsv4", sm_scale=0.07, precision="fp8")  # noqa: E731
    batched = jax.vmap(f)(qs)
    for i in range(2):
        single = f(qs[i])
        assert np.all(np.isfinite(np.asarray(single[1])))
        np.testing.assert_array_equal(np.asarray(batched[0][i]), np.asarray(single[0]))
        np.testing.assert_array_equal(np.asarray(batched[1][i]), np.asarray(single[1]))
